"""Exhaustive enumeration of every valid assignment: the oracle for tests on small graphs."""

from __future__ import annotations

import itertools
import time

from solver.problem import INFEASIBLE, OPTIMAL, StageProblem, StageSolution


def solve_brute_force(problem: StageProblem) -> StageSolution:
    """Try all p**L assignments (keep L <= ~10); ties go to the lexicographically first one."""
    start = time.perf_counter()
    best: tuple[int, tuple[int, ...]] | None = None
    for stage_of in itertools.product(range(problem.num_stages), repeat=problem.num_layers):
        if problem.violation(stage_of) is not None:
            continue
        value = problem.objective_value(stage_of)
        if best is None or value < best[0]:
            best = (value, stage_of)
    wall = time.perf_counter() - start
    if best is None:
        return StageSolution(status=INFEASIBLE, stage_of_layer=None, objective=None, bound=0,
                             wall_s=wall, backend="brute-force")
    return StageSolution(status=OPTIMAL, stage_of_layer=list(best[1]), objective=best[0],
                         bound=best[0], wall_s=wall, backend="brute-force")
