"""profiling.run: real pipeline runs on gloo match a single process; peaks are measured per rank.

Each run spawns pp * dp * tp processes (a few seconds each on two cores, 10-25 s with four), so
the suite keeps to one run per layout: 2-stage 1F1B (planner split), 4-stage GPipe (uneven hand
split, the last stage holds only the head), DP=2 x PP=2 (DDP), ZeRO-1/2/3, TP=2 x PP=2,
TP=2 x DP=2 (FSDP2), TP=2 with a vocabulary-parallel embedding and head, full recompute,
interleaved 1F1B (two chunks per rank: pp 2 and 3, full recompute, DP=2), and a rank that fails or
hangs.
"""

from __future__ import annotations

import copy
import multiprocessing

import pytest
import torch

import models
from profiling.executors.base import LEARNING_RATE, RankReport, batch_for_iteration, build_model
from profiling.executors.parallelize import shard_order
from profiling.export import export_graph
from profiling.run import RunError, format_reports, run_plan
from profiling.trace.memory import CATEGORIES, LiveTensorTracker
from profiling.trace.tensor_parallel import VOCAB_PARALLEL_MIN_ROWS
from solver import Cluster, ParallelConfig, TrainingConfig, evaluate, plan
from solver.errors import InputError
from solver.report.plan_report import evaluation_to_dict, plan_to_dict
from tests.conftest import FP32_ADAM, assert_peaks_within, assert_runs_match_reference

OVERRIDES = {"layers": 4, "dropout": 0.0}
FSDP2_BOUNDS = {"under_pct": 0.0, "over_pct": 11.0}
"""FSDP2 (ZeRO 2/3 with dp > 1): never under; at pp 1 over by a layer's unsharded gradients
charged whole at each of its weight-gradient moments and a neighbour's buffers counted beside
it (solver/costs/fsdp.py: measured +10.2% ZeRO 2 dp 2, +3.3% tp 2 dp 2 ZeRO 3, on these 4 blocks
of 12,704 parameters, whose activations are small beside them); under pipelining (one reduce per
step) +0.9% to +3.5% over 1F1B, m 2 (ZeRO 3: a layer's unsharded weights from its backward to
its next forward, solver/costs/fsdp.py)."""
TORCH_FP32 = {"runtime": "torch", **FP32_ADAM}
"""fp32 Adam planned for the torch runtime, the one the torch engine runs (profiling.run)."""


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
        **TORCH_FP32,
    )
    return plan_to_dict(plan(graph, Cluster(num_gpus=pp * dp, gpu_memory_bytes=2**30), training))


def reference(
    global_batch: int, *, iterations: int = 1, seed: int = 0, overrides: dict = OVERRIDES
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the last of ``iterations`` single-process Adam steps on the same
    model and global batches."""
    spec = models.get("gpt-tiny", **overrides)
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


def assert_matches_reference(
    reports,
    global_batch: int,
    *,
    iterations: int = 1,
    overrides: dict = OVERRIDES,
    tolerance: float = 1e-6,
) -> None:
    loss, grads = reference(global_batch, iterations=iterations, overrides=overrides)
    assert_runs_match_reference(reports, loss, grads, tolerance)


WITHIN_PCT = 3.0
"""How far a rank's measured peak may be from the plan's, either way, in percent: gpt-tiny on the
torch engine measured median 0.4%, max 2.3% in benchmarks/bench_accuracy.md. A test whose setup
measured more says why beside its own bound."""


def assert_peaks_reported(
    reports,
    plan_dict,
    *,
    first_iteration: bool,
    under_pct: float = WITHIN_PCT,
    over_pct: float = WITHIN_PCT,
) -> None:
    """Every rank reports its measured peak, its breakdown and the plan's peak, and the error
    is within ``under_pct`` below and ``over_pct`` above (``assert_peaks_within``;
    ``first_iteration``: a one-iteration run)."""
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
    assert_peaks_within(
        reports, under_pct=under_pct, over_pct=over_pct, first_iteration=first_iteration
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_two_stage_1f1b_matches_single_process(graph):
    plan_dict = planned(graph, pp=2, dp=1, micro_batch=2, global_batch=8, schedule="1f1b")
    assert plan_dict["config"]["num_microbatches"] == 4
    reports = run_plan("gpt-tiny", plan_dict, iterations=1, overrides=OVERRIDES, capture_grads=True)
    assert [(r.rank, r.stage) for r in reports] == [(0, 0), (1, 1)]
    assert_matches_reference(reports, global_batch=8)
    assert_peaks_reported(reports, plan_dict, first_iteration=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_four_stage_gpipe_uneven_split_matches_single_process(graph):
    config = ParallelConfig(pp=4, tp=1, dp=1, micro_batch=1, num_microbatches=4, schedule="gpipe")
    training = TrainingConfig(
        global_batch=4, micro_batch_sizes=(1,), schedule="gpipe", max_slowdown=None, **TORCH_FP32
    )
    # embed + layers.0 | layers.1 | layers.2 + layers.3 | head (a stage with only the loss head)
    plan_dict = evaluation_to_dict(evaluate(graph, config, [2, 1, 2, 1], training=training))
    assert [len(stage["layers"]) for stage in plan_dict["stages"]] == [2, 1, 2, 1]
    reports = run_plan("gpt-tiny", plan_dict, iterations=1, overrides=OVERRIDES, capture_grads=True)
    assert_matches_reference(reports, global_batch=4)
    assert_peaks_reported(reports, plan_dict, first_iteration=True)


@pytest.mark.slow
@pytest.mark.distributed
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
    assert_peaks_reported(reports, plan_dict, first_iteration=False)
    # Data-parallel replicas hold the same gradients (DDP averaged them) and the same peak.
    for a, b in ((reports[0], reports[1]), (reports[2], reports[3])):
        assert a.grads.keys() == b.grads.keys()
        for name in a.grads:
            torch.testing.assert_close(a.grads[name], b.grads[name], rtol=0, atol=0)
        # Second iteration: optimizer state exists at the peak.
        assert a.measured_breakdown["optimizer"] > 0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp2_dp2_pp2_matches_single_process(graph, zero):
    """FSDP2 handed to PipelineStage as torchtitan does: one reduce-scatter per step, so every
    layer's unsharded weights and gradients stay to the step's end (solver/costs/states.py,
    ``reduces_per_step``); ZeRO 3 reshards each layer after every forward, so its unsharded
    weights live from its backward to its next forward (``fsdp.backward_weight_bytes``).
    Measured +1.7%/+0.9% (ZeRO 2) and +2.3%/+3.5% (ZeRO 3; +5.1%/+6.3% when every unsharded
    weight was a state) on stages 0/1."""
    config = ParallelConfig(pp=2, tp=1, dp=2, micro_batch=1, num_microbatches=2, zero=zero)
    training = TrainingConfig(
        global_batch=4, micro_batch_sizes=(1,), zero_stages=(zero,), max_slowdown=None, **TORCH_FP32
    )
    plan_dict = evaluation_to_dict(evaluate(graph, config, [3, 3], training=training))
    reports = run_plan("gpt-tiny", plan_dict, iterations=2, overrides=OVERRIDES, capture_grads=True)
    assert_matches_reference(reports, global_batch=4, iterations=2)
    assert_peaks_reported(reports, plan_dict, first_iteration=False, **FSDP2_BOUNDS)
    for report in reports:
        measured, predicted = report.measured_breakdown, report.predicted_breakdown
        # the plan holds the unsharded gradients (g P') beside their dp=2 shards, and the
        # unsharded weights beside theirs: all of them at ZeRO 2 (w P' + w P'/2), at ZeRO 3
        # those of the layers after the peak's (fsdp.backward_weight_bytes); the tracker counts
        # only the shards as params (FSDP2 pads odd first dimensions; Adam adds a 4-byte step
        # counter per tensor)
        if zero == 2:
            assert measured["params"] == pytest.approx(predicted["weights"] / 3, rel=0.02)
        else:
            assert measured["params"] * 0.98 <= predicted["weights"] <= 3.06 * measured["params"]
        assert predicted["grads"] == pytest.approx(2 * measured["params"], rel=0.02)
        assert measured["optimizer"] == pytest.approx(predicted["optimizer"], rel=0.02)
        # ... and the run really holds them: its peak is above all three
        held = predicted["weights"] + predicted["grads"] + predicted["optimizer"]
        assert report.measured_peak_bytes > held


def evaluated(graph, split, **config) -> dict:
    """A plan dict for a hand-picked config and split (fp32 training, Adam)."""
    parallel = ParallelConfig(**config)
    training = TrainingConfig(
        global_batch=parallel.dp * parallel.micro_batch * parallel.num_microbatches,
        micro_batch_sizes=(parallel.micro_batch,),
        zero_stages=(parallel.zero,),
        recompute=parallel.recompute,
        schedule=parallel.schedule,
        virtual_stages=(parallel.virtual_stages,),
        sequence_parallel="on" if parallel.sp else "off",
        max_slowdown=None,
        **TORCH_FP32,
    )
    return evaluation_to_dict(evaluate(graph, parallel, split, training=training))


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_pp2_matches_single_process(graph):
    plan_dict = evaluated(graph, [3, 3], pp=2, tp=2, dp=1, micro_batch=1, num_microbatches=2)
    reports = run_plan("gpt-tiny", plan_dict, iterations=2, overrides=OVERRIDES, capture_grads=True)
    # rank = (stage * dp + dp_rank) * tp + tp_rank
    assert [(r.rank, r.stage, r.dp_rank, r.tp_rank) for r in reports] == [
        (0, 0, 0, 0),
        (1, 0, 0, 1),
        (2, 1, 0, 0),
        (3, 1, 0, 1),
    ]
    assert_matches_reference(reports, global_batch=2, iterations=2)
    assert_peaks_reported(reports, plan_dict, first_iteration=False)
    for report in reports:
        # qkv, proj, fc1 and fc2 are split, norms, embedding and head replicated: the cost model's
        # split of the profiled graph (its tp_params), to the byte.
        assert report.measured_breakdown["params"] == report.predicted_breakdown["weights"]
        assert report.cuda_max_allocated_bytes is None


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_vocabulary_parallel_embedding_and_head_match_single_process():
    """A 16384-token vocabulary is split by rows under TP (the cost model's rule): the embedding
    row-parallel, the LM head column-parallel with a vocabulary-parallel cross-entropy."""
    overrides = {"layers": 2, "dropout": 0.0, "vocab_size": VOCAB_PARALLEL_MIN_ROWS}
    graph = export_graph("gpt-tiny", dtype="fp32", overrides=overrides)
    plan_dict = evaluated(graph, [4], pp=1, tp=2, dp=1, micro_batch=1, num_microbatches=2)
    reports = run_plan("gpt-tiny", plan_dict, iterations=2, overrides=overrides, capture_grads=True)
    # The sharded softmax sums its 16384 exponentials in a different order: 1e-6 is too tight.
    assert_matches_reference(
        reports, global_batch=2, iterations=2, overrides=overrides, tolerance=5e-6
    )
    # measured -8.9%: the vocabulary-parallel embedding and cross-entropy keep more than
    # the plan counts (grads 3.05 MiB beside 2.05 MiB of weights), not modelled yet
    assert_peaks_reported(reports, plan_dict, first_iteration=False, under_pct=10.0)
    for report in reports:  # both tables split over tp=2, as the cost model's tp_params say
        assert report.measured_breakdown["params"] == report.predicted_breakdown["weights"]


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_dp2_fsdp2_matches_single_process(graph):
    plan_dict = evaluated(graph, [6], pp=1, tp=2, dp=2, micro_batch=1, num_microbatches=2, zero=3)
    reports = run_plan("gpt-tiny", plan_dict, iterations=2, overrides=OVERRIDES, capture_grads=True)
    assert [(r.dp_rank, r.tp_rank) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_matches_reference(reports, global_batch=4, iterations=2)
    assert_peaks_reported(reports, plan_dict, first_iteration=False, **FSDP2_BOUNDS)
    for report in reports:  # split over tp, then sharded over dp
        measured, predicted = report.measured_breakdown, report.predicted_breakdown
        assert measured["params"] == pytest.approx(predicted["weights"], rel=0.02)
        assert measured["optimizer"] == pytest.approx(predicted["optimizer"], rel=0.02)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("zero", [1, 2])
def test_zero1_zero2_dp2_match_single_process(graph, zero):
    plan_dict = evaluated(
        graph, [6], pp=1, tp=1, dp=2, micro_batch=1, num_microbatches=2, zero=zero
    )
    reports = run_plan("gpt-tiny", plan_dict, iterations=2, overrides=OVERRIDES, capture_grads=True)
    assert_matches_reference(reports, global_batch=4, iterations=2)
    assert_peaks_reported(
        reports, plan_dict, first_iteration=False, **(FSDP2_BOUNDS if zero == 2 else {})
    )
    full = reference(4)[1]
    full_bytes = sum(grad.numel() * grad.element_size() for grad in full.values())
    for report in reports:
        measured, predicted = report.measured_breakdown, report.predicted_breakdown
        # Adam state sharded over dp=2 (ZeroRedundancyOptimizer splits whole tensors greedily,
        # FSDP2 splits every tensor): about half of the unsharded 8 bytes per parameter; and
        # Adam's step scalars, 4 bytes per parameter tensor on every rank (not sharded).
        assert predicted["optimizer"] == full_bytes + 4 * len(full)
        assert measured["optimizer"] == pytest.approx(full_bytes, rel=0.1)
        # ZeRO-1 keeps whole weights; ZeRO-2 (FSDP2) keeps shards between steps.
        assert measured["params"] == pytest.approx(full_bytes / zero, rel=0.02)


@pytest.mark.slow
@pytest.mark.distributed
def test_full_recompute_pp2_matches_single_process(graph):
    plan_dict = evaluated(
        graph, [3, 3], pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4, recompute="full"
    )
    reports = run_plan("gpt-tiny", plan_dict, iterations=1, overrides=OVERRIDES, capture_grads=True)
    assert_matches_reference(reports, global_batch=4)
    assert_peaks_reported(reports, plan_dict, first_iteration=True)
    for report in reports:
        # Only layer inputs stay between forward and backward: the saved activations at the peak
        # are one layer's re-materialised tensors, far below what one micro-batch of the stage
        # saves without recomputation (b = 1).
        names = set(plan_dict["stages"][report.stage]["layers"])
        full_set = sum(layer.activation_bytes for layer in graph.layers if layer.name in names)
        assert report.measured_breakdown["activations"] < full_set / 4


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("pp", "split", "num_microbatches", "recompute", "chunks"),
    [
        # rank 0: embed..layers.0 | layers.2; rank 1: layers.1 | layers.3 + head
        (2, [2, 1, 1, 2], 4, "none", [[2, 1], [1, 2]]),
        # the last virtual stage holds only the loss head; every layer under checkpoint
        (2, [2, 1, 2, 1], 4, "full", [[2, 2], [1, 1]]),
        # six virtual stages of one layer each over three ranks, m = p
        (3, [1] * 6, 3, "none", [[1, 1], [1, 1], [1, 1]]),
    ],
)
def test_interleaved_matches_single_process(graph, pp, split, num_microbatches, recompute, chunks):
    """ScheduleInterleaved1F1B with two chunks per rank (virtual stage j on rank j mod pp)."""
    plan_dict = evaluated(
        graph,
        split,
        pp=pp,
        tp=1,
        dp=1,
        micro_batch=1,
        num_microbatches=num_microbatches,
        virtual_stages=2,
        recompute=recompute,
    )
    assert [[len(chunk) for chunk in stage["chunks"]] for stage in plan_dict["stages"]] == chunks
    reports = run_plan("gpt-tiny", plan_dict, iterations=1, overrides=OVERRIDES, capture_grads=True)
    assert [r.layers for r in reports] == [stage["layers"] for stage in plan_dict["stages"]]
    assert_matches_reference(reports, global_batch=num_microbatches)
    assert_peaks_reported(reports, plan_dict, first_iteration=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_interleaved_dp2_ddp_per_chunk_matches_single_process(graph):
    plan_dict = evaluated(
        graph, [1, 2, 2, 1], pp=2, tp=1, dp=2, micro_batch=1, num_microbatches=2, virtual_stages=2
    )
    reports = run_plan("gpt-tiny", plan_dict, iterations=2, overrides=OVERRIDES, capture_grads=True)
    assert [(r.rank, r.stage, r.dp_rank) for r in reports] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert_matches_reference(reports, global_batch=4, iterations=2)
    # measured +12.4% and +13.1%: interleaved ranks keep the persistent moment, an upper
    # bound, and DDP's buckets beside step gradients (docs/cost-model.md, Gradient lifetime)
    assert_peaks_reported(reports, plan_dict, first_iteration=False, over_pct=15.0)
    for a, b in ((reports[0], reports[1]), (reports[2], reports[3])):  # DDP averaged each chunk
        for name in a.grads:
            torch.testing.assert_close(a.grads[name], b.grads[name], rtol=0, atol=0)


def test_shard_order_gives_each_tp_rank_whole_heads():
    # q of 8 rows, k and v of 4 rows each, over tp=2: rank 0 gets q[0:4], k[0:2], v[0:2].
    order = shard_order([8, 4, 4], 2)
    assert order.tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15]


def test_cuda_device_without_a_gpu_is_an_input_error(graph, monkeypatch):
    plan_dict = planned(graph, pp=2, dp=1, micro_batch=2, global_batch=8, schedule="1f1b")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match=r"device cuda: torch.cuda.is_available\(\) is False"):
        run_plan("gpt-tiny", plan_dict, overrides=OVERRIDES, device="cuda")
    with pytest.raises(InputError, match="device 'tpu'; valid: cpu, cuda"):
        run_plan("gpt-tiny", plan_dict, overrides=OVERRIDES, device="tpu")


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


@pytest.mark.slow
@pytest.mark.distributed
def test_failed_rank_stops_every_process(graph):
    plan_dict = planned(graph, pp=2, dp=1, micro_batch=2, global_batch=8, schedule="1f1b")
    with pytest.raises(RunError, match="(?s)rank1 failed first.*injected failure") as raised:
        run_plan("gpt-tiny", plan_dict, iterations=1, overrides=OVERRIDES, _fault=(1, "raise"))
    assert_all_stopped(raised.value, world=2)


@pytest.mark.slow
@pytest.mark.distributed
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


def _drop_last_layer(plan_dict: dict) -> None:
    """A consistent plan for a model with one layer less (the checked plan stays valid)."""
    plan_dict["stages"][1]["layers"].pop()
    plan_dict["stage_of_layer"].pop()
    plan_dict["graph"]["num_layers"] -= 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p["config"].update(tp=2, dp=2, zero=1), "ZeroRedundancyOptimizer cannot"),
        (lambda p: p["config"].update(zero=4), "config.zero: expected one of 0, 1, 2, 3, got 4"),
        (lambda p: p["config"].update(tp=3), r"heads \(4\) and kv_heads \(4\) must be multiples"),
        (lambda p: p["config"].update(recompute="selective"), "recompute='selective'"),
        (lambda p: p["config"].update(tp=4, dp=2), r"pp\(2\) \* dp\(2\) \* tp\(4\) = 16"),
        (lambda p: p["stages"][1]["layers"].__setitem__(-1, "layers.9"), "unknown layers"),
        (_drop_last_layer, "missing layers"),
        (lambda p: p["config"].update(pp=3), "2 stages for pp=3"),
        (lambda p: p["config"].update(dp=64), "processes"),
        (lambda p: p["config"].update(tp=3, sp=True), "sp=true with tp 3 splits the sequence"),
    ],
)
def test_bad_plans_are_input_errors_before_spawning(graph, change, message):
    plan_dict = copy.deepcopy(
        planned(graph, pp=2, dp=1, micro_batch=2, global_batch=8, schedule="1f1b")
    )
    change(plan_dict)
    with pytest.raises(InputError, match=message):
        run_plan("gpt-tiny", plan_dict, overrides=OVERRIDES, max_processes=8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p["config"].update(tp=2), r"virtual_stages=2 with tp=2: .* --tp 1"),
        (
            lambda p: p["config"].update(dp=2, zero=1),
            r"virtual_stages=2 with dp=2 and zero=1: .* --zero 0",
        ),
        (lambda p: p["config"].update(schedule="gpipe"), "schedule 'gpipe': .* --schedule 1f1b"),
        (lambda p: p["config"].update(num_microbatches=5), r"rounds max\(1, m // pp\) = 2"),
        (lambda p: p["stages"][0].pop("chunks"), r"stages\[0\].chunks: has 0 chunks"),
        (lambda p: p["stages"][1]["chunks"].reverse(), r"stages\[1\].chunks: must list"),
    ],
)
def test_unsupported_interleaved_plans_are_input_errors(graph, change, message):
    plan_dict = evaluated(
        graph, [2, 1, 1, 2], pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4, virtual_stages=2
    )
    change(plan_dict)
    with pytest.raises(InputError, match=message):
        run_plan("gpt-tiny", plan_dict, overrides=OVERRIDES, max_processes=8)


def test_tied_vocabulary_parallel_tables_are_an_input_error(graph):
    plan_dict = evaluated(graph, [6], pp=1, tp=2, dp=1, micro_batch=1, num_microbatches=2)
    tied = {**OVERRIDES, "vocab_size": VOCAB_PARALLEL_MIN_ROWS, "tied_embeddings": True}
    with pytest.raises(InputError, match="tied embeddings with a vocabulary-parallel table"):
        run_plan("gpt-tiny", plan_dict, overrides=tied)


def test_format_reports_adds_the_cuda_column_only_on_cuda():
    breakdown = dict.fromkeys(CATEGORIES, 2**20)
    report = RankReport(
        rank=3,
        stage=1,
        dp_rank=0,
        tp_rank=1,
        layers=["head"],
        measured_peak_bytes=5 * 2**20,
        measured_breakdown=breakdown,
        predicted_peak_bytes=None,
        predicted_breakdown=None,
        error_pct=None,
        iteration_ms=[12.0],
    )
    header, row = format_reports([report]).splitlines()
    assert "cuda_MiB" not in header and row.split()[:5] == ["3", "1", "0", "1", "5.000"]
    report.cuda_max_allocated_bytes = 6 * 2**20
    header, row = format_reports([report]).splitlines()
    assert header.split()[-1] == "cuda_MiB" and row.split()[-1] == "6.000"


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


def tracked_peaks(model_of, losses, optimizer_options=None) -> tuple[list[int], int]:
    """Adam steps on ``model_of()``, one per loss function in ``losses`` (model, step -> scalar),
    measured by LiveTensorTracker and, on a second model of the same seed, by torch's MemTracker
    (through ``_torch_compat``): ours's peak of each step, and MemTracker's peak of all."""
    from profiling._torch_compat import mem_tracker

    def train(tracker, reset) -> list[int]:
        model = model_of()
        optimizer = torch.optim.Adam(model.parameters(), **(optimizer_options or {}))
        if isinstance(tracker, LiveTensorTracker):
            tracker.track_module(model)
            tracker.track_grads(model)
            tracker.track_optimizer(optimizer)
        else:
            tracker.track_external(model, optimizer)
        peaks = []
        with tracker:
            for step, loss_of in enumerate(losses):
                optimizer.zero_grad(set_to_none=True)
                reset()
                loss_of(model, step).backward()
                optimizer.step()
                if isinstance(tracker, LiveTensorTracker):
                    peaks.append(tracker.peak_bytes)
        return peaks

    ours = LiveTensorTracker()
    peaks = train(ours, ours.reset_peak)
    theirs = mem_tracker()
    train(theirs, theirs.reset_mod_stats)
    (snapshot,) = theirs.get_tracker_snapshot("peak").values()
    return peaks, snapshot["Total"]


def test_tracker_peak_equals_memtracker_on_a_small_module():
    """The fast twin of the gpt-tiny cross-check below: a small MLP, forward, backward and a
    foreach Adam step, twice: LiveTensorTracker's peak is MemTracker's to the byte."""

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
        )

    def loss(model, step):
        return model(torch.randn(16, 32)).square().mean()

    peaks, theirs = tracked_peaks(mlp, [loss, loss], {"foreach": True})
    assert max(peaks) == theirs
    param_bytes = (32 * 64 + 64 + 2 * 64 + 64 * 8 + 8) * 4
    assert max(peaks) >= 4 * param_bytes  # weights, gradients and Adam's two states at least


@pytest.mark.slow
def test_tracker_peak_equals_memtracker_on_a_training_step():
    """Cross-check with torch's own MemTracker: the same peak, to the byte, over three steps."""
    spec = models.get("gpt-tiny", **OVERRIDES)

    def loss(model, step):
        ids, targets = batch_for_iteration(spec, batch=4, seq=None, seed=0, iteration=step)
        return model(ids, targets)

    peaks, theirs = tracked_peaks(lambda: build_model(spec, 0), [loss] * 3)
    assert max(peaks) == theirs
    assert peaks[1] == peaks[2] > peaks[0]  # from the second step on, Adam state is live


def test_tracker_tags_what_is_live_at_the_peak(tmp_path, monkeypatch):
    """``tag_peak``: the storages live at the peak, grouped by category and the code that made
    them, sum to the peak; the saved input of a Linear is named by its shape and line."""
    from profiling.trace.memory import PEAK_TAGS_ENV, write_peak_tags

    layer = torch.nn.Linear(32, 16)
    tracker = LiveTensorTracker(tag_peak=True)
    tracker.track_module(layer)
    tracker.track_grads(layer)
    with tracker:
        tracker.reset_peak()
        x = torch.randn(8, 32).exp()  # the exp's output is saved by the Linear
        with tracker.saved_tensors():
            loss = layer(x).relu().sum()
        loss.backward()
    tags = tracker.peak_tags()
    assert sum(total for *_, total in tags) == tracker.peak_bytes
    assert {category for category, *_ in tags} <= set(CATEGORIES)
    saved = [tag for category, tag, _, _ in tags if category == "activations"]
    assert any(
        tag.startswith("1024 B (8, 32) torch.float32 | ") and "test_run.py" in tag for tag in saved
    ), saved
    monkeypatch.setenv(PEAK_TAGS_ENV, str(tmp_path / "tags"))  # made if missing
    write_peak_tags(tracker, 3)
    lines = (tmp_path / "tags" / "rank3.txt").read_text().splitlines()
    assert lines[0].startswith(f"peak {tracker.peak_bytes} ") and len(lines) == len(tags) + 1
    assert LiveTensorTracker().tag_peak  # the environment variable switches it on
