"""profiling.run: real pipeline runs on gloo match a single process; peaks are measured per rank.

Each run spawns pp * dp processes (a few seconds each on two cores), so the suite runs four of
them: 2-stage 1F1B (planner split), 4-stage GPipe (uneven hand split, the last stage holds only
the head), DP=2 x PP=2, and a rank that fails.
"""

from __future__ import annotations

import copy
import multiprocessing

import pytest
import torch

import models
from profiling.export import export_graph
from profiling.memory import CATEGORIES, LiveTensorTracker
from profiling.run import (
    LEARNING_RATE,
    RunError,
    batch_for_iteration,
    build_model,
    format_reports,
    run_plan,
)
from solver import Cluster, ParallelConfig, TrainingConfig, evaluate, plan
from solver.errors import InputError
from solver.report import evaluation_to_dict, plan_to_dict

OVERRIDES = {"layers": 4, "dropout": 0.0}
FP32 = dict(weight_bytes_per_param=4, grad_bytes_per_param=4, optimizer_bytes_per_param=8)


@pytest.fixture(scope="module")
def graph():
    return export_graph("gpt-tiny", dtype="fp32", overrides=OVERRIDES)


def planned(graph, *, pp: int, dp: int, micro_batch: int, global_batch: int, schedule: str):
    """A plan dict from the real planner with pinned degrees (fp32 training, Adam)."""
    training = TrainingConfig(
        global_batch=global_batch,
        micro_batch_sizes=(micro_batch,),
        pp=pp,
        dp=dp,
        tp=1,
        schedule=schedule,
        max_slowdown=None,
        **FP32,
    )
    return plan_to_dict(plan(graph, Cluster(num_gpus=pp * dp, gpu_memory_bytes=2**30), training))


def reference(
    global_batch: int, *, iterations: int = 1, seed: int = 0
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the last of ``iterations`` single-process Adam steps on the same
    model and global batches."""
    spec = models.get("gpt-tiny", **OVERRIDES)
    model = build_model(spec, seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    for iteration in range(iterations):
        optimizer.zero_grad(set_to_none=True)
        ids, targets = batch_for_iteration(
            spec, batch=global_batch, seq=None, seed=seed, iteration=iteration
        )
        loss = model(ids, targets)
        loss.backward()
        if iteration < iterations - 1:
            optimizer.step()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


def assert_matches_reference(reports, global_batch: int, *, iterations: int = 1) -> None:
    loss, grads = reference(global_batch, iterations=iterations)
    seen = set()
    for report in reports:
        assert report.grads, f"rank {report.rank} captured no gradients"
        for name, grad in report.grads.items():
            expected = grads[name]
            error = float((grad - expected).norm() / expected.norm())
            assert error <= 1e-6, f"rank {report.rank} {name}: relative error {error:.3g}"
            seen.add(name)
    assert seen == set(grads), f"parameters without a gradient: {set(grads) - seen}"
    last = [r for r in reports if r.losses]
    measured = sum(r.losses[-1] for r in last) / len(last)  # mean over data-parallel ranks
    assert measured == pytest.approx(loss, rel=1e-6)


def assert_peaks_reported(reports, plan_dict) -> None:
    for report in reports:
        assert report.measured_peak_bytes > 0
        assert sum(report.measured_breakdown.values()) == report.measured_peak_bytes
        assert set(report.measured_breakdown) == set(CATEGORIES)
        assert report.measured_breakdown["params"] > 0
        predicted = plan_dict["stages"][report.stage]["peak_bytes"]
        assert report.predicted_peak_bytes == predicted
        expected = 100 * (predicted - report.measured_peak_bytes) / report.measured_peak_bytes
        assert report.error_pct == pytest.approx(expected)
    print(format_reports(reports))


def test_two_stage_1f1b_matches_single_process(graph):
    plan_dict = planned(graph, pp=2, dp=1, micro_batch=2, global_batch=8, schedule="1f1b")
    assert plan_dict["config"]["num_microbatches"] == 4
    reports = run_plan("gpt-tiny", plan_dict, iterations=1, overrides=OVERRIDES, capture_grads=True)
    assert [(r.rank, r.stage) for r in reports] == [(0, 0), (1, 1)]
    assert_matches_reference(reports, global_batch=8)
    assert_peaks_reported(reports, plan_dict)


def test_four_stage_gpipe_uneven_split_matches_single_process(graph):
    config = ParallelConfig(pp=4, tp=1, dp=1, micro_batch=1, num_microbatches=4, schedule="gpipe")
    training = TrainingConfig(
        global_batch=4, micro_batch_sizes=(1,), schedule="gpipe", max_slowdown=None, **FP32
    )
    # embed + layers.0 | layers.1 | layers.2 + layers.3 | head (a stage with only the loss head)
    plan_dict = evaluation_to_dict(evaluate(graph, config, [2, 1, 2, 1], training=training))
    assert [len(stage["layers"]) for stage in plan_dict["stages"]] == [2, 1, 2, 1]
    reports = run_plan("gpt-tiny", plan_dict, iterations=1, overrides=OVERRIDES, capture_grads=True)
    assert_matches_reference(reports, global_batch=4)
    assert_peaks_reported(reports, plan_dict)


def test_dp2_pp2_runs_and_reports_per_rank_peaks(graph):
    plan_dict = planned(graph, pp=2, dp=2, micro_batch=1, global_batch=4, schedule="1f1b")
    reports = run_plan("gpt-tiny", plan_dict, iterations=2, overrides=OVERRIDES, capture_grads=True)
    assert [(r.rank, r.stage, r.dp_rank) for r in reports] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert all(len(r.iteration_ms) == 2 for r in reports)
    assert_matches_reference(reports, global_batch=4, iterations=2)
    assert_peaks_reported(reports, plan_dict)
    # Data-parallel replicas hold the same gradients (DDP averaged them) and the same peak.
    for a, b in ((reports[0], reports[1]), (reports[2], reports[3])):
        assert a.grads.keys() == b.grads.keys()
        for name in a.grads:
            torch.testing.assert_close(a.grads[name], b.grads[name], rtol=0, atol=0)
        # Second iteration: optimizer state exists at the peak.
        assert a.measured_breakdown["optimizer"] > 0


def test_zero3_fsdp2_dp2_pp2_matches_single_process(graph):
    config = ParallelConfig(pp=2, tp=1, dp=2, micro_batch=1, num_microbatches=2, zero=3)
    training = TrainingConfig(
        global_batch=4, micro_batch_sizes=(1,), zero_stages=(3,), max_slowdown=None, **FP32
    )
    plan_dict = evaluation_to_dict(evaluate(graph, config, [3, 3], training=training))
    reports = run_plan("gpt-tiny", plan_dict, iterations=2, overrides=OVERRIDES, capture_grads=True)
    assert_matches_reference(reports, global_batch=4, iterations=2)
    assert_peaks_reported(reports, plan_dict)
    for report in reports:
        # Weights and Adam state are sharded over dp=2, as the cost model assumes for ZeRO-3
        # (FSDP2 pads odd first dimensions; Adam adds a 4-byte step counter per tensor).
        measured, predicted = report.measured_breakdown, report.predicted_breakdown
        assert measured["params"] == pytest.approx(predicted["weights"], rel=0.02)
        assert measured["optimizer"] == pytest.approx(predicted["optimizer"], rel=0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def assert_all_stopped(error: RunError, world: int) -> None:
    assert len(error.pids) == world
    assert not any(_alive(pid) for pid in error.pids)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("memplan-rank")]


def test_failed_rank_stops_every_process(graph):
    plan_dict = planned(graph, pp=2, dp=1, micro_batch=2, global_batch=8, schedule="1f1b")
    with pytest.raises(RunError, match="(?s)rank1 failed first.*injected failure") as raised:
        run_plan("gpt-tiny", plan_dict, iterations=1, overrides=OVERRIDES, _fault=(1, "raise"))
    assert_all_stopped(raised.value, world=2)


def test_hung_rank_times_out_and_stops_every_process(graph):
    plan_dict = planned(graph, pp=2, dp=1, micro_batch=2, global_batch=8, schedule="1f1b")
    with pytest.raises(
        RunError, match=r"timed out after 12 s with ranks \[0, 1\] still running"
    ) as raised:
        run_plan(
            "gpt-tiny",
            plan_dict,
            iterations=1,
            overrides=OVERRIDES,
            timeout_s=12,
            _fault=(0, "hang"),
        )
    assert_all_stopped(raised.value, world=2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p["config"].update(tp=2), "tensor parallelism"),
        (lambda p: p["config"].update(zero=1), "only zero=0"),
        (lambda p: p["config"].update(recompute="full"), "recompute"),
        (lambda p: p["stages"][1]["layers"].append("layers.9"), "unknown layers"),
        (lambda p: p["stages"][1]["layers"].pop(), "missing layers"),
        (lambda p: p["config"].update(pp=3), "2 stages for pp=3"),
        (lambda p: p["config"].update(dp=64), "processes"),
    ],
)
def test_bad_plans_are_input_errors_before_spawning(graph, change, message):
    plan_dict = copy.deepcopy(
        planned(graph, pp=2, dp=1, micro_batch=2, global_batch=8, schedule="1f1b")
    )
    change(plan_dict)
    with pytest.raises(InputError, match=message):
        run_plan("gpt-tiny", plan_dict, overrides=OVERRIDES, max_processes=8)


def test_tracker_counts_states_activations_and_frees():
    layer = torch.nn.Linear(64, 64)
    tracker = LiveTensorTracker()
    tracker.track_module(layer)
    tracker.track_grads(layer)
    optimizer = torch.optim.Adam(layer.parameters())
    tracker.track_optimizer(optimizer)
    param_bytes = (64 * 64 + 64) * 4
    with tracker:
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_peak()
            x = torch.randn(8, 64)
            with tracker.saved_tensors():
                loss = layer(x).relu().sum()
            assert tracker.current["activations"] > 0
            loss.backward()
            optimizer.step()
            del x, loss
    assert tracker.current == {
        "params": param_bytes,
        "grads": param_bytes,
        "optimizer": 2 * param_bytes + 2 * 4,  # exp_avg, exp_avg_sq and two fp32 step counters
        "activations": 0,
        "other": 0,
    }
    assert tracker.peak_bytes > tracker.current_bytes


def test_tracker_peak_equals_memtracker_on_a_training_step():
    """Cross-check with torch's own MemTracker: the same peak, to the byte, over three steps."""
    from torch.distributed._tools.mem_tracker import MemTracker

    spec = models.get("gpt-tiny", **OVERRIDES)

    def train(tracker, reset) -> list[int]:
        model = build_model(spec, 0)
        optimizer = torch.optim.Adam(model.parameters())
        if isinstance(tracker, LiveTensorTracker):
            tracker.track_module(model)
            tracker.track_grads(model)
            tracker.track_optimizer(optimizer)
        else:
            tracker.track_external(model, optimizer)
        peaks = []
        with tracker:
            for iteration in range(3):
                optimizer.zero_grad(set_to_none=True)
                reset()
                ids, targets = batch_for_iteration(
                    spec, batch=4, seq=None, seed=0, iteration=iteration
                )
                model(ids, targets).backward()
                optimizer.step()
                del ids, targets
                if isinstance(tracker, LiveTensorTracker):
                    peaks.append(tracker.peak_bytes)
        return peaks

    ours = LiveTensorTracker()
    peaks = train(ours, ours.reset_peak)
    theirs = MemTracker()
    train(theirs, theirs.reset_mod_stats)
    (snapshot,) = theirs.get_tracker_snapshot("peak").values()
    assert max(peaks) == snapshot["Total"]
    assert peaks[1] == peaks[2] > peaks[0]  # from the second step on, Adam state is live
