"""T5-11B in seconds: the exact DP over the DAG's ideals (``--backend auto`` -> dag) against
CP-SAT at the same time limit.

    python scripts/bench_dag.py [--out benchmarks] [--graph T5.json] [--time-limit 60]
                                [--repeats 3]

T5-11B (zoo preset ``t5-11b``: 52 layers, 74 edges; an encoder chain, a decoder chain whose
every block reads the encoder's output, an independent decoder embedding) on 64, 256 and 1024
GPUs of 80 GiB at global batch 1024 and 4096, default flags otherwise: each case runs the CLI
(``python -m solver.plan``) once with the default backend and once with ``--backend cpsat``,
as a subprocess, and reports its wall time (process start to exit), exit code, status, gap,
config and peak from its ``--json``. The graph comes from ``python -m profiling.export
t5-11b`` (torch, fake tensors) unless ``--graph`` names one. Writes benchmarks/bench_dag.md and
.csv; :func:`headline_rows` gives the row of issue 17's point 2 for scripts/bench_search.py.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import harness
from harness import GIB, ROOT, markdown_table

GPU_COUNTS = (64, 256, 1024)
BATCHES = (1024, 4096)
BACKENDS = ("auto", "cpsat")
COLUMNS = [
    "gpus",
    "global batch",
    "backend",
    "wall s",
    "runs",
    "exit",
    "status",
    "gap %",
    "config",
    "peak GiB",
    "contiguous",
    "solver",
]
HEADLINE = (256, 4096)
"""The case of issue 17's point 2."""


def plan_command(graph: str, gpus: int, batch: int, backend: str, time_limit_s: float) -> list[str]:
    command = [
        "-m",
        "solver.plan",
        graph,
        "--gpus",
        str(gpus),
        "--gpu-memory",
        "80GiB",
        "--global-batch",
        str(batch),
    ]
    if backend != "auto":
        command += ["--backend", backend]
    if time_limit_s != 60:
        command += ["--time-limit", f"{time_limit_s:g}"]
    return command


def shown(command: list[str], graph: str) -> str:
    """The command as a user types it, with the graph as profiling.export writes it."""
    return "python " + " ".join(command).replace(graph, "t5-11b.json")


def run_case(
    graph: str, gpus: int, batch: int, backend: str, time_limit_s: float, repeats: int
) -> dict:
    """Run one CLI plan as a subprocess ``repeats`` times: the median wall time, the exit code
    and the figures of the last run's JSON."""
    command = plan_command(graph, gpus, batch, backend, time_limit_s)
    walls = []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "plan.json"
        for _ in range(repeats):
            out.unlink(missing_ok=True)
            argv = [sys.executable, *command, "--json", str(out), "--quiet"]
            done = harness.run_process(argv, env=env)
            walls.append(done.wall_s)
        row = {
            "gpus": gpus,
            "global batch": batch,
            "backend": backend,
            "wall s": round(statistics.median(walls), 2),
            "runs": repeats,
            "exit": done.returncode,
            "command": shown(command, graph),
        }
        if not out.exists():
            row.update(status="no plan", solver=done.stderr.strip().splitlines()[-1][:120])
            return row
        document = json.loads(out.read_text())
    solver = document["solver"]
    config = document["config"]
    row.update(
        status=solver["status"],
        **{"gap %": round(100 * solver["gap"], 2)},
        config=(
            f"pp{config['pp']} tp{config['tp']} dp{config['dp']} b{config['micro_batch']} "
            f"m{config['num_microbatches']} zero{config['zero']}"
        ),
        **{"peak GiB": round(document["peak_bytes"] / GIB, 3)},
        contiguous=_contiguous(document["stage_of_layer"]),
        solver=(
            f"{solver['backend']} {solver['wall_s']:.2f} s, {solver['configs_solved']} of "
            f"{solver['configs_total']} configs solved"
        ),
    )
    return row


def _contiguous(stage_of_layer: list[int]) -> str:
    """yes: every stage is a run of consecutive layers of the graph's (module) order, which
    torch.distributed.pipelining's split points can cut; no: some stage is an ideal that is not
    a prefix (e.g. decoder.embed beside the encoder)."""
    ordered = all(a <= b for a, b in zip(stage_of_layer[:-1], stage_of_layer[1:], strict=True))
    return "yes" if ordered else "no"


def export_graph(folder: Path) -> str:
    path = folder / "t5-11b.json"
    done = harness.run_process([sys.executable, "-m", "profiling.export", "t5-11b", "--out", path])
    if done.returncode != 0:
        raise SystemExit(f"t5-11b: export failed: {done.stderr.strip()}")
    return str(path)


def headline_rows(out_dir: str | Path = ROOT / "benchmarks") -> list[dict]:
    """Issue 17 point 2 (T5-11B on 256 GPUs, batch 4096, default flags): the row of
    bench_dag.csv (run ``python scripts/bench_dag.py`` first)."""
    found = []
    for row in harness.read_csv(Path(out_dir) / "bench_dag.csv"):
        if (int(row["gpus"]), int(row["global batch"])) != HEADLINE:
            continue
        result = f"{row['status']} in {row['wall s']} s (exit {row['exit']})"
        if row["status"] != "no plan":
            result += (
                f", gap {row['gap %']}%, {row['config']}, peak {row['peak GiB']} GiB; "
                f"solver {row['solver']}"
            )
        found.append(
            {
                "point": f"2. T5-11B on 256 GPUs, batch 4096 ({row['backend']} backend)",
                "command": row["command"],
                "result": result,
            }
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--graph", help="T5-11B layer graph (default: export it)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="per plan, seconds")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each auto case (median wall time)"
    )
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    with tempfile.TemporaryDirectory() as scratch:
        graph = args.graph or export_graph(Path(scratch))
        rows = []
        for gpus in GPU_COUNTS:
            for batch in BATCHES:
                for backend in BACKENDS:
                    # CP-SAT runs to its time limit: once
                    repeats = args.repeats if backend == "auto" else 1
                    row = run_case(graph, gpus, batch, backend, args.time_limit, repeats)
                    print(row, flush=True)
                    rows.append(row)
    harness.write_csv(args.out / "bench_dag.csv", rows, [*COLUMNS, "command"])
    lines = [
        "# T5-11B: the exact DP over ideals against CP-SAT",
        "",
        f"Command: {run.command_text} (Python {harness.python_version()}, "
        f"{harness.architecture()}, {harness.cores()} cores shared with other jobs; wall time of "
        "the whole CLI process, Python's start and imports included, the median of `runs`; time "
        f"limit {args.time_limit:g} s).",
        "",
        "T5-11B from `python -m profiling.export t5-11b` (52 layers, 74 edges) on 80 GiB GPUs, "
        "default flags (megatron runtime, 1F1B, ZeRO 0, throughput within 1.25x of the fastest "
        "plan that fits). *auto* runs the exact DP over the DAG's ideals (`--backend dag`, "
        "`solver/backends/dag.py`); *cpsat* forces CP-SAT on every config. gap: (objective - "
        "bound) / objective as the plan reports it; exit 4: no plan within the time limit; "
        "contiguous: every stage is a run of the module order (what `pipeline()` split points "
        "cut; `no` gets the exports' NOT CONTIGUOUS warning).",
        "",
        *markdown_table(rows, COLUMNS),
        "",
        "Each case's command (the graph as `profiling.export` writes it):",
        "",
        *[f"- `{row['command']}`" for row in rows],
        "",
    ]
    harness.write_report(args.out, "bench_dag.md", lines, note=f" in {run.elapsed_s:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
