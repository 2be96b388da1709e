"""The Pareto front: non-dominated, recomputed by solver.evaluate, and equal to a brute-force
enumeration of every split of every config on tiny cases."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest

from solver import Cluster, TrainingConfig, evaluate
from solver.backends.problem import StageProblem
from solver.cli import plan_main
from solver.costs.schedule_time import stages_timeline
from solver.errors import InfeasibleError, InputError
from solver.search.config_search import build_entries
from solver.search.pareto import dominated, pareto_front
from tests.conftest import GPT_1_3B, MIXED_CLUSTER, cluster_group, cluster_of
from tests.random_graphs import random_chain, random_dag

TRAINING = TrainingConfig(global_batch=4, micro_batch_sizes=(1, 2), zero_stages=(0, 3))


def brute_force_front(graph, cluster, training) -> set[tuple[int, int]]:
    """Non-dominated (peak, iteration ns) over every valid split of every candidate config."""
    values = set()
    for entry in build_entries(graph, cluster, training):
        problem = StageProblem(costs=entry.costs, capacity_bytes=cluster.gpu_memory_bytes)
        for stage_of in itertools.product(range(problem.num_stages), repeat=graph.num_layers):
            if problem.violation(stage_of) is None:
                values.add(problem.measure(stage_of))
    return {v for v in values if not any(w != v and w[0] <= v[0] and w[1] <= v[1] for w in values)}


def tiny_case(seed: int, make_graph, num_layers: int):
    """A random graph on 4 GPUs whose capacity cuts off part of the splits."""
    graph = make_graph(random.Random(seed), num_layers)
    roomy = Cluster(num_gpus=4, gpu_memory_bytes=2**40)
    peaks = sorted(brute_force_front(graph, roomy, TRAINING))
    capacity = peaks[len(peaks) // 2][0]  # the fastest roomy plans no longer fit
    return graph, dataclasses.replace(roomy, gpu_memory_bytes=capacity)


def check_points(front, graph, cluster, training) -> None:
    """Points fit, are pairwise non-dominated, and solver.evaluate recomputes their numbers."""
    pairs = [(p.peak_bytes, -p.iteration_bound_ns) for p in front.points]  # exact axis
    assert all(not dominated(a, b) for a in pairs for b in pairs)
    assert pairs == sorted(pairs) and len(set(pairs)) == len(pairs)
    for point in front.points:
        assert point.peak_bytes <= cluster.gpu_memory_bytes
        again = evaluate(
            graph, point.config, point.stage_of_layer, cluster=cluster, training=training
        )
        assert (again.peak_bytes, again.iteration_ns) == (point.peak_bytes, point.iteration_ns)
        assert [s.breakdown() for s in again.stages] == [s.breakdown() for s in point.stages]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_front_equals_brute_force_on_tiny_chains(seed):
    graph, cluster = tiny_case(seed, random_chain, 5)
    front = pareto_front(graph, cluster, TRAINING, max_points=None)
    check_points(front, graph, cluster, TRAINING)
    assert front.complete and front.proven
    expected = brute_force_front(graph, cluster, TRAINING)
    assert {(p.peak_bytes, p.iteration_bound_ns) for p in front.points} == expected


def test_front_equals_brute_force_on_a_tiny_dag():
    graph, cluster = tiny_case(3, random_dag, 5)
    assert not build_entries(graph, cluster, TRAINING)[0].costs.is_chain()
    front = pareto_front(graph, cluster, TRAINING, max_points=None)
    check_points(front, graph, cluster, TRAINING)
    expected = brute_force_front(graph, cluster, TRAINING)
    assert {(p.peak_bytes, p.iteration_bound_ns) for p in front.points} == expected


def test_bounded_front_keeps_both_ends_and_only_front_points():
    graph, cluster = tiny_case(3, random_chain, 6)
    expected = brute_force_front(graph, cluster, TRAINING)
    assert len(expected) > 3, "the case must have a front longer than the bound"
    front = pareto_front(graph, cluster, TRAINING, max_points=3)
    check_points(front, graph, cluster, TRAINING)
    found = [(p.peak_bytes, p.iteration_bound_ns) for p in front.points]
    assert not front.complete and 2 <= len(found) <= 3
    assert set(found) <= expected
    assert found[0] == min(expected) and found[-1] == min(expected, key=lambda v: (v[1], v[0]))


def test_min_throughput_is_a_floor():
    graph, cluster = tiny_case(1, random_chain, 5)
    full = pareto_front(graph, cluster, TRAINING, max_points=None)
    floor = full.points[len(full.points) // 2].throughput
    training = dataclasses.replace(TRAINING, min_throughput=floor)
    front = pareto_front(graph, cluster, training, max_points=None)
    assert [p.peak_bytes for p in front.points] == [
        p.peak_bytes for p in full.points if p.throughput >= floor
    ]


def test_nothing_fits_and_bad_bound_are_typed_errors():
    graph = random_chain(random.Random(0), 4)
    with pytest.raises(InfeasibleError):
        pareto_front(graph, Cluster(num_gpus=2, gpu_memory_bytes=1), TRAINING)
    with pytest.raises(InputError, match="at least 2"):
        pareto_front(graph, Cluster(num_gpus=2), TRAINING, max_points=1)


@pytest.mark.slow
def test_plan_cli_pareto_prints_writes_json_and_plots(capsys, tmp_path, gpt_graph):
    out, picture = tmp_path / "front.json", tmp_path / "front.png"
    args = [GPT_1_3B, "--gpus", "8", "--gpu-memory", "40GiB", "--global-batch", "32", "--pareto"]
    code = plan_main([*args, "--pareto-points", "4", "--json", str(out), "--plot", str(picture)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Pareto front of gpt-1.3b" in captured.out and "samples/s" in captured.out
    document = json.loads(out.read_text())
    assert document["format"] == "pareto" and 2 <= len(document["points"]) <= 4
    pairs = [(p["peak_bytes"], p["throughput"]) for p in document["points"]]
    assert all(not dominated(a, b) for a in pairs for b in pairs)
    assert picture.read_bytes()[:4] == b"\x89PNG"
    assert all(len(p["stage_of_layer"]) == gpt_graph.num_layers for p in document["points"])


def test_plan_cli_pareto_points_below_two_is_exit_2(capsys):
    args = [GPT_1_3B, "--gpus", "8", "--global-batch", "32", "--pareto", "--pareto-points", "1"]
    assert plan_main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--pareto-points" in err


# -- heterogeneous clusters: the memory axis is the memory objective's --------------------------


def _two_groups(small_bytes: int, large_bytes: int) -> Cluster:
    """2 GPUs of `small_bytes` at 989 TFLOP/s and 2 of `large_bytes` at 312 (one node each)."""
    return cluster_of(
        cluster_group("small", small_bytes), cluster_group("large", large_bytes, tflops=312)
    )


def placed_brute_force_front(graph, cluster, training) -> set[tuple[int, int]]:
    """Non-dominated (memory objective, iteration bound ns) over every config, split and
    assignment of stages to groups that fits every group's capacity (and whose simulated
    iteration meets the throughput floor)."""
    budget = (
        None
        if training.min_throughput is None
        else math.floor(training.global_batch * 1e9 / training.min_throughput)
    )
    values = set()
    for entry in build_entries(graph, cluster, training):
        problem = StageProblem(
            costs=entry.costs, placement=entry.placement, iteration_budget_ns=budget
        )
        p, counts = problem.num_stages, entry.placement.stages_per_group
        groupings = [
            list(groups)
            for groups in itertools.product(range(len(counts)), repeat=p)
            if [groups.count(k) for k in range(len(counts))] == counts
        ]
        edges = list(zip(entry.costs.edge_src, entry.costs.edge_dst, strict=True))
        for stage_of in itertools.product(range(p), repeat=graph.num_layers):
            if len(set(stage_of)) < p or any(stage_of[u] > stage_of[v] for u, v in edges):
                continue  # an empty stage or an edge backwards: no grouping makes it valid
            for groups in groupings:
                if problem.violation(stage_of, None, groups) is not None:
                    continue
                stages = problem.stages(stage_of, None, groups)
                if (
                    budget is None
                    or stages_timeline(entry.costs, stages, stage_of).makespan_ns <= budget
                ):
                    values.add(problem.measure(stage_of, None, groups))
    return {v for v in values if not any(w != v and w[0] <= v[0] and w[1] <= v[1] for w in values)}


def hetero_case(seed: int, make_graph, num_layers: int, memory_objective: str):
    """A random graph on 2 small fast + 2 large slow GPUs: the small capacity is the median peak
    of the front with no memory limit, the large one twice it (placement decides what fits)."""
    graph = make_graph(random.Random(seed), num_layers)
    absolute = dataclasses.replace(TRAINING, memory_objective="absolute")
    peaks = sorted(placed_brute_force_front(graph, _two_groups(2**40, 2**40), absolute))
    small = peaks[len(peaks) // 2][0]
    training = dataclasses.replace(TRAINING, memory_objective=memory_objective)
    return graph, _two_groups(small, 2 * small), training


def check_placed_points(front, graph, cluster, training) -> None:
    """Each point places its stages on the groups (all GPUs used), fits each group's memory,
    is recomputed exactly by solver.evaluate with its group_of_stage, and no point dominates
    another on (memory axis, iteration)."""
    unit = "ppm" if training.memory_objective == "utilization" else "bytes"
    assert front.memory_unit == unit
    pairs = [(m, p.iteration_bound_ns) for m, p in zip(front.memory, front.points, strict=True)]
    assert pairs == sorted(pairs) and all(a[1] > b[1] for a, b in itertools.pairwise(pairs))
    for memory, point in zip(front.memory, front.points, strict=True):
        assert point.group_of_stage is not None and len(point.group_of_stage) == point.config.pp
        for k, group in enumerate(cluster.groups):
            hosted = point.group_of_stage.count(k)
            assert hosted * point.config.tp * point.config.dp == group.num_gpus
        assert point.fits
        again = evaluate(
            graph,
            point.config,
            point.stage_of_layer,
            cluster=cluster,
            training=training,
            group_of_stage=point.group_of_stage,
        )
        assert (again.peak_bytes, again.iteration_ns) == (point.peak_bytes, point.iteration_ns)
        expected = max(again.utilization_ppm) if unit == "ppm" else again.peak_bytes
        assert memory == expected


TINY_CHAINS = [(seed, objective) for seed in (0, 1, 2) for objective in ("utilization", "absolute")]
"""(seed, memory objective) cases, seconds each: slow."""


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "memory_objective"), TINY_CHAINS)
def test_heterogeneous_front_equals_brute_force_on_tiny_chains(seed, memory_objective):
    graph, cluster, training = hetero_case(seed, random_chain, 5, memory_objective)
    expected = placed_brute_force_front(graph, cluster, training)
    assert len(expected) >= 2, "the case must have a trade-off"
    front = pareto_front(graph, cluster, training, max_points=None)
    assert front.complete and front.proven
    check_placed_points(front, graph, cluster, training)
    found = {(m, p.iteration_bound_ns) for m, p in zip(front.memory, front.points, strict=True)}
    assert found == expected


@pytest.mark.slow
@pytest.mark.parametrize("memory_objective", ["utilization", "absolute"])
def test_heterogeneous_front_equals_brute_force_on_a_tiny_dag(memory_objective):
    graph, cluster, training = hetero_case(3, random_dag, 5, memory_objective)
    assert not build_entries(graph, cluster, training)[0].costs.is_chain()
    front = pareto_front(graph, cluster, training, max_points=None)
    check_placed_points(front, graph, cluster, training)
    found = {(m, p.iteration_bound_ns) for m, p in zip(front.memory, front.points, strict=True)}
    assert found == placed_brute_force_front(graph, cluster, training)


@pytest.mark.slow
def test_heterogeneous_front_with_a_floor_and_a_bound():
    """--min-throughput cuts the slow end of the front; max_points samples it, keeping both
    ends and only front points."""
    graph, cluster, training = hetero_case(1, random_chain, 6, "utilization")
    full = pareto_front(graph, cluster, training, max_points=None)
    pairs = [(m, p.iteration_bound_ns) for m, p in zip(full.memory, full.points, strict=True)]
    assert len(pairs) > 3, "the case must have a front longer than the bound"
    sampled = pareto_front(graph, cluster, training, max_points=3)
    found = [(m, p.iteration_bound_ns) for m, p in zip(sampled.memory, sampled.points, strict=True)]
    assert not sampled.complete and 2 <= len(found) <= 3
    assert set(found) <= set(pairs) and found[0] == pairs[0] and found[-1] == pairs[-1]
    floor = full.points[len(pairs) // 2].throughput
    floored = dataclasses.replace(training, min_throughput=floor)
    front = pareto_front(graph, cluster, floored, max_points=None)
    kept = [(m, p.iteration_bound_ns) for m, p in zip(front.memory, front.points, strict=True)]
    assert kept == [
        pair for pair, p in zip(pairs, full.points, strict=True) if p.throughput >= floor
    ]
    assert set(kept) == placed_brute_force_front(graph, cluster, floored)


def test_heterogeneous_nothing_fits_is_infeasible():
    graph = random_chain(random.Random(0), 4)
    with pytest.raises(InfeasibleError, match="group"):
        pareto_front(graph, _two_groups(1, 2), TRAINING)


@pytest.mark.slow
@pytest.mark.parametrize("memory_objective, unit", [("utilization", "ppm"), ("absolute", "bytes")])
def test_plan_cli_pareto_on_a_heterogeneous_cluster(capsys, tmp_path, memory_objective, unit):
    out, picture = tmp_path / "front.json", tmp_path / "front.png"
    args = [GPT_1_3B, "--cluster", MIXED_CLUSTER, "--global-batch", "32", "--pareto", "--pp", "2"]
    args += ["--memory-objective", memory_objective, "--pareto-points", "3", "--reserve", "0"]
    code = plan_main([*args, "--json", str(out), "--plot", str(picture)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "a100-40g" in captured.out and "max util" in captured.out
    document = json.loads(out.read_text())
    assert document["memory_unit"] == unit and document["memory_objective"] == memory_objective
    assert [g["name"] for g in document["cluster"]["groups"]] == ["a100-40g", "a100-80g"]
    points = document["points"]
    assert 2 <= len(points) <= 3
    for point in points:
        groups = [stage["group"] for stage in point["stages"]]
        assert sorted(groups) == ["a100-40g", "a100-80g"]  # pp2: one stage on each group
        assert all(s["peak_bytes"] <= s["capacity_bytes"] for s in point["stages"])
        memory = (
            max(math.ceil(s["peak_bytes"] * 10**6 / s["capacity_bytes"]) for s in point["stages"])
            if unit == "ppm"
            else point["peak_bytes"]
        )
        assert point["memory"] == memory
    pairs = [(p["memory"], -p["throughput"]) for p in points]
    assert pairs == sorted(pairs) and len({m for m, _ in pairs}) == len(pairs)
    assert all(a[1] > b[1] for a, b in itertools.pairwise(pairs)), "faster as memory grows"
    assert picture.read_bytes()[:4] == b"\x89PNG"
