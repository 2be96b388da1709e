"""Interleaved stages at scale: GPT-3 175B with pp 16 and v = 2, 3, 4 on 128 and 256 GPUs.

    python scripts/bench_interleaved_scale.py [--out benchmarks] [--before /work/main]
        [--graph FILE] [--time-limit 60] [--only SUBSTRING]

Each point is one ``python -m solver.plan`` command with the default flags (60 s limit, one
worker, the throughput constraint of 1.25 x the fastest plan), run as a subprocess of the checkout
named by ``--after`` (default: this one) and, with ``--before CHECKOUT``, of that checkout too (the
main branch before issue 17's point 5). Reported per run: wall time, CPU time of the subprocess,
the solver's status, gap and the chosen config's peak. The graph is the zoo's GPT-3 175B profile
(SDPA attention, ``python -m profiling.export gpt3-175b``, made once in a temporary folder unless
``--graph`` names it) and, for the rows marked "example", the bundled examples/gpt3-175b.json
(explicit attention). Writes benchmarks/bench_interleaved_scale.md and .csv.

``headline_rows()`` gives issue 17's point 5 for scripts/bench_search.py, from the CSV.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

import harness
from harness import GIB, ROOT, markdown_table

COMMON = "--gpu-memory 80GiB --global-batch 1536"
POINTS = (
    # graph ("zoo" profile or the bundled "example"), GPUs, extra flags
    ("zoo", 128, "--pp 16 --virtual-stages 2"),
    ("zoo", 128, "--pp 16 --virtual-stages 3"),
    ("zoo", 128, "--pp 16 --virtual-stages 4"),
    ("zoo", 256, "--pp 16 --virtual-stages 2"),
    ("zoo", 256, "--pp 16 --virtual-stages 3"),
    ("zoo", 256, "--pp 16 --virtual-stages 4"),
    ("zoo", 128, "--virtual-stages 1,2,4"),
    ("zoo", 256, "--virtual-stages 1,2,4"),
    ("zoo", 128, "--pp 16 --virtual-stages 2 --runtime torch"),
    ("example", 128, "--pp 16 --virtual-stages 2"),
    ("example", 128, "--pp 16 --virtual-stages 4 --zero 1"),
)
HEADLINE = ("zoo", 128, "--virtual-stages 1,2,4")
"""The row of point 5 in benchmarks/bench_search.md (the issue's own command)."""
COLUMNS = [
    "graph",
    "gpus",
    "flags",
    "code",
    "wall s",
    "cpu s",
    "status",
    "gap %",
    "peak GiB",
    "config",
]


def graph_path(kind: str, zoo_graph: str | None) -> str:
    return "examples/gpt3-175b.json" if kind == "example" else zoo_graph


def command(kind: str, gpus: int, flags: str, graph: str) -> str:
    return f"python -m solver.plan {graph} --gpus {gpus} {COMMON} {flags}"


def run_point(checkout: Path, kind: str, gpus: int, flags: str, graph: str, limit: float) -> dict:
    """One plan command in ``checkout`` (its code on PYTHONPATH), timed; its --json read back."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        argv = [sys.executable, "-m", "solver.plan", str(Path(graph).resolve())]
        argv += ["--gpus", str(gpus), *shlex.split(COMMON), *shlex.split(flags)]
        argv += ["--time-limit", str(limit), "--json", str(out), "--quiet"]
        env = os.environ | {"PYTHONPATH": str(checkout)}
        done = harness.run_process(argv, cwd=checkout, env=env)
        row = {"graph": kind, "gpus": gpus, "flags": flags, "wall s": round(done.wall_s, 1)}
        row["cpu s"] = round(done.cpu_s, 1)
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or ["?"])[-1]
            return row | {"status": f"exit {done.returncode}", "config": reason[:90]}
        plan = json.loads(out.read_text())
        solver = plan["solver"]
        return row | {
            "status": solver["status"],
            "gap %": round(100 * solver["gap"], 2),
            "peak GiB": round(solver["objective"] / GIB, 2),
            "config": _label(plan["config"]),
        }


def _label(config: dict) -> str:
    label = f"pp{config['pp']} tp{config['tp']} dp{config['dp']} m{config['num_microbatches']}"
    if config.get("virtual_stages", 1) > 1:
        label += f" v{config['virtual_stages']}"
    return label


def zoo_profile(folder: str) -> str:
    """The zoo's GPT-3 175B profile (SDPA), exported once."""
    path = Path(folder) / "gpt3-175b.json"
    if not path.exists():
        export = [sys.executable, "-m", "profiling.export", "gpt3-175b", "--out", str(path)]
        done = harness.run_process(export, env=os.environ | {"PYTHONPATH": str(ROOT)})
        if done.returncode != 0:
            raise SystemExit(f"gpt3-175b: export failed: {done.stderr.strip()}")
    return str(path)


def headline_rows(out_dir: str | Path = ROOT / "benchmarks") -> list[dict]:
    """Issue 17 point 5 (GPT-3 175B, --virtual-stages 1,2,4 on 128 GPUs; and the worst pp 16
    v 2-4 point) from ``out_dir``/bench_interleaved_scale.csv, after the change."""
    path = Path(out_dir) / "bench_interleaved_scale.csv"
    rows = [row for row in harness.read_csv(path) if row["code"] == "after"]
    kind, gpus, flags = HEADLINE
    head = next(r for r in rows if (r["graph"], int(r["gpus"]), r["flags"]) == (kind, gpus, flags))
    pinned = [
        r
        for r in rows
        if r["graph"] == "zoo" and re.fullmatch(r"--pp 16 --virtual-stages \d", r["flags"])
    ]
    slowest = max(pinned, key=lambda r: float(r["cpu s"]))
    proven = sum(r["status"] == "OPTIMAL" for r in pinned)
    return [
        {
            "point": "5. interleaved at scale (GPT-3 175B, pp 16, v 2-4)",
            "command": command(kind, gpus, flags, "gpt3.json")
            + "  (scripts/bench_interleaved_scale.py)",
            "result": (
                f"{head['status']}, gap {head['gap %']}%, {head['cpu s']} s CPU "
                f"({head['wall s']} s wall, shared machine); pp 16 with v 2, 3, 4 on 128 and "
                f"256 GPUs: {proven} of {len(pinned)} OPTIMAL, at most {slowest['cpu s']} s CPU"
            ),
        }
    ]


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--after", default=str(ROOT), help="checkout of the code measured")
    parser.add_argument("--before", help="checkout to compare with (e.g. the main branch)")
    parser.add_argument("--graph", help="the zoo's GPT-3 175B profile (default: export it)")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--only", help="run only the points whose flags contain this")
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    with tempfile.TemporaryDirectory() as tmp:
        zoo = args.graph or zoo_profile(tmp)
        codes = [("after", Path(args.after))]
        if args.before:
            codes.insert(0, ("before", Path(args.before)))
        rows = []
        for kind, gpus, flags in POINTS:
            if args.only and args.only not in flags:
                continue
            graph = graph_path(kind, zoo)
            for code, checkout in codes:
                row = {"code": code} | run_point(
                    checkout, kind, gpus, flags, graph, args.time_limit
                )
                rows.append(row)
                print(" | ".join(str(row.get(c, "")) for c in COLUMNS), flush=True)
    harness.write_csv(args.out / "bench_interleaved_scale.csv", rows, COLUMNS)
    lines = [
        "# Interleaved stages at scale: GPT-3 175B, pp 16, v 2-4",
        "",
        f"Made by {run.command_text} on {harness.node()} ({harness.cores()} cores, shared "
        "with other jobs: wall times are noisy, CPU times less so).",
        "",
        f"Each row: `{command('GRAPH', 'N', 'FLAGS', 'GRAPH')}` with the default flags "
        f"(--time-limit {args.time_limit:g}, one worker, throughput >= 1/1.25 of the fastest "
        "plan). zoo: `python -m profiling.export gpt3-175b` (SDPA); example: "
        "examples/gpt3-175b.json (explicit attention). code: before = the main branch, after = "
        "the chunk-size relaxation (solver/backends/interleaved.py).",
        "",
        *markdown_table(rows, COLUMNS),
        "",
    ]
    harness.write_report(args.out, "bench_interleaved_scale.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
