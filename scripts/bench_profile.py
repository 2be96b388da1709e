"""Profiling benchmark: wall time and peak RSS of fake-tensor profiles of big presets (no GPU).

    python scripts/bench_profile.py [--out benchmarks]

Every preset (and bundled hf: config) is profiled by ``python -m profiling.export PRESET`` in a
fresh process (so its peak resident memory is its own), then planned with ``python -m
solver.plan``. Targets: GPT-3 175B and Llama-2 70B shapes under 60 s and 4 GiB each on
2 cores.
Writes benchmarks/bench_profile.md and .csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tables import markdown_table, write_report  # scripts/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("gpt3-175b", "llama2-70b")
"""The presets with a target: under 60 s and 4 GiB each."""


def cases() -> list[tuple[str, list[str]]]:
    """Every zoo preset but the tiny ones (tests cover those), plus the bundled hf: configs."""
    import models
    from profiling.hf.models import bundled_configs

    zoo = [(name, []) for name in models.presets() if not name.endswith("-tiny")]
    return zoo + [(f"hf:{name}", []) for name in bundled_configs()]


def cluster_for(params: int) -> tuple[int, int]:
    """(GPUs, global batch) for planning: enough 80 GiB GPUs for 4x the 16 B/param states."""
    gpus = 8
    while gpus * 80 * 2**30 < 4 * 16 * params:
        gpus *= 2
    return gpus, 2 * gpus


def run_measured(command: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall seconds, peak RSS GiB of that child alone (os.wait4), result) of one command."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(command, child.returncode, out.read(), err.read())
    return wall, usage.ru_maxrss / 2**20, result  # ru_maxrss is in KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for preset, extra in cases():
            graph_path = Path(scratch) / f"{preset.replace(':', '_')}.json"
            wall, rss, result = run_measured(
                [
                    sys.executable,
                    "-m",
                    "profiling.export",
                    preset,
                    *extra,
                    "--no-progress",
                    "--out",
                    str(graph_path),
                ]
            )
            if result.returncode != 0:
                raise SystemExit(f"{preset}: export failed: {result.stderr.strip()}")
            graph = json.loads(graph_path.read_text())
            gpus, batch = cluster_for(sum(layer["params"] for layer in graph["layers"]))
            start = time.perf_counter()
            planned = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "solver.plan",
                    str(graph_path),
                    "--gpus",
                    str(gpus),
                    "--global-batch",
                    str(batch),
                    "--json",
                    str(graph_path.with_suffix(".plan.json")),
                    "--quiet",
                ],
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            plan_wall = time.perf_counter() - start
            plan = (
                json.loads(graph_path.with_suffix(".plan.json").read_text())
                if planned.returncode == 0
                else None
            )
            row = {
                "preset": preset + (" (target)" if preset in TARGETS else ""),
                "layers": len(graph["layers"]),
                "params_billions": sum(layer["params"] for layer in graph["layers"]) / 1e9,
                "seq": graph["meta"]["seq_len"],
                "profile_wall_s": round(wall, 2),
                "profile_peak_rss_gib": round(rss, 3),
                "plan_gpus": gpus,
                "plan_wall_s": round(plan_wall, 2),
                "plan": (
                    f"exit {planned.returncode}: {planned.stderr.strip()[:80]}"
                    if plan is None
                    else f"pp{plan['config']['pp']} tp{plan['config']['tp']} "
                    f"dp{plan['config']['dp']}, peak {plan['peak_bytes'] / 2**30:.1f} GiB"
                ),
            }
            rows.append(row)
            print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "bench_profile.csv", "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    columns = list(rows[0])
    lines = [
        "# Profiling benchmark",
        "",
        "Command: `python scripts/bench_profile.py`  ",
        f"Machine: {platform.machine()}, {platform.python_version()}, run "
        f"{time.strftime('%Y-%m-%d')}; fake tensors (--device meta), batch 1, bf16, no GPU. "
        "Peak RSS is the export process's own (os.wait4 ru_maxrss). Plans: default options, "
        "80 GiB GPUs; plan_wall_s includes the solver's start-up.",
        "",
        *markdown_table(rows, columns),
        "",
    ]
    write_report(args.out, "bench_profile.md", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
