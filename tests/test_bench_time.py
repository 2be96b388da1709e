"""The pure parts of scripts/bench_time.py: the link fit, the error statistics, the ranking
agreement and the headline row, on hand-made numbers (no timing here)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_time  # noqa: E402
from bench_time import error_pct, error_stats, fit_link, ranking_agreement  # noqa: E402


def test_fit_link_recovers_latency_and_bandwidth():
    sizes = [16384, 65536, 131072, 524288]
    # 50 us + bytes / 2 GB/s
    seconds = [50e-6 + size / 2e9 for size in sizes]
    latency_us, gb_per_s = fit_link(sizes, seconds)
    assert latency_us == pytest.approx(50.0)
    assert gb_per_s == pytest.approx(2.0)


def test_fit_link_is_theil_sen_and_clamps_a_negative_latency():
    # points (0 B, 1 s), (1 B, 2 s), (2 B, 4 s): pairwise slopes 1, 1.5, 3 -> 1.5 s/B;
    # intercepts 1, 0.5, 1 -> 1 s
    latency_us, gb_per_s = fit_link([0, 1, 2], [1.0, 2.0, 4.0])
    assert latency_us == pytest.approx(1e6)
    assert gb_per_s == pytest.approx(1 / 1.5 / 1e9)
    latency_us, _ = fit_link([1000, 2000], [0.5e-6, 1.5e-6])  # intercept -0.5 us
    assert latency_us == 0.0
    with pytest.raises(ValueError):
        fit_link([1000, 1000], [1e-6, 2e-6])
    with pytest.raises(ValueError):
        fit_link([1000, 2000], [2e-6, 1e-6])


def test_fit_link_ignores_one_slow_size():
    sizes = [16384, 65536, 131072, 262144, 524288]
    seconds = [80e-6 + size / 4e9 for size in sizes]
    seconds[2] *= 2  # a rank waited for a CPU at 128 KiB
    latency_us, gb_per_s = fit_link(sizes, seconds)
    assert latency_us == pytest.approx(80.0)
    assert gb_per_s == pytest.approx(4.0)


def test_error_statistics():
    assert error_pct(110.0, 100.0) == pytest.approx(10.0)
    assert error_pct(80.0, 100.0) == pytest.approx(-20.0)
    assert error_stats([-20.0, 5.0, 10.0, -1.0]) == (pytest.approx(7.5), 20.0)


def test_ranking_agreement_skips_pairs_inside_the_spreads():
    predicted = [100.0, 200.0, 150.0, 300.0]
    measured = [110.0, 190.0, 200.0, 290.0]
    spreads = [5.0, 5.0, 5.0, 5.0]
    # pairs: (0,1) +, (0,2) +, (0,3) +, (1,2) gap 10 == 5 + 5: tie, skipped,
    # (1,3) +, (2,3) +  -> 5 considered, all agree
    assert ranking_agreement(predicted, measured, spreads) == (5, 5)
    predicted[2] = 90.0  # now below layout 0's prediction, measured above it: (0,2) disagrees
    assert ranking_agreement(predicted, measured, spreads) == (4, 5)
    spreads = [100.0] * 4  # everything a tie
    assert ranking_agreement(predicted, measured, spreads) == (0, 0)


def test_headline_row_from_a_csv(tmp_path):
    rows = [
        # layout, even, predicted, measured, spread -> error %
        ("a", True, 90.0, 100.0, 1.0),  # -10
        ("b", False, 210.0, 200.0, 1.0),  # +5
        ("c", False, 300.0, 300.0, 1.0),  # 0
    ]
    with open(tmp_path / "bench_time.csv", "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=[*bench_time.COLUMNS, "command"])
        writer.writeheader()
        for name, even, predicted, measured, spread in rows:
            writer.writerow(
                {c: "" for c in bench_time.COLUMNS}
                | {
                    "layout": name,
                    "even": even,
                    "predicted_ms": predicted,
                    "measured_ms": measured,
                    "spread_ms": spread,
                    "error_pct": round(error_pct(predicted, measured), 1),
                    "command": "python scripts/bench_time.py",
                }
            )
    (row,) = bench_time.headline_rows(tmp_path)
    assert row["command"] == "python scripts/bench_time.py"
    assert "median |error| 5.0%, max 10.0% (3 layouts)" in row["result"]
    assert "even 10.0% (1), uneven 2.5% (2)" in row["result"]
    assert "ranking 3/3 (100%)" in row["result"]
    assert bench_time.headline_rows(tmp_path / "absent") == []
