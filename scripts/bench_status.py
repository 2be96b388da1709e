"""A plan whenever one exists, and honest status (issue 17, points 1 and 3).

    python scripts/bench_status.py [--gpus 64,256,1024] [--models gpt3-175b,...] [--out benchmarks]

1. Default flags on the zoo: each model is profiled as a user would (``python -m profiling.export
   MODEL``, into ``--graphs``), then planned with ``python -m solver.plan GRAPH --gpus N
   --gpu-memory 80GiB --global-batch B`` and nothing else (the 60 s default time limit) at each
   GPU count, as a subprocess. Exit 0 is a plan, 3 a proof that nothing fits (with the GPU count
   that does), 4 "no plan found in time": the count of exit 4 is the row of point 1 (target 0).
2. The issue's two cases: T5-11B on 256 GPUs at global batch 4096 (exited 4 before the incumbent
   pass) at the default limit and at ``--time-limit 5``, and GPT-3 175B on 128 GPUs with
   ``--virtual-stages 1,2,4`` (said "time limit reached" when it was not): status, gap, wall time,
   whether the time limit was reached, each search's time and proof, and the notes.

3. The cost of the incumbent pass (quick splits of every config before any exact solve): the
   examples' GPT-3 175B chain on 64..4096 GPUs with default flags, ``--virtual-stages 1,2,4``
   and ``--recompute auto``, and T5-11B on 64..1024 GPUs, each at ``--time-limit 10``: the pass's
   wall time (both searches) against the searches' (from the plan JSON's ``solver.searches``).
   Plain chain configs skip the pass (the chain algorithm is exact in milliseconds).

Each run records its wall time from start to exit (interpreter start and graph reading
included). Writes benchmarks/bench_status.md and .csv; :func:`headline_rows` reads the .csv back
for ``scripts/bench_search.py``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import harness
from harness import ROOT, markdown_table

MODELS = {
    "gpt3-175b": 1536,
    "llama2-70b": 1024,
    "t5-11b": 4096,
    "mixtral-8x7b": 256,
    "bert-large": 1024,
}
"""Zoo presets planned with default flags -> global batch (the model's published one or so)."""
GPUS = (64, 256, 1024)
EXAMPLE = ROOT / "examples" / "gpt3-175b.json"
CASES = (
    ("T5-11B, 256 GPUs, default limit", "t5-11b", ("--gpus", "256", "--global-batch", "4096")),
    (
        "T5-11B, 256 GPUs, --time-limit 5",
        "t5-11b",
        ("--gpus", "256", "--global-batch", "4096", "--time-limit", "5"),
    ),
    (
        "GPT-3 175B, 128 GPUs, --virtual-stages 1,2,4",
        "gpt3-175b",
        ("--gpus", "128", "--global-batch", "1536", "--virtual-stages", "1,2,4"),
    ),
    (
        "T5-11B, 256 GPUs, --recompute selective --time-limit 5 (honest status when unproven)",
        "t5-11b",
        ("--gpus", "256", "--global-batch", "4096", "--recompute", "selective")
        + ("--time-limit", "5"),
    ),
)
"""(name, model, solver.plan flags) of the issue's cases (80 GiB GPUs); the last one stays
unproven (selective recomputation on a DAG goes to CP-SAT), to show what its notes say."""
COST_GPUS = (64, 256, 1024, 4096)
COST_OPTIONS = {
    "default": (),
    "--virtual-stages 1,2,4": ("--virtual-stages", "1,2,4"),
    "--recompute auto": ("--recompute", "auto"),
}
COST_COLUMNS = ["case", "exit", "wall_s", "search_s", "incumbent_s", "incumbent_pct", "seeded"]
COLUMNS = [
    "case",
    "exit",
    "wall_s",
    "status",
    "gap_pct",
    "time_limit_reached",
    "searches",
    "outcome",
]


def profile(model: str, graphs: Path) -> Path:
    """The model's layer graph, profiled once into ``graphs``."""
    path = graphs / f"{model}.json"
    if not path.exists():
        command = [sys.executable, "-m", "profiling.export", model, "--out", str(path)]
        done = harness.run_process(command)
        if done.returncode != 0:
            raise SystemExit(f"{model}: export failed: {done.stderr.strip()}")
    return path


def run_plan(graph: Path, flags: tuple[str, ...]) -> dict:
    """``python -m solver.plan GRAPH --gpu-memory 80GiB FLAGS``: exit code, wall time, and the
    solver fields of its JSON (or the error line)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        command = [sys.executable, "-m", "solver.plan", str(graph), "--gpu-memory", "80GiB"]
        command += [*flags, "--json", str(out), "--quiet"]
        done = harness.run_process(command)
        row = {"exit": done.returncode, "wall_s": round(done.wall_s, 1)}
        if done.returncode == 0:
            solver = json.loads(out.read_text())["solver"]
            searches = solver.get("searches", [])
            search_s = sum(s["wall_s"] for s in searches)
            incumbent_s = sum(s["incumbent_s"] for s in searches)
            row |= {
                "search_s": round(search_s, 2),
                "incumbent_s": round(incumbent_s, 3),
                "incumbent_pct": round(100 * incumbent_s / search_s, 1) if search_s else 0.0,
                "seeded": "+".join(str(s["configs_with_incumbent"]) for s in searches),
                "status": solver["status"],
                "gap_pct": round(100 * solver["gap"], 2),
                "time_limit_reached": solver.get("time_limit_reached"),
                "searches": "; ".join(_search_cell(s) for s in solver.get("searches", [])),
                "outcome": " / ".join(solver["notes"]) or "proven optimal",
            }
        else:
            row |= {"status": "", "outcome": done.stderr.strip().splitlines()[-1][:300]}
        row["command"] = "python -m solver.plan " + " ".join(
            [graph.name, "--gpu-memory", "80GiB", *flags]
        )
        return row


def _search_cell(search: dict) -> str:
    proof = "proven" if search["proven"] else f"open {search['configs_open']}"
    limit = ", limit reached" if search["time_limit_reached"] else ""
    return (
        f"{search['name']} {search['wall_s']:.1f} s (quick {search['incumbent_s']:.2f} s) "
        f"{proof}{limit}"
    )


def headline_rows(out_dir: Path = ROOT / "benchmarks") -> list[dict]:
    """The rows of points 1 and 3 for benchmarks/bench_search.md (point, command, result), read
    from the last run's bench_status.csv."""
    path = Path(out_dir) / "bench_status.csv"
    if not path.exists():
        return []
    rows = harness.read_csv(path)
    zoo = [r for r in rows if r["part"] == "zoo"]
    exits = {code: sum(r["exit"] == code for r in zoo) for code in ("0", "3", "4")}
    headline = [
        {
            "point": "1. a plan whenever one exists",
            "command": "python scripts/bench_status.py (python -m solver.plan with default flags "
            f"on {len(zoo)} zoo model x GPU count runs)",
            "result": f"exit 4: {exits['4']} of {len(zoo)} runs (exit 0: {exits['0']}, exit 3 "
            f"nothing fits: {exits['3']})",
        }
    ]
    for row in (r for r in rows if r["part"] == "case"):
        status = (
            f"{row['status']}, gap {row['gap_pct']}%, time limit reached "
            f"{row['time_limit_reached']}"
            if row["exit"] == "0"
            else f"exit {row['exit']}"
        )
        headline.append(
            {
                "point": "1 / 3. " + row["case"],
                "command": row["command"],
                "result": f"{status}, {row['wall_s']} s; {row['outcome']}",
            }
        )
    return headline


def cost_cases(graphs: Path) -> list[tuple]:
    """(name, graph, GPUs, global batch, flags) of the incumbent pass's cost runs."""
    return [
        (f"gpt3-175b (examples/), {gpus} GPUs, {option}", EXAMPLE, gpus, 1536, flags)
        for option, flags in COST_OPTIONS.items()
        for gpus in COST_GPUS
    ] + [
        (f"t5-11b, {gpus} GPUs, default", profile("t5-11b", graphs), gpus, 4096, ())
        for gpus in COST_GPUS[:3]
    ]


def all_rows(args, graphs: Path) -> list[dict]:
    """The zoo runs, the issue's cases and the cost runs, as ``args`` selects them."""
    rows = []
    for model in [] if args.no_zoo else args.models.split(","):
        graph = profile(model, graphs)
        for gpus in args.gpus.split(","):
            flags = ("--gpus", gpus, "--global-batch", str(MODELS[model]))
            rows.append({"part": "zoo", "case": f"{model}, {gpus} GPUs"} | run_plan(graph, flags))
            print(rows[-1], flush=True)
    for name, model, flags in () if args.no_cases else CASES:
        rows.append({"part": "case", "case": name} | run_plan(profile(model, graphs), flags))
        print(rows[-1], flush=True)
    for name, graph, gpus, batch, flags in () if args.no_cost else cost_cases(graphs):
        flags = ("--gpus", str(gpus), "--global-batch", str(batch), "--time-limit", "10", *flags)
        rows.append({"part": "cost", "case": name} | run_plan(graph, flags))
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--models", default=",".join(MODELS), help="zoo presets (of MODELS)")
    parser.add_argument("--gpus", default=",".join(map(str, GPUS)), help="GPU counts")
    parser.add_argument("--graphs", default=str(Path(tempfile.gettempdir()) / "bench_status"))
    parser.add_argument("--no-cases", action="store_true", help="skip the issue's cases")
    parser.add_argument("--no-zoo", action="store_true", help="skip the zoo runs")
    parser.add_argument("--no-cost", action="store_true", help="skip the pass-cost runs")
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    graphs = Path(args.graphs)
    graphs.mkdir(parents=True, exist_ok=True)
    rows = all_rows(args, graphs)
    fields = ["part", *COLUMNS, *COST_COLUMNS[3:], "command"]
    harness.write_csv(args.out / "bench_status.csv", rows, fields, extrasaction="ignore")
    zoo = [r for r in rows if r["part"] == "zoo"]
    lines = [
        "# A plan whenever one exists, and honest status",
        "",
        f"Command: {run.command_text}",
        "",
        f"Machine: {harness.architecture()}, {harness.cores()} CPUs (shared with other jobs: "
        f"wall times are upper bounds), Python {harness.python_version()}.",
        "",
        "## 1. Default flags on the zoo (80 GiB GPUs, 60 s default limit)",
        "",
        f"Exit 4 (no plan found in time): **{sum(r['exit'] == 4 for r in zoo)} of {len(zoo)}** "
        "runs; exit 3 is a proof that nothing fits.",
        "",
        *markdown_table(zoo, COLUMNS),
        "",
        "## The issue's cases",
        "",
        *markdown_table([r for r in rows if r["part"] == "case"], [*COLUMNS, "command"]),
        "",
        "## 3. Cost of the incumbent pass (--time-limit 10)",
        "",
        "search_s: both searches' wall time; incumbent_s: their incumbent passes; seeded: configs "
        "given a quick split in each search (fastest plan + smallest peak).",
        "",
        *markdown_table([r for r in rows if r["part"] == "cost"], COST_COLUMNS),
        "",
    ]
    harness.write_report(args.out, "bench_status.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
