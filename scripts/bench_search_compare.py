"""Search speed before and after a change: bench_search's points, timed on two checkouts.

Each point (an exact chain solve or a full hybrid search, as ``scripts/bench_search.py`` times
it) runs in a fresh interpreter per checkout, the two checkouts alternating, ``--repeats``
times; the table gives each side's median CPU seconds (``time.process_time``, every thread of
the process: less sensitive than wall time to other jobs on a shared machine) and the ratio
after / before. Alternating in fresh processes keeps a busy machine's load on both sides alike
(a whole bench_search run on one side, then on the other, saw the load change between them).
A search point runs once untimed first: the layer-graph schema's compile (fastjsonschema, once
per process, growing with the schema's fields) and first imports are not the search.

    python scripts/bench_search_compare.py --before /path/to/old/checkout [--after .]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import harness

POINTS = [
    ("chain", "gpt", 2000, 8),
    ("chain", "random", 2000, 32),
    ("chain", "gpt", 2000, 128),
    ("chain", "random", 400, 128),
    ("search", "gpt", 96, 64),
    ("search", "gpt", 96, 4096),
    ("search", "gpt", 1000, 256),
]
"""(kind, graph, layers, stages or GPUs): bench_search's chain and search rows."""

POINT_CODE = r"""
import sys, time
sys.path[:0] = [sys.argv[1] + "/scripts", sys.argv[1]]
import bench_search as b
from solver.backends.chain import solve_chain
from solver.backends.problem import StageProblem
kind, graph, layers, size = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
if kind == "chain":
    chain = b.random_chain(layers, 1) if graph == "random" else b.gpt_chain(layers)
    costs = b.config_costs(chain, size)
    solve_chain(StageProblem(costs=costs))  # the cost tables' caches filled, as in bench_search
    run, repeats = lambda: solve_chain(StageProblem(costs=costs)), 5
else:
    b.search_row(layers, size)  # once untimed: the schema's compile and first imports
    run, repeats = lambda: b.search_row(layers, size), 3
seconds = []
for _ in range(repeats):
    started = time.process_time()
    run()
    seconds.append(time.process_time() - started)
print(min(seconds))
"""
"""Times one point in the checkout given as argv[1]; prints its least CPU seconds (all threads)
over a few calls in one interpreter: the call least disturbed by other work on the machine."""


def point_seconds(checkout: Path, point: tuple) -> float:
    """CPU seconds of one point in a fresh interpreter with ``checkout`` first on the path."""
    argv = [sys.executable, "-c", POINT_CODE, str(checkout), *map(str, point)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=checkout)
    return float(done.stdout.split()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--before", type=Path, required=True, help="the old checkout")
    parser.add_argument("--after", type=Path, default=Path.cwd(), help="the new checkout")
    parser.add_argument("--repeats", type=int, default=3, help="runs per point and side")
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    rows = []
    for point in POINTS:
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.repeats):
            for side in ("before", "after"):
                times[side].append(point_seconds(getattr(args, side).resolve(), point))
        before, after = (statistics.median(times[side]) for side in ("before", "after"))
        least_before, least_after = (min(times[side]) for side in ("before", "after"))
        rows.append(
            {
                "kind": point[0],
                "graph": point[1],
                "layers": point[2],
                "stages_or_gpus": point[3],
                "before_cpu_ms": round(before * 1e3, 2),
                "after_cpu_ms": round(after * 1e3, 2),
                "ratio": round(after / before, 3),
                "before_min_ms": round(least_before * 1e3, 2),
                "after_min_ms": round(least_after * 1e3, 2),
                "min_ratio": round(least_after / least_before, 3),
            }
        )
        print(rows[-1], flush=True)
    ratios = [row["ratio"] for row in rows]
    least = [row["min_ratio"] for row in rows]
    lines = [
        "# Search speed before and after",
        "",
        f"Command: {run.command_text}  ",
        f"Machine: {harness.architecture()}, Python {harness.python_version()}, run "
        f"{harness.today()}, load averages {harness.load_averages()} at the end; before = "
        f"{args.before} ({harness.git_commit(args.before)}), after = {args.after} "
        f"({harness.git_commit(args.after)}); {args.repeats} alternating fresh-process runs "
        "per side, each the least CPU time of a few calls (5 chain solves, 3 searches); "
        "`ratio` of their medians, `min_ratio` of their minima (the runs least disturbed by "
        "other work on a shared machine).",
        "",
        f"**Median ratio after / before {statistics.median(ratios):.3f}, max {max(ratios):.3f}; "
        f"of the minima: median {statistics.median(least):.3f}, max {max(least):.3f}.**",
        "",
        *harness.markdown_table(rows, list(rows[0])),
    ]
    harness.write_report(args.out, "bench_search_compare.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
