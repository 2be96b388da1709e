"""solver.evaluate with a given set of recomputed layers (--recompute selective
--recompute-layers SPEC): the costs equal the cost model's, bad specs are one-line exit-2 errors,
and a plan's own split and recomputed layers evaluate back to the plan's peak."""

from __future__ import annotations

import json
import random

import pytest

from solver.cli import evaluate_main, plan_main
from solver.costs import layer_costs, stage_costs
from solver.evaluation import recompute_flags
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import GPT_1_3B, MIXED_CLUSTER, activation_heavy_chain
from tests.random_graphs import random_chain


@pytest.fixture
def chain_file(tmp_path):
    """A random 10-layer chain (names l0..l9) saved as JSON."""
    graph = random_chain(random.Random(11), 10)
    path = tmp_path / "chain.json"
    graph.save(path)
    return graph, str(path)


def test_spec_reads_names_positions_and_ranges(chain_file):
    graph, _ = chain_file
    flags = recompute_flags(graph, " 0-2 ,l5,7, 7-7,l9")
    assert [i for i, flag in enumerate(flags) if flag] == [0, 1, 2, 5, 7, 9]
    assert recompute_flags(graph, "") == [False] * 10
    assert recompute_flags(graph, "0-9") == [True] * 10


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_evaluate_with_recompute_set_equals_stage_costs(chain_file, tmp_path, run_cli, seed):
    """The CLI's per-stage peaks, breakdowns, times and recomputed names equal stage_costs on
    the selective coefficients with the same flags, computed here independently."""
    graph, path = chain_file
    rng = random.Random(seed)
    recomputed_positions = sorted(rng.sample(range(10), 4))
    spec = ",".join(graph.names[i] if rng.random() < 0.5 else str(i) for i in recomputed_positions)
    counts = [3, 2, 5]
    config = ParallelConfig(  # SP: the megatron runtime's default with tp > 1
        pp=3, tp=2, dp=2, micro_batch=1, num_microbatches=4, recompute="selective", sp=True
    )
    out = tmp_path / "e.json"
    argv = [path, "--pp", "3", "--tp", "2", "--dp", "2", "--global-batch", "8"]
    argv += ["--gpus-per-node", "4", "--split", "3,2,5", "--recompute", "selective"]
    code, text, err = run_cli(evaluate_main, *argv, "--recompute-layers", spec, "--json", str(out))
    assert code == 0, err
    cluster = Cluster(num_gpus=12, gpus_per_node=4)
    costs = layer_costs(graph, config, cluster, TrainingConfig(global_batch=8))
    split = [s for s, n in enumerate(counts) for _ in range(n)]
    flags = [i in recomputed_positions for i in range(10)]
    expected = stage_costs(costs, split, flags)
    document = json.loads(out.read_text())
    assert document["config"]["recompute"] == "selective"
    assert document["peak_bytes"] == max(stage.peak_bytes for stage in expected)
    for stage, want in zip(document["stages"], expected, strict=True):
        assert stage["peak_bytes"] == want.peak_bytes
        assert stage["breakdown"] == want.breakdown()
        assert stage["time_ms"] == want.time_ns / 1e6
        assert stage["recomputed"] == [graph.names[i] for i in want.recomputed]
        assert set(stage["recomputed"]) <= set(stage["layers"])
    assert sum(len(stage["recomputed"]) for stage in document["stages"]) == 4
    # recomputing strictly less activation memory than none, same as the flags say
    none = stage_costs(costs, split, [False] * 10)
    assert [s.peak_bytes for s in none] != [s.peak_bytes for s in expected]
    header = text.splitlines()[2]
    assert header.rstrip().endswith("recomputed") and "selective-recompute" in text


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--recompute", "selective", "--recompute-layers", "0-3,l42"], "'l42' is not a layer"),
        (["--recompute", "selective", "--recompute-layers", "10"], "position 10 outside 0..9"),
        (["--recompute", "selective", "--recompute-layers", "2-12"], "position 12 outside 0..9"),
        (["--recompute", "selective", "--recompute-layers", "5-2"], "write 2-5"),
        (["--recompute", "selective", "--recompute-layers", "1,,2"], "empty item"),
        (["--recompute", "selective", "--recompute-layers", "-1"], "'-1' is not a layer"),
        (["--recompute-layers", "0-3"], "needs --recompute selective"),
        (["--recompute", "full", "--recompute-layers", "0-3"], "needs --recompute selective"),
        (["--recompute", "selective"], "--recompute selective needs --recompute-layers"),
    ],
)
def test_bad_recompute_layers_are_one_line_exit_2(chain_file, run_cli, extra, message):
    _, path = chain_file
    argv = [path, "--pp", "2", "--global-batch", "4", "--split", "even", *extra]
    code, out, err = run_cli(evaluate_main, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and "--recompute-layers" in err and message in err
    assert "Traceback" not in err


def test_plan_recompute_selective_round_trips_through_evaluate(tmp_path, run_cli):
    """A memory-tight uniform chain under a throughput floor: the plan recomputes some but not
    all layers; solver.evaluate with its config, its stage_of_layer and its recomputed names
    (as the plan JSON lists them) gives the same peak, iteration and per-stage lists."""
    graph_path = tmp_path / "uniform.json"
    activation_heavy_chain(8).save(graph_path)
    plan_json = tmp_path / "plan.json"
    argv = [str(graph_path), "--gpus", "4", "--global-batch", "8", "--micro-batch", "1"]
    argv += ["--pp", "4", "--recompute", "selective", "--max-slowdown", "1.2"]
    code, _, err = run_cli(plan_main, *argv, "--json", str(plan_json), "--quiet")
    assert code == 0, err
    plan = json.loads(plan_json.read_text())
    names = [name for stage in plan["stages"] for name in stage["recomputed"]]
    assert 0 < len(names) < 8, "the case must recompute some layers, not all"
    config = plan["config"]
    assert config["recompute"] == "selective"
    evaluated = tmp_path / "evaluated.json"
    code, text, err = run_cli(
        evaluate_main,
        str(graph_path),
        "--pp",
        str(config["pp"]),
        "--tp",
        str(config["tp"]),
        "--dp",
        str(config["dp"]),
        "--micro-batch",
        str(config["micro_batch"]),
        "--zero",
        str(config["zero"]),
        "--global-batch",
        "8",
        "--split",
        ",".join(map(str, plan["stage_of_layer"])),
        "--recompute",
        "selective",
        "--recompute-layers",
        ",".join(names),
        "--json",
        str(evaluated),
    )
    assert code == 0, err
    document = json.loads(evaluated.read_text())
    assert document["peak_bytes"] == plan["peak_bytes"]
    assert document["iteration_ms"] == plan["iteration_ms"]
    assert [s["recomputed"] for s in document["stages"]] == [
        s["recomputed"] for s in plan["stages"]
    ]
    assert [s["peak_bytes"] for s in document["stages"]] == [
        s["peak_bytes"] for s in plan["stages"]
    ]
    # without the recomputed layers the same split needs more memory
    code, _, err = run_cli(
        evaluate_main,
        str(graph_path),
        "--pp",
        "4",
        "--global-batch",
        "8",
        "--split",
        ",".join(map(str, plan["stage_of_layer"])),
        "--json",
        str(evaluated),
    )
    assert code == 0, err
    assert json.loads(evaluated.read_text())["peak_bytes"] > plan["peak_bytes"]


def test_selective_on_a_heterogeneous_cluster(run_cli):
    """--cluster with --stage-groups and a recompute set: the peak is the cost model's, on each
    stage's group, and the recomputed column comes last, as in the header."""
    from solver.evaluation import evaluate
    from solver.files.cluster_file import load_cluster
    from solver.graph import load_graph

    argv = [
        GPT_1_3B,
        "--cluster",
        MIXED_CLUSTER,
        "--pp",
        "4",
        "--tp",
        "8",
        "--global-batch",
        "64",
        "--split",
        "even",
        "--stage-groups",
        "a100-40g,a100-40g,a100-80g,a100-80g",
        "--recompute",
        "selective",
        "--recompute-layers",
        "1-5",
    ]
    code, out, _ = run_cli(evaluate_main, *argv)
    assert code == 0
    graph = load_graph(GPT_1_3B)
    config = ParallelConfig(  # SP: the megatron runtime's default with tp > 1
        pp=4, tp=8, dp=1, micro_batch=1, num_microbatches=64, recompute="selective", sp=True
    )
    expected = evaluate(
        graph,
        config,
        "even",
        cluster=load_cluster(MIXED_CLUSTER),
        group_of_stage=[0, 0, 1, 1],
        recomputed=[1 <= i <= 5 for i in range(graph.num_layers)],
    )
    lines = out.splitlines()
    header = lines[2].split()
    first = lines[3].split("  ")
    assert header[-1] == "recomputed" and header[-3:-1] == ["capacity", "util"]
    assert first[-1].strip().startswith("5: ")
    assert expected.stages[0].recomputed == list(range(1, 6))
    assert f"{expected.peak_bytes / 2**30:.2f} GiB" in out
