"""Large chains: wall time and peak memory of ``solver.plan`` on 20,000 to 1,000,000 layers, with
and without ``--time-limit 5`` (issue 27, item 2).

    python scripts/bench_scale.py [--out benchmarks] [--before CHECKOUT] [--only SUBSTRING]
        [--memory-limit-gib 8]

Each case runs ``python -m solver.plan`` as a subprocess, as a user would, and records its wall
time from start to exit (interpreter start and graph reading included), its exit code, the
solver's line or its error, and its peak resident memory (``os.wait4``); every run is capped at
``--memory-limit-gib`` of address space (``prlimit --as``), so that a run that would take the
machine's memory fails alone. The graphs (written into a temporary folder) are chains of small,
unequal layers (``chain_layer``, as tests/test_scale.py's: about 100 bytes of JSON a layer, all
fitting one 80 GiB GPU):

- 20,000, 200,000 and 1,000,000 layers on one GPU (global batch 8), with ``--time-limit 600``
  (no limit in practice) and ``--time-limit 5``;
- the issue's crash: 20,002 layers on 20,002 GPUs, ``--pp 20002`` (one layer a stage, one
  micro-batch of 20,002 samples), where the chain algorithm's [term, stage, position] arrays
  asked for 24 GiB, with ``--time-limit 60`` and ``--time-limit 5``.

With ``--before CHECKOUT`` every case also runs from that checkout (e.g. the main branch before
this change), its rows marked "before". Target: every run with ``--time-limit 5`` ends within
5 s of its first byte read (about 6.5 s from the start, the interpreter's start and imports
included), with a plan or exit 4. Writes benchmarks/bench_scale.md and .csv.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import harness
from harness import ROOT, markdown_table

START_S = 1.5
"""Interpreter start and imports before ``solver.plan`` reads the graph, at most (about 1 s)."""
SIZES = (20_000, 200_000, 1_000_000)
CRASH_LAYERS = 20_002
COLUMNS = [
    "checkout",
    "case",
    "time_limit_s",
    "wall_s",
    "within_limit",
    "exit",
    "peak_rss_mib",
    "outcome",
]


def chain_layer(index: int) -> dict:
    """Layer ``index`` of the chains: small, its parameters, activations and FLOPs varying with
    the index (as tests/test_scale.py's ``chain_document``)."""
    return {
        "name": f"l{index}",
        "params": 100 + (index * 7919) % 400,
        "activation_bytes": 1000 + (index * 104729) % 2000,
        "output_bytes": 256,
        "fwd_flops": 1e6 * (1 + index % 3),
    }


def write_chain(path: Path, num_layers: int) -> None:
    """A chain's layer-graph JSON, written a layer at a time: this process stays small, so the
    runs it starts (forks of it until they exec) do not inherit its memory in their peak."""
    head = {"format": "layer-graph", "version": 1, "model": f"chain-{num_layers}"}
    with open(path, "w") as stream:
        stream.write(json.dumps(head)[:-1] + ', "layers": [')
        for index in range(num_layers):
            stream.write((", " if index else "") + json.dumps(chain_layer(index)))
        stream.write("]}")


def cases(folder: Path) -> list[tuple[str, list[str], list[float]]]:
    """(name, solver.plan arguments without --time-limit, the limits to run) of every case; the
    graphs are written into ``folder``."""
    found = []
    for size in SIZES:
        path = folder / f"chain-{size}.json"
        write_chain(path, size)
        args = [str(path), "--gpus", "1", "--gpu-memory", "80GiB", "--global-batch", "8"]
        found.append((f"{size:,}-layer chain, 1 GPU", args, [600, 5]))
    path = folder / f"chain-{CRASH_LAYERS}.json"
    write_chain(path, CRASH_LAYERS)
    args = [str(path), "--gpus", str(CRASH_LAYERS), "--pp", str(CRASH_LAYERS)]
    args += ["--gpu-memory", "80GiB", "--global-batch", str(CRASH_LAYERS)]
    args += ["--micro-batch", str(CRASH_LAYERS)]
    found.append((f"{CRASH_LAYERS:,}-layer chain on {CRASH_LAYERS:,} stages", args, [60, 5]))
    return found


def run_case(checkout: Path, arguments: list[str], limit_s: float, memory_gib: float) -> dict:
    """One run from ``checkout``: wall time, exit code, outcome line, peak resident memory."""
    command = ["prlimit", f"--as={int(memory_gib * 2**30)}", sys.executable, "-m", "solver.plan"]
    command += [*arguments, "--time-limit", f"{limit_s:g}"]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = harness.run_process(command, cwd=checkout, env=env)
    return {
        "wall_s": round(done.wall_s, 1),
        "within_limit": "yes" if done.wall_s <= limit_s + START_S else "NO",
        "exit": done.returncode,
        "peak_rss_mib": round(done.peak_rss_bytes / 2**20),
        "outcome": _outcome(done.stdout, done.stderr),
    }


def _outcome(out: str, err: str) -> str:
    """The solver line of a plan, else the last line of stderr (an error, or a traceback's)."""
    for line in out.splitlines():
        if line.startswith("solver:"):
            return line.split(", objective")[0].replace("|", "/")[:100]
    lines = [line for line in err.splitlines() if line.strip()]
    return lines[-1].replace("|", "/")[:140] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--before", type=Path, help="also run every case from this checkout")
    parser.add_argument(
        "--before-label", default="before", help="its name in the table (e.g. its commit)"
    )
    parser.add_argument("--only", default="", help="run the cases whose name holds this text")
    parser.add_argument(
        "--memory-limit-gib", type=float, default=8.0, help="address-space cap of each run"
    )
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    before = [(args.before_label, args.before.resolve())] if args.before else []
    checkouts = [(f"after ({run.commit})", ROOT), *before]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, arguments, limits in cases(Path(folder)):
            if args.only not in name:
                continue
            for label, checkout in checkouts:
                for limit in limits:
                    row = {"checkout": label, "case": name, "time_limit_s": limit}
                    row |= run_case(checkout, arguments, limit, args.memory_limit_gib)
                    rows.append(row)
                    print(
                        f"{label} {name}, --time-limit {limit}: {row['wall_s']} s, exit "
                        f"{row['exit']}, {row['peak_rss_mib']} MiB: {row['outcome']}",
                        flush=True,
                    )
    harness.write_csv(args.out / "bench_scale.csv", rows, COLUMNS)
    lines = [
        "# Large chains: time and memory of solver.plan",
        "",
        f"Command: {run.command_text}  ",
        f"Machine: {harness.machine()}, {harness.cores()} cores, load {run.loads_before} at the "
        f"start; {run.elapsed_s:.0f} s in all.",
        "",
        "Wall time from the command's start to its exit (the interpreter's start and imports, "
        f"about 1 s, included: a run is within its limit when it ends by limit + {START_S} s); "
        "peak resident memory of the run; each run capped at "
        f"{args.memory_limit_gib:g} GiB of address space. Chains of small unequal layers "
        "(the script's chain_layer).",
        "",
        *markdown_table(rows, COLUMNS),
        "",
    ]
    harness.write_report(args.out, "bench_scale.md", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
