"""Mixture-of-experts plans: expert-parallel degrees and Megatron's even split, per routing factor.

    python scripts/bench_moe.py [--out benchmarks] [--time-limit 60] [--graph-dir DIR]

For Mixtral-8x7B on 64 x 80 GiB and DeepSeek-MoE-16B on 32 x 80 GiB (the zoo presets, profiled
with fake tensors by ``profiling.export``; ``--graph-dir`` reads ``<preset>.json`` files instead),
bf16-mixed on the megatron runtime with the distributed optimizer (ZeRO-1), and for the routing
factor 1.0 (balanced) and dropless (the worst case, ep min(k, E/ep) / k):

  - for each ep in 1, 2, 4, 8 (pinned ``--ep``): the memory-optimal plan over every pp, tp, dp
    (ep | dp) and micro-batch within 1.25x of the fastest plan that fits, the fastest plan that
    fits, and Megatron's even split of each one's config;
  - ep auto: what the planner picks among every ep dividing E and dp.

Reported: the config, planned peak per GPU, throughput, fits or not, and the even split's peak,
throughput and fit. Writes benchmarks/bench_moe.md and benchmarks/bench_moe.csv.
"""

from __future__ import annotations

from pathlib import Path

import harness
from harness import GIB, markdown_table

from solver import Cluster, InfeasibleError, TrainingConfig, load_graph, plan
from solver.costs import routing_factor
from solver.costs.moe import routed_experts
from solver.reserve import DEFAULT_RESERVE

CASES = (
    # preset, GPUs, GPU memory (GiB), global batch
    ("mixtral-8x7b", 64, 80, 256),
    ("deepseek-moe-16b", 32, 80, 256),
)
EXPERT_DEGREES = (1, 2, 4, 8, None)  # None: --ep auto
FACTORS = (1.0, "dropless")
OBJECTIVES = ("memory", "throughput")
COLUMNS = (
    "model, cluster",
    "routing",
    "ep",
    "objective",
    "config",
    "peak GiB",
    "samples/s",
    "fits",
    "even peak GiB",
    "even samples/s",
    "even fits",
    "f",
    "status",
    "time s",
)


def load(preset: str, graph_dir: Path | None):
    """The preset's layer graph: from ``graph_dir`` when given, else profiled (fake tensors)."""
    if graph_dir is not None:
        return load_graph(graph_dir / f"{preset}.json")
    from profiling.export import export_graph

    return export_graph(preset)


def run_case(graph, gpus, memory, batch, factor, ep, objective, time_limit) -> dict:
    """One row: the plan of ``ep`` (None: auto) for ``objective`` and its even split."""
    cluster = Cluster(num_gpus=gpus, gpu_memory_bytes=memory * GIB)
    training = TrainingConfig(
        global_batch=batch,
        micro_batch_sizes=(1, 2),
        zero_stages=(1,),
        recompute="none",
        sequence_parallel="auto",
        objective=objective,
        ep=None if ep is None else (ep,),
        moe_capacity_factor=factor,
        reserve=DEFAULT_RESERVE,
    )
    row = {
        "model, cluster": f"{graph.model} {gpus}x{memory}G B{batch}",
        "routing": "balanced (1.0)" if factor == 1.0 else str(factor),
        "ep": "auto" if ep is None else ep,
        "objective": "memory (<= 1.25x slower)" if objective == "memory" else "throughput",
    }
    clock = harness.Stopwatch()
    try:
        result = plan(graph, cluster, training, time_limit_s=time_limit, suggest_gpus=False)
    except InfeasibleError as error:
        best = error.best_peak_bytes
        return row | {
            "peak GiB": "" if best is None else f"{best / GIB:.2f}",
            "fits": "no",
            "status": f"none fits ({str(error).split(';')[0]})",
            "time s": f"{clock.wall_s:.1f}",
        }
    even = result.baselines["even"]
    config = result.config
    return row | {
        "config": config.label(),
        "peak GiB": f"{result.peak_bytes / GIB:.2f}",
        "samples/s": f"{result.throughput:.4g}",
        "fits": "yes" if result.evaluation.fits else "no",
        "even peak GiB": f"{even.peak_bytes / GIB:.2f}",
        "even samples/s": f"{even.throughput:.4g}",
        "even fits": "yes" if even.fits else "no",
        "f": f"{float(routing_factor(graph, config, training)):.3g}",
        "status": result.solver.status,
        "time s": f"{clock.wall_s:.1f}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--graph-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    rows, models = [], []
    for preset, gpus, memory, batch in CASES:
        graph = load(preset, args.graph_dir)
        experts = routed_experts(graph)
        assert experts is not None, f"{preset}: the graph has no routed experts"
        meta = graph.meta
        models.append(
            f"{graph.model}: {sum(layer.params for layer in graph.layers) / 1e9:.1f} B "
            f"parameters, {sum(layer.expert_params for layer in graph.layers) / 1e9:.1f} B in "
            f"routed experts, E {experts.num_experts}, top-{experts.top_k}, shared "
            f"{experts.shared_experts}, seq {meta.get('seq_len')}, {meta.get('dtype')}"
        )
        for factor in FACTORS:
            for ep in EXPERT_DEGREES:
                for objective in OBJECTIVES:
                    rows.append(
                        run_case(graph, gpus, memory, batch, factor, ep, objective, args.time_limit)
                    )
                    print(rows[-1], flush=True)
    harness.write_csv(args.out / "bench_moe.csv", rows, COLUMNS)
    text = [
        "# Mixture of experts: expert-parallel degrees and the even split",
        "",
        f"Command: {run.command_text} (Python {harness.python_version()}, "
        f"{harness.architecture()}, time limit {args.time_limit:.0f} s per plan). CSV: "
        "`bench_moe.csv`.",
        "",
        *(f"- {line}" for line in models),
        "",
        "bf16-mixed, megatron runtime, distributed optimizer (ZeRO-1: the dense states over dp, "
        "the experts' over dp / ep), sequence parallelism with tp > 1 (megatron-core refuses MoE "
        "layers with TP but without SP), micro-batch 1 or 2, no recomputation, the default reserve "
        "(1 GiB + 5%: 75 of 80 GiB usable). *ep*: pinned `--ep`, or auto (every ep dividing E "
        "and dp). *objective* memory: the smallest peak of any config and split at most 1.25x "
        "slower than the fastest plan that fits (the planner's default); throughput: the "
        "fastest plan that fits. *even*: Megatron's even split of the row's config. "
        "*routing*: the routing factor f "
        "(docs/cost-model.md#mixture-of-experts-and-expert-parallelism): balanced, or dropless, "
        "the worst case a dropless router can send one GPU, f = ep min(k, E/ep) / k; column f "
        "is the factor of the row's config. none fits: no config with that ep fits (the best "
        "peak shown).",
        "",
        *markdown_table(rows, list(COLUMNS)),
        "",
    ]
    harness.write_report(args.out, "bench_moe.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
