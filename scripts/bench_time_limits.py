"""Time limits: wall time of the CLIs against ``--time-limit`` on inputs that used to overrun it.

    python scripts/bench_time_limits.py [--limits 10,30] [--out benchmarks]

Each case runs ``python -m solver.plan`` (or ``solver.sweep``) as a subprocess, as a user
would, and records its wall time from start to exit (interpreter start and graph reading
included), its exit code, the solver's status or error, and its peak resident memory
(``os.wait4``). Cases (graphs generated into a temporary folder from scripts/make_examples.py):

- a 5,000-layer GPT chain (hidden 1024, 64 GPUs): ``--recompute auto`` (selective, CP-SAT on
  each config), ``--backend cpsat`` (one CP-SAT model of 5,000 x 64 prefix variables per config),
  ``--recompute auto --pareto``, and on 8 GPUs, where nothing fits (exit 3: the explanation
  and its search for a GPU count that fits run under the same deadline);
- a 302-layer T5-style DAG (the encoder output feeds all 149 decoder blocks; CP-SAT) and the same
  with ``--backend milp``;
- ``--gpus 1000000007`` on the chain (a prime: no config; the candidate enumeration used to loop
  to N);
- the README's default case (examples/gpt3-175b.json, 64 GPUs, 80 GiB, global batch 256);
- a sweep of the chain at 64 and 128 GPUs (``--recompute auto``, ``--workers 2``; the limit is
  per point).

Target: every run returns within its limit + 5 s. Writes benchmarks/bench_time_limits.md.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import harness
from harness import ROOT, markdown_table
from make_examples import gpt, t5_dag

SLACK_S = 5.0
"""A run may exceed its time limit by this much (interpreter start, reading, writing)."""
PLAN = ("-m", "solver.plan")
COMMON = ("--global-batch", "256")
README = str(ROOT / "examples" / "gpt3-175b.json")


def cases(chain: str, dag: str) -> list[tuple[str, tuple[str, ...]]]:
    """(name, CLI arguments without --time-limit) of every case."""
    return [
        (
            "5,000-layer chain, --recompute auto",
            (*PLAN, chain, "--gpus", "64", "--recompute", "auto"),
        ),
        (
            "5,000-layer chain, --backend cpsat",
            (*PLAN, chain, "--gpus", "64", "--backend", "cpsat"),
        ),
        (
            "5,000-layer chain, --recompute auto --pareto",
            (*PLAN, chain, "--gpus", "64", "--recompute", "auto", "--pareto"),
        ),
        (
            "5,000-layer chain on 8 GPUs, --recompute auto (nothing fits: exit 3)",
            (*PLAN, chain, "--gpus", "8", "--recompute", "auto"),
        ),
        ("302-layer DAG (CP-SAT)", (*PLAN, dag, "--gpus", "64")),
        ("302-layer DAG, --backend milp", (*PLAN, dag, "--gpus", "64", "--backend", "milp")),
        ("--gpus 1000000007 (chain)", (*PLAN, chain, "--gpus", "1000000007")),
        ("README default (GPT-3 175B, 64 GPUs)", (*PLAN, README, "--gpus", "64")),
        (
            "sweep of the chain, --recompute auto, 64 and 128 GPUs, 2 workers",
            ("-m", "solver.sweep", chain, "--gpus", "64,128", "--workers", "2")
            + ("--recompute", "auto"),
        ),
    ]


def run_measured(arguments: tuple[str, ...], limit_s: float) -> dict:
    """Run one case: its wall time, exit code, outcome line and peak resident memory (the
    child's own, ``os.wait4``)."""
    command = [sys.executable, *arguments, *COMMON, "--time-limit", f"{limit_s:g}"]
    done = harness.run_process(command)
    return {
        "wall_s": round(done.wall_s, 1),
        "over_limit_s": round(done.wall_s - limit_s, 1),
        "within_target": "yes" if done.wall_s <= limit_s + SLACK_S else "NO",
        "exit": done.returncode,
        "peak_rss_mib": round(done.peak_rss_bytes / 2**20),
        "outcome": _outcome(done.stdout, done.stderr),
    }


def _outcome(out: str, err: str) -> str:
    """The solver line of a plan, the first error line, or the points of a sweep."""
    table = out.splitlines()
    if table and table[0].split()[:3] == ["gpus", "memory", "status"]:
        points = [line.split() for line in table[1:]]  # gpus, memory (2 words), status, ...
        return "; ".join(f"{point[0]} GPUs {point[3]}" for point in points)
    for line in out.splitlines():
        if line.startswith("solver:"):
            return line.split(", objective")[0].split(" (")[0].replace("|", "/")[:90]
    if err.strip():
        return err.strip().splitlines()[0].replace("|", "/")[:90]
    for line in out.splitlines():
        if line.strip():
            return line.strip().replace("|", "/")[:90]
    return ""


def write_graphs(folder: Path) -> tuple[str, str]:
    chain = folder / "chain-5000.json"
    gpt("chain-5000-h1024", layers=4998, s=2048, h=1024, a=16, vocab=50257).save(chain)
    dag = folder / "dag-302.json"
    t5_dag(blocks=149, s=512, h=768, a=12, vocab=32128).save(dag)
    return str(chain), str(dag)


COLUMNS = [
    "case",
    "time_limit_s",
    "wall_s",
    "over_limit_s",
    "within_target",
    "exit",
    "peak_rss_mib",
    "outcome",
]


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--limits", default="10,30", help="time limits to run, seconds")
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    limits = [float(text) for text in args.limits.split(",")]
    loads = [run.load_before]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        chain, dag = write_graphs(Path(folder))
        for name, arguments in cases(chain, dag):
            for limit in limits:
                row = {"case": name, "time_limit_s": f"{limit:g}"}
                row |= run_measured(arguments, limit)
                loads.append(harness.load_average())
                print(
                    f"{name} @ {limit:g} s: {row['wall_s']} s, exit {row['exit']}: {row['outcome']}"
                )
                rows.append(row)
    missed = [r for r in rows if r["within_target"] != "yes"]
    lines = [
        "# Time limits",
        "",
        f"Command: {run.command_text}  ",
        f"Machine: {harness.machine()}, {harness.cores()} cores, Python "
        f"{harness.python_version()}, run {harness.today()}, {run.elapsed_s:.0f} s in all; "
        f"1-minute load average {min(loads):.1f}-{max(loads):.1f} during the runs (a shared "
        "machine: other processes slow them down)",
        "",
        "Each run is the CLI as a subprocess: wall time from start to exit (interpreter start and "
        "graph reading included), exit code (0 plan, 2 bad input, 3 nothing fits, 4 time limit "
        "without a plan), peak resident memory of the process (`os.wait4`; for a sweep the "
        "parent's, without its workers). The 5,000-layer chain is a GPT chain of hidden size "
        "1024 (scripts/make_examples.py `gpt`), the DAG a T5-style "
        "encoder-decoder of 149 + 149 blocks (`t5_dag`: the encoder output feeds every decoder "
        "block); global batch 256, 80 GiB GPUs, other options at their defaults. A sweep's "
        "limit applies to each point.",
        "",
        f"Target: within the limit + {SLACK_S:g} s. "
        + (
            "Every run met it."
            if not missed
            else f"{len(missed)} run(s) missed it: "
            + "; ".join(f"{r['case']} @ {r['time_limit_s']} s" for r in missed)
        ),
        "",
        *markdown_table(rows, COLUMNS),
        "",
    ]
    harness.write_report(args.out, "bench_time_limits.md", lines)
    return 0 if not missed else 1


if __name__ == "__main__":
    raise SystemExit(main())
