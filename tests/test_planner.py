"""The planner end to end against a brute-force oracle over every config and every split."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from solver import Cluster, TrainingConfig, plan
from solver.backends.problem import StageProblem
from solver.costs import iteration_bound_ns, layer_costs, stage_costs
from solver.costs.schedule_time import stages_timeline
from solver.errors import InfeasibleError, InputError
from solver.plan_check import check_plan
from solver.search.candidates import candidate_configs
from tests.conftest import slow_params
from tests.random_graphs import random_chain, random_dag


def every_plan(graph, cluster, training):
    """(peak bytes, iteration bound ns, simulated iteration ns) of every config, split and
    recompute set that fits in the cluster's memory."""
    capacity = cluster.gpu_memory_bytes
    plans = []
    for config in candidate_configs(graph.num_layers, cluster, training):
        costs = layer_costs(graph, config, cluster, training)
        problem = StageProblem(costs=costs, capacity_bytes=capacity)
        flags = [None]
        if costs.selective:
            flags = list(itertools.product((False, True), repeat=graph.num_layers))
        for split in itertools.product(range(costs.num_stages), repeat=graph.num_layers):
            for recomputed in flags:
                if problem.violation(split, recomputed) is not None:
                    continue
                stages = stage_costs(costs, split, recomputed)
                peak = max(stage.peak_bytes for stage in stages)
                timeline = stages_timeline(costs, stages, split).makespan_ns
                plans.append((peak, iteration_bound_ns(costs, stages), timeline))
    return plans


def check_against_every_plan(result, graph, cluster, training):
    """The planner against every plan: its fastest plan is one of those with the least bound,
    the budget is --max-slowdown times its simulated iteration, the plan meets the budget in
    its simulated schedule, and its peak is the least of those that do (proven), or at least
    that (not proven, a note says why)."""
    plans = every_plan(graph, cluster, training)
    fastest = min(bound for _, bound, _ in plans)
    assert result.fastest_iteration_ns in {sim for _, bound, sim in plans if bound == fastest}
    budget = result.iteration_budget_ns
    assert budget == math.floor(training.max_slowdown * result.fastest_iteration_ns)
    assert result.evaluation.iteration_ns <= budget
    expected = min(peak for peak, _, sim in plans if sim <= budget)
    if result.solver.status == "OPTIMAL":
        assert result.peak_bytes == expected
    else:
        assert result.peak_bytes >= expected and result.solver.notes
    assert check_plan(result) == []


@pytest.mark.parametrize("seed", slow_params(range(8), 0, 6))
@pytest.mark.parametrize("shape", ["chain", "dag"])
def test_plan_equals_brute_force_over_all_configs(seed, shape):
    rng = random.Random(seed)
    graph = (random_chain if shape == "chain" else random_dag)(rng, rng.randint(4, 6))
    cluster = Cluster(num_gpus=4, gpus_per_node=2, gpu_memory_bytes=10**9)
    training = TrainingConfig(
        global_batch=8,
        micro_batch_sizes=(1, 2),
        zero_stages=(0, 3) if seed % 2 else (0,),
        recompute="auto" if seed % 3 == 0 else "none",
        schedule="gpipe" if seed % 4 == 1 else "1f1b",
    )
    result = plan(graph, cluster, training, time_limit_s=60)
    check_against_every_plan(result, graph, cluster, training)


def test_capacity_binds_and_infeasible_explains():
    rng = random.Random(7)
    graph = random_chain(rng, 6)
    cluster = Cluster(num_gpus=4, gpus_per_node=2, gpu_memory_bytes=10**9)
    training = TrainingConfig(global_batch=8, max_slowdown=None)
    free = plan(graph, cluster, training)
    tight = dataclasses.replace(cluster, gpu_memory_bytes=free.peak_bytes)
    assert plan(graph, tight, training).peak_bytes == free.peak_bytes
    too_small = dataclasses.replace(cluster, gpu_memory_bytes=free.peak_bytes - 1)
    with pytest.raises(InfeasibleError) as caught:
        plan(graph, too_small, training)
    error = caught.value
    assert error.exit_code == 3
    assert error.best_peak_bytes == free.peak_bytes
    assert "over;" in str(error) and "(--gpu-memory)" in str(error)
    if error.suggested_gpus is not None:  # the suggestion really fits
        bigger = dataclasses.replace(too_small, num_gpus=error.suggested_gpus)
        assert plan(graph, bigger, training).peak_bytes <= too_small.gpu_memory_bytes


def test_min_throughput_infeasible_names_the_constraint():
    rng = random.Random(3)
    graph = random_chain(rng, 5)
    cluster = Cluster(num_gpus=2, gpus_per_node=2, gpu_memory_bytes=10**9)
    fastest = plan(graph, cluster, TrainingConfig(global_batch=4, objective="throughput"))
    ok = plan(
        graph, cluster, TrainingConfig(global_batch=4, min_throughput=fastest.throughput * 0.999)
    )
    assert ok.throughput >= fastest.throughput * 0.999
    with pytest.raises(InfeasibleError, match="throughput constraint cannot be met"):
        plan(
            graph, cluster, TrainingConfig(global_batch=4, min_throughput=fastest.throughput * 1.01)
        )


def test_throughput_objective_is_fastest_and_memory_plan_within_slowdown():
    rng = random.Random(11)
    graph = random_chain(rng, 6)
    cluster = Cluster(num_gpus=4, gpus_per_node=2, gpu_memory_bytes=10**9)
    fastest = plan(graph, cluster, TrainingConfig(global_batch=8, objective="throughput"))
    lean = plan(graph, cluster, TrainingConfig(global_batch=8, max_slowdown=1.25))
    unconstrained = plan(graph, cluster, TrainingConfig(global_batch=8, max_slowdown=None))
    assert lean.throughput >= fastest.throughput / 1.25 * (1 - 1e-9)
    assert unconstrained.peak_bytes <= lean.peak_bytes <= fastest.peak_bytes
    assert lean.fastest_throughput == pytest.approx(fastest.throughput)


def test_pinned_config_mismatch_is_input_error():
    graph = random_chain(random.Random(0), 6)
    with pytest.raises(InputError, match=r"pp\(4\) \* tp\(2\) \* dp\(2\) = 16 != gpus\(8\)"):
        plan(graph, Cluster(num_gpus=8), TrainingConfig(global_batch=8, pp=4, tp=2, dp=2))


def test_deterministic():
    graph = random_dag(random.Random(5), 7)
    cluster = Cluster(num_gpus=4, gpus_per_node=2, gpu_memory_bytes=10**9)
    training = TrainingConfig(global_batch=8)
    first, second = plan(graph, cluster, training), plan(graph, cluster, training)
    assert first.config == second.config and first.stage_of_layer == second.stage_of_layer
