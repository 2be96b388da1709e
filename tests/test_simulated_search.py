"""Bound and simulate (``solver.backends.simulated``): where a schedule's simulated iteration
exceeds the iteration bound the backends model (interleaved 1F1B, the split-backward
schedules), the fastest split and a throughput floor are the SIMULATED ones. Oracle: brute force
over every split, each simulated (``StageProblem(simulated=True)``'s objective)."""

from __future__ import annotations

import dataclasses

import pytest

from solver.backends import _solve_bound, solve
from solver.backends.brute_force import solve_brute_force
from solver.backends.problem import (
    FEASIBLE,
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OBJECTIVE_TIME,
    OPTIMAL,
    StageProblem,
)
from solver.backends.simulated import solve_simulated
from solver.search.incumbents import chunk_balanced_splits
from tests.conftest import slow_params
from tests.test_interleaved import _random_interleaved
from tests.test_zero_bubble_search import _random_split

CASES = [("interleaved", seed) for seed in range(12)] + [("split", seed) for seed in range(12)]
"""Interleaved 1F1B (v = 2, 3) and zbv / dualpipev / interleaved-zb on random chains and DAGs."""


def _costs(kind: str, seed: int):
    return (_random_interleaved if kind == "interleaved" else _random_split)(seed)[2]


@pytest.mark.parametrize(("kind", "seed"), slow_params(CASES, 0, 1, 5, 11, 12, 15, 23))
@pytest.mark.parametrize("backend", ["cpsat", "milp"])
def test_fastest_split_is_the_brute_force_simulated_optimum(kind, seed, backend):
    costs = _costs(kind, seed)
    problem = StageProblem(costs=costs, objective=OBJECTIVE_TIME, simulated=True)
    oracle = solve_brute_force(problem)
    got = solve(problem, backend, time_limit_s=60)
    assert got.status == OPTIMAL
    assert got.objective == oracle.objective == got.bound
    assert problem.objective_value(got.stage_of_layer) == oracle.objective


def test_the_bound_alone_misses_the_simulated_optimum():
    """Why the search simulates: on these cases the bound-optimal split simulates longer than
    the best split (the old search reported it OPTIMAL)."""
    slower = 0
    for kind, seed in [("interleaved", 0), ("interleaved", 1), ("split", 3), ("split", 11)]:
        costs = _costs(kind, seed)
        problem = StageProblem(costs=costs, objective=OBJECTIVE_TIME, simulated=True)
        bound_only = _solve_bound(
            dataclasses.replace(problem, simulated=False), "cpsat", time_limit_s=30
        )
        slower += problem.objective_value(bound_only.stage_of_layer) > solve_brute_force(
            problem
        ).objective
    assert slower == 4


def test_without_cuts_the_gap_is_reported():
    """A backend that cannot cut a split off (the dynamic programs) solves the bound once: its
    split is FEASIBLE, with the bound as the lower bound, when it simulates longer."""
    costs = _costs("interleaved", 0)
    problem = StageProblem(costs=costs, objective=OBJECTIVE_TIME, simulated=True)
    got = solve_simulated(
        problem,
        lambda bound_problem, **hints: _solve_bound(bound_problem, "cpsat", **hints),
        cuts=False,
        time_limit_s=30,
    )
    assert got.status == FEASIBLE
    assert got.objective == problem.objective_value(got.stage_of_layer)
    assert got.bound == _solve_bound(
        dataclasses.replace(problem, simulated=False), "cpsat", time_limit_s=30
    ).objective
    assert got.bound < got.objective


@pytest.mark.parametrize(("kind", "seed"), [("interleaved", 0), ("interleaved", 11), ("split", 3)])
def test_throughput_floor_is_met_by_the_simulation(kind, seed):
    """--min-throughput / --max-slowdown: a split passes only if its SIMULATED time meets the
    budget; the budget sits between the bound-optimal split's bound and its simulated time, so
    the bound alone would let it through."""
    costs = _costs(kind, seed)
    fastest = StageProblem(costs=costs, objective=OBJECTIVE_TIME)
    split = _solve_bound(fastest, "cpsat", time_limit_s=30).stage_of_layer
    simulated = dataclasses.replace(fastest, simulated=True).objective_value(split)
    budget = simulated - 1
    limited = StageProblem(
        costs=costs, objective=OBJECTIVE_MEMORY, iteration_budget_ns=budget, simulated=True
    )
    assert dataclasses.replace(limited, simulated=False).violation(split) is None
    assert limited.violation(split) is not None
    expected = solve_brute_force(limited)
    for backend in ("cpsat", "milp"):
        got = solve(limited, backend, time_limit_s=60)
        assert got.status == expected.status
        if expected.status == INFEASIBLE:
            continue
        assert got.objective == expected.objective
        assert limited.violation(got.stage_of_layer) is None


def test_chunk_balanced_splits():
    splits = chunk_balanced_splits(98, 16, 32)
    counts = [splits["balanced-last-rank"].count(j) for j in range(32)]
    assert counts == [3] * 15 + [4] + [3] * 15 + [4]  # the bench_schedules repro's fast split
    assert [splits["balanced-last"].count(j) for j in range(32)] == [3] * 30 + [4, 4]
    assert [splits["balanced-first-rank"].count(j) for j in range(32)] == (
        [4] + [3] * 15 + [4] + [3] * 15
    )
    assert chunk_balanced_splits(5, 4, 8) == {}
