"""Solver benchmark: full config searches on GPT-style chains and per-config chain solves.

    python scripts/bench_solver.py [--quick] [--out benchmarks]

Writes benchmarks/bench_solver.md and .csv: for chains of 24, 96, 400 and 2000 layers and 8..4096
GPUs (80 GiB each), the wall time of the full search (median of --repeats runs), the plan found
(config, peak, throughput, status) and the even (Megatron) and parameter-balanced (DeepSpeed)
splits of the same config; then per-config exact chain solves of 2000 layers x 8..128 stages.
Targets: 400 layers on 1024 GPUs under 5 s median; 2000 x 128 well under a second.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from make_examples import gpt  # noqa: E402
from tables import markdown_table, write_report  # noqa: E402

from solver import Cluster, InfeasibleError, ParallelConfig, TrainingConfig, plan  # noqa: E402
from solver.backends.chain import solve_chain  # noqa: E402
from solver.backends.problem import StageProblem  # noqa: E402
from solver.costs import layer_costs  # noqa: E402
from solver.report.plan_report import meets_throughput  # noqa: E402

GIB = 2**30
# total layers (blocks + embedding + head) -> hidden size, heads: realistic shapes per depth
SHAPES = {24: (4096, 32), 96: (12288, 96), 400: (4096, 32), 2000: (2048, 16)}
GPU_COUNTS = (8, 64, 512, 1024, 4096)


def chain_graph(num_layers: int):
    hidden, heads = SHAPES[num_layers]
    return gpt(
        f"gpt-{num_layers}L-h{hidden}",
        layers=num_layers - 2,
        s=2048,
        h=hidden,
        a=heads,
        vocab=50257,
    )


def time_search(graph, num_gpus: int, repeats: int) -> dict:
    cluster = Cluster(num_gpus=num_gpus, gpu_memory_bytes=80 * GIB)
    training = TrainingConfig(global_batch=max(512, 2 * num_gpus))
    walls, result, error = [], None, None
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            result = plan(graph, cluster, training, time_limit_s=300)
        except InfeasibleError as infeasible:
            error = infeasible
        walls.append(time.perf_counter() - start)
    row = {
        "layers": graph.num_layers,
        "gpus": num_gpus,
        "global_batch": training.global_batch,
        "wall_s_median": statistics.median(walls),
        "repeats": repeats,
    }
    if result is None:
        return row | {
            "status": "INFEASIBLE",
            "config": "-",
            "peak_gib": error.best_peak_bytes / GIB,
            "note": str(error)[:120],
        }
    even, params = result.baselines["even"], result.baselines["parameters"]

    def ok(baseline) -> str:
        """Whether a baseline split fits memory and meets the throughput constraint."""
        return (
            "yes"
            if baseline.fits and meets_throughput(result, baseline)
            else ("no (memory)" if not baseline.fits else "no (throughput)")
        )

    return row | {
        "status": result.solver.status,
        "config": result.config.label(),
        "configs": f"{result.solver.configs_total}/{result.solver.configs_solved}/"
        f"{result.solver.configs_pruned}",
        "peak_gib": result.peak_bytes / GIB,
        "throughput": result.throughput,
        "even_peak_gib": even.peak_bytes / GIB,
        "params_peak_gib": params.peak_bytes / GIB,
        "vs_even_pct": 100 * (result.peak_bytes - even.peak_bytes) / even.peak_bytes,
        "vs_params_pct": 100 * (result.peak_bytes - params.peak_bytes) / params.peak_bytes,
        "even_ok": ok(even),
        "params_ok": ok(params),
    }


def time_chain_solves(graph, stages: int, repeats: int, with_budget: bool) -> dict:
    config = ParallelConfig(pp=stages, tp=1, dp=2, micro_batch=1, num_microbatches=4 * stages)
    costs = layer_costs(
        graph,
        config,
        Cluster(num_gpus=2 * stages),
        TrainingConfig(global_batch=config.global_batch),
    )
    budget = None
    if with_budget:  # 10% above the fastest split's iteration time: a binding constraint
        fastest = solve_chain(StageProblem(costs=costs, objective="time"))
        budget = int(fastest.objective * 1.1)
    problem = StageProblem(costs=costs, iteration_budget_ns=budget)
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        solution = solve_chain(problem)
        walls.append(time.perf_counter() - start)
    peak = None if solution.objective is None else solution.objective / GIB
    return {
        "layers": graph.num_layers,
        "stages": stages,
        "budget": "1.1x fastest" if with_budget else "none",
        "status": solution.status,
        "peak_gib": peak,
        "wall_s_median": statistics.median(walls),
        "repeats": repeats,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="24 and 96 layers only")
    args = parser.parse_args()
    sizes = (24, 96) if args.quick else tuple(SHAPES)
    search_rows = []
    for num_layers in sizes:
        graph = chain_graph(num_layers)
        for num_gpus in GPU_COUNTS:
            repeats = args.repeats if num_layers <= 400 else 1
            row = time_search(graph, num_gpus, repeats)
            search_rows.append(row)
            print(
                f"{num_layers:5d} layers {num_gpus:5d} GPUs: {row['wall_s_median']:.2f} s "
                f"{row['status']} {row['config']} peak {row['peak_gib']:.2f} GiB "
                f"vs even {row.get('vs_even_pct', float('nan')):+.1f}%",
                flush=True,
            )
    chain_rows = []
    big = chain_graph(2000 if not args.quick else 96)
    for stages in (s for s in (8, 32, 128) if s <= big.num_layers):
        for with_budget in (False, True):
            row = time_chain_solves(big, stages, 5, with_budget)
            chain_rows.append(row)
            print(
                f"chain {row['layers']} x {stages} budget {row['budget']}: "
                f"{row['wall_s_median'] * 1e3:.1f} ms",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/bench_solver.py" + (" --quick" if args.quick else "")
    search_cols = [
        "layers",
        "gpus",
        "global_batch",
        "wall_s_median",
        "status",
        "config",
        "configs",
        "peak_gib",
        "throughput",
        "even_peak_gib",
        "params_peak_gib",
        "vs_even_pct",
        "vs_params_pct",
        "even_ok",
        "params_ok",
    ]
    chain_cols = ["layers", "stages", "budget", "status", "peak_gib", "wall_s_median"]
    with open(args.out / "bench_solver.csv", "w", newline="") as stream:
        writer = csv.DictWriter(
            stream,
            fieldnames=["table", *search_cols, "repeats", "stages", "budget", "note"],
            extrasaction="ignore",
        )
        writer.writeheader()
        writer.writerows({"table": "search", **row} for row in search_rows)
        writer.writerows({"table": "chain", **row} for row in chain_rows)
    lines = [
        "# Solver benchmark",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, run {time.strftime('%Y-%m-%d')}",
        "",
        "## Full config search (80 GiB GPUs, 8 per node, max slowdown 1.25, ZeRO 0, micro-batch "
        "1/2/4)",
        "",
        "configs = total/solved/pruned; vs_* = plan peak vs that split of the same config "
        "(negative = our plan needs less); *_ok = whether that split fits in memory and meets "
        "the throughput constraint (a split that misses the constraint can have a lower peak "
        "than the constrained optimum).",
        "",
        *markdown_table(search_rows, search_cols, ".3f"),
        "",
        "## Per-config exact chain solves (memory objective)",
        "",
        *markdown_table(chain_rows, chain_cols, ".3f"),
        "",
    ]
    write_report(args.out, "bench_solver.md", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
