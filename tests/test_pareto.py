"""The Pareto front: non-dominated, recomputed by solver.evaluate, and equal to a brute-force
enumeration of every split of every config on tiny cases."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest

from solver import Cluster, TrainingConfig, evaluate, load_graph
from solver.cli import plan_main
from solver.errors import InfeasibleError, InputError
from solver.pareto import dominated, pareto_front
from solver.problem import StageProblem
from solver.search import build_entries
from tests.random_graphs import random_chain, random_dag

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt-1.3b.json")
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
    pairs = [(p.peak_bytes, p.throughput) for p in front.points]
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
    assert {(p.peak_bytes, p.iteration_ns) for p in front.points} == expected


def test_front_equals_brute_force_on_a_tiny_dag():
    graph, cluster = tiny_case(3, random_dag, 5)
    assert not build_entries(graph, cluster, TRAINING)[0].costs.is_chain()
    front = pareto_front(graph, cluster, TRAINING, max_points=None)
    check_points(front, graph, cluster, TRAINING)
    expected = brute_force_front(graph, cluster, TRAINING)
    assert {(p.peak_bytes, p.iteration_ns) for p in front.points} == expected


def test_bounded_front_keeps_both_ends_and_only_front_points():
    graph, cluster = tiny_case(0, random_chain, 6)
    expected = brute_force_front(graph, cluster, TRAINING)
    assert len(expected) > 3, "the case must have a front longer than the bound"
    front = pareto_front(graph, cluster, TRAINING, max_points=3)
    check_points(front, graph, cluster, TRAINING)
    found = [(p.peak_bytes, p.iteration_ns) for p in front.points]
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


def test_plan_cli_pareto_prints_writes_json_and_plots(capsys, tmp_path):
    out, picture = tmp_path / "front.json", tmp_path / "front.png"
    args = [GPT, "--gpus", "8", "--gpu-memory", "40GiB", "--global-batch", "32", "--pareto"]
    code = plan_main([*args, "--pareto-points", "4", "--json", str(out), "--plot", str(picture)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Pareto front of gpt-1.3b" in captured.out and "samples/s" in captured.out
    document = json.loads(out.read_text())
    assert document["format"] == "pareto" and 2 <= len(document["points"]) <= 4
    pairs = [(p["peak_bytes"], p["throughput"]) for p in document["points"]]
    assert all(not dominated(a, b) for a in pairs for b in pairs)
    assert picture.read_bytes()[:4] == b"\x89PNG"
    graph = load_graph(GPT)
    assert all(len(p["stage_of_layer"]) == graph.num_layers for p in document["points"])


def test_plan_cli_pareto_points_below_two_is_exit_2(capsys):
    args = [GPT, "--gpus", "8", "--global-batch", "32", "--pareto", "--pareto-points", "1"]
    assert plan_main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--pareto-points" in err
