"""Exhaustive enumeration of every valid assignment: the oracle for tests on small graphs."""

from __future__ import annotations

import itertools
import math
import time

from solver.backends.problem import INFEASIBLE, OPTIMAL, StageProblem, StageSolution
from solver.errors import InputError

MAX_ASSIGNMENTS = 10**8
"""Most (assignment, recompute set, group assignment) combinations the oracle tries (hours of
Python; a 2^L recompute-set list or L^p assignments beyond it would not even fit in memory)."""


def solve_brute_force(problem: StageProblem) -> StageSolution:
    """Try all p**L assignments (keep L <= ~10); ties go to the lexicographically first one.
    Under selective recomputation, every one of the 2**L recompute sets with each (keep L <= ~6);
    with a placement, every assignment of groups to stages too (K**p more)."""
    start = time.perf_counter()
    _check_size(problem)
    best: tuple[int, tuple[int, ...], tuple[bool, ...] | None, list[int] | None] | None = None
    edges = list(zip(problem.costs.edge_src.tolist(), problem.costs.edge_dst.tolist(), strict=True))
    num_stages, num_layers = problem.num_stages, problem.num_layers
    recompute_sets = (
        list(itertools.product((False, True), repeat=num_layers)) if problem.selective else [None]
    )
    group_assignments = _group_assignments(problem)
    for stage_of in itertools.product(range(num_stages), repeat=num_layers):
        # cheap structural filters first (order, non-empty), then the full check
        if any(stage_of[u] > stage_of[v] for u, v in edges) or len(set(stage_of)) < num_stages:
            continue
        for recomputed, groups in itertools.product(recompute_sets, group_assignments):
            if problem.violation(stage_of, recomputed, groups) is not None:
                continue
            value = problem.objective_value(stage_of, recomputed, groups)
            if best is None or value < best[0]:
                best = (value, stage_of, recomputed, groups)
    wall = time.perf_counter() - start
    if best is None:
        return StageSolution(
            status=INFEASIBLE,
            stage_of_layer=None,
            objective=None,
            bound=0,
            wall_s=wall,
            backend="brute-force",
        )
    return StageSolution(
        status=OPTIMAL,
        stage_of_layer=list(best[1]),
        objective=best[0],
        bound=best[0],
        wall_s=wall,
        backend="brute-force",
        recomputed=None if best[2] is None else list(best[2]),
        group_of_stage=best[3],
    )


def _group_assignments(problem: StageProblem) -> list[list[int] | None]:
    """[None] without a placement, else every group of each stage with the right counts."""
    placement = problem.placement
    if placement is None:
        return [None]
    return [
        list(groups)
        for groups in itertools.product(range(placement.num_groups), repeat=problem.num_stages)
        if all(groups.count(k) == n for k, n in enumerate(placement.stages_per_group))
    ]


def _check_size(problem: StageProblem) -> None:
    """InputError when the enumeration would exceed ``MAX_ASSIGNMENTS`` (before any list of
    them is made)."""
    # log10 of the count: p^L (x 2^L) (x K^p), never the (possibly huge) number itself
    digits = problem.num_layers * math.log10(max(problem.num_stages, 1))
    if problem.selective:
        digits += problem.num_layers * math.log10(2)
    if problem.placement is not None:
        digits += problem.num_stages * math.log10(max(problem.placement.num_groups, 1))
    if digits > math.log10(MAX_ASSIGNMENTS):
        raise InputError(
            f"brute force: {problem.num_stages}^{problem.num_layers} stage assignments"
            f"{' x 2^L recompute sets' if problem.selective else ''}"
            f"{' x group choices' if problem.placement is not None else ''} is more than "
            f"{MAX_ASSIGNMENTS:.0e}: it is the tests' oracle for about 10 layers; solve larger "
            "problems with solve_chain, solve_dag or solve_cpsat"
        )
