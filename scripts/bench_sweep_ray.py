"""Ray sweep benchmark: GPT-3 175B over 64..4096 GPUs at 80 GiB with ``--executor ray`` and
``--executor local``, wall times side by side, rows compared.

    python scripts/bench_sweep_ray.py [--workers 2] [--repeats 3] [--out benchmarks]

Solves examples/gpt3-175b.json at the 7 powers of two from 64 to 4096 GPUs x 80 GiB with default
plan options and global batch 1536 (as benchmarks/bench_sweep.md) through
``solver.sweep.sweep``, four ways, each ``--repeats`` times (median wall time):

- ``executor="ray"`` with no Ray instance running: what ``python -m solver.sweep ...
  --executor ray`` pays, starting a local instance with ``--workers`` CPUs and shutting it down;
- ``executor="ray"`` on an instance already running (``ray.init(num_cpus=workers)`` first): what
  a sweep on an existing cluster pays, the tasks alone;
- ``executor="local"`` on ``--workers`` processes, and in-process (workers=1).

Every run's rows must equal the in-process rows but for ``wall_s`` (asserted). Writes
benchmarks/bench_sweep_ray.md (command, machine, the timings, the rows) and
benchmarks/bench_sweep_ray.csv (one line per way: median wall, runs, points).
:func:`headline_rows` reads that CSV back for benchmarks/bench_search.md (issue 17, point 6).
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

import harness
from harness import GIB, ROOT, markdown_table

from solver import Cluster, TrainingConfig, load_graph
from solver.sweep import sweep

GPU_COUNTS = (64, 128, 256, 512, 1024, 2048, 4096)
MEMORY = (80 * GIB,)
GLOBAL_BATCH = 1536
NAME = "bench_sweep_ray"
CLI = (
    "python -m solver.sweep examples/gpt3-175b.json --gpus 64,128,256,512,1024,2048,4096 "
    "--gpu-memory 80GiB --global-batch 1536 --executor ray"
)
"""The CLI form of the benchmarked sweep (the first way)."""


def _timeless(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


def timed(graph, repeats: int, **how) -> tuple[list[dict], list[float]]:
    """The rows of the sweep and the wall time (s) of each of ``repeats`` runs."""
    training = TrainingConfig(global_batch=GLOBAL_BATCH)
    cluster = Cluster(num_gpus=1)
    rows, walls = harness.repeat(
        lambda: sweep(graph, GPU_COUNTS, MEMORY, training, cluster, **how), repeats
    )
    return rows or [], walls


def measure(workers: int, repeats: int) -> tuple[list[dict], list[dict]]:
    """(timing rows, the sweep's rows); asserts that every way gives the in-process rows."""
    import ray

    graph = load_graph(ROOT / "examples" / "gpt3-175b.json")
    reference, serial = timed(graph, repeats, workers=1)
    ways = [("in-process", "local, in-process (workers=1)", "local", 1, serial)]
    rows, walls = timed(graph, repeats, workers=workers)
    assert _timeless(rows) == _timeless(reference)
    ways.append(("local", f"local, {workers} processes", "local", workers, walls))
    rows, walls = timed(graph, repeats, workers=workers, executor="ray")
    assert _timeless(rows) == _timeless(reference)
    started = f"ray, local instance of {workers} CPUs started and shut down"
    ways.append(("ray-started", started, "ray", workers, walls))
    ray.init(num_cpus=workers, include_dashboard=False, logging_level=logging.WARNING)
    try:
        timed(graph, 1, executor="ray")  # warm: the workers import the solver once
        rows, walls = timed(graph, repeats, executor="ray")
    finally:
        ray.shutdown()
    assert _timeless(rows) == _timeless(reference)
    running = f"ray, tasks on a running instance of {workers} CPUs (after a warm-up sweep)"
    ways.append(("ray-running", running, "ray", workers, walls))
    timing = [
        {
            "key": key,
            "way": way,
            "executor": executor,
            "cpus": cpus,
            "median_wall_s": round(statistics.median(walls), 2),
            "walls_s": " ".join(f"{wall:.2f}" for wall in walls),
            "points": len(reference),
            "rows_equal": True,
        }
        for key, way, executor, cpus, walls in ways
    ]
    return timing, reference


def headline_rows(out: Path = ROOT / "benchmarks") -> list[dict]:
    """Issue 17's point 6 row for benchmarks/bench_search.md, from the last run's CSV."""
    timing = {row["key"]: row for row in harness.read_csv(Path(out) / f"{NAME}.csv")}
    started, running, local = timing["ray-started"], timing["ray-running"], timing["local"]
    return [
        {
            "point": "6. sweeps on Ray (GPT-3 175B, 64-4096 GPUs, 80 GiB)",
            "command": f"python scripts/bench_sweep_ray.py; {CLI}",
            "result": (
                f"{started['points']} points: ray {started['median_wall_s']} s with a local "
                f"instance started and shut down ({running['median_wall_s']} s on a running "
                f"one), local {local['median_wall_s']} s on {local['cpus']} processes; rows "
                "equal (but wall_s)"
            ),
        }
    ]


def display(row: dict) -> dict:
    shown = {
        "gpus": row["gpus"],
        "status": row["status"],
        "config": row["config"] or "-",
        "peak_gib": None if row["peak_bytes"] is None else row["peak_bytes"] / GIB,
        "throughput": row["throughput"],
        "wall_s": row["wall_s"],
    }
    return {key: "-" if value is None else value for key, value in shown.items()}


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--workers", type=int, default=2, help="processes / Ray CPUs")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    timing, rows = measure(args.workers, args.repeats)
    load = max(run.load_before, harness.load_average())
    for line in timing:
        print(f"{line['way']}: {line['median_wall_s']} s ({line['walls_s']})")
    harness.write_csv(args.out / f"{NAME}.csv", timing, list(timing[0]))
    import ray

    lines = [
        "# Ray sweep benchmark",
        "",
        f"Command: {run.command_text}  ",
        f"Machine: {harness.machine()}, {harness.cores()} cores ({harness.usable_cores()} usable "
        f"by this run), Python {harness.python_version()}, Ray {ray.__version__}, run "
        f"{harness.today()}; 1-minute load average {load:.1f} around the runs (the machine was "
        "shared with other jobs, which slow every way down)",
        "",
        f"examples/gpt3-175b.json at {len(GPU_COUNTS)} GPU counts "
        f"({', '.join(map(str, GPU_COUNTS))}) x 80 GiB = {len(rows)} points; global batch "
        f"{GLOBAL_BATCH}, default options. The same "
        f"sweep from the shell: `{CLI}`. Median of {args.repeats} runs each; every run's rows "
        "equal the in-process rows in every column but wall_s (asserted).",
        "",
        *markdown_table(timing, ["way", "executor", "cpus", "median_wall_s", "walls_s"], ".2f"),
        "",
        "A local Ray instance takes seconds to start (processes for its control store, raylet "
        "and workers, each importing the solver), more than these 7 points take to solve; on a "
        "running instance or cluster a sweep pays for its tasks alone. Ray is for studies "
        "larger than one machine; on one machine the local executor is the faster choice.",
        "",
        *markdown_table([display(row) for row in rows], list(display(rows[0])), ".3f"),
        "",
    ]
    harness.write_report(args.out, f"{NAME}.md", lines, note=f" and {NAME}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
