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

import statistics

import harness
from harness import GIB, ROOT, markdown_table

from solver import Cluster, TrainingConfig, load_graph
from solver.sweep import CsvRows, sweep

GPU_COUNTS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
MEMORY = (40 * GIB, 80 * GIB)
GLOBAL_BATCH = 1536


def timed_sweep(graph, workers: int, repeats: int) -> tuple[list[dict], list[float]]:
    training = TrainingConfig(global_batch=GLOBAL_BATCH)
    cluster = Cluster(num_gpus=1)
    rows, walls = harness.repeat(
        lambda: sweep(graph, GPU_COUNTS, MEMORY, training, cluster, workers=workers), repeats
    )
    return rows or [], walls


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


COLUMNS = [
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


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--workers", type=int, default=2, help="processes of the parallel run")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    graph = load_graph(ROOT / "examples" / "gpt3-175b.json")
    points = len(GPU_COUNTS) * len(MEMORY)
    serial_rows, serial_walls = timed_sweep(graph, 1, args.repeats)
    rows, walls = timed_sweep(graph, args.workers, args.repeats)
    strip = [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]
    assert strip == [{k: v for k, v in r.items() if k != "wall_s"} for r in serial_rows]
    load = max(run.load_before, harness.load_average())
    serial, parallel = statistics.median(serial_walls), statistics.median(walls)
    print(f"{points} points: in-process {serial:.1f} s ({points / serial:.2f} points/s)")
    rate = points / parallel
    print(f"{points} points: {args.workers} workers {parallel:.1f} s ({rate:.2f} points/s)")
    args.out.mkdir(parents=True, exist_ok=True)
    CsvRows(args.out / "bench_sweep.csv").finish(rows)
    lines = [
        "# Sweep benchmark",
        "",
        f"Command: {run.command_text}  ",
        f"Machine: {harness.machine()}, {harness.cores()} cores ({harness.usable_cores()} usable "
        f"by this run), Python {harness.python_version()}, run {harness.today()}; 1-minute load "
        f"average {load:.1f} around the runs (other processes on the machine slow them down)",
        "",
        *summary_lines(graph, rows, args, serial, parallel),
        "",
        *markdown_table([display(row) for row in rows], COLUMNS, ".3f"),
        "",
    ]
    harness.write_report(args.out, "bench_sweep.md", lines, note=" and bench_sweep.csv")
    return 0


def summary_lines(graph, rows: list[dict], args, serial: float, parallel: float) -> list[str]:
    """The sweep's description, the timings of both runs and the points' outcome."""
    points = len(GPU_COUNTS) * len(MEMORY)
    optimal = sum(r["status"] == "OPTIMAL" for r in rows)
    infeasible = sum(r["status"] == "INFEASIBLE" for r in rows)
    fitting = {
        m: [r["gpus"] for r in rows if r["fits"] and r["gpu_memory_bytes"] == m] for m in MEMORY
    }
    smallest = ", ".join(f"{m // GIB} GiB: {min(g, default='none')}" for m, g in fitting.items())
    return [
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
        f"Target: the whole sweep under 60 s on 2 cores. Points: {optimal} OPTIMAL, "
        f"{infeasible} INFEASIBLE; smallest count that fits: {smallest}. wall_s below "
        "is each point's own solve time in the parallel run; vs_even_pct = plan peak vs the "
        "even split of the same config (negative: the plan needs less).",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
