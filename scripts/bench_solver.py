"""Solver benchmark: full config searches on GPT-style chains and per-config chain solves.

    python scripts/bench_solver.py [--quick] [--out benchmarks]

Writes benchmarks/bench_solver.md and .csv: for chains of 24, 96, 400 and 2000 layers and 8..4096
GPUs (80 GiB each), the wall time of the full search (median of --repeats runs), the plan found
(config, peak, throughput, status) and the even (Megatron) and parameter-balanced (DeepSpeed)
splits of the same config; then per-config exact chain solves of 2000 layers x 8..128 stages.
Targets: 400 layers on 1024 GPUs under 5 s median; 2000 x 128 well under a second.
"""

from __future__ import annotations

import statistics
import time

import harness
from harness import GIB, markdown_table
from make_examples import gpt

from solver import Cluster, InfeasibleError, ParallelConfig, TrainingConfig, plan
from solver.backends.chain import solve_chain
from solver.backends.problem import StageProblem
from solver.costs import layer_costs
from solver.report.plan_report import meets_throughput

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
    solution, walls = harness.repeat(lambda: solve_chain(problem), repeats)
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


SEARCH_COLUMNS = [
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
CHAIN_COLUMNS = ["layers", "stages", "budget", "status", "peak_gib", "wall_s_median"]


def search_rows(sizes: tuple[int, ...], repeats: int) -> list[dict]:
    """The full searches of every chain size on every GPU count (2000 layers: one run each)."""
    rows = []
    for num_layers in sizes:
        graph = chain_graph(num_layers)
        for num_gpus in GPU_COUNTS:
            row = time_search(graph, num_gpus, repeats if num_layers <= 400 else 1)
            rows.append(row)
            print(
                f"{num_layers:5d} layers {num_gpus:5d} GPUs: {row['wall_s_median']:.2f} s "
                f"{row['status']} {row['config']} peak {row['peak_gib']:.2f} GiB "
                f"vs even {row.get('vs_even_pct', float('nan')):+.1f}%",
                flush=True,
            )
    return rows


def chain_rows(num_layers: int) -> list[dict]:
    """Exact chain solves of one chain into 8, 32 and 128 stages, without and with a budget."""
    rows = []
    big = chain_graph(num_layers)
    for stages in (s for s in (8, 32, 128) if s <= big.num_layers):
        for with_budget in (False, True):
            row = time_chain_solves(big, stages, 5, with_budget)
            rows.append(row)
            print(
                f"chain {row['layers']} x {stages} budget {row['budget']}: "
                f"{row['wall_s_median'] * 1e3:.1f} ms",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, quick="24 and 96 layers only")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    searches = search_rows((24, 96) if args.quick else tuple(SHAPES), args.repeats)
    chains = chain_rows(96 if args.quick else 2000)
    harness.write_csv(
        args.out / "bench_solver.csv",
        [{"table": "search", **row} for row in searches]
        + [{"table": "chain", **row} for row in chains],
        ["table", *SEARCH_COLUMNS, "repeats", "stages", "budget", "note"],
        extrasaction="ignore",
    )
    lines = [
        "# Solver benchmark",
        "",
        f"Command: {run.command_text}  ",
        f"Machine: {harness.machine()}, Python {harness.python_version()}, run {harness.today()}",
        "",
        "## Full config search (80 GiB GPUs, 8 per node, max slowdown 1.25, ZeRO 0, micro-batch "
        "1/2/4)",
        "",
        "configs = total/solved/pruned; vs_* = plan peak vs that split of the same config "
        "(negative = our plan needs less); *_ok = whether that split fits in memory and meets "
        "the throughput constraint (a split that misses the constraint can have a lower peak "
        "than the constrained optimum).",
        "",
        *markdown_table(searches, SEARCH_COLUMNS, ".3f"),
        "",
        "## Per-config exact chain solves (memory objective)",
        "",
        *markdown_table(chains, CHAIN_COLUMNS, ".3f"),
        "",
    ]
    harness.write_report(args.out, "bench_solver.md", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
