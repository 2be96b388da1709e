"""Every script under scripts/ imports and answers ``--help``, and the harness writes its tables
as the committed ones in benchmarks/ read: a broken script fails here, not on its next run."""

from __future__ import annotations

import csv
import importlib
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
NAMES = sorted(path.stem for path in SCRIPTS.glob("*.py"))
LIBRARIES = {"harness", "accuracy_schedules", "sleeping_pipeline"}
"""Modules other scripts import (no command of their own)."""


@pytest.fixture()
def scripts_on_path(monkeypatch):
    """scripts/ first on sys.path, as when a script runs (``python scripts/x.py``)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))


def test_every_script_is_listed():
    assert "harness" in NAMES and "bench_solver" in NAMES and len(NAMES) >= 25


@pytest.mark.parametrize("name", NAMES)
def test_script_imports_and_answers_help(name, scripts_on_path, capsys):
    module = importlib.import_module(name)
    if name in LIBRARIES:
        return
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out


def test_no_module_of_the_api_imports_a_script():
    root = SCRIPTS.parent
    for package in ("solver", "profiling", "models"):
        for path in (root / package).rglob("*.py"):
            text = path.read_text()
            for name in NAMES:
                assert f"import {name}\n" not in text and f"from {name} import" not in text, (
                    f"{path} imports scripts/{name}.py"
                )


def test_harness_writes_a_tiny_table(scripts_on_path, tmp_path, capsys):
    import harness

    rows = [{"case": "a", "wall_s": 0.12345, "status": "OPTIMAL"}, {"case": "b", "wall_s": 2.0}]
    columns = ["case", "wall_s", "status"]
    assert harness.markdown_table(rows, columns, ".3f") == [
        "| case | wall_s | status |",
        "|---|---|---|",
        "| a | 0.123 | OPTIMAL |",
        "| b | 2.000 |  |",
    ]
    assert harness.markdown_table(rows[:1], columns)[2] == "| a | 0.12345 | OPTIMAL |"
    path = harness.write_report(tmp_path / "new", "t.md", ["# T", "", "text"], note=" (note)")
    assert path.read_text() == "# T\n\ntext"
    assert capsys.readouterr().out == f"wrote {path} (note)\n"
    path = harness.write_csv(tmp_path / "new" / "t.csv", rows, columns)
    assert path.read_bytes() == b"case,wall_s,status\r\na,0.12345,OPTIMAL\r\nb,2.0,\r\n"
    assert harness.read_csv(path)[1] == {"case": "b", "wall_s": "2.0", "status": ""}
    with pytest.raises(ValueError):
        harness.write_csv(tmp_path / "x.csv", [{"case": "a", "other": 1}], ["case"])
    harness.write_csv(
        tmp_path / "x.csv", [{"case": "a", "other": 1}], ["case"], extrasaction="ignore"
    )
    assert list(csv.reader(open(tmp_path / "x.csv"))) == [["case"], ["a"]]


def test_run_records_the_command_line_and_commit(scripts_on_path):
    import harness

    run = harness.Run.start(SCRIPTS / "bench_solver.py", ["--quick", "--out", "a dir"])
    assert run.command == "python scripts/bench_solver.py --quick --out 'a dir'"
    assert run.command_text.startswith(f"`{run.command}` (commit ")
    assert run.commit and run.elapsed_s >= 0
    args = harness.parser("Title line.\n\nMore.", quick="smoke").parse_args(["--quick"])
    assert args.quick and args.out == harness.BENCHMARKS


def test_stopwatch_and_repeat_measure_wall_and_cpu(scripts_on_path):
    import harness

    with harness.Stopwatch() as clock:
        sum(range(10_000))
    assert clock.wall_s >= 0 and clock.cpu_s >= 0
    assert clock.wall_s == clock.wall_s  # frozen once stopped
    calls = []
    result, walls = harness.repeat(lambda: calls.append(1) or len(calls), 3)
    assert result == 3 and len(walls) == 3 and all(w >= 0 for w in walls)


def test_run_process_measures_a_child(scripts_on_path):
    import harness

    done = harness.run_process([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"])
    assert (done.returncode, done.stdout) == (3, "out\n")
    assert done.wall_s > 0 and done.peak_rss_bytes > 0 and done.cpu_s >= 0


def test_bench_accuracy_only_filters_the_hf_layouts(scripts_on_path, capsys):
    """``--hf-only --only TEXT`` keeps the HF layouts whose label contains TEXT; a TEXT no label
    holds, or ``--only`` without ``--hf-only``, is refused before anything runs."""
    bench = importlib.import_module("bench_accuracy")
    t5 = bench.hf_layouts("t5")
    assert len(t5) == sum(layout[0] == "t5" for layout in bench.HF_LAYOUTS) == 4
    assert bench.hf_layouts("t5 pp3 gpipe") == [("t5", 3, [4, 3, 3], "gpipe", "fp32")]
    assert bench.hf_layouts() == bench.HF_LAYOUTS
    with pytest.raises(SystemExit, match="no HF layout"):
        bench.hf_layouts("t5 pp9")
    with pytest.raises(SystemExit) as refused:
        bench.main(["--only", "t5"])
    assert refused.value.code == 2 and "give it with --hf-only" in capsys.readouterr().err


@pytest.mark.slow
def test_search_compare_times_a_point_in_a_checkout(scripts_on_path):
    import bench_search_compare

    root = SCRIPTS.parent
    seconds = bench_search_compare.point_seconds(root, ("chain", "gpt", 24, 4))
    assert 0 < seconds < 60
