"""Sweep benchmark: GPT-3 175B over 64..4096 GPUs at 40 and 80 GiB, timed end to end.

    python scripts/bench_sweep.py [--workers 2] [--repeats 1] [--out benchmarks]

Solves examples/gpt3-175b.json (98 layers) at 13 GPU counts (powers of two from 64 to 4096 and
the 1.5x counts between them) x 2 memory sizes = 26 points with default plan options (global
batch 1536, the GPT-3 paper's 3.2M tokens of 2048; ZeRO 0, micro-batch 1/2/4, max slowdown
1.25) through ``solver.sweep.sweep``, once in-process (workers=1) and once on ``--workers``
processes. Writes benchmarks/bench_sweep.md (command, machine, wall times, points/s, the rows)
and benchmarks/bench_sweep.csv (the rows, as ``python -m solver.sweep --out`` writes them).
Target: the whole sweep in under 60 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from tables import markdown_table, write_report  # noqa: E402

from solver import Cluster, TrainingConfig, load_graph  # noqa: E402
from solver.sweep import CsvRows, sweep  # noqa: E402

GIB = 2**30
GPU_COUNTS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
MEMORY = (40 * GIB, 80 * GIB)
GLOBAL_BATCH = 1536


def timed_sweep(graph, workers: int, repeats: int) -> tuple[list[dict], list[float]]:
    training = TrainingConfig(global_batch=GLOBAL_BATCH)
    walls, rows = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        rows = sweep(graph, GPU_COUNTS, MEMORY, training, Cluster(num_gpus=1), workers=workers)
        walls.append(time.perf_counter() - start)
    return rows, walls


def display(row: dict) -> dict:
    """A row with sizes in GiB and the saving against the even split, for the Markdown table."""

    def gib(key: str) -> float | None:
        return None if row[key] is None else row[key] / GIB

    shown = {
        "gpus": row["gpus"],
        "memory_gib": row["gpu_memory_bytes"] // GIB,
        "status": row["status"],
        "config": row["config"] or "-",
        "peak_gib": gib("peak_bytes"),
        "throughput": row["throughput"],
        "even_peak_gib": gib("even_peak_bytes"),
        "params_peak_gib": gib("parameters_peak_bytes"),
        "wall_s": row["wall_s"],
    }
    if row["fits"] and row["even_peak_bytes"]:
        shown["vs_even_pct"] = (
            100 * (row["peak_bytes"] - row["even_peak_bytes"]) / (row["even_peak_bytes"])
        )
    return {key: "-" if value is None else value for key, value in shown.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("--workers", type=int, default=2, help="processes of the parallel run")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    graph = load_graph(ROOT / "examples" / "gpt3-175b.json")
    points = len(GPU_COUNTS) * len(MEMORY)
    load_before = os.getloadavg()[0]
    serial_rows, serial_walls = timed_sweep(graph, 1, args.repeats)
    rows, walls = timed_sweep(graph, args.workers, args.repeats)
    strip = [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]
    assert strip == [{k: v for k, v in r.items() if k != "wall_s"} for r in serial_rows]
    load = max(load_before, os.getloadavg()[0])
    serial, parallel = statistics.median(serial_walls), statistics.median(walls)
    print(f"{points} points: in-process {serial:.1f} s ({points / serial:.2f} points/s)")
    rate = points / parallel
    print(f"{points} points: {args.workers} workers {parallel:.1f} s ({rate:.2f} points/s)")
    args.out.mkdir(parents=True, exist_ok=True)
    writer = CsvRows(args.out / "bench_sweep.csv")
    writer.finish(rows)
    counted = {status: sum(r["status"] == status for r in rows) for status in ("OPTIMAL",)}
    counted["INFEASIBLE"] = sum(r["status"] == "INFEASIBLE" for r in rows)
    fitting = {
        m: [r["gpus"] for r in rows if r["fits"] and r["gpu_memory_bytes"] == m] for m in MEMORY
    }
    smallest = ", ".join(f"{m // GIB} GiB: {min(g, default='none')}" for m, g in fitting.items())
    command = "python scripts/bench_sweep.py" + (
        f" --workers {args.workers}" if args.workers != 2 else ""
    )
    columns = [
        "gpus",
        "memory_gib",
        "status",
        "config",
        "peak_gib",
        "throughput",
        "even_peak_gib",
        "params_peak_gib",
        "vs_even_pct",
        "wall_s",
    ]
    lines = [
        "# Sweep benchmark",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores ("
        f"{len(os.sched_getaffinity(0))} usable by this run), Python "
        f"{platform.python_version()}, run {time.strftime('%Y-%m-%d')}; 1-minute load average "
        f"{load:.1f} around the runs (other processes on the machine slow them down)",
        "",
        f"examples/gpt3-175b.json ({graph.num_layers} layers) at {len(GPU_COUNTS)} GPU counts "
        f"({', '.join(map(str, GPU_COUNTS))}) x 40 and 80 GiB = {points} points; global batch "
        f"{GLOBAL_BATCH}, default options (ZeRO 0, micro-batch 1/2/4, max slowdown 1.25, 8 GPUs "
        "per node). Median of "
        f"{args.repeats} run(s); both runs give identical rows.",
        "",
        "| run | wall (s) | points/s |",
        "|---|---|---|",
        f"| in-process (workers=1, one core) | {serial:.1f} | {points / serial:.2f} |",
        f"| `sweep(..., workers={args.workers})` (processes) | {parallel:.1f} | "
        f"{points / parallel:.2f} |",
        "",
        f"Target: the whole sweep under 60 s on 2 cores. Points: {counted['OPTIMAL']} OPTIMAL, "
        f"{counted['INFEASIBLE']} INFEASIBLE; smallest count that fits: {smallest}. wall_s below "
        "is each point's own solve time in the parallel run; vs_even_pct = plan peak vs the "
        "even split of the same config (negative: the plan needs less).",
        "",
        *markdown_table([display(row) for row in rows], columns, ".3f"),
        "",
    ]
    write_report(args.out, "bench_sweep.md", lines, note=" and bench_sweep.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
