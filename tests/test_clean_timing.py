"""Clean step timing in real runs (issue 18, point 3): after the instrumented iterations,
``profiling.run`` times ``step_iterations`` more with the live-tensor tracker closed (no dispatch
mode, saved-tensor, gradient or optimizer hooks), every rank starting after a barrier and the
slowest rank's time reported as ``RankReport.step_ms``; each rank runs with the thread count the
graph's layer times were measured with (``meta.timing.threads``, written by ``profiling.export``)
unless told otherwise.

The fast tests check the tracker's switch-off, the graph's ``meta.timing``, the choice of thread
count and the report columns without processes; the distributed ones (a few seconds each on two
cores) run tiny plans on the torch, megatron and traced engines.
"""

from __future__ import annotations

import copy
import json
import os
import statistics

import pytest
import torch

from profiling import export, validate
from profiling.executors.base import RankReport
from profiling.export import export_graph
from profiling.run import format_reports, rank_threads, run_plan, step_ms
from profiling.trace.memory import CATEGORIES, LiveTensorTracker
from solver import Cluster, TrainingConfig, plan
from solver.errors import InputError
from solver.files.plan_file import load_plan
from solver.graph import graph_from_dict, load_graph, timing_of
from solver.report.plan_report import plan_to_dict

GPT = {"layers": 4, "hidden": 32, "heads": 4, "seq_len": 16, "vocab_size": 96, "dropout": 0.0}
FP32 = dict(weight_bytes_per_param=4, grad_bytes_per_param=4, optimizer_bytes_per_param=8)


def _training(pp: int, runtime: str = "torch") -> TrainingConfig:
    return TrainingConfig(
        global_batch=4,
        micro_batch_sizes=(1,),
        pp=pp,
        tp=1,
        dp=1,
        runtime=runtime,
        max_slowdown=None,
        **FP32,
    )


@pytest.fixture(scope="module")
def graphs():
    """gpt-tiny profiled on the CPU with 1 thread (timed: ``meta.timing``) and with fake tensors
    (no times, no ``meta.timing``), and the thread count of the process before and after."""
    before = torch.get_num_threads()
    timed = export_graph("gpt-tiny", dtype="fp32", device="cpu", overrides=GPT, threads=1)
    after = torch.get_num_threads()
    return {"cpu": timed, "meta": export_graph("gpt-tiny", dtype="fp32", overrides=GPT)}, (
        before,
        after,
    )


def _plan_file(tmp_path, graphs, *, pp: int, device: str = "cpu", runtime: str = "torch"):
    """A plan JSON (path) for the ``device`` graph ("cpu": timed with 1 thread; "meta": no
    timing), saved to a file first, so that the plan records the graph's path."""
    graph_path = tmp_path / "graph.json"
    graphs[0][device].save(graph_path)
    graph = load_graph(graph_path)
    training = _training(pp, runtime)
    document = plan_to_dict(plan(graph, Cluster(num_gpus=pp, gpu_memory_bytes=2**30), training))
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(document))
    return plan_path


# -- the tracker switched off ------------------------------------------------------------------


def test_tracker_lists_what_is_installed_and_close_removes_it():
    layer = torch.nn.Linear(8, 8)
    optimizer = torch.optim.Adam(layer.parameters())
    tracker = LiveTensorTracker()
    tracker.track_module(layer)
    with tracker:
        tracker.track_grads(layer)
        tracker.track_optimizer(optimizer)
        with tracker.saved_tensors():
            assert tracker.active_instrumentation() == [
                "dispatch mode",
                "saved-tensor hooks",
                "storage resize patch",
                "gradient hooks (2)",
                "optimizer hooks (1)",
            ]
            layer(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    assert tracker.active_instrumentation() == ["gradient hooks (2)", "optimizer hooks (1)"]
    peak = tracker.peak_bytes
    tracker.close()
    assert tracker.active_instrumentation() == []
    counted = tracker.num_tracked
    optimizer.zero_grad(set_to_none=True)
    layer(torch.randn(4, 8)).sum().backward()  # the hooks would tag both gradients
    optimizer.step()  # and the step hook the Adam states
    assert tracker.num_tracked == counted
    assert tracker.peak_bytes == peak  # what was read stays


def test_hooks_left_installed_are_counted():
    layer = torch.nn.Linear(8, 8)
    tracker = LiveTensorTracker()
    tracker.track_grads(layer)
    counted = tracker.num_tracked
    layer(torch.randn(2, 8)).sum().backward()
    assert tracker.num_tracked == counted + 2  # weight and bias gradients: the check can fail


# -- meta.timing and the thread count ------------------------------------------------------------


@pytest.mark.slow
def test_cpu_profile_records_its_thread_count_and_restores_torchs(graphs):
    (timed, fake), (before, after) = (graphs[0]["cpu"], graphs[0]["meta"]), graphs[1]
    assert after == before
    recorded = {k: timed.meta["timing"][k] for k in ("device", "threads", "timed_runs")}
    assert recorded == {"device": "cpu", "threads": 1, "timed_runs": 3}  # + the time terms
    assert timing_of(timed) == timed.meta["timing"]
    assert all(layer.fwd_ms is not None for layer in timed.layers)
    assert "timing" not in fake.meta and timing_of(fake) is None  # no times, nothing recorded


def test_graph_meta_timing_round_trips_and_is_checked(graphs):
    document = copy.deepcopy(graphs[0]["meta"].to_dict())  # to_dict shares meta
    document["meta"]["timing"] = {"device": "cpu", "threads": 3}
    assert timing_of(graph_from_dict(document))["threads"] == 3
    for threads in (0, 4097):  # 1..4096 (profiling.export.MAX_THREADS)
        document["meta"]["timing"] = {"device": "cpu", "threads": threads}
        with pytest.raises(InputError, match=r"meta\.timing\.threads"):
            graph_from_dict(document)
    document["meta"]["timing"] = {"device": "cpu"}
    with pytest.raises(InputError, match="threads"):
        graph_from_dict(document)


def test_rank_threads_given_then_graph_then_cores(tmp_path, graphs):
    path = _plan_file(tmp_path, graphs, pp=2)
    plan_file = load_plan(path)
    assert rank_threads(plan_file, "cpu") == (1, f"{plan_file.graph.path}: meta.timing.threads")
    assert rank_threads(plan_file, "cpu", 3) == (3, "given")
    cores = max(1, (os.cpu_count() or 1) // 2)
    # timed on another device type: the count says nothing about this run
    assert rank_threads(plan_file, "cuda")[0] == cores
    (tmp_path / "graph.json").unlink()  # the graph gone: the cores' share
    assert rank_threads(plan_file, "cpu")[0] == cores
    with pytest.raises(InputError, match=r"threads must be an integer in 1\.\.4096"):
        rank_threads(plan_file, "cpu", 0)


def test_fake_profile_leaves_the_cores_share(tmp_path, graphs):
    plan_file = load_plan(_plan_file(tmp_path, graphs, pp=2, device="meta"))
    assert rank_threads(plan_file, "cpu") == (
        max(1, (os.cpu_count() or 1) // 2),
        f"cpu_count {os.cpu_count()} // world 2",
    )


def test_bad_thread_and_step_options_exit_2(tmp_path, capsys, graphs):
    plan_path = _plan_file(tmp_path, graphs, pp=1, device="meta")
    runs = [
        (export.main, ["gpt-tiny", "--device", "cpu", "--threads", "0"]),
        (validate.main, [str(plan_path), "--model", "gpt-tiny", "--threads", "0"]),
        (validate.main, [str(plan_path), "--model", "gpt-tiny", "--threads", "4097"]),
        (validate.main, [str(plan_path), "--model", "gpt-tiny", "--step-iterations", "-1"]),
    ]
    for main, argv in runs:
        flag = argv[-2]
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        error = capsys.readouterr().err
        assert flag in error and len(error.strip().splitlines()) == 1


# -- reports ----------------------------------------------------------------------------------


def _report(rank: int, steps: list[float], threads: int | None = 1) -> RankReport:
    return RankReport(
        rank=rank,
        stage=rank,
        dp_rank=0,
        tp_rank=0,
        layers=["x"],
        measured_peak_bytes=2**20,
        measured_breakdown=dict.fromkeys(CATEGORIES, 0),
        predicted_peak_bytes=None,
        predicted_breakdown=None,
        error_pct=None,
        iteration_ms=[30.0],
        step_ms=steps,
        threads=threads,
    )


def test_format_reports_shows_step_time_and_threads():
    header, row = format_reports([_report(0, [20.0, 10.0, 12.0])]).splitlines()
    columns = header.split()
    assert columns[-3:] == ["iter_ms", "step_ms", "threads"]
    assert row.split()[-3:] == ["30.0", "12.0", "1"]
    header, row = format_reports([_report(0, [], threads=None)]).splitlines()
    assert row.split()[-2:] == ["nan", "-"]


def test_step_ms_is_the_median_of_the_slowest_ranks():
    reports = [_report(0, [10.0, 30.0, 20.0]), _report(1, [15.0, 25.0, 20.0])]
    assert step_ms(reports) == 20.0  # median of 15, 30, 20
    assert step_ms([_report(0, [])]) is None


# -- runs ---------------------------------------------------------------------------------------


def _assert_clean(reports, *, iterations: int, threads: int) -> None:
    for report in reports:
        assert report.step_instrumentation == [], report.step_instrumentation
        assert report.threads == threads
        assert len(report.step_ms) == iterations and all(t > 0 for t in report.step_ms)
        assert len(report.step_cpu_ms) == iterations and all(t > 0 for t in report.step_cpu_ms)
        assert report.step_ms == reports[0].step_ms  # the slowest rank's, on every rank


@pytest.mark.slow
@pytest.mark.distributed
def test_validate_times_a_clean_step_with_the_graphs_threads(tmp_path, capsys, graphs):
    path = _plan_file(tmp_path, graphs, pp=2)
    out = tmp_path / "run.json"
    code = validate.main(
        [str(path), "--model", "gpt-tiny", "--step-iterations", "2", "--json", str(out)]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    document = json.loads(out.read_text())
    assert document["threads"] == 1
    assert document["threads_from"].endswith("graph.json: meta.timing.threads")
    assert document["plan_iteration_ms"] == json.loads(path.read_text())["iteration_ms"]
    ranks = document["ranks"]
    assert [len(rank["iteration_ms"]) for rank in ranks] == [2, 2]
    for rank in ranks:
        assert rank["threads"] == 1 and rank["step_instrumentation"] == []
        assert len(rank["step_ms"]) == 2 and rank["step_ms"] == ranks[0]["step_ms"]
        assert len(rank["step_cpu_ms"]) == 2
    assert document["step_ms"] == pytest.approx(statistics.median(ranks[0]["step_ms"]))
    assert "step_ms threads" in printed and "1 threads per rank" in printed


@pytest.mark.slow
@pytest.mark.distributed
def test_given_threads_win_over_the_graphs(tmp_path, graphs):
    path = _plan_file(tmp_path, graphs, pp=1)
    (report,) = run_plan(
        "gpt-tiny", path, overrides=GPT, iterations=1, threads=2, step_iterations=0
    )
    assert report.threads == 2 and report.step_ms == [] and len(report.iteration_ms) == 1


@pytest.mark.slow
@pytest.mark.distributed
def test_megatron_engine_times_a_clean_step(tmp_path, graphs):
    pytest.importorskip("megatron.core", reason="megatron-core is the [megatron] extra")
    path = _plan_file(tmp_path, graphs, pp=2, runtime="megatron")
    reports = run_plan("gpt-tiny", path, overrides=GPT, engine="megatron", step_iterations=2)
    _assert_clean(reports, iterations=2, threads=1)


@pytest.mark.slow
@pytest.mark.distributed
def test_traced_engine_times_a_clean_step(tmp_path):
    from tests.run_any_factories import TINY_HF_MODELS

    name, overrides = TINY_HF_MODELS["gpt2"]
    graph = export_graph(name, dtype="fp32", seq=32, overrides=overrides)
    document = plan_to_dict(plan(graph, Cluster(num_gpus=1, gpu_memory_bytes=2**30), _training(1)))
    reports = run_plan(name, document, overrides=overrides, seq=32, threads=1, step_iterations=1)
    _assert_clean(reports, iterations=1, threads=1)
