"""Usable memory (solver/reserve.py): capacity - reserve in every feasibility check, the
sourced CLI default, --reserve, a calibration's constant in its place, bad input."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest

from solver.calibration import Calibration, write_calibration
from solver.cli.evaluate import evaluate_main
from solver.cli.plan import plan_main
from solver.cli.sweep import sweep_main
from solver.errors import InfeasibleError, InputError
from solver.evaluation import evaluate
from solver.files.plan_file import evaluate_plan, load_plan
from solver.graph import load_graph
from solver.reserve import DEFAULT_RESERVE, MemoryReserve, default_reserve, parse_reserve
from solver.search.planner import plan
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import GPT_1_3B, MIXED_CLUSTER

GIB = 2**30
PEAK_8_GPUS = 8667883520
"""gpt-1.3b's parameters split of pp4 tp2 on 8 GPUs, global batch 64 (2+4+12 bytes/param): the
CLI's plan on 8 x 80 GiB (the smallest peak within --max-slowdown 1.25)."""
SMALLEST_PEAK = 6380312576
"""gpt-1.3b's smallest peak on 8 GPUs, global batch 64, any speed: pp2 tp4 dp1 b1 m64."""


@pytest.mark.parametrize(
    ("text", "fixed", "fraction"),
    [("3GiB", 3 * GIB, 0.0), ("8%", 0, 0.08), ("1GiB+5%", GIB, 0.05), ("0", 0, 0.0)],
)
def test_parse(text, fixed, fraction):
    reserve = parse_reserve(text)
    assert (reserve.fixed_bytes, reserve.fraction) == (fixed, pytest.approx(fraction))


@pytest.mark.parametrize("text", ["120%", "-1GiB", "100%", "", "3 apples", "1GiB+"])
def test_parse_rejects(text):
    with pytest.raises(InputError):
        parse_reserve(text)


def test_default_is_1_gib_plus_5_percent():
    """On an 80 GiB GPU: 1 GiB + 4 GiB = 5 GiB reserved, 75 GiB usable; on 40 GB (A100 40GB,
    40e9 bytes): 1 GiB + 2e9 bytes."""
    assert DEFAULT_RESERVE.bytes_for(80 * GIB) == 5 * GIB
    assert DEFAULT_RESERVE.usable_bytes(80 * GIB) == 75 * GIB
    assert DEFAULT_RESERVE.bytes_for(40 * 10**9) == GIB + 2 * 10**9
    assert default_reserve(None) is DEFAULT_RESERVE
    # a calibration with a per-GPU constant replaces it; one without does not
    assert default_reserve(Calibration(constant_bytes=123)).bytes_for(80 * GIB) == 0
    assert default_reserve(Calibration()) is DEFAULT_RESERVE
    # the Python API keeps Cluster.gpu_memory_bytes as usable memory: no reserve by default
    assert TrainingConfig(global_batch=1).usable_bytes(80 * GIB) == 80 * GIB


def _evaluation(capacity, reserve):
    graph = load_graph(GPT_1_3B)
    config = ParallelConfig(pp=4, tp=2, dp=1, micro_batch=1, num_microbatches=64)
    training = TrainingConfig(
        global_batch=64, micro_batch_sizes=(1,), reserve=reserve, sequence_parallel="off"
    )
    return evaluate(
        graph, config, [6, 7, 7, 6], cluster=Cluster(num_gpus=8, gpu_memory_bytes=capacity),
        training=training,
    )  # fmt: skip


def test_reserve_shrinks_usable_memory_exactly():
    """The parameters split of pp4 tp2 peaks at PEAK_8_GPUS bytes: it fits 10 GiB with a
    reserve that leaves exactly its peak, and not with one byte more."""
    free = _evaluation(10 * GIB, MemoryReserve())
    assert free.peak_bytes == PEAK_8_GPUS and free.fits
    margin = 10 * GIB - PEAK_8_GPUS
    exact = _evaluation(10 * GIB, MemoryReserve(fixed_bytes=margin))
    assert exact.usable_bytes == [PEAK_8_GPUS] * 4 and exact.fits
    over = _evaluation(10 * GIB, MemoryReserve(fixed_bytes=margin + 1))
    assert not over.fits and over.peak_bytes == PEAK_8_GPUS  # the peak itself does not change
    share = _evaluation(10 * GIB, MemoryReserve(fraction=0.2))  # 8 GiB usable < 8.07 GiB
    assert share.usable_bytes[0] == 10 * GIB - 2 * GIB and not share.fits


def test_plan_that_fits_by_a_known_margin_becomes_infeasible():
    """At reserve 0 the optimum peak equals the capacity (margin 0); a reserve of 1 GiB makes
    every plan too big, and the message names usable, capacity and reserve."""
    graph = load_graph(GPT_1_3B)
    cluster = Cluster(num_gpus=8, gpu_memory_bytes=SMALLEST_PEAK)
    training = TrainingConfig(
        global_batch=64, max_slowdown=None, reserve=MemoryReserve(), sequence_parallel="off"
    )
    assert plan(graph, cluster, training, time_limit_s=30).peak_bytes == SMALLEST_PEAK
    tight = dataclasses.replace(training, reserve=MemoryReserve(fixed_bytes=GIB))
    with pytest.raises(InfeasibleError) as error:
        plan(graph, cluster, tight, time_limit_s=30, suggest_gpus=False)
    message = str(error.value)
    usable = SMALLEST_PEAK - GIB
    assert "needs 5.94 GiB (pp2 tp4 dp1 b1 m64 zero0 1f1b) of usable 4.94 GiB per GPU" in message
    assert "= capacity 5.94 GiB - reserve 1.00 GiB (1.00 GiB), 1.00 GiB (20.2%) over" in message
    assert error.value.capacity_bytes == usable


def test_cli_default_reserve_in_the_report_and_json(run_cli, tmp_path):
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli(
        plan_main, GPT_1_3B, "--gpus", "8", "--global-batch", "64", "--json", str(out)
    )
    assert code == 0, err
    assert (
        "of usable 75.00 GiB = capacity 80.00 GiB - reserve 5.00 GiB (1.00 GiB + 5%, default)"
        in (stdout)
    )
    document = json.loads(out.read_text())
    assert document["training"]["reserve"] == {
        "fixed_bytes": GIB,
        "fraction": 0.05,
        "source": "default",
    }
    stages = len(document["stages"])
    assert [stage["usable_bytes"] for stage in document["stages"]] == [75 * GIB] * stages
    # the plan file keeps its reserve: evaluated again, the same numbers
    again = evaluate_plan(load_plan(str(out)))
    assert again.usable_bytes == [75 * GIB] * stages


def test_plan_without_a_reserve_record_loads_with_none(run_cli, tmp_path):
    out = tmp_path / "plan.json"
    run_cli(plan_main, GPT_1_3B, "--gpus", "8", "--global-batch", "64", "--json", str(out))
    document = json.loads(out.read_text())
    del document["training"]["reserve"]
    for stage in document["stages"]:
        del stage["usable_bytes"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(document))
    assert load_plan(str(old)).training.usable_bytes(80 * GIB) == 80 * GIB


@pytest.mark.slow
def test_cli_reserve_makes_the_quick_plan_infeasible(run_cli):
    """gpt-1.3b on 8 x 10 GiB: fits with --reserve 0 (peak 5.94 GiB), and with --reserve 40%
    (6 GiB usable, 99.0% full), not with --reserve 50% (5 GiB usable): exit 3 naming it."""
    args = (GPT_1_3B, "--gpus", "8", "--gpu-memory", "10GiB", "--global-batch", "64")
    args += ("--sequence-parallel", "off", "--zero", "0", "--recompute", "none")
    args += ("--micro-batch", "1,2,4")  # the configurations this figure was measured over
    code, stdout, _ = run_cli(plan_main, *args, "--reserve", "0")
    assert code == 0 and "peak: 5.94 GiB per GPU (59.4% of 10.00 GiB (no reserve); fits)" in stdout
    code, stdout, _ = run_cli(plan_main, *args, "--reserve", "40%")
    assert code == 0
    assert "(99.0% of usable 6.00 GiB = capacity 10.00 GiB - reserve 4.00 GiB (40%, --reserve)" in (
        stdout
    )
    code, _, err = run_cli(plan_main, *args, "--reserve", "50%", "--time-limit", "20")
    assert code == 3
    assert "of usable 5.00 GiB per GPU = capacity 10.00 GiB - reserve 5.00 GiB (50%)" in err


def test_calibration_constant_replaces_the_default(run_cli, tmp_path):
    calibration = tmp_path / "calibration.json"
    write_calibration(calibration, Calibration(constant_bytes=2**20))
    code, stdout, err = run_cli(
        plan_main,
        *(GPT_1_3B, "--gpus", "8", "--global-batch", "64", "--calibration", str(calibration)),
    )
    assert code == 0, err
    assert "of 80.00 GiB (no reserve)" in stdout
    code, stdout, err = run_cli(
        plan_main,
        *(GPT_1_3B, "--gpus", "8", "--global-batch", "64", "--calibration", str(calibration)),
        *("--reserve", "2GiB"),
    )
    assert code == 0 and "reserve 2.00 GiB (2.00 GiB, --reserve)" in stdout


def test_heterogeneous_groups_each_lose_their_reserve(run_cli, tmp_path):
    out = tmp_path / "ev.json"
    code, stdout, err = run_cli(
        evaluate_main,
        *(GPT_1_3B, "--cluster", MIXED_CLUSTER, "--pp", "2", "--tp", "8", "--dp", "1"),
        *("--global-batch", "8", "--split", "even", "--stage-groups", "a100-40g,a100-80g"),
        *("--json", str(out)),
    )
    assert code == 0, err
    stages = json.loads(out.read_text())["stages"]
    for stage in stages:
        capacity = stage["capacity_bytes"]
        assert stage["usable_bytes"] == capacity - GIB - -(-5 * capacity // 100)
    assert "reserve 1.00 GiB + 5% per GPU, default" in stdout


def test_sweep_csv_has_the_reserve_column(run_cli, tmp_path):
    out = tmp_path / "sweep.csv"
    code, _, err = run_cli(
        sweep_main,
        *(GPT_1_3B, "--gpus", "8", "--gpu-memory", "40GiB,80GiB", "--global-batch", "64"),
        *("--reserve", "2GiB+10%", "--out", str(out)),
    )
    assert code == 0, err
    rows = list(csv.DictReader(out.open()))
    for row in rows:
        capacity = int(row["gpu_memory_bytes"])
        assert int(row["reserve_bytes"]) == 2 * GIB + capacity // 10
        assert int(row["usable_bytes"]) == capacity - int(row["reserve_bytes"])
    assert {int(row["usable_bytes"]) for row in rows} == {34 * GIB, 70 * GIB}


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("120%", "within 0%..99%"),
        ("-1GiB", "cannot be negative"),
        ("80GiB", "leaves nothing of the 80.00 GiB"),
        ("50GiB+40%", "leaves nothing"),
    ],
)
def test_bad_reserve_exits_2_with_one_line(run_cli, value, words):
    code, _, err = run_cli(
        plan_main, GPT_1_3B, "--gpus", "8", "--global-batch", "64", f"--reserve={value}"
    )
    assert code == 2
    assert err.count("\n") == 1 and words in err and "reserve" in err


@pytest.mark.slow
def test_plans_with_a_reserve_stay_within_usable_memory(run_cli, tmp_path):
    """A homogeneous and a heterogeneous plan under the default reserve: every stage's peak is
    at most its usable memory, and the plan checker (solver.plan_check) agrees."""
    from solver.files.cluster_file import load_cluster
    from solver.plan_check import check_plan

    graph = load_graph(GPT_1_3B)
    training = TrainingConfig(global_batch=64, reserve=DEFAULT_RESERVE)
    small = Cluster(num_gpus=8, gpu_memory_bytes=10 * GIB)  # 8.5 GiB usable
    result = plan(graph, small, training, time_limit_s=30)
    assert result.evaluation.usable_bytes == [10 * GIB - GIB - GIB // 2] * result.config.pp
    assert result.peak_bytes <= 8.5 * GIB and check_plan(result) == []
    mixed = load_cluster(MIXED_CLUSTER)
    placed = plan(graph, mixed, dataclasses.replace(training, global_batch=32), time_limit_s=30)
    for stage, usable, capacity in zip(
        placed.stages, placed.evaluation.usable_bytes, placed.evaluation.capacity_bytes, strict=True
    ):
        assert usable == DEFAULT_RESERVE.usable_bytes(capacity)
        assert stage.peak_bytes <= usable
    assert check_plan(placed) == []
