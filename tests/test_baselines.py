"""Baseline partitioners: valid splits, exact costs, never better than our optimum, and the
CAPSlog-style greedy caught being sub-optimal on a case small enough to check by hand."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from solver import Cluster, ParallelConfig, TrainingConfig, evaluate, graph_from_dict
from solver.backends import resolve_backend, solve
from solver.backends.brute_force import solve_brute_force
from solver.backends.problem import OBJECTIVE_TIME, StageProblem
from solver.costs import iteration_bound_ns, layer_costs, stage_costs
from solver.evaluation import evaluate_partitioners, resolve_split
from solver.report.baselines import (
    PARTITIONERS,
    capslog_split,
    capslog_statistics,
    even_split,
    fastest_fitting_split,
    min_max_blocks,
    uniform_split,
)
from solver.search.planner import plan
from solver.specs import RUNTIMES
from tests.random_graphs import (
    random_chain,
    random_config,
    random_dag,
    random_problem,
    with_unsaved_output,
)

CHAIN_ORDERED = ("even", "uniform", "parameters", "size", "capslog")
"""Partitioners that cut the layer list into contiguous runs (throughput follows the DAG)."""


def random_case(seed: int):
    rng = random.Random(9000 + seed)
    make = random_chain if seed % 3 else random_dag
    graph = make(rng, rng.randint(4, 8))
    problem = random_problem(rng, graph)
    config = problem.costs.config
    cluster = Cluster(num_gpus=config.num_gpus)
    # the options the problem's costs were built with, admitting its schedule and recompute
    training = TrainingConfig(
        global_batch=config.global_batch,
        schedule=config.schedule,
        recompute=config.recompute,
        sequence_parallel="on" if config.sp else "off",
    )
    return graph, problem, cluster, training


@pytest.mark.parametrize("seed", range(30))
def test_every_partitioner_gives_a_valid_split_with_exact_costs(seed):
    graph, problem, cluster, training = random_case(seed)
    costs, num_stages = problem.costs, problem.num_stages
    evaluations = evaluate_partitioners(graph, costs, cluster=cluster, training=training)
    assert set(evaluations) == set(PARTITIONERS)
    for name, evaluation in evaluations.items():
        split = evaluation.stage_of_layer
        # non-empty stages 0..p-1, no edge going backwards (raises InputError otherwise)
        assert resolve_split(graph, num_stages, split) == split, name
        assert sorted(set(split)) == list(range(num_stages)), name
        if name in CHAIN_ORDERED:
            assert split == sorted(split), f"{name} is not contiguous in list order"
        # the reported costs recompute from scratch (coefficients rebuilt from the graph)
        fresh = evaluate(graph, costs.config, split, cluster=cluster, training=training)
        assert [s.breakdown() for s in evaluation.stages] == [s.breakdown() for s in fresh.stages]
        assert evaluation.peak_bytes == max(s.peak_bytes for s in stage_costs(costs, split))
        assert evaluation.iteration_ns == fresh.iteration_ns


@pytest.mark.parametrize("seed", range(30))
def test_our_optimum_is_never_worse_than_any_baseline(seed):
    graph, problem, cluster, training = random_case(seed)
    backend = resolve_backend("auto", problem.costs.is_chain())
    optimum = solve(problem, backend, time_limit_s=30).objective
    evaluations = evaluate_partitioners(graph, problem.costs, cluster=cluster, training=training)
    for name, evaluation in evaluations.items():
        assert optimum <= evaluation.peak_bytes, name


@pytest.mark.parametrize("seed", range(4))
def test_the_plan_beats_every_baseline_on_its_own_config(seed):
    rng = random.Random(70 + seed)
    graph = random_chain(rng, 10)
    cluster = Cluster(num_gpus=8, gpus_per_node=4, gpu_memory_bytes=10**7)
    training = TrainingConfig(global_batch=16, max_slowdown=None)
    result = plan(graph, cluster, training)
    costs = layer_costs(graph, result.config, cluster, training)
    for name, evaluation in evaluate_partitioners(
        graph, costs, cluster=cluster, training=training
    ).items():
        assert result.peak_bytes <= evaluation.peak_bytes, name


def chain_graph(layers: list[dict]):
    return graph_from_dict({"format": "layer-graph", "version": 1, "model": "m", "layers": layers})


def test_capslog_greedy_is_sub_optimal_where_transients_do_not_add_up():
    """4 layers, 2 stages, GPipe (k = 4 on both), 1 byte per parameter, edges of 1000 B.

    body = params + 4 x activations: 16000, 13000, 16000, 36000; transients 9000, 1000, 9000, 5000;
    while layer l runs, its micro-batch holds the layers up to l (``costs.layer_moments``).
    Optimum [l0 l1 l2 | l3]: stage 0 = states 21000 + 3 x 6000 held + 1000 (send) + during(l2)
    6000 + 9000 = 55000, stage 1 = 36000 + 1000 + 5000 = 42000. CAPSlog predicts stage l0..l2 as
    isolated(l0) 26000 + added(l1) 11000 + added(l2) 24000 = 61000: l2's transient is counted
    although l0's, equal, is freed before l2 runs. So below 61000 the greedy closes stage 0 after
    l1 and settles on [l0 l1 | l2 l3] = 58000 (16000 + 3 x 9000 + 1000 + 9000 + 5000), 5.5% worse.
    """
    sizes = [(8000, 2000, 9000), (5000, 2000, 1000), (8000, 2000, 9000), (8000, 7000, 5000)]
    graph = chain_graph(
        [
            {
                "name": f"l{i}",
                "params": params,
                "activation_bytes": activations,
                "output_bytes": 1000,
                "transient_bytes": transient,
            }
            for i, (params, activations, transient) in enumerate(sizes)
        ]
    )
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4, schedule="gpipe")
    training = TrainingConfig(
        global_batch=4,
        weight_bytes_per_param=1,
        grad_bytes_per_param=0,
        optimizer_bytes_per_param=0,
    )
    costs = layer_costs(graph, config, Cluster(num_gpus=2), training)
    isolated, added = capslog_statistics(costs)
    assert isolated[0, 0] + added[0, 1] + added[0, 2] == 61000
    greedy = capslog_split(costs)
    assert greedy == [0, 0, 1, 1]
    assert max(s.peak_bytes for s in stage_costs(costs, greedy)) == 58000
    optimum = solve_brute_force(StageProblem(costs=costs))
    assert optimum.stage_of_layer == [0, 0, 0, 1]
    assert optimum.objective == 55000


@pytest.mark.parametrize("seed", range(6))
def test_capslog_statistics_are_the_cost_models_one_and_two_layer_stages(seed):
    rng = random.Random(40 + seed)
    # torch: the output its pipeline keeps for the loss (costs.moment_transient), every other
    graph = with_unsaved_output(random_chain(rng, 6), 500 * (seed % 2))
    config = dataclasses.replace(random_config(rng, 6), pp=3)
    training = TrainingConfig(global_batch=config.global_batch, runtime=rng.choice(RUNTIMES))
    costs = layer_costs(graph, config, Cluster(num_gpus=config.num_gpus), training)
    isolated, added = capslog_statistics(costs)
    num_layers, num_stages = costs.num_layers, costs.num_stages
    checked = 0
    for s in range(num_stages):
        for first in range(num_layers):
            for size in (1, 2):
                last = first + size - 1
                layers_after = num_layers - 1 - last
                if not (s <= first and (first == 0) == (s == 0)):
                    continue  # stages 0..s-1 take the layers before, one at least each
                if not (
                    num_stages - 1 - s <= layers_after
                    and (layers_after == 0) == (s == num_stages - 1)
                ):
                    continue  # and stages s+1..p-1 the layers after
                # stage s = first..last; the layers before and after fill the other stages
                before = [min(i, s - 1) for i in range(first)]
                after = [min(s + 1 + j, num_stages - 1) for j in range(layers_after)]
                split = before + [s] * size + after
                peak = stage_costs(costs, split)[s].peak_bytes
                predicted = isolated[s, first] + (added[s, last] if size == 2 else 0)
                assert predicted == peak, (s, first, size)
                checked += 1
    assert checked == 2 + 7 + 2  # (first, size) pairs of stages 0, 1 and 2 on 6 layers


def test_uniform_is_deepspeeds_partition_uniform_and_even_is_megatrons():
    block = {"params": 10, "activation_bytes": 1, "output_bytes": 1}
    graph = chain_graph(
        [{"name": "embed", "params": 100, "activation_bytes": 1, "output_bytes": 1}]
        + [dict(block, name=f"layers.{i}") for i in range(8)]
        + [{"name": "head", "params": 100, "activation_bytes": 1, "output_bytes": 1}]
    )
    # DeepSpeed: 10 items over 4 parts -> 3, 3, 2, 2 (the first L % p parts one more)
    assert np.bincount(uniform_split(graph, 4)).tolist() == [3, 3, 2, 2]
    # Megatron: 8 blocks over 4 stages, the embedding on the first and the head on the last
    assert np.bincount(even_split(graph, 4)).tolist() == [3, 2, 2, 3]


@pytest.mark.parametrize("seed", range(10))
def test_min_max_blocks_is_exact(seed):
    rng = random.Random(seed)
    weights = np.array([rng.randint(1, 50) for _ in range(rng.randint(3, 9))])
    stages = rng.randint(1, min(4, len(weights)))
    split = min_max_blocks(weights, stages)
    assert split == sorted(split) and sorted(set(split)) == list(range(stages))
    best = min(
        max(part.sum() for part in np.split(weights, cuts))
        for cuts in itertools.combinations(range(1, len(weights)), stages - 1)
    )
    assert np.bincount(split, weights=weights).max() == best


@pytest.mark.parametrize("seed", range(8))
def test_throughput_first_is_the_fastest_split_that_fits(seed):
    rng = random.Random(500 + seed)
    graph = (random_chain if seed % 2 else random_dag)(rng, rng.randint(4, 7))
    costs = random_problem(rng, graph).costs
    fastest_overall = solve_brute_force(StageProblem(costs=costs, objective=OBJECTIVE_TIME))
    peak_of_fastest = max(s.peak_bytes for s in stage_costs(costs, fastest_overall.stage_of_layer))
    capacity = peak_of_fastest - 1  # the fastest split no longer fits
    expected = solve_brute_force(
        StageProblem(costs=costs, objective=OBJECTIVE_TIME, capacity_bytes=capacity)
    )
    split = fastest_fitting_split(costs, capacity)
    stages = stage_costs(costs, split)
    if expected.has_solution:
        assert max(s.peak_bytes for s in stages) <= capacity
        assert iteration_bound_ns(costs, stages) == expected.objective
    else:  # nothing fits: the fastest split regardless of memory
        assert iteration_bound_ns(costs, stages) == fastest_overall.objective
    for name in PARTITIONERS:  # every partitioner takes the capacity argument
        assert len(PARTITIONERS[name](graph, costs, capacity)) == graph.num_layers
