"""The chain backend against the brute-force oracle, plus hand-made cases it must get right."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.chain import is_chain_problem, solve_chain
from solver.backends.chain_time import time_rules
from solver.backends.problem import (
    FEASIBLE,
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OBJECTIVE_TIME,
    OPTIMAL,
    UNKNOWN,
    StageProblem,
)
from solver.costs import LayerCosts, bound_terms, in_flight_microbatches, layer_costs
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import slow_params
from tests.random_graphs import random_chain, random_dag, random_problem

NUM_RANDOM_CHAINS = 72


def assert_same_optimum(problem: StageProblem) -> None:
    """The chain backend and the brute force agree on status and objective value."""
    expected = solve_brute_force(problem)
    solution = solve_chain(problem)
    context = (
        problem.costs.config,
        problem.objective,
        problem.capacity_bytes,
        problem.iteration_budget_ns,
    )
    assert solution.backend == "chain"
    assert solution.status == expected.status, context
    assert solution.objective == expected.objective, context
    if expected.status == INFEASIBLE:
        assert solution.stage_of_layer is None
        return
    assert problem.violation(solution.stage_of_layer) is None, context
    assert problem.objective_value(solution.stage_of_layer) == solution.objective
    assert solution.bound == solution.objective


def limit_variants(problem: StageProblem) -> list[StageProblem]:
    """The problem under both objectives with capacities and budgets taken from its optima."""
    fastest = solve_brute_force(dataclasses.replace(problem, objective=OBJECTIVE_TIME))
    smallest = solve_brute_force(dataclasses.replace(problem, objective=OBJECTIVE_MEMORY))
    if fastest.stage_of_layer is None:  # more stages than layers: every variant is infeasible
        return [
            dataclasses.replace(problem, objective=objective)
            for objective in (OBJECTIVE_MEMORY, OBJECTIVE_TIME)
        ]
    min_peak = smallest.objective
    min_iteration = fastest.objective
    peak_when_fastest = problem.measure(fastest.stage_of_layer)[0]
    iteration_when_smallest = problem.measure(smallest.stage_of_layer)[1]
    middle_iteration = (min_iteration + iteration_when_smallest) // 2
    variants = [
        dataclasses.replace(
            problem, objective=objective, capacity_bytes=cap, iteration_budget_ns=budget
        )
        for objective in (OBJECTIVE_MEMORY, OBJECTIVE_TIME)
        for cap in (None, min_peak, peak_when_fastest)
        for budget in (None, min_iteration, middle_iteration)
    ]
    variants.append(dataclasses.replace(problem, capacity_bytes=min_peak - 1))  # infeasible
    variants.append(
        dataclasses.replace(
            problem, objective=OBJECTIVE_TIME, iteration_budget_ns=min_iteration - 1
        )
    )  # infeasible
    return variants


@pytest.mark.slow
@pytest.mark.parametrize(
    "seed", slow_params(range(NUM_RANDOM_CHAINS), 2, *range(24, NUM_RANDOM_CHAINS))
)
def test_random_chain_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    graph = random_chain(rng, rng.randint(2, 8))
    problem = random_problem(rng, graph)
    for variant in limit_variants(problem):
        assert_same_optimum(variant)


def synthetic_costs(rng: random.Random, num_layers: int, num_stages: int) -> LayerCosts:
    """Small random integers straight into LayerCosts: many ties, zeros and a few huge edges."""
    micro_batches = rng.choice([1, 2, 3, 8])
    schedule = rng.choice(["1f1b", "gpipe"])
    config = ParallelConfig(
        pp=num_stages, tp=1, dp=1, micro_batch=1, num_microbatches=micro_batches, schedule=schedule
    )

    def column(high: int) -> np.ndarray:
        return np.array([rng.randint(0, high) for _ in range(num_layers)], dtype=np.int64)

    edges = [
        rng.choice([0, rng.randint(0, 3), rng.randint(0, 30) * rng.choice([1, 10, 100])])
        for _ in range(num_layers - 1)
    ]
    return LayerCosts(
        config=config,
        weight_bytes=column(5),
        grad_bytes=column(3),
        optimizer_bytes=column(4),
        stored_bytes=column(4),
        transient_bytes=np.array(
            [rng.choice([0, 0, rng.randint(0, 40)]) for _ in range(num_layers)], dtype=np.int64
        ),
        time_ns=column(rng.choice([1, 5, 20])),
        dp_sync_ns=column(rng.choice([0, 1, 20])),
        edge_src=np.arange(num_layers - 1),
        edge_dst=np.arange(1, num_layers),
        edge_bytes=np.array(edges, dtype=np.int64),
        in_flight=[
            in_flight_microbatches(schedule, micro_batches, num_stages, s)
            for s in range(num_stages)
        ],
    )


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_synthetic_chain_matches_brute_force(seed: int) -> None:
    rng = random.Random(1000 + seed)
    num_layers = rng.randint(1, 7)
    num_stages = rng.randint(1, min(4, num_layers + 1))
    problem = StageProblem(costs=synthetic_costs(rng, num_layers, num_stages))
    for variant in limit_variants(problem):
        assert_same_optimum(variant)


def contiguous_splits(num_layers: int, num_stages: int) -> list[list[int]]:
    """Every assignment of a chain with non-empty, ordered stages."""
    splits = []
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        splits.append([s for s in range(num_stages) for _ in range(bounds[s], bounds[s + 1])])
    return splits


@pytest.mark.parametrize("seed", range(8))
def test_longer_chains_match_enumeration(seed: int) -> None:
    """12-16 layers and 3-5 stages (too many for the brute force): enumerate contiguous splits."""
    rng = random.Random(2000 + seed)
    num_layers, num_stages = rng.randint(12, 16), rng.randint(3, 5)
    graph = random_chain(rng, num_layers)
    config = ParallelConfig(
        pp=num_stages,
        tp=1,
        dp=rng.choice([2, 4]),
        micro_batch=1,
        num_microbatches=rng.choice([2, 4, 8]),
        zero=rng.choice([0, 1]),
        recompute=rng.choice(["none", "full"]),
    )
    costs = layer_costs(
        graph,
        config,
        Cluster(num_gpus=config.num_gpus),
        TrainingConfig(global_batch=config.global_batch),
    )
    base = StageProblem(costs=costs)
    measures = [base.measure(split) for split in contiguous_splits(num_layers, num_stages)]
    peaks = sorted(peak for peak, _ in measures)
    iterations = sorted(iteration for _, iteration in measures)
    for objective, cap, budget in itertools.product(
        (OBJECTIVE_MEMORY, OBJECTIVE_TIME),
        (None, peaks[len(peaks) // 4]),
        (None, iterations[len(iterations) // 4]),
    ):
        problem = dataclasses.replace(
            base, objective=objective, capacity_bytes=cap, iteration_budget_ns=budget
        )
        allowed = [
            peak if objective == OBJECTIVE_MEMORY else iteration
            for peak, iteration in measures
            if (cap is None or peak <= cap) and (budget is None or iteration <= budget)
        ]
        solution = solve_chain(problem)
        if not allowed:
            assert solution.status == INFEASIBLE
            continue
        assert solution.status == OPTIMAL
        assert solution.objective == min(allowed)
        assert problem.violation(solution.stage_of_layer) is None


def hand_made_costs(state_bytes: list[int], edge_bytes: list[int], num_stages: int) -> LayerCosts:
    """A chain with only weights and boundary buffers (one micro-batch, GPipe: k_s = 1)."""
    num_layers = len(state_bytes)
    zeros = np.zeros(num_layers, dtype=np.int64)
    config = ParallelConfig(
        pp=num_stages, tp=1, dp=1, micro_batch=1, num_microbatches=1, schedule="gpipe"
    )
    return LayerCosts(
        config=config,
        weight_bytes=np.array(state_bytes, dtype=np.int64),
        grad_bytes=zeros,
        optimizer_bytes=zeros,
        stored_bytes=zeros,
        transient_bytes=zeros,
        time_ns=np.ones(num_layers, dtype=np.int64),
        dp_sync_ns=zeros,
        edge_src=np.arange(num_layers - 1),
        edge_dst=np.arange(1, num_layers),
        edge_bytes=np.array(edge_bytes, dtype=np.int64),
        in_flight=[1] * num_stages,
        receive_copies=[0] + [1] * (num_stages - 1),  # one buffer per boundary side
        send_copies=[1] * (num_stages - 1) + [0],
    )


def test_huge_output_followed_by_tiny_one_is_not_a_greedy_fill() -> None:
    """Layer 1's output is huge and layer 2's tiny, so stage 0 = {0, 1} (120 B) is worse than
    stage 0 = {0, 1, 2} (31 B): the peak is not monotone in the stage end. Greedy fill stops at
    the first layer that does not fit and ends with 80 B; the optimum is 31 B."""
    problem = StageProblem(costs=hand_made_costs([10, 10, 10, 10], [50, 100, 1], 2))
    solution = solve_chain(problem)
    assert solution.status == OPTIMAL
    assert solution.objective == 31 == solve_brute_force(problem).objective
    assert solution.stage_of_layer == [0, 0, 0, 1]


def test_huge_edges_with_more_stages() -> None:
    """Every other edge is huge: the stages must cut at the tiny ones."""
    state = [7, 3, 9, 1, 4, 4, 8, 2]
    edges = [1000, 1, 1000, 2, 1000, 1, 1000]
    problem = StageProblem(costs=hand_made_costs(state, edges, 3))
    assert_same_optimum(problem)
    assert_same_optimum(dataclasses.replace(problem, objective=OBJECTIVE_TIME, capacity_bytes=30))


def test_more_stages_than_layers_is_infeasible() -> None:
    problem = StageProblem(costs=hand_made_costs([1, 2], [3], 3))
    solution = solve_chain(problem)
    assert solution.status == INFEASIBLE
    assert solution.stage_of_layer is None and solution.objective is None


def test_rejects_a_graph_that_is_not_a_chain() -> None:
    rng = random.Random(7)
    problem = random_problem(rng, random_dag(rng, 6))
    assert not is_chain_problem(problem)
    with pytest.raises(ValueError):
        solve_chain(problem)


def large_problem(seed: int, **limits: int) -> StageProblem:
    rng = random.Random(seed)
    graph = random_chain(rng, 300)
    config = ParallelConfig(pp=16, tp=1, dp=2, micro_batch=1, num_microbatches=32)
    costs = layer_costs(
        graph,
        config,
        Cluster(num_gpus=config.num_gpus),
        TrainingConfig(global_batch=config.global_batch),
    )
    return StageProblem(costs=costs, **limits)


def test_deterministic_split() -> None:
    problem = large_problem(3)
    first, second = solve_chain(problem), solve_chain(problem)
    assert first.status == OPTIMAL
    assert first.stage_of_layer == second.stage_of_layer


def test_time_limit_returns_a_valid_answer() -> None:
    problem = large_problem(4, objective=OBJECTIVE_TIME)
    solution = solve_chain(problem, time_limit_s=0.0)
    assert solution.status in (UNKNOWN, FEASIBLE, OPTIMAL)
    if solution.stage_of_layer is not None:
        assert problem.violation(solution.stage_of_layer) is None
        assert solution.bound <= solution.objective


def test_large_chain_budget_is_respected() -> None:
    """A binding iteration budget on 300 layers x 16 stages: valid, and no better than without."""
    free = solve_chain(large_problem(5))
    fastest = solve_chain(large_problem(5, objective=OBJECTIVE_TIME))
    slow = large_problem(5).measure(free.stage_of_layer)[1]
    budget = (fastest.objective + slow) // 2
    problem = large_problem(5, iteration_budget_ns=budget)
    solution = solve_chain(problem)
    assert solution.status == OPTIMAL
    assert problem.violation(solution.stage_of_layer) is None
    assert free.objective <= solution.objective


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_time_rules_are_non_decreasing_prefix_sums(schedule):
    """The chain's relaxation needs every term's U and V non-decreasing along the chain
    (``time_rules``): random layer times and forward shares, every pipeline depth and micro-batch
    count, 1F1B and GPipe."""
    rng = random.Random(5)
    for _ in range(20):
        layers = rng.randint(3, 12)
        pp = rng.randint(1, min(layers, 6))
        m = rng.randint(1, 12)
        config = ParallelConfig(
            pp=pp, tp=1, dp=1, micro_batch=1, num_microbatches=m, schedule=schedule
        )
        graph = random_chain(rng, layers)
        costs = layer_costs(graph, config, Cluster(num_gpus=pp), TrainingConfig(global_batch=m))
        time_ns = np.array([rng.randint(0, 1000) for _ in range(layers)], dtype=np.int64)
        costs = dataclasses.replace(
            costs,
            time_ns=time_ns,
            forward_ns=np.array([rng.randint(0, int(t)) for t in time_ns], dtype=np.int64),
            optimizer_step_ns=np.array([rng.randint(0, 50) for _ in range(layers)]),
        )
        prefix = lambda values: np.concatenate(([0], np.cumsum(values, dtype=np.int64)))  # noqa: E731
        end, start, _, _ = time_rules(costs, bound_terms(costs), prefix)
        assert np.all(np.diff(end, axis=-1) >= 0) and np.all(np.diff(start, axis=-1) >= 0)
