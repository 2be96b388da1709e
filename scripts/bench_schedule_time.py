"""Bubble formula vs schedule simulation of the iteration time, on a chain with known times.

    python scripts/bench_schedule_time.py [--out benchmarks]

A synthetic GPT-shaped chain with measured per-sample times and no communication (tp 1, dp 1,
no p2p time): an embedding (forward 0.3 ms), 16 blocks (1 ms) and an LM head with its loss
(1.5 ms), backward twice the forward. For pp 2, 3, 4, m 4 and 8, 1F1B and GPipe, Megatron's
even split and two uneven ones (front stages lighter, as the memory-optimal plans make them),
it compares ``solver.evaluate``'s ``iteration_ms`` (the bubble formula (m + p - 1) max_s T_s)
with ``solver.schedule_time.simulated_iteration_ns`` (the schedule's own order of forwards and
backwards, event by event), and, in a second table, interleaved 1F1B (v 2) against its formula
m max_r T_r + (p - 1) max_j T_j. Writes benchmarks/bench_schedule_time.md and .csv;
:func:`headline_rows` gives issue 18's point-1 row.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tables import markdown_table, write_report  # noqa: E402  (scripts/ is sys.path[0] when run as a script)

from solver import Cluster, ParallelConfig, TrainingConfig, evaluate  # noqa: E402
from solver.cost_model import layer_costs  # noqa: E402
from solver.graph import graph_from_dict  # noqa: E402
from solver.schedule_time import schedule_timeline  # noqa: E402

COMMAND = "python scripts/bench_schedule_time.py"
FORWARD_MS = [0.3] + [1.0] * 16 + [1.5]
"""Per-sample forward times of the chain: embedding, 16 blocks, head + loss."""
SPLITS = {
    2: ("even", [8, 10], [7, 11]),
    3: ("even", [5, 6, 7], [4, 6, 8]),
    4: ("even", [3, 4, 5, 6], [4, 4, 5, 5]),
}
"""Layer counts per stage; "even" is Megatron's (``evaluate``'s "even")."""
INTERLEAVED = (
    # pp, m, layers per virtual stage (p v of them), label
    (2, 4, "even"),
    (2, 4, [1, 3, 5, 9]),
    (2, 8, "even"),
    (2, 8, [1, 3, 5, 9]),
    (3, 6, "even"),
    (3, 6, [1, 2, 3, 3, 4, 5]),
    (4, 8, "even"),
    (4, 8, [1, 1, 2, 2, 2, 3, 3, 4]),
)
COLUMNS = [
    "schedule",
    "pp",
    "v",
    "m",
    "split",
    "max T_s ms",
    "formula ms",
    "simulated ms",
    "formula above %",
    "bubble sim %",
]


def chain_graph():
    """The synthetic chain (module docstring): measured times, 1 KiB boundaries."""
    layers = [
        {
            "name": name,
            "params": 1000,
            "activation_bytes": 4096,
            "output_bytes": 1024,
            "fwd_ms": forward,
            "bwd_ms": 2 * forward,
        }
        for name, forward in zip(
            ["embed"] + [f"block{i}" for i in range(16)] + ["head"], FORWARD_MS, strict=True
        )
    ]
    return graph_from_dict(
        {"format": "layer-graph", "version": 1, "model": "synthetic-chain", "layers": layers}
    )


def measure(graph, pp: int, m: int, schedule: str, split, v: int = 1) -> dict:
    """One layout: the formula's iteration (``evaluate``) and the simulated one."""
    config = ParallelConfig(
        pp=pp, tp=1, dp=1, micro_batch=1, num_microbatches=m, schedule=schedule, virtual_stages=v
    )
    cluster = Cluster(num_gpus=pp)
    training = TrainingConfig(
        global_batch=m, micro_batch_sizes=(1,), schedule=schedule, virtual_stages=(v,)
    )
    evaluation = evaluate(graph, config, split, cluster=cluster, training=training)
    costs = layer_costs(graph, config, cluster, training)
    stage_of = [0] * graph.num_layers
    for stage in evaluation.stages:
        for j, chunk in zip(range(stage.index, pp * v, pp), stage.chunks, strict=True):
            for layer in chunk:
                stage_of[layer] = j
    timeline = schedule_timeline(costs, stage_of)
    simulated, formula = timeline.makespan_ns, evaluation.iteration_ns
    counts = [0] * (pp * v)
    for j in stage_of:
        counts[j] += 1
    slowest = max(s.time_ns for s in evaluation.stages)
    return {
        "schedule": "interleaved" if v > 1 else schedule,
        "pp": pp,
        "v": v,
        "m": m,
        "split": "-".join(map(str, counts)) + (" (even)" if split == "even" else ""),
        "even": split == "even",
        "max T_s ms": round(slowest / 1e6, 3),
        "formula ms": round(formula / 1e6, 3),
        "simulated ms": round(simulated / 1e6, 3),
        "formula above %": round(100 * (formula - simulated) / simulated, 1),
        "bubble sim %": round(100 * sum(timeline.idle_ns) / (pp * simulated), 1),
    }


def run() -> list[dict]:
    graph = chain_graph()
    rows = []
    for pp, splits in SPLITS.items():
        for m in (4, 8):
            for schedule in ("1f1b", "gpipe"):
                for split in splits:
                    rows.append(measure(graph, pp, m, schedule, split))
    for pp, m, split in INTERLEAVED:
        rows.append(measure(graph, pp, m, "1f1b", split, v=2))
    return rows


def summary(rows: list[dict]) -> dict[str, tuple[float, float, float, int]]:
    """(median, min, max, count) of "formula above %" per group."""
    groups = {
        "1F1B/GPipe even": [r for r in rows if r["v"] == 1 and r["even"]],
        "1F1B/GPipe uneven": [r for r in rows if r["v"] == 1 and not r["even"]],
        "interleaved even": [r for r in rows if r["v"] > 1 and r["even"]],
        "interleaved uneven": [r for r in rows if r["v"] > 1 and not r["even"]],
    }
    out = {}
    for name, group in groups.items():
        values = [r["formula above %"] for r in group]
        out[name] = (statistics.median(values), min(values), max(values), len(values))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks"))
    args = parser.parse_args()
    rows = run()
    stats = summary(rows)
    lines = [
        "# Iteration time: bubble formula vs schedule simulation",
        "",
        f"Command: `{COMMAND}` (deterministic: no timing, no solver; a few seconds).",
        "",
        "A synthetic chain with known per-sample times and no communication: embedding 0.3 ms,",
        "16 blocks 1 ms, head + loss 1.5 ms (forward; backward twice that), tp 1, dp 1,",
        "micro-batch 1. *formula*: `solver.evaluate`'s `iteration_ms`, (m + p - 1) max_s T_s",
        "(interleaved: m max_r T_r + (p - 1) max_j T_j). *simulated*:",
        "`solver.schedule_time.simulated_iteration_ns`, the schedule's own order of forwards and",
        'backwards run event by event (docs/cost-model.md, "Iteration time by schedule',
        'simulation"). *formula above %*: (formula - simulated) / simulated. *bubble sim %*: the',
        "ranks' idle share of the simulated iteration.",
        "",
        "| layouts | formula above simulated: median | min | max | n |",
        "|---|---|---|---|---|",
    ]
    for name, (median, low, high, n) in stats.items():
        lines.append(f"| {name} | {median:.1f}% | {low:.1f}% | {high:.1f}% | {n} |")
    lines += [
        "",
        "## 1F1B and GPipe",
        "",
        *markdown_table([r for r in rows if r["v"] == 1], COLUMNS),
        "",
        "## Interleaved 1F1B (v 2, megatron order, g = p)",
        "",
        "The interleaved formula is above the simulation on every layout here, but it is not an",
        "upper bound on uneven chunks: tests/test_schedule_time.py has a 2-rank case it charges",
        "13 where the schedule takes 14 (a backward waits on the other rank's slow chunk).",
        "",
        *markdown_table([r for r in rows if r["v"] > 1], COLUMNS),
        "",
    ]
    write_report(args.out, "bench_schedule_time.md", lines)
    with open(Path(args.out) / "bench_schedule_time.csv", "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=[*COLUMNS, "command"])
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row[c] for c in COLUMNS} | {"command": COMMAND})
    return 0


def headline_rows(out_dir: str | Path = ROOT / "benchmarks") -> list[dict]:
    """Issue 18 point 1: how far the bubble formula is above the simulated schedule on the
    synthetic chain's 1F1B/GPipe layouts, from the last run's bench_schedule_time.csv (empty
    without one)."""
    path = Path(out_dir) / "bench_schedule_time.csv"
    if not path.exists():
        return []
    with open(path, newline="") as stream:
        rows = [r for r in csv.DictReader(stream) if r["v"] == "1"]
    result = []
    for even in (True, False):
        values = [
            float(r["formula above %"]) for r in rows if r["split"].endswith("(even)") == even
        ]
        result.append(
            {
                "point": f"1. schedule simulation, {'even' if even else 'uneven'} splits "
                "(synthetic chain, 1F1B/GPipe, pp 2-4)",
                "command": COMMAND,
                "result": f"formula above simulated: median {statistics.median(values):.1f}%, "
                f"range {min(values):.1f} to {max(values):.1f}% over {len(values)} layouts",
            }
        )
    return result


if __name__ == "__main__":
    raise SystemExit(main())
