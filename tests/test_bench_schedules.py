"""scripts/bench_schedules.py on a tiny GPT (make_examples' closed form, no torch): every number
of a row is recomputed from the row alone, by ``solver.evaluate`` of its config and split."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_schedules  # noqa: E402
import make_examples  # noqa: E402
from bench_schedules import SCHEDULES, Cell, cell_rows  # noqa: E402

from solver import ParallelConfig, evaluate  # noqa: E402
from solver.evaluation import recompute_flags  # noqa: E402

GIB = 2**30
CELL = Cell("tiny", 4, 1.5, 16)


@pytest.fixture(scope="module")
def graph():
    return make_examples.gpt("tiny", layers=6, s=256, h=512, a=8, vocab=8000)


def recomputed_row(graph, row: dict) -> dict:
    """The numbers of ``row`` recomputed from its own fields (config, split, recomputed)."""
    config = ParallelConfig(
        pp=row["pp"], tp=row["tp"], dp=row["dp"], ep=row["ep"], micro_batch=row["b"],
        num_microbatches=row["m"], zero=row["zero"], recompute=row["recompute"],
        schedule=row["runs"].split(" v")[0], virtual_stages=row["v"], sp=row["tp"] > 1,
    )  # fmt: skip
    cluster, _ = bench_schedules.options(CELL, [])
    training = bench_schedules.options(
        CELL, ["--schedule", config.schedule, "--virtual-stages", str(config.virtual_stages)]
    )[1]
    flags = recompute_flags(graph, row["recomputed"]) if row["recomputed"] else None
    split = [int(n) for n in row["split"].split(",")]
    mine = evaluate(graph, config, split, cluster=cluster, training=training, recomputed=flags)
    even = evaluate(graph, config, "even", cluster=cluster, training=training, recomputed=flags)
    peaks = [stage.peak_bytes for stage in mine.stages]
    return mine, {
        "peak_gib": round(mine.peak_bytes / GIB, 3),
        "peak_rank": peaks.index(max(peaks)),
        "samples_s": round(mine.throughput, 4),
        "fits": mine.fits,
        "even_gib": round(even.peak_bytes / GIB, 3),
        "m": CELL.batch // (config.dp * config.micro_batch),
    }


def check_rows(graph, rows: list[dict]) -> None:
    """Fields present, numbers recomputed, percentages against the base row's fastest config."""
    base = rows[0]
    base_evaluation, _ = recomputed_row(graph, base)
    assert (base["schedule"], base["goal"]) == ("base: 1f1b even", "fastest")
    assert rows[1]["goal"] == "smallest" and rows[1]["peak_gib"] <= base["peak_gib"]
    assert base["split"] == ",".join(
        map(str, [len(s) for s in make_even_names(graph, base["pp"])])
    )
    for row in rows:
        assert (row["model"], row["gpus"], row["gpu_gib"], row["batch"]) == ("tiny", 4, 1.5, 16)
        if "peak_gib" not in row:
            assert row["note"].split(" ", 1)[0].endswith("Error"), row
            continue
        plan_only = {"note", "status", "gap_pct", "required_samples_s"}
        assert set(bench_schedules.SHOWN) - plan_only <= set(row), row
        mine, again = recomputed_row(graph, row)
        assert {k: row[k] for k in again} == again, row["schedule"]
        pairs = (("peak_vs_base_pct", "peak_bytes"), ("speed_vs_base_pct", "throughput"))
        for name, field in pairs:
            ratio = getattr(mine, field) / getattr(base_evaluation, field)
            assert row[name] == round(100 * (ratio - 1), 1), (row["schedule"], name)
        if row["schedule"] in bench_schedules.SCHEDULES:
            schedule, virtual = bench_schedules.SCHEDULES[row["schedule"]]
            assert row["runs"].split(" v")[0] == schedule
            assert str(row["v"]) in virtual.split(",")
            assert row["status"] in ("OPTIMAL", "FEASIBLE") and row["gap_pct"] >= 0


def make_even_names(graph, pp: int) -> list[list[int]]:
    """The even split's layers per stage (Megatron's default, ``solver.report.baselines``)."""
    from solver.report.baselines import even_split

    assignment = even_split(graph, pp)
    return [[i for i, s in enumerate(assignment) if s == stage] for stage in range(pp)]


@pytest.mark.parametrize("name", ["1f1b", pytest.param("zbv", marks=pytest.mark.slow)])
def test_a_schedules_rows_are_recomputed_from_the_rows(graph, name):
    rows = cell_rows(graph, CELL, 5.0, schedules={name: SCHEDULES[name]}, auto=False)
    assert [(r["schedule"], r["goal"]) for r in rows] == [
        ("base: 1f1b even", "fastest"),
        ("base: 1f1b even", "smallest"),
        (name, "min-peak"),
        (name, "slowdown-1.25"),
        (name, "throughput"),
    ]
    check_rows(graph, rows)
    smallest, default, fastest = rows[2:]
    assert smallest["peak_gib"] <= default["peak_gib"] <= fastest["peak_gib"]
    assert fastest["samples_s"] >= default["samples_s"] >= fastest["samples_s"] / 1.25 - 1e-3
    assert "--max-slowdown none" in smallest["flags"]
    assert "--objective throughput" in fastest["flags"]


def test_a_refused_schedule_gets_its_reason():
    """dualpipev needs m >= 2 pp: with a global batch of 2 no layout runs it (exit 2)."""
    tiny = make_examples.gpt("tiny", layers=6, s=256, h=512, a=8, vocab=8000)
    row = bench_schedules.plan_row(
        tiny, Cell("tiny", 4, 1.5, 2), "dualpipev", ("dualpipev", "2"), "min-peak", 5.0, None
    )
    assert row["note"].startswith("InputError (exit 2): schedule dualpipev needs at least"), row
    assert "peak_gib" not in row
    assert bench_schedules.why(row) == "refused"


@pytest.mark.slow
def test_every_schedule_and_auto(graph):
    rows = cell_rows(graph, CELL, 5.0)
    assert len(rows) == 2 + 3 * len(bench_schedules.SCHEDULES) + 3
    check_rows(graph, rows)
    auto = {r["goal"]: r for r in rows if r["schedule"] == "auto"}
    # never worse than 1F1B alone under the same throughput budget (auto's: 1.25x its fastest)
    (alone,) = [r for r in rows if r["goal"] == bench_schedules.AUTO_BUDGET]
    required = auto["slowdown-1.25"]["required_samples_s"]
    assert f"--min-throughput {required!r}" in alone["flags"] and alone["runs"] == "1f1b"
    assert auto["slowdown-1.25"]["peak_gib"] <= alone["peak_gib"]
    assert alone["samples_s"] >= required - 1e-3
    mins = [r for r in rows if r["goal"] == "min-peak" and "peak_gib" in r]
    fastest = max(r["samples_s"] for r in rows if r["goal"] == "throughput" and "samples_s" in r)
    # auto searches every schedule: as fast as the fastest of them, and within 1.25x of it
    assert auto["throughput"]["samples_s"] == pytest.approx(fastest, rel=1e-3)
    assert auto["slowdown-1.25"]["samples_s"] >= fastest / 1.25 - 1e-3
    assert min(r["peak_gib"] for r in mins) <= auto["slowdown-1.25"]["peak_gib"]
    summary = bench_schedules.cell_summary(rows)
    assert set(summary) <= set(bench_schedules.SUMMARY)
    assert summary[f"1f1b at {bench_schedules.AUTO_BUDGET}"].startswith("1f1b: ")
    assert summary["zbv"] == f"{next(r for r in mins if r['schedule'] == 'zbv')['peak_gib']:.1f}"


def test_rerun_auto_reads_the_kept_rows_back_as_they_were_made(tmp_path):
    """--rerun-auto keeps the other rows of a CSV: read back, they are the rows as made
    (numbers as numbers, empty fields left out), so the summary table is the same."""
    import harness

    cell = {"model": "m", "gpus": 8, "gpu_gib": 80, "batch": 16}
    rows = [
        cell | {"schedule": "1f1b", "goal": "min-peak", "peak_gib": 12.5, "split": "3,3,2"},
        cell | {"schedule": "zbv", "goal": "min-peak", "note": "NoSolutionError (exit 4): x"},
    ]
    rows[0]["note"] = ""
    path = harness.write_csv(tmp_path / "rows.csv", rows, list(rows[0]) + ["peak_rank"])
    back = bench_schedules.typed_rows(harness.read_csv(path))
    assert back[0] == {k: v for k, v in rows[0].items() if v != ""}
    assert back[1] == rows[1]
    assert bench_schedules.cell_summary(back) == bench_schedules.cell_summary(rows)
