"""Exhaustive enumeration of every valid assignment: the oracle for tests on small graphs."""

from __future__ import annotations

import itertools
import time

from solver.problem import INFEASIBLE, OPTIMAL, StageProblem, StageSolution


def solve_brute_force(problem: StageProblem) -> StageSolution:
    """Try all p**L assignments (keep L <= ~10), and under selective recomputation every one of
    the 2**L recompute sets with each (keep L <= ~6); ties go to the lexicographically first
    (split, then recompute set)."""
    start = time.perf_counter()
    best: tuple[int, tuple[int, ...], tuple[bool, ...] | None] | None = None
    edges = list(zip(problem.costs.edge_src.tolist(), problem.costs.edge_dst.tolist(), strict=True))
    num_stages, num_layers = problem.num_stages, problem.num_layers
    recompute_sets = (
        list(itertools.product((False, True), repeat=num_layers)) if problem.selective else [None]
    )
    for stage_of in itertools.product(range(num_stages), repeat=num_layers):
        # cheap structural filters first (order, non-empty), then the full check
        if any(stage_of[u] > stage_of[v] for u, v in edges) or len(set(stage_of)) < num_stages:
            continue
        for recomputed in recompute_sets:
            if problem.violation(stage_of, recomputed) is not None:
                continue
            value = problem.objective_value(stage_of, recomputed)
            if best is None or value < best[0]:
                best = (value, stage_of, recomputed)
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
    )
