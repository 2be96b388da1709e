"""python -m profiling.validate: runs a planner plan for real and gates on the per-rank error."""

from __future__ import annotations

import json

import pytest

from profiling.export import export_graph
from profiling.validate import TOLERANCE_EXCEEDED, main
from solver import Cluster, TrainingConfig, plan
from solver.cli import plan_main
from solver.report.plan_report import plan_to_dict


def write_plan(tmp_path, runtime="torch"):
    graph = export_graph("gpt-tiny", dtype="fp32")
    result = plan(
        graph,
        Cluster(num_gpus=2),
        TrainingConfig(
            global_batch=8,
            pp=2,
            weight_bytes_per_param=4,
            grad_bytes_per_param=4,
            optimizer_bytes_per_param=8,
            runtime=runtime,
        ),
    )
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_to_dict(result)))
    return path


@pytest.mark.slow
@pytest.mark.distributed
def test_validate_reports_ranks_and_gates_on_tolerance(tmp_path, capsys):
    plan_path = write_plan(tmp_path)
    out = tmp_path / "reports.json"
    # a plan for the torch runtime: within the accuracy benchmark's 8% target
    assert (
        main([str(plan_path), "--model", "gpt-tiny", "--tolerance", "8", "--json", str(out)]) == 0
    )
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["stage"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert rank["measured_peak_bytes"] > 0 and rank["predicted_peak_bytes"] > 0
        expected = (
            100
            * (rank["predicted_peak_bytes"] - rank["measured_peak_bytes"])
            / rank["measured_peak_bytes"]
        )
        assert abs(rank["error_pct"] - expected) < 1e-9
    captured = capsys.readouterr()
    assert "within 8%" in captured.out and "runtime" not in captured.err
    assert main([str(plan_path), "--model", "gpt-tiny", "--tolerance", "0.001"]) == (
        TOLERANCE_EXCEEDED
    )
    assert "exceeds --tolerance" in capsys.readouterr().err


def test_validate_rejects_a_file_that_is_not_a_plan(tmp_path, capsys):
    graph = tmp_path / "graph.json"
    graph.write_text(json.dumps({"format": "layer-graph"}))
    assert main([str(graph), "--model", "gpt-tiny"]) == 2
    err = capsys.readouterr().err
    assert "not a plan" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tolerance", "-5"], "argument --tolerance: must be a number in [0, 1e+06] percent"),
        (["--timeout", "0"], "argument --timeout: must be a number in (0, 604800] seconds"),
        (["--timeout", "nan"], "argument --timeout: must be a number in"),
        (["--model", "llama-tiny"], "made for model 'gpt-tiny', not 'llama-tiny'"),
    ],
)
def test_validate_bad_flags_and_another_model_are_one_line_exit_2(
    tmp_path, run_cli, flags, message
):
    """Before anything is spawned, and no runtime note with the error."""
    plan_path = write_plan(tmp_path, runtime="megatron")
    code, out, err = run_cli(main, str(plan_path), "--model", "gpt-tiny", *flags)
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and "note:" not in err and out == ""


def test_validate_cuda_without_a_gpu_is_a_one_line_input_error(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan_path = write_plan(tmp_path)
    assert main([str(plan_path), "--model", "gpt-tiny", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "device cuda: torch.cuda.is_available() is False" in err and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.distributed
def test_validate_notes_a_plan_for_another_runtime(tmp_path, capsys):
    plan_path = write_plan(tmp_path, runtime="megatron")
    assert main([str(plan_path), "--model", "gpt-tiny", "--tolerance", "100"]) == 0
    assert "planned for the megatron runtime" in capsys.readouterr().err


def write_plan_with_graph(tmp_path):
    """A torch-runtime plan for gpt-tiny whose graph file is next to it (--plot-schedule
    evaluates the plan again)."""
    graph_path = tmp_path / "graph.json"
    export_graph("gpt-tiny", dtype="fp32").save(graph_path)
    plan_path = tmp_path / "plan.json"
    code = plan_main(
        [str(graph_path), "--gpus", "2", "--pp", "2", "--global-batch", "4", "--runtime",
         "torch", "--bytes-per-param", "4,4,8", "--json", str(plan_path), "--quiet"]
    )  # fmt: skip
    assert code == 0
    return plan_path


@pytest.mark.slow
@pytest.mark.distributed
def test_validate_plot_schedule_overlays_the_memory_measured_at_each_action(tmp_path, capsys):
    plan_path = write_plan_with_graph(tmp_path)
    out, picture = tmp_path / "reports.json", tmp_path / "schedule.png"
    code = main(
        [str(plan_path), "--model", "gpt-tiny", "--tolerance", "100", "--step-iterations", "0",
         "--json", str(out), "--plot-schedule", str(picture)]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "note:" not in capsys.readouterr().err  # every stage recorded its actions
    for rank in json.loads(out.read_text())["ranks"]:
        values = rank["action_bytes"]
        assert len(values) == 2 * 4  # F and B of each of the 4 micro-batches
        assert 0 < max(values) <= rank["measured_peak_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "message"),
    [("s.txt", "--plot-schedule"), ("missing/s.png", "does not exist")],
)
def test_validate_bad_plot_schedule_is_one_line_exit_2_before_the_run(
    tmp_path, run_cli, monkeypatch, name, message
):
    def fail(*args, **kwargs):
        raise AssertionError("ran before checking --plot-schedule")

    monkeypatch.setattr("profiling.run.run_plan", fail)
    plan_path = write_plan(tmp_path)
    target = tmp_path / name
    code, out, err = run_cli(
        main, str(plan_path), "--model", "gpt-tiny", "--plot-schedule", str(target)
    )
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
    assert not target.exists()


@pytest.mark.slow
def test_validate_plot_schedule_without_the_plans_graph_is_one_line_before_the_run(
    tmp_path, run_cli, monkeypatch
):
    def fail(*args, **kwargs):
        raise AssertionError("ran before finding the plan's graph")

    monkeypatch.setattr("profiling.run.run_plan", fail)
    plan_path = write_plan_with_graph(tmp_path)
    (tmp_path / "graph.json").unlink()
    code, out, err = run_cli(
        main, str(plan_path), "--model", "gpt-tiny", "--plot-schedule", str(tmp_path / "s.png")
    )
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "not found" in err and "pass the graph: profiling.validate ... --graph GRAPH.json" in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["plan.json"]
    code, _, err = run_cli(main, str(plan_path), "--model", "gpt-tiny", "--graph", "g.json")
    assert (
        code == 2 and err == "error: --graph is the plan's graph for --plot-schedule: give both\n"
    )
