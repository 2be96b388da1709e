"""The planner end to end against a brute-force oracle over every config and every split."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from solver import Cluster, TrainingConfig, plan
from solver.backends.brute_force import solve_brute_force
from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, StageProblem
from solver.candidates import candidate_configs
from solver.cost_model import layer_costs
from solver.errors import InfeasibleError, InputError
from solver.plan_check import check_plan
from tests.conftest import slow_params
from tests.random_graphs import random_chain, random_dag


def oracle(graph, cluster, training):
    """(best peak, best throughput at that peak) by enumerating every config and split."""
    capacity = cluster.gpu_memory_bytes
    configs = candidate_configs(graph.num_layers, cluster, training)
    costs = [layer_costs(graph, c, cluster, training) for c in configs]
    budget = None
    if training.max_slowdown is not None:
        fastest = [
            solve_brute_force(
                StageProblem(costs=c, objective=OBJECTIVE_TIME, capacity_bytes=capacity)
            )
            for c in costs
        ]
        times = [s.objective for s in fastest if s.objective is not None]
        if not times:
            return None, None
        budget = math.floor(training.max_slowdown * min(times))
    best = [
        solve_brute_force(
            StageProblem(
                costs=c,
                objective=OBJECTIVE_MEMORY,
                capacity_bytes=capacity,
                iteration_budget_ns=budget,
            )
        )
        for c in costs
    ]
    peaks = [s.objective for s in best if s.objective is not None]
    if not peaks:
        return None, None
    peak = min(peaks)
    fastest_at_peak = min(
        solve_brute_force(
            StageProblem(
                costs=c, objective=OBJECTIVE_TIME, capacity_bytes=peak, iteration_budget_ns=budget
            )
        ).objective
        or math.inf
        for c in costs
    )
    return peak, training.global_batch * 1e9 / fastest_at_peak


@pytest.mark.parametrize("seed", slow_params(range(8), 6))
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
    expected_peak, expected_throughput = oracle(graph, cluster, training)
    result = plan(graph, cluster, training, time_limit_s=60)
    assert result.peak_bytes == expected_peak
    assert result.throughput == pytest.approx(expected_throughput, rel=1e-12)
    assert result.solver.status == "OPTIMAL" and result.solver.gap == 0
    assert check_plan(result) == []


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
