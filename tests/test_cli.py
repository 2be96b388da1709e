"""CLI smoke tests: plans print and write JSON; every bad input is one line with its exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from solver.cli import evaluate_main, plan_main
from tests.conftest import GPT_1_3B, ROOT, T5_DAG


def test_plan_prints_table_and_writes_json(run_cli, tmp_path):
    out = tmp_path / "plan.json"
    code, text, err = run_cli(
        plan_main,
        GPT_1_3B,
        "--gpus",
        "16",
        "--gpu-memory",
        "40GiB",
        "--global-batch",
        "64",
        "--json",
        str(out),
    )
    assert code == 0, err
    assert "Plan for gpt-1.3b" in text and "OPTIMAL" in text and "peak:" in text
    document = json.loads(out.read_text())
    config = document["config"]
    assert config["pp"] * config["tp"] * config["dp"] == 16
    assert set(config) >= {
        "pp",
        "tp",
        "dp",
        "micro_batch",
        "num_microbatches",
        "zero",
        "recompute",
        "schedule",
    }
    assert document["peak_bytes"] == max(s["peak_bytes"] for s in document["stages"])
    for stage in document["stages"]:
        assert stage["peak_bytes"] == sum(stage["breakdown"].values())
        assert {"index", "layers", "time_ms"} <= set(stage)
    assert document["solver"]["status"] == "OPTIMAL" and document["solver"]["gap"] == 0
    assert {"backend", "objective", "bound", "wall_s"} <= set(document["solver"])
    assert document["throughput"] > 0 and document["peak_bytes"] <= 40 * 2**30
    assert set(document["exports"]) >= {"torch_pipelining", "megatron", "deepspeed"}
    assert sum(document["exports"]["deepspeed"]["layer_counts"]) == 26


def test_evaluate_even_split_matches_plan_baseline(capsys, tmp_path):
    plan_json = tmp_path / "plan.json"
    assert (
        plan_main(
            [
                GPT_1_3B,
                "--gpus",
                "8",
                "--global-batch",
                "32",
                "--pp",
                "4",
                "--tp",
                "2",
                "--micro-batch",
                "1",
                "--json",
                str(plan_json),
                "--quiet",
            ]
        )
        == 0
    )
    plan = json.loads(plan_json.read_text())
    evaluated = tmp_path / "even.json"
    code = evaluate_main(
        [
            GPT_1_3B,
            "--pp",
            "4",
            "--tp",
            "2",
            "--dp",
            "1",
            "--global-batch",
            "32",
            "--split",
            "even",
            "--json",
            str(evaluated),
        ]
    )
    assert code == 0
    even = json.loads(evaluated.read_text())
    assert even["peak_bytes"] == plan["baselines"]["even"]["peak_bytes"]
    assert [len(s["layers"]) for s in even["stages"]] == plan["baselines"]["even"]["layer_counts"]
    assert plan["peak_bytes"] <= even["peak_bytes"]
    counts = ",".join(str(len(s["layers"])) for s in plan["stages"])
    assert (
        evaluate_main(
            [
                GPT_1_3B,
                "--pp",
                "4",
                "--tp",
                "2",
                "--global-batch",
                "32",
                "--split",
                counts,
                "--quiet",
                "--json",
                str(evaluated),
            ]
        )
        == 0
    )
    assert json.loads(evaluated.read_text())["peak_bytes"] == plan["peak_bytes"]


def test_dag_plans_with_cpsat_and_milp_agree(capsys, tmp_path):
    peaks = {}
    for backend in ("cpsat", "milp"):
        code = plan_main(
            [
                T5_DAG,
                "--gpus",
                "8",
                "--global-batch",
                "16",
                "--pp",
                "4",
                "--micro-batch",
                "1",
                "--backend",
                backend,
                "--quiet",
                "--time-limit",
                "60",
                "--json",
                str(tmp_path / f"t5-{backend}.json"),
            ]
        )
        assert code == 0, capsys.readouterr().err
        peaks[backend] = json.loads((tmp_path / f"t5-{backend}.json").read_text())["peak_bytes"]
    assert peaks["cpsat"] == peaks["milp"]


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--gpus", "0", "--global-batch", "8"], "argument --gpus: must be >= 1, got 0"),
        (
            ["--gpus", "8", "--gpu-memory", "abc", "--global-batch", "8"],
            "cannot read 'abc' as a size",
        ),
        (
            ["--gpus", "8", "--global-batch", "8", "--pp", "4", "--tp", "2", "--dp", "2"],
            r"pp(4) * tp(2) * dp(2) = 16 != gpus(8)",
        ),
        (
            ["--gpus", "8", "--global-batch", "8", "--micro-batch", "x"],
            "expected comma-separated integers",
        ),
        (["--gpus", "8", "--global-batch", "8", "--max-slowdown", "0.5"], "must be >= 1"),
        # absurd values: exit 2 naming the flag and the range
        (
            ["--gpus", "8", "--global-batch", "8", "--gpu-memory", "1e400"],
            "'1e400' is not a finite",
        ),
        (
            ["--gpus", "8", "--global-batch", "8", "--gpu-memory", "1e30"],
            "argument --gpu-memory: '1e30' is 1e+30 bytes, over the limit of 2^50 bytes (1 PiB)",
        ),
        (
            ["--gpus", "8", "--global-batch", "8", "--gpu-tflops", "inf"],
            "argument --gpu-tflops: must be a number in [1e-06, 1e+06] TFLOP/s, got 'inf'",
        ),
        (
            ["--gpus", "8", "--global-batch", "8", "--flops-efficiency", "nan"],
            "argument --flops-efficiency: must be a number in (0, 1]",
        ),
        (
            ["--gpus", "8", "--global-batch", "8", "--inter-node-gbps", "-1"],
            "argument --inter-node-gbps: must be a number in [0.001, 1e+06] GB/s",
        ),
        (
            ["--gpus", "8", "--global-batch", "8", "--min-throughput", "inf"],
            "argument --min-throughput: must be a finite number > 0, got 'inf'",
        ),
        (
            ["--gpus", "8", "--global-batch", "8", "--min-throughput", "1e-300"],
            "--min-throughput 1e-300: must be within",
        ),
        (
            ["--gpus", "8", "--global-batch", "8", "--max-slowdown", "inf"],
            "argument --max-slowdown: must be >= 1 (a number in [1, 1000]) or 'none'",
        ),
        (["--gpus", "8", "--global-batch", str(2**30)], "argument --global-batch: must be in"),
        (
            ["--gpus", "8", "--global-batch", "8", "--bytes-per-param", "2,2,4096"],
            "argument --bytes-per-param: each value must be in 0..256, got 4096",
        ),
        (["--gpus", str(2**40), "--global-batch", "8"], "at most 2^32"),
        (["--gpus", "8", "--global-batch", "7", "--micro-batch", "2"], "no valid parallel config"),
    ],
)
def test_bad_cli_values_exit_2_with_one_line(run_cli, args, pattern):
    code, out, err = run_cli(plan_main, GPT_1_3B, *args)
    assert code == 2
    assert pattern in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bad_graph_exit_2(run_cli, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run_cli(plan_main, str(bad), "--gpus", "8", "--global-batch", "8")
    assert code == 2 and f"{bad}: not valid JSON" in err and err.count("\n") == 1


def test_json_never_overwrites_the_graph_or_writes_into_missing_folder(run_cli, tmp_path):
    graph = tmp_path / "g.json"
    graph.write_text(Path(GPT_1_3B).read_text())
    before = graph.read_text()
    code, _, err = run_cli(
        plan_main, str(graph), "--gpus", "8", "--global-batch", "8", "--json", str(graph)
    )
    assert code == 2 and "is the input file" in err and graph.read_text() == before
    code, _, err = run_cli(
        plan_main,
        str(graph),
        "--gpus",
        "8",
        "--global-batch",
        "8",
        "--json",
        str(tmp_path / "missing" / "p.json"),
    )
    assert code == 2 and "does not exist" in err


def test_infeasible_exits_3_with_explanation(run_cli):
    code, _, err = run_cli(
        plan_main,
        GPT_1_3B,
        *("--gpus", "2", "--gpu-memory", "8GiB", "--global-batch", "8", "--reserve", "0"),
    )
    assert code == 3
    assert "nothing fits in 8.00 GiB per GPU" in err and "over;" in err
    assert "smallest GPU count that fits" in err
    assert err.count("\n") == 1


@pytest.mark.slow
def test_module_entry_points_run_as_subprocesses(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "solver.plan",
            GPT_1_3B,
            "--gpus",
            "8",
            "--global-batch",
            "16",
            "--time-limit",
            "30",
            "--pp",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "torch.distributed.pipelining split points" in result.stdout
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "solver.evaluate",
            GPT_1_3B,
            "--pp",
            "2",
            "--global-batch",
            "8",
            "--split",
            "13,14",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "summing to 27" in result.stderr


@pytest.mark.slow
def test_solver_runs_without_torch(tmp_path):
    """The solver package must import and plan with torch unavailable."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import solver, solver.backends.chain, solver.backends.cpsat, solver.backends.milp\n"
        "import solver.cli\n"
        f"from solver import load_graph, Cluster, TrainingConfig, plan\n"
        f"graph = load_graph({GPT_1_3B!r})\n"
        "p = plan(graph, Cluster(num_gpus=8), TrainingConfig(global_batch=16))\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print(p.config.label())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("pp")


def torch_copies(m: int, k: int, stage: int, stages: int = 4) -> int:
    """Boundary copies a torch-runtime 1F1B stage holds at its peak (received + sent)."""
    received = m - k + (m > 1)
    sent = m + k + (2 <= k and 2 * k - 1 <= m)
    return received * (stage > 0) + sent * (stage < stages - 1)


def test_runtime_torch_counts_a_receive_buffer_per_micro_batch(run_cli, tmp_path):
    """--runtime torch: R_s = m - k_s received and S_s = m + k_s sent copies of each boundary,
    and under 1F1B one more of each that Schedule1F1B's send lists hold (the input gradient last
    sent; with k_s >= 2 and m >= 2 k_s - 1 the warm-up output of micro-batch k_s - 2)."""
    peaks = {}
    for runtime in ("megatron", "torch"):
        out = tmp_path / f"{runtime}.json"
        args = ("--gpus", "8", "--global-batch", "32", "--pp", "4", "--tp", "2")
        args += ("--sequence-parallel", "off")  # whole boundary tensors
        code, text, _ = run_cli(
            plan_main, GPT_1_3B, *args, "--runtime", runtime, "--json", str(out)
        )
        assert code == 0
        document = json.loads(out.read_text())
        assert document["runtime"] == runtime
        assert ("runtime: torch" in text) == (runtime == "torch")
        peaks[runtime] = document
    m = peaks["torch"]["config"]["num_microbatches"]
    b = peaks["torch"]["config"]["micro_batch"]
    boundary = json.loads(Path(GPT_1_3B).read_text())["layers"][0]["output_bytes"] * b
    for document, copies in (
        (peaks["megatron"], lambda s: (s > 0) + (s < 3)),
        (peaks["torch"], lambda s: torch_copies(m, min(m, 4 - s), s)),
    ):
        for stage in document["stages"]:
            assert stage["breakdown"]["buffers"] == copies(stage["index"]) * boundary


def test_a_graph_without_flops_or_times_plans_for_memory_and_says_throughput_n_a(run_cli, tmp_path):
    """Zero time everywhere: the plan is still the memory optimum; no line prints an infinite
    throughput or divides by it."""
    graph = json.loads(Path(GPT_1_3B).read_text())
    for layer in graph["layers"]:
        for key in layer:
            if "flops" in key or key.endswith("_ms"):
                layer[key] = 0
    path = tmp_path / "no-time.json"
    path.write_text(json.dumps(graph))
    code, out, err = run_cli(plan_main, str(path), "--gpus", "8", "--global-batch", "64")
    assert code == 0, err
    assert "inf" not in out.replace("info", "")
    baselines = [line for line in out.splitlines() if " split (" in line]
    assert len(baselines) == 2 and all("throughput n/a" in line for line in baselines)


@pytest.mark.slow
def test_runtime_sets_gradient_bytes_and_megatron_may_keep_sent_outputs(run_cli, tmp_path):
    """--runtime megatron counts fp32 gradients (2,4,12), torch bf16 ones (2,2,12), unless
    --bytes-per-param says otherwise; --no-deallocate-pipeline-outputs keeps a non-last megatron
    stage's k_s sent outputs (S_s = 1 + k_s), and the torch runtime ignores it."""
    args = ("--gpus", "8", "--global-batch", "32", "--pp", "4", "--tp", "2")
    args += ("--sequence-parallel", "off", "--quiet")  # whole boundary tensors

    def planned(*flags: str) -> dict:
        out = tmp_path / "plan.json"
        code, _, err = run_cli(plan_main, GPT_1_3B, *args, *flags, "--json", str(out))
        assert code == 0, err
        return json.loads(out.read_text())

    for flags, grad_bytes in (
        ((), 4),
        (("--runtime", "torch"), 2),
        (("--bytes-per-param", "2,2,12"), 2),
        (("--runtime", "torch", "--bytes-per-param", "2,4,12"), 4),
    ):
        document = planned(*flags)
        assert document["training"]["grad_bytes_per_param"] == grad_bytes, flags
        for stage in document["stages"]:  # tp 2 splits w and g exactly: grads = g/w weights
            breakdown = stage["breakdown"]
            assert 2 * breakdown["grads"] == grad_bytes * breakdown["weights"], flags
    code, text, _ = run_cli(plan_main, GPT_1_3B, *args[:-1], "--no-deallocate-pipeline-outputs")
    assert code == 0 and "sent pipeline outputs kept until their backward" in text
    kept = planned("--no-deallocate-pipeline-outputs")
    assert kept["training"]["deallocate_pipeline_outputs"] is False
    m, b = kept["config"]["num_microbatches"], kept["config"]["micro_batch"]
    boundary = json.loads(Path(GPT_1_3B).read_text())["layers"][0]["output_bytes"] * b
    for stage in kept["stages"]:
        s = stage["index"]
        copies = (s > 0) + (1 + min(m, 4 - s)) * (s < 3)
        assert stage["breakdown"]["buffers"] == copies * boundary
    torch = planned("--runtime", "torch")
    assert (
        planned("--runtime", "torch", "--no-deallocate-pipeline-outputs")["stages"]
        == (torch["stages"])
    )


def test_evaluate_takes_the_runtime_flags(run_cli, tmp_path):
    """solver.evaluate: the runtime's gradient bytes unless --bytes-per-param, and
    --no-deallocate-pipeline-outputs, as solver.plan (stage 0 of 2: k_0 = 2 outputs kept)."""
    out = tmp_path / "evaluation.json"

    def first_stage(*flags: str) -> tuple[dict, dict]:
        code, _, err = run_cli(
            evaluate_main, GPT_1_3B, "--pp", "2", "--global-batch", "8", "--split", "even",
            "--json", str(out), "--quiet", *flags,
        )  # fmt: skip
        assert code == 0, err
        document = json.loads(out.read_text())
        return document["training"], document["stages"][0]["breakdown"]

    training, freed = first_stage()
    assert training["grad_bytes_per_param"] == 4 and training["deallocate_pipeline_outputs"]
    assert freed["grads"] == 2 * freed["weights"]
    assert first_stage("--runtime", "torch")[0]["grad_bytes_per_param"] == 2
    assert first_stage("--bytes-per-param", "2,2,12")[1]["grads"] == freed["weights"]
    training, kept = first_stage("--no-deallocate-pipeline-outputs")
    assert training["deallocate_pipeline_outputs"] is False
    boundary = json.loads(Path(GPT_1_3B).read_text())["layers"][0]["output_bytes"]
    assert kept["buffers"] - freed["buffers"] == 2 * boundary  # k_0 = min(m 8, p 2) = 2, b = 1
    assert kept | {"buffers": 0} == freed | {"buffers": 0}


def test_sequence_parallel_flag_of_plan_and_evaluate(run_cli, tmp_path):
    """--sequence-parallel auto gives SP to a tp > 1 plan (Megatron's --sequence-parallel in its
    export, ' sp' in its label) and lowers its peak; evaluate takes on/off for its one config;
    SP without TP is one line, exit 2."""
    args = ("--gpus", "8", "--global-batch", "32", "--pp", "2", "--tp", "4", "--quiet")
    peaks = {}
    for mode in ("off", "auto"):
        out = tmp_path / f"{mode}.json"
        code, _, err = run_cli(
            plan_main, GPT_1_3B, *args, "--sequence-parallel", mode, "--json", str(out)
        )
        assert code == 0, err
        document = json.loads(out.read_text())
        assert document["config"]["sp"] is (mode == "auto")
        args_of_megatron = document["exports"]["megatron"]["args"]
        assert ("--sequence-parallel" in args_of_megatron) is (mode == "auto")
        peaks[mode] = document["peak_bytes"]
    assert peaks["auto"] < peaks["off"]
    code, text, _ = run_cli(plan_main, GPT_1_3B, *args[:-1], "--sequence-parallel", "on")
    assert code == 0 and " sp" in text
    evaluated = {}
    for mode in ("off", "on"):
        code, _, err = run_cli(
            evaluate_main, GPT_1_3B, "--pp", "2", "--tp", "4", "--global-batch", "8",
            "--split", "even", "--sequence-parallel", mode, "--json", str(tmp_path / "e.json"),
            "--quiet",
        )  # fmt: skip
        assert code == 0, err
        evaluated[mode] = json.loads((tmp_path / "e.json").read_text())
    stage = [evaluated[mode]["stages"][0]["breakdown"] for mode in ("off", "on")]
    assert stage[1]["activations"] < stage[0]["activations"]
    assert stage[1]["weights"] == stage[0]["weights"]
    assert evaluated["on"]["training"]["sequence_parallel"] == "on"
    for main, extra in (
        (plan_main, ("--gpus", "8", "--global-batch", "32", "--tp", "1")),
        (evaluate_main, ("--pp", "2", "--global-batch", "8", "--split", "even")),
    ):
        code, out, err = run_cli(main, GPT_1_3B, *extra, "--sequence-parallel", "on")
        assert code == 2 and out == "", err
        assert len(err.strip().splitlines()) == 1 and "--sequence-parallel on with" in err
        assert "tp(1)" in err


@pytest.mark.parametrize("parser", ["plan", "sweep"])
def test_plan_and_sweep_flags_make_the_training_options(parser):
    from solver.cli.common import training_from_args
    from solver.cli.plan import plan_parser
    from solver.cli.sweep import sweep_parser

    parse = {"plan": plan_parser, "sweep": sweep_parser}[parser]().parse_args
    base = [GPT_1_3B, "--gpus", "8", "--global-batch", "16"]
    default = training_from_args(parse(base))
    assert (default.grad_bytes_per_param, default.deallocate_pipeline_outputs) == (4, True)
    torch = training_from_args(parse([*base, "--runtime", "torch"]))
    assert torch.grad_bytes_per_param == 2
    kept = training_from_args(parse([*base, "--no-deallocate-pipeline-outputs"]))
    assert kept.deallocate_pipeline_outputs is False
    given = training_from_args(parse([*base, "--bytes-per-param", "4,4,8"]))
    assert (given.weight_bytes_per_param, given.grad_bytes_per_param) == (4, 4)
    # SP by default where the engine runs it (specs.default_sequence_parallel)
    assert default.sequence_parallel == "auto" and torch.sequence_parallel == "auto"
    assert training_from_args(parse([*base, "--sequence-parallel", "auto"])).sequence_parallel == (
        "auto"
    )
