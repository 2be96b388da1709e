"""Exact optimum vs CAPSlog's greedy on empirical (mem_isolated, mem_added) statistics.

    python scripts/bench_empirical.py [--out benchmarks]

Both plan with the same model, ``memory_model="empirical"`` (a stage holds mem_isolated of its
first layer + mem_added of the others, docs/cost-model.md): our exact chain solver, and
``solver.report.baselines.capslog_split`` (binary search on a threshold over the fill-first greedy).

- random statistics: 200 chains of 24-96 layers, 4-16 stages, mem_added uniform, the first-layer
  surplus mem_isolated - mem_added uniform in [0, 2 x mean added] (the greedy is exact only when
  that surplus is the same for every layer);
- realistic statistics: the isolated / added peaks of the bundled GPT-3 175B and T5 graphs'
  layers under the analytic cost model (pp-only configs, bf16 + Adam), as a profiler would measure
  them, with a per-layer +-10% measurement noise.

Writes benchmarks/bench_empirical.md and .csv: how often the greedy is sub-optimal and by how much.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import harness
from harness import ROOT, markdown_table

from solver import Cluster, TrainingConfig
from solver.backends.chain import solve_chain
from solver.backends.problem import StageProblem
from solver.costs import layer_costs, stage_costs
from solver.graph import LayerGraph, graph_from_dict, load_graph
from solver.report.baselines import capslog_split
from solver.specs import ParallelConfig

CLUSTER = Cluster(num_gpus=1, gpu_memory_bytes=2**50)


def with_statistics(model: str, isolated: list[int], added: list[int]) -> LayerGraph:
    layers = [
        {
            "name": f"l{i}",
            "params": 1,
            "activation_bytes": 1,
            "output_bytes": 1,
            "mem_isolated": iso,
            "mem_added": add,
        }
        for i, (iso, add) in enumerate(zip(isolated, added, strict=True))
    ]
    document = {"format": "layer-graph", "version": 1, "model": model, "layers": layers}
    return graph_from_dict(document)


def compare(graph: LayerGraph, pp: int) -> tuple[int, int, float, float]:
    """(exact peak, greedy peak, exact s, greedy s) under the empirical model."""
    config = ParallelConfig(pp=pp, tp=1, dp=1, micro_batch=1, num_microbatches=pp)
    training = TrainingConfig(global_batch=pp, memory_model="empirical")
    costs = layer_costs(graph, config, CLUSTER, training)
    with harness.Stopwatch() as exact_clock:
        exact = solve_chain(StageProblem(costs=costs), time_limit_s=60)
    with harness.Stopwatch() as greedy_clock:
        greedy = capslog_split(costs)
    exact_s, greedy_s = exact_clock.wall_s, greedy_clock.wall_s
    greedy_peak = max(s.peak_bytes for s in stage_costs(costs, greedy))
    assert greedy_peak >= exact.objective, "the exact optimum is a lower bound"
    return exact.objective, greedy_peak, exact_s, greedy_s


def realistic_statistics(path: Path, pp: int, rng: random.Random) -> LayerGraph:
    """mem_isolated / mem_added of each layer at a middle stage, from the analytic model + noise."""
    graph = load_graph(path)
    config = ParallelConfig(pp=pp, tp=1, dp=1, micro_batch=1, num_microbatches=4 * pp)
    costs = layer_costs(graph, config, CLUSTER, TrainingConfig(global_batch=4 * pp))
    stage = pp // 2  # a middle stage's in-flight count and buffers
    k = costs.in_flight[stage]
    body = costs.state_bytes + k * costs.stored_bytes
    edge = [0, *costs.edge_bytes.tolist()] if graph.is_chain else [0] * graph.num_layers
    isolated, added = [], []
    for layer in range(graph.num_layers):
        noise = 1 + rng.uniform(-0.1, 0.1)
        own = int(body[layer] * noise)
        added.append(own)
        isolated.append(own + int(2 * edge[layer] + costs.transient_bytes[layer]))
    return with_statistics(f"{graph.model} statistics", isolated, added)


KINDS = ("random", "gpt3-175b.json", "t5-dag.json")


def comparisons() -> list[tuple]:
    """(statistics, case, layers, stages, exact peak, greedy peak, exact s, greedy s) of the 200
    random chains, then of 10 draws of each example graph's statistics at pp 4 and 8."""
    rng = random.Random(2024)
    rows = []
    for case in range(200):
        num_layers = rng.randint(24, 96)
        pp = rng.choice([4, 8, 16])
        added = [rng.randint(1, 100) * 10**6 for _ in range(num_layers)]
        isolated = [a + rng.randint(0, 2 * 505) * 10**5 for a in added]
        exact, greedy, exact_s, greedy_s = compare(with_statistics("random", isolated, added), pp)
        rows.append(("random", case, num_layers, pp, exact, greedy, exact_s, greedy_s))
    for name in KINDS[1:]:
        for pp in (4, 8):
            for draw in range(10):
                graph = realistic_statistics(ROOT / "examples" / name, pp, rng)
                exact, greedy, exact_s, greedy_s = compare(graph, pp)
                rows.append((name, draw, graph.num_layers, pp, exact, greedy, exact_s, greedy_s))
    return rows


def table_row(kind, case, layers, pp, exact, greedy, exact_s, greedy_s) -> dict:
    return {
        "statistics": kind,
        "case": case,
        "layers": layers,
        "stages": pp,
        "exact_gib": round(exact / 2**30, 3),
        "capslog_gib": round(greedy / 2**30, 3),
        "capslog_worse_pct": round(100 * (greedy - exact) / exact, 2),
        "exact_ms": round(exact_s * 1e3, 2),
        "capslog_ms": round(greedy_s * 1e3, 2),
    }


def summary_row(table: list[dict], kind: str) -> dict:
    """How often and by how much the greedy misses the optimum on one kind of statistics."""
    worse = [row["capslog_worse_pct"] for row in table if row["statistics"] == kind]
    exact_ms = [row["exact_ms"] for row in table if row["statistics"] == kind]
    greedy_ms = [row["capslog_ms"] for row in table if row["statistics"] == kind]
    return {
        "statistics": kind,
        "cases": len(worse),
        "capslog_suboptimal": sum(w > 0 for w in worse),
        "median_worse_pct": round(statistics.median(worse), 2),
        "max_worse_pct": round(max(worse), 2),
        "median_exact_ms": round(statistics.median(exact_ms), 2),
        "median_capslog_ms": round(statistics.median(greedy_ms), 2),
    }


def main(argv: list[str] | None = None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    run = harness.Run.start(__file__, argv)
    table = [table_row(*row) for row in comparisons()]
    harness.write_csv(args.out / "bench_empirical.csv", table, list(table[0]))
    summary = [summary_row(table, kind) for kind in KINDS]
    lines = [
        "# Exact optimum vs CAPSlog's greedy on empirical statistics",
        "",
        f"Command: {run.command_text}  ",
        f"Machine: {harness.architecture()}, Python {harness.python_version()}, run "
        f'{harness.today()}. Model: `memory_model="empirical"` (mem_isolated of a '
        "stage's first layer + mem_added of the others) for both; `capslog_worse_pct` = how much "
        "higher the greedy's peak is than the proven optimum.",
        "",
        *markdown_table(summary, list(summary[0])),
        "",
        "## Every case",
        "",
        *markdown_table(table, list(table[0])),
        "",
    ]
    harness.write_report(args.out, "bench_empirical.md", lines)
    for row in summary:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
