"""What-if studies: sweep rows, monotonic sanity, min-gpus against brute force, the CSV, the CLI."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from solver import Cluster, PlannerError, TrainingConfig, plan
from solver.cli.sweep import sweep_main
from solver.errors import InputError
from solver.sweep import (
    ROW_KEYS,
    CsvRows,
    max_scale,
    min_gpus,
    read_rows,
    sweep,
    sweep_points,
    valid_gpu_counts,
)
from tests.conftest import GPT_1_3B, slow_params
from tests.random_graphs import random_chain

GIB = 2**30
TEMPLATE = Cluster(num_gpus=1)


def test_rows_have_every_column_and_keep_infeasible_and_error_points(gpt_graph):
    training = TrainingConfig(global_batch=64, pp=2)
    rows = sweep(gpt_graph, [3, 1, 8], [16 * GIB, 40 * GIB], training, TEMPLATE, workers=1)
    assert [(r["gpus"], r["gpu_memory_bytes"] // GIB) for r in rows] == [
        (3, 16),
        (3, 40),
        (1, 16),
        (1, 40),
        (8, 16),
        (8, 40),
    ]
    assert all(tuple(row) == ROW_KEYS for row in rows)
    by_point = {(r["gpus"], r["gpu_memory_bytes"] // GIB): r for r in rows}
    error = by_point[3, 16]  # pp pinned to 2 does not divide 3 GPUs
    assert error["status"] == "ERROR" and "pp(2)" in error["detail"] and error["config"] == ""
    assert error["pp"] is None and error["peak_bytes"] is None and error["fits"] is None
    for point in ((8, 16), (8, 40)):
        row = by_point[point]
        assert row["status"] == "OPTIMAL" and row["fits"] and row["gap"] == 0
        assert row["pp"] == 2 and row["pp"] * row["tp"] * row["dp"] == 8
        assert row["peak_bytes"] <= row["gpu_memory_bytes"]
        assert row["config"].startswith("pp2 ") and row["recompute"] == "none"
        assert row["even_peak_bytes"] >= row["peak_bytes"] or row["even_throughput"] is not None
        assert row["parameters_peak_bytes"] and row["parameters_throughput"] > 0
    plain = TrainingConfig(global_batch=64)
    (infeasible,) = sweep(gpt_graph, [1], [16 * GIB], plain, TEMPLATE, workers=1)
    assert infeasible["status"] == "INFEASIBLE" and infeasible["fits"] is False
    assert infeasible["peak_bytes"] > 16 * GIB  # the best peak found, over the capacity
    assert infeasible["detail"].startswith("nothing fits") and "\n" not in infeasible["detail"]


@pytest.mark.slow
def test_parallel_and_in_process_sweeps_agree(gpt_graph):
    training = TrainingConfig(global_batch=64, zero_stages=(0, 1))
    points = ([1, 2, 4, 8, 16], [12 * GIB, 40 * GIB])
    here = sweep(gpt_graph, *points, training, TEMPLATE, workers=1)
    done = []
    pool = sweep(gpt_graph, *points, training, TEMPLATE, workers=2, on_row=done.append)
    assert len(done) == len(pool) == 10
    strip = [{k: v for k, v in row.items() if k != "wall_s"} for row in here]
    assert strip == [{k: v for k, v in row.items() if k != "wall_s"} for row in pool]
    assert {row["status"] for row in here} == {"OPTIMAL", "INFEASIBLE"}


def _peak(rows: list[dict]) -> dict[tuple[int, int], int | None]:
    return {
        (r["gpus"], r["gpu_memory_bytes"]): r["peak_bytes"] if r["fits"] else None for r in rows
    }


@pytest.mark.slow
@pytest.mark.parametrize("seed", slow_params([0, 1, 2], 0, 1))
def test_doubling_gpus_never_raises_the_optimum_without_a_throughput_constraint(seed):
    """What is guaranteed: without a throughput constraint, every config (p, t, d, b, z) of N
    GPUs has the config (p, t, 2d, b, z) on 2N GPUs when 2 d b divides the global batch (here
    64 >= 2 * 8 * 4), with the same states or fewer (ZeRO shards over 2d), m / 2 micro-batches
    (k_s = min(m, p - s) no larger) and the same buffers; so the optimum cannot rise. With the
    default max_slowdown the budget follows the fastest plan, and nothing of the kind holds."""
    graph = random_chain(random.Random(seed), 9)
    training = TrainingConfig(
        global_batch=64, zero_stages=(0, 1, 2, 3), max_slowdown=None, recompute="auto"
    )
    template = Cluster(num_gpus=1, gpus_per_node=4)
    rows = sweep(graph, [1, 2, 4, 8, 16], [10**12], training, template, workers=1)
    peaks = [row["peak_bytes"] for row in rows]
    assert all(row["status"] == "OPTIMAL" for row in rows)
    assert all(later <= earlier for earlier, later in zip(peaks, peaks[1:], strict=False))


@pytest.mark.parametrize("seed", [3, 4])
def test_more_memory_never_raises_the_optimum_under_an_absolute_constraint(seed):
    """Same GPU count, same configs, same throughput floor: a larger capacity only admits more
    splits (a relative --max-slowdown would tighten the floor with the capacity)."""
    graph = random_chain(random.Random(seed), 8)
    training = TrainingConfig(global_batch=32, max_slowdown=None, min_throughput=1.0)
    rows = sweep(graph, [2, 4, 6], [150_000, 300_000, 10**9], training, TEMPLATE, workers=1)
    peaks = _peak(rows)
    for gpus in (2, 4, 6):
        series = [peaks[gpus, memory] for memory in (150_000, 300_000, 10**9)]
        solved = [peak for peak in series if peak is not None]
        assert series[len(series) - len(solved) :] == solved  # fits stays fitting
        assert all(b <= a for a, b in zip(solved, solved[1:], strict=False))


def _brute_force_min_gpus(graph, capacity, training, template, limit):
    for gpus in range(1, limit + 1):
        cluster = Cluster(num_gpus=gpus, gpu_memory_bytes=capacity, gpus_per_node=4)
        try:
            plan(graph, cluster, training)
        except PlannerError:
            continue
        return gpus
    return None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("seed", "share", "min_throughput"),
    slow_params(
        [(0, 0.3, None), (1, 0.45, None), (2, 0.35, 4000.0)], (0, 0.3, None), (2, 0.35, 4000.0)
    ),
)
def test_min_gpus_equals_a_brute_force_scan(seed, share, min_throughput):
    graph = random_chain(random.Random(seed), 6)
    training = TrainingConfig(
        global_batch=12, micro_batch_sizes=(1, 2), min_throughput=min_throughput
    )
    template = Cluster(num_gpus=1, gpus_per_node=4)
    single = plan(graph, Cluster(num_gpus=1), TrainingConfig(global_batch=12, max_slowdown=None))
    capacity = int(share * single.peak_bytes)
    counts = valid_gpu_counts(graph.num_layers, template, training)
    assert counts[0] == 1 and 5 in counts and 7 not in counts  # 7 = no pp <= 6, tp | 4, dp | 12
    expected = _brute_force_min_gpus(graph, capacity, training, template, max(counts))
    assert expected is not None and expected > 1
    found = min_gpus(graph, capacity, training, template, workers=1)
    assert found.gpus == expected and found.plan.config.num_gpus == expected
    assert found.plan.peak_bytes <= capacity
    listed = min_gpus(graph, capacity, training, template, candidates=range(1, 40), workers=1)
    assert listed.gpus == expected
    assert all(row["status"] != "OPTIMAL" for row in listed.rows if row["gpus"] < expected)


@pytest.mark.slow
def test_max_scale_finds_the_boundary_and_the_first_size_that_does_not_fit():
    rng = random.Random(7)
    layer = random_chain(rng, 1).layers[0]

    def graph_of(size: int):
        from solver.graph import graph_from_dict

        layers = [{**_layer_dict(layer), "name": f"l{i}"} for i in range(size)]
        return graph_from_dict(
            {"format": "layer-graph", "version": 1, "model": "m", "layers": layers}
        )

    cluster = Cluster(num_gpus=2, gpu_memory_bytes=2_000_000)
    training = TrainingConfig(global_batch=4)
    sizes = list(range(1, 41))
    result = max_scale(graph_of, sizes, cluster, training, scale="layers")
    fitting = []
    for size in sizes:
        try:
            plan(graph_of(size), cluster, training)
            fitting.append(size)
        except PlannerError:
            pass
    assert result.size == max(fitting) and result.too_big == result.size + 1
    assert result.plan.peak_bytes <= 2_000_000 and "nothing fits" in result.too_big_detail
    assert len(result.rows) < len(sizes) // 2  # galloping + bisection, not a scan
    low = max_scale(graph_of, sizes, cluster, training, start=39)
    assert (low.size, low.too_big) == (result.size, result.too_big)


def _layer_dict(layer) -> dict:
    keys = ("params", "tp_params", "activation_bytes", "tp_activation_bytes", "output_bytes")
    keys += ("fwd_flops", "tp_comm_bytes", "transient_bytes")
    return {key: getattr(layer, key) for key in keys}


def test_csv_round_trips_every_kind_of_row(gpt_graph, tmp_path):
    training = TrainingConfig(global_batch=64, pp=2)
    rows = sweep(gpt_graph, [3, 1, 8], [16 * GIB, 40 * GIB], training, TEMPLATE, workers=1)
    rows += sweep(gpt_graph, [1], [16 * GIB], TrainingConfig(global_batch=64), TEMPLATE, workers=1)
    assert {row["status"] for row in rows} == {"ERROR", "INFEASIBLE", "OPTIMAL"}
    writer = CsvRows(tmp_path / "sweep.csv")
    for row in reversed(rows):  # completion order
        writer.append(row)
    writer.finish(rows)
    assert read_rows(tmp_path / "sweep.csv") == rows


def test_an_interrupted_sweep_keeps_the_rows_written(gpt_graph, tmp_path):
    writer = CsvRows(tmp_path / "sweep.csv")

    def on_row(row):
        writer.append(row)
        if writer.count == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep(gpt_graph, [1, 2, 4, 8], [40 * GIB], TrainingConfig(global_batch=64), TEMPLATE,
              workers=1, on_row=on_row)  # fmt: skip
    writer.close()
    assert [row["gpus"] for row in read_rows(tmp_path / "sweep.csv")] == [1, 2]


def test_cli_interrupted_keeps_rows_and_returns_130(run_cli, tmp_path, monkeypatch):
    append = CsvRows.append

    def interrupted(self, row):
        append(self, row)
        if self.count == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(CsvRows, "append", interrupted)
    out = tmp_path / "sweep.csv"
    code, _, err = run_cli(
        sweep_main, GPT_1_3B, "--gpus", "1,2,4,8", "--global-batch", "64", "--out", str(out),
        "--workers", "1", "--quiet",
    )  # fmt: skip
    assert code == 130 and "2 rows kept" in err
    assert len(read_rows(out)) == 2


@pytest.mark.slow
def test_cli_writes_csv_in_point_order_and_prints_a_table(run_cli, tmp_path):
    out = tmp_path / "sweep.csv"
    code, text, err = run_cli(
        sweep_main, GPT_1_3B, "--gpus", "8,2,4", "--gpu-memory", "16GiB,40GiB", "--global-batch",
        "64", "--out", str(out), "--workers", "2", "--zero", "auto",
    )  # fmt: skip
    assert code == 0, err
    rows = read_rows(out)
    assert [(r["gpus"], r["gpu_memory_bytes"] // GIB) for r in rows] == [
        (8, 16), (8, 40), (2, 16), (2, 40), (4, 16), (4, 40),
    ]  # fmt: skip
    # usable: the memory after the CLI's default reserve (1 GiB + 5%)
    assert text.splitlines()[0].split()[:4] == ["gpus", "memory", "usable", "status"]
    assert len(text.splitlines()) == 7 and "OPTIMAL" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "8,,16"], "empty item"),
        (["--gpus", "x"], "positive integer"),
        (["--gpus", "0"], "must be >= 1"),
        (["--gpus", ","], "empty item"),
        (["--gpus", "8", "--gpu-memory", "40GiB,,80GiB"], "comma-separated sizes"),
        (["--gpus", "8", "--gpu-memory", "lots"], "cannot read"),
        (["--gpus", "8", "--out", "/no/such/folder/s.csv"], "does not exist"),
        (["--gpus", "8", "--plot", "/no/such/folder/s.png"], "does not exist"),
        (["--gpus", "8", "--out", GPT_1_3B], "input file"),
        (["--gpus", "auto"], "--find min-gpus"),
        (["--gpus", "8", "--model", "gpt-tiny"], "--find max-scale"),
        (["--gpus", "8", "--json", "x.json"], "--json goes with --find"),
        (["--gpus", "8", "--find", "min-gpus", "--gpu-memory", "40GiB,80GiB"], "one --gpu"),
        (["--gpus", "3", "--pp", "2"], "no point can be solved"),
    ],
)
def test_cli_bad_input_is_one_line_with_exit_2(run_cli, args, message):
    before = Path(GPT_1_3B).read_bytes()
    code, text, err = run_cli(sweep_main, GPT_1_3B, "--global-batch", "64", "--quiet", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert text == "" and Path(GPT_1_3B).read_bytes() == before


def test_cli_every_point_an_error_prints_no_table_and_writes_nothing(run_cli, tmp_path):
    """Bad input at every point: exit 2 and the one error line; no table on stdout, no CSV (an
    existing one stays as it was), no plot, nothing left beside them."""
    out, plot = tmp_path / "s.csv", tmp_path / "s.png"
    out.write_text("kept\n")
    code, text, err = run_cli(
        sweep_main, GPT_1_3B, "--gpus", "3,5", "--pp", "2", "--global-batch", "64",
        "--out", str(out), "--plot", str(plot), "--workers", "1",
    )  # fmt: skip
    assert code == 2 and text == "" and err.count("\n") == 1
    assert err.startswith("error: no point can be solved; first: pinned pp(2) = 2 does not divide")
    assert out.read_text() == "kept\n" and sorted(p.name for p in tmp_path.iterdir()) == ["s.csv"]


def test_cli_some_error_points_still_exit_0(run_cli, tmp_path):
    out = tmp_path / "s.csv"
    code, _, err = run_cli(
        sweep_main, GPT_1_3B, "--gpus", "3,8", "--pp", "2", "--global-batch", "64", "--quiet",
        "--out", str(out), "--workers", "1",
    )  # fmt: skip
    assert code == 0, err
    assert [row["status"] for row in read_rows(out)] == ["ERROR", "OPTIMAL"]


def test_sweep_points_reject_empty_and_non_integer_lists():
    with pytest.raises(InputError, match="empty"):
        sweep_points([], [1])
    with pytest.raises(InputError, match="positive integers"):
        sweep_points([8, 0], [1])
    with pytest.raises(InputError, match="positive integers"):
        sweep_points([8], [1.5])
    assert sweep_points([8, 8, 4], [2, 1, 2]) == [(8, 2), (8, 1), (4, 2), (4, 1)]


@pytest.mark.slow
def test_cli_min_gpus_prints_and_writes_the_plan(run_cli, tmp_path):
    out = tmp_path / "plan.json"
    code, text, err = run_cli(
        sweep_main, GPT_1_3B, "--find", "min-gpus", "--gpus", "auto", "--gpu-memory", "12GiB",
        "--global-batch", "64", "--json", str(out), "--workers", "1",
    )  # fmt: skip
    assert code == 0, err
    # 3 with the default search (ZeRO, recompute, micro-batch 1-4); 4 with the defaults
    # before issue 29 (--zero 0 --recompute none --micro-batch 1,2,4)
    assert text.startswith("smallest GPU count that fits 12.00 GiB per GPU: 3 ")
    assert "Plan for gpt-1.3b" in text
    document = json.loads(out.read_text())
    assert document["cluster"]["num_gpus"] == 3 and document["peak_bytes"] <= 12 * GIB
    code, text, err = run_cli(
        sweep_main, GPT_1_3B, "--find", "min-gpus", "--gpus", "1,2", "--gpu-memory", "12GiB",
        "--global-batch", "64", "--workers", "1",
    )  # fmt: skip
    assert code == 3 and "no GPU count fits" in err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (profiling)")
def test_cli_max_scale_regenerates_a_preset(run_cli, tmp_path):
    code, text, err = run_cli(
        sweep_main, "--find", "max-scale", "--model", "gpt-tiny", "--scale", "layers", "--range",
        "1:6", "--gpus", "2", "--gpu-memory", "1MiB", "--global-batch", "4", "--reserve", "0",
    )  # fmt: skip
    assert code == 0, err
    assert "largest gpt-tiny that fits on 2 GPUs x 1.00 MiB: layers=6" in text
    assert "the top of the range (6) fits" in text


@pytest.mark.slow
def test_cli_plot_draws_the_sweep(run_cli, tmp_path):
    picture = tmp_path / "sweep.png"
    code, _, err = run_cli(
        sweep_main, GPT_1_3B, "--gpus", "1,4,16", "--gpu-memory", "16GiB,40GiB", "--global-batch",
        "64", "--plot", str(picture), "--workers", "1", "--quiet",
    )  # fmt: skip
    assert code == 0, err
    assert picture.read_bytes()[:4] == b"\x89PNG"
