"""The empirical (mCAP/CAPSlog) memory model: per-layer mem_isolated / mem_added statistics."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from solver import Cluster, TrainingConfig, evaluate, plan
from solver.backends import solve
from solver.backends.brute_force import solve_brute_force
from solver.backends.problem import StageProblem
from solver.costs import layer_costs, stage_costs
from solver.errors import InputError
from solver.graph import graph_from_dict
from solver.specs import ParallelConfig

CLUSTER = Cluster(num_gpus=4, gpu_memory_bytes=10**9)


def statistics_graph(rng: random.Random, num_layers: int, *, chain: bool = True):
    layers = []
    for i in range(num_layers):
        added = rng.randint(1, 100) * 10
        isolated = added + rng.choice([0, rng.randint(1, 80) * 10])
        layers.append(
            {
                "name": f"l{i}",
                "params": 1000,
                "activation_bytes": 100,
                "output_bytes": 10,
                "mem_isolated": isolated,
                "mem_added": added,
            }
        )
    document = {"format": "layer-graph", "version": 1, "model": "stats", "layers": layers}
    if not chain:
        document["edges"] = [{"src": "l0", "dst": f"l{i}", "bytes": 1} for i in range(1, 3)] + [
            {"src": f"l{i}", "dst": f"l{i + 1}", "bytes": 1} for i in range(2, num_layers - 1)
        ]
    return graph_from_dict(document)


def empirical_peak(graph, stage_of_layer: list[int]) -> int:
    """max over stages of mem_isolated(first layer) + sum mem_added(the others), by hand."""
    peaks = []
    for stage in sorted(set(stage_of_layer)):
        members = [
            layer for layer, s in zip(graph.layers, stage_of_layer, strict=True) if s == stage
        ]
        peaks.append(members[0].mem_isolated + sum(layer.mem_added for layer in members[1:]))
    return max(peaks)


def empirical_problem(graph, pp: int) -> StageProblem:
    config = ParallelConfig(pp=pp, tp=1, dp=1, micro_batch=1, num_microbatches=pp)
    training = TrainingConfig(global_batch=pp, memory_model="empirical")
    return StageProblem(costs=layer_costs(graph, config, CLUSTER, training))


@pytest.mark.parametrize("seed", range(12))
def test_every_backend_finds_the_empirical_optimum(seed):
    """Chain DP, CP-SAT and MILP agree with an enumeration of every contiguous split."""
    rng = random.Random(seed)
    num_layers, pp = rng.randint(4, 9), rng.randint(2, 4)
    graph = statistics_graph(rng, num_layers)
    problem = empirical_problem(graph, pp)
    best = min(
        empirical_peak(graph, [sum(layer >= cut for cut in cuts) for layer in range(num_layers)])
        for cuts in itertools.combinations(range(1, num_layers), pp - 1)
    )
    assert solve_brute_force(problem).objective == best
    for backend in ("chain", "cpsat", "milp"):
        solution = solve(problem, backend, time_limit_s=60)
        assert solution.objective == best, backend
        stages = stage_costs(problem.costs, solution.stage_of_layer)
        assert max(s.peak_bytes for s in stages) == empirical_peak(graph, solution.stage_of_layer)


def test_plan_and_evaluate_use_the_statistics():
    graph = statistics_graph(random.Random(7), 12)
    training = TrainingConfig(global_batch=4, memory_model="empirical", max_slowdown=None)
    result = plan(graph, CLUSTER, training)
    assert (result.config.pp, result.config.tp, result.config.dp) == (4, 1, 1)
    assert result.peak_bytes == empirical_peak(graph, result.stage_of_layer)
    even = evaluate(graph, result.config, "even", cluster=CLUSTER, training=training)
    assert even.peak_bytes == empirical_peak(graph, even.stage_of_layer) >= result.peak_bytes


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda layers: layers[3].pop("mem_added"), "only one of mem_isolated/mem_added"),
        (lambda layers: layers[2].update(mem_isolated=1, mem_added=5), "is below mem_added"),
    ],
)
def test_bad_statistics_are_one_line_input_errors(change, message):
    graph = statistics_graph(random.Random(1), 6)
    document = graph.to_dict()
    change(document["layers"])
    with pytest.raises(InputError, match=message):
        graph_from_dict(document, origin="g.json")


def test_empirical_model_needs_statistics_a_chain_and_one_pipeline():
    rng = random.Random(3)
    plain = graph_from_dict(
        {
            "format": "layer-graph",
            "version": 1,
            "model": "plain",
            "layers": [
                {"name": f"l{i}", "params": 1, "activation_bytes": 1, "output_bytes": 1}
                for i in range(4)
            ],
        }
    )
    training = TrainingConfig(global_batch=4, memory_model="empirical")
    with pytest.raises(InputError, match="have no mem_isolated/mem_added"):
        plan(plain, CLUSTER, training)
    with pytest.raises(InputError, match="not a chain"):
        plan(statistics_graph(rng, 8, chain=False), CLUSTER, training)
    config = ParallelConfig(pp=2, tp=2, dp=1, micro_batch=1, num_microbatches=2)
    with pytest.raises(InputError, match="tp or dp > 1"):
        layer_costs(statistics_graph(rng, 6), config, CLUSTER, training)


def test_cli_plans_and_evaluates_with_the_statistics(tmp_path, capsys):
    from solver.cli import evaluate_main, plan_main

    graph = statistics_graph(random.Random(11), 10)
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(graph.to_dict()))
    out = tmp_path / "plan.json"
    args = [str(path), "--gpus", "4", "--global-batch", "4", "--memory-model", "empirical"]
    assert plan_main([*args, "--max-slowdown", "none", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["memory_model"] == "empirical"
    assert document["peak_bytes"] == empirical_peak(graph, document["stage_of_layer"])
    assert "memory model: empirical" in capsys.readouterr().out
    split = ",".join(str(document["stage_of_layer"].count(s)) for s in range(4))
    assert evaluate_main([*args, "--pp", "4", "--split", split]) == 0
    assert "memory model: empirical" in capsys.readouterr().out
    plain = Path(__file__).resolve().parents[1] / "examples" / "gpt-1.3b.json"
    code = plan_main([str(plain), *args[1:]])
    err = capsys.readouterr().err
    assert code == 2 and "have no mem_isolated/mem_added" in err and err.count("\n") == 1
