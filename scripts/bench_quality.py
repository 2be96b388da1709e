"""Plan quality: our plan vs the partitioners people use, on zoo models and clusters.

    python scripts/bench_quality.py [--out benchmarks]

For each case (a zoo preset profiled with fake tensors, bf16, batch 1; a cluster; a global batch)
``solver.plan`` runs with its default options (max slowdown 1.25, ZeRO 0, micro-batch 1/2/4, no
recompute), then every partitioner of ``solver.report.baselines.PARTITIONERS`` splits the SAME
config (pp, tp, dp, micro-batch), and the cost model evaluates each split: peak, whether it fits,
throughput, and our reduction of the peak in %. Then the largest GPT-3-shaped model (hidden
12288, 96 heads, sequence 2048) that fits on 64 x 80 GiB GPUs, by binary search on the block count,
for our plan and for the best config of each chain partitioner (mCAP's "1.55x larger models").
Writes benchmarks/bench_quality.md and .csv.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import harness
from harness import GIB, markdown_table

from solver import Cluster, InfeasibleError, TrainingConfig, graph_from_dict, load_graph, plan
from solver.backends import resolve_backend, solve
from solver.backends.problem import StageProblem
from solver.costs import layer_costs, stage_costs
from solver.evaluation import evaluate_assignment, evaluate_partitioners
from solver.report.baselines import (
    PARTITIONER_SOURCES,
    PARTITIONERS,
    even_split,
    parameter_balanced_split,
    uniform_split,
)
from solver.report.plan_report import meets_throughput
from solver.search.config_search import build_entries

TARGETS = {"even": 30.0, "parameters": 20.0}
"""Target median peak reduction (%) against the even and the parameter-balanced split."""


@dataclass(frozen=True)
class Case:
    preset: str
    gpus: int
    gpu_gib: int
    global_batch: int


CASES = (
    Case("gpt3-2.7b", 8, 40, 64),
    Case("gpt3-13b", 32, 40, 128),
    Case("gpt3-175b", 256, 80, 512),
    Case("gpt3-175b", 1024, 80, 1536),
    Case("llama2-70b", 64, 80, 128),
    Case("t5-11b", 32, 40, 256),
    Case("vit-h14", 8, 40, 512),
    Case("resnet-152", 8, 40, 256),
    Case("bert-large", 8, 40, 256),
)
LARGEST_CLUSTER = Cluster(num_gpus=64, gpu_memory_bytes=80 * GIB)
LARGEST_BATCH = 128
CHAIN_SPLITS = {
    "even": even_split,
    "uniform": uniform_split,
    "parameters": parameter_balanced_split,
}
"""Splits that depend on the graph only: their best config is found by evaluating each one."""


class GraphCache:
    """Profiles each preset once per run (``profiling.export.export_graph``) under a temp dir."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def get(self, preset: str, overrides: dict | None = None):
        from profiling.export import export_graph

        suffix = "".join(f"-{k}{v}" for k, v in sorted((overrides or {}).items()))
        path = self.folder / f"{preset}{suffix}.json"
        if not path.exists():
            export_graph(preset, dtype="bf16", overrides=overrides).save(path)
        return load_graph(path)


def run_case(case: Case, graphs: GraphCache) -> tuple[list[dict], dict]:
    """Rows of one case: our plan, our memory-only optimum of its config, every baseline."""
    graph = graphs.get(case.preset)
    cluster = Cluster(num_gpus=case.gpus, gpu_memory_bytes=case.gpu_gib * GIB)
    training = TrainingConfig(global_batch=case.global_batch)
    with harness.Stopwatch() as clock:
        result = plan(graph, cluster, training)
    wall = clock.wall_s
    costs = layer_costs(graph, result.config, cluster, training)
    # the same config without the throughput constraint: what the baselines are not held to
    backend = resolve_backend("auto", costs.is_chain())
    memory_only = solve(StageProblem(costs=costs), backend, time_limit_s=120)
    label = f"{case.preset} {case.gpus}x{case.gpu_gib}G B{case.global_batch}"
    base = {"case": label, "layers": graph.num_layers, "config": result.config.label()}
    evaluations = {
        "ours": result.evaluation,
        "ours-memory": evaluate_assignment(
            graph, costs, memory_only.stage_of_layer, cluster=cluster, training=training
        ),
    } | evaluate_partitioners(graph, costs, cluster=cluster, training=training)
    summary = {
        "case": label,
        "config": result.config.label(),
        "ours_gib": result.peak_bytes / GIB,
        "ours_memory_gib": memory_only.objective / GIB,
    }
    rows = []
    for name, evaluation in evaluations.items():
        reduction = 100 * (evaluation.peak_bytes - result.peak_bytes) / evaluation.peak_bytes
        reduction_memory = (
            100 * (evaluation.peak_bytes - memory_only.objective) / evaluation.peak_bytes
        )
        rows.append(
            base
            | {
                "partitioner": name,
                "peak_gib": evaluation.peak_bytes / GIB,
                "fits": evaluation.fits,
                "throughput": evaluation.throughput,
                "meets_constraint": meets_throughput(result, evaluation),
                "reduction_pct": reduction,
                "reduction_memory_pct": reduction_memory,
            }
            | ({"plan_wall_s": wall} if name == "ours" else {})
        )
        if name in PARTITIONERS:
            summary[name] = reduction
            summary[f"{name}/mem"] = reduction_memory
    return rows, summary


def gpt_with_blocks(template, num_blocks: int):
    """The profiled GPT graph with ``num_blocks`` copies of its (identical) block layer."""
    document = template.to_dict()
    layers = document["layers"]
    block = layers[1]
    document["layers"] = (
        [layers[0]] + [dict(block, name=f"layers.{i}") for i in range(num_blocks)] + [layers[-1]]
    )
    document["model"] = f"gpt3-175b-shape-{num_blocks}-blocks"
    return graph_from_dict(document)


def fits_ours(graph) -> bool:
    try:
        plan(graph, LARGEST_CLUSTER, TrainingConfig(global_batch=LARGEST_BATCH))
    except InfeasibleError:
        return False
    return True


def best_split_peak(graph, split_of) -> int:
    """Smallest peak of ``split_of``'s split over every candidate config (throughput ignored)."""
    training = TrainingConfig(global_batch=LARGEST_BATCH)
    return min(
        max(s.peak_bytes for s in stage_costs(e.costs, split_of(graph, e.costs.num_stages)))
        for e in build_entries(graph, LARGEST_CLUSTER, training)
    )


def largest_fitting(template, fits) -> int:
    """Largest block count N with fits(graph of N blocks) (doubling, then binary search)."""
    low, high = 0, 8
    while fits(gpt_with_blocks(template, high)):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        if fits(gpt_with_blocks(template, middle)):
            low = middle
        else:
            high = middle
    return low


def largest_models(graphs: GraphCache) -> list[dict]:
    template = graphs.get("gpt3-175b", {"layers": 2})
    # the replicated block is what the profiler gives for any depth
    exported, copied = graphs.get("gpt3-175b", {"layers": 4}), gpt_with_blocks(template, 4)
    assert exported.to_dict()["layers"] == copied.to_dict()["layers"], "blocks differ by depth"
    capacity = LARGEST_CLUSTER.gpu_memory_bytes
    checks = {"ours": fits_ours} | {
        name: (lambda graph, split_of=split_of: best_split_peak(graph, split_of) <= capacity)
        for name, split_of in CHAIN_SPLITS.items()
    }
    rows = []
    for name, fits in checks.items():
        blocks = largest_fitting(template, fits)
        graph = gpt_with_blocks(template, blocks)
        rows.append(
            {
                "partitioner": name,
                "blocks": blocks,
                "params_billions": sum(layer.params for layer in graph.layers) / 1e9,
            }
        )
    ours = rows[0]["params_billions"]
    for row in rows:
        row["ours_over_this"] = ours / row["params_billions"]
    return rows


RECOMPUTE_CASES = (Case("gpt3-175b", 64, 80, 256), Case("llama2-70b", 32, 80, 128))
"""Cases for selective recomputation against Megatron's full recomputation."""
MIXED_GPUS = 128
"""GPT-3 175B on half 40 GiB and half 80 GiB GPUs (8 per node) vs all 40 GiB."""


def recompute_rows(graphs: GraphCache) -> list[dict]:
    """Our plan with --recompute auto (selective) vs full (Megatron --recompute-granularity full
    --recompute-method uniform: every layer), default options otherwise, same cluster."""
    rows = []
    for case in RECOMPUTE_CASES:
        graph = graphs.get(case.preset)
        cluster = Cluster(num_gpus=case.gpus, gpu_memory_bytes=case.gpu_gib * GIB)
        full_throughput = None
        for mode, label in (
            ("full", "full"),
            ("auto", "auto"),
            ("auto", "auto at full's throughput"),
        ):
            floor = {"min_throughput": full_throughput} if label != mode else {}
            training = TrainingConfig(global_batch=case.global_batch, recompute=mode, **floor)
            clock = harness.Stopwatch()
            result = plan(graph, cluster, training, time_limit_s=60)
            recomputed = sum(len(stage.recomputed) for stage in result.stages)
            if mode == "full":
                recomputed, full_throughput = graph.num_layers, result.throughput
            rows.append(
                {
                    "case": f"{case.preset} {case.gpus}x{case.gpu_gib}G B{case.global_batch}",
                    "recompute": label,
                    "config": result.config.label(),
                    "recomputed_layers": f"{recomputed}/{graph.num_layers}",
                    "peak_gib": result.peak_bytes / GIB,
                    "throughput": result.throughput,
                    "status": result.solver.status,
                    "gap_pct": 100 * result.solver.gap,
                    "wall_s": clock.wall_s,
                }
            )
    return rows


def mixed_cluster_rows(graphs: GraphCache) -> list[dict]:
    """GPT-3 175B on a 40/80 GiB mix (absolute peak and max utilization) vs all 40 GiB."""
    from solver.files.cluster_file import cluster_from_dict

    graph = graphs.get("gpt3-175b")
    training = TrainingConfig(global_batch=256)

    def group(name: str, gib: int) -> dict:
        nodes = MIXED_GPUS // 2 // 8
        return {
            "name": name,
            "num_nodes": nodes,
            "gpus_per_node": 8,
            "gpu_memory": f"{gib}GiB",
            "gpu_tflops": 312,  # A100, as the Cluster defaults
        }

    mixed = cluster_from_dict(
        {"format": "cluster", "version": 1, "groups": [group("40g", 40), group("80g", 80)]}
    )
    rows = []
    for label, cluster, options in (
        ("all 40 GiB", Cluster(num_gpus=MIXED_GPUS, gpu_memory_bytes=40 * GIB), {}),
        ("40/80 GiB mix, utilization", mixed, {"memory_objective": "utilization"}),
        ("40/80 GiB mix, absolute", mixed, {"memory_objective": "absolute"}),
    ):
        clock = harness.Stopwatch()
        try:
            result = plan(graph, cluster, dataclasses.replace(training, **options))
        except InfeasibleError as error:
            rows.append({"cluster": label, "config": "-", "fits": "no: " + str(error)[:60]})
            continue
        utilization = max(result.evaluation.utilization_ppm) / 1e4
        rows.append(
            {
                "cluster": label,
                "config": result.config.label(),
                "fits": "yes",
                "peak_gib": result.peak_bytes / GIB,
                "max_utilization_pct": utilization,
                "throughput": result.throughput,
                "wall_s": clock.wall_s,
            }
        )
    return rows


def _met(value: float, target: float) -> str:
    return "yes" if value >= target else "no"


COLUMNS = [
    "case",
    "layers",
    "config",
    "partitioner",
    "peak_gib",
    "fits",
    "throughput",
    "meets_constraint",
    "reduction_pct",
    "reduction_memory_pct",
    "plan_wall_s",
]
SUMMARY_KEYS = [key for name in PARTITIONERS for key in (name, f"{name}/mem")]
"""Per-case summary columns: each partitioner's reduction with our plan and our memory optimum."""
SUMMARY_COLUMNS = ["case", "config", "ours_gib", "ours_memory_gib", *SUMMARY_KEYS]


def suite(graphs: GraphCache) -> tuple[list[dict], list[dict]]:
    """(every row, one summary per case) of the ``CASES``."""
    rows, summaries = [], []
    for case in CASES:
        case_rows, summary = run_case(case, graphs)
        rows += case_rows
        summaries.append(summary)
        print(
            f"{summary['case']}: {summary['config']} ours {summary['ours_gib']:.2f} GiB, "
            + ", ".join(
                f"vs {name} {summary[name]:+.1f}% ({summary[name + '/mem']:+.1f}%)"
                for name in PARTITIONERS
            ),
            flush=True,
        )
    return rows, summaries


def median_rows(summaries: list[dict]) -> list[dict]:
    """Per partitioner: the median, min and max reduction over the suite, against its target."""
    medians = {key: statistics.median(s[key] for s in summaries) for key in SUMMARY_KEYS}
    return [
        {
            "partitioner": name,
            "source": PARTITIONER_SOURCES[name],
            "median_pct": medians[name],
            "min_pct": min(s[name] for s in summaries),
            "max_pct": max(s[name] for s in summaries),
            "median_memory_only_pct": medians[f"{name}/mem"],
            "min_memory_only_pct": min(s[f"{name}/mem"] for s in summaries),
            "target_pct": TARGETS.get(name, ""),
            "met_memory_only": ""
            if name not in TARGETS
            else _met(medians[f"{name}/mem"], TARGETS[name]),
            "met_default_plan": "" if name not in TARGETS else _met(medians[name], TARGETS[name]),
        }
        for name in PARTITIONERS
    ]


def main(argv: list[str] | None = None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    run = harness.Run.start(__file__, argv)
    with tempfile.TemporaryDirectory() as scratch:
        graphs = GraphCache(Path(scratch))
        rows, summaries = suite(graphs)
        largest = largest_models(graphs)
        for row in largest:
            print(f"largest GPT-3-shaped model, {row['partitioner']}: {row['blocks']} blocks")
        recompute = recompute_rows(graphs)
        for row in recompute:
            print(row, flush=True)
        mixed = mixed_cluster_rows(graphs)
        for row in mixed:
            print(row, flush=True)
    total_s = run.elapsed_s
    harness.write_csv(
        args.out / "bench_quality.csv",
        [{"table": "suite", **row} for row in rows]
        + [
            {"table": "largest", **{k: v for k, v in row.items() if k != "ours_over_this"}}
            for row in largest
        ],
        ["table", *COLUMNS, "blocks", "params_billions"],
    )
    medians = median_rows(summaries)
    lines = [
        "# Plan quality against baseline partitioners",
        "",
        f"Command: {run.command_text}  ",
        f"Machine: {harness.machine()}, Python {harness.python_version()}, {harness.cores()} "
        f"cores, load average {run.load_before:.1f} at the start (a shared machine), run "
        f"{harness.today()}, {total_s:.0f} s in all (profiling included)",
        "",
        *SUITE_TEXT,
        "",
        "## Median reduction of the peak per GPU across the suite",
        "",
        *markdown_table(medians, list(medians[0]), ".1f"),
        "",
        "## Reduction per case (%)",
        "",
        *markdown_table(summaries, SUMMARY_COLUMNS, ".1f"),
        "",
        "## Largest GPT-3-shaped model on 64 x 80 GiB (global batch 128)",
        "",
        "Blocks of GPT-3 175B's shape (hidden 12288, 96 heads, sequence 2048) plus embedding and "
        "head; our plan (any config, default options) vs the best config of each fixed split "
        "(throughput ignored for those).",
        "",
        *markdown_table(largest, list(largest[0]), ".3f"),
        "",
        *RECOMPUTE_TEXT,
        "",
        *markdown_table(recompute, list(recompute[0]), ".3f"),
        "",
        f"## GPT-3 175B on {MIXED_GPUS} GPUs: a 40/80 GiB mix vs all 40 GiB",
        "",
        "The mix has half its GPUs at 40 GiB and half at 80 GiB (`--cluster`, stages placed on "
        "groups by the solver); global batch 256, default options.",
        "",
        *markdown_table(mixed, list(mixed[-1]), ".3f"),
        "",
        "## All rows",
        "",
        *markdown_table(rows, COLUMNS, ".3f"),
        "",
    ]
    harness.write_report(args.out, "bench_quality.md", lines, note=f" in {total_s:.0f} s")
    return 0


SUITE_TEXT = [
    "Graphs: zoo presets profiled with fake tensors (`profiling.export.export_graph`, bf16, "
    "batch 1). Ours: `solver.plan` with default options (max slowdown 1.25 against the "
    "fastest plan that fits, ZeRO 0, micro-batch 1/2/4, no recompute, megatron runtime). "
    "Every baseline splits the same config as our plan and is evaluated by the same cost "
    "model. Reduction = (baseline peak - our peak) / baseline peak, with our plan's peak "
    "(`*_pct`, `reduction_pct`) and with our memory-only optimum of the same config "
    "(`ours-memory`: the exact minimum without the throughput constraint, which the baselines "
    "are not held to either; `*/mem`, `*_memory_only_pct`). A baseline may beat our "
    "plan's peak when it is slower than the plan's throughput constraint allows "
    "(`meets_constraint` = no); it never beats the memory-only optimum. "
    "`met_memory_only` compares the memory-only optimum's median with its target "
    "(partitioner against partitioner), `met_default_plan` the default plan's."
]
RECOMPUTE_TEXT = [
    "## Selective recomputation vs Megatron's full recomputation",
    "",
    "Our plan with `--recompute auto` (the recomputed layers chosen jointly with the split) "
    "vs `--recompute full` (every layer, Megatron's `--recompute-granularity full`), default "
    "options otherwise (max slowdown 1.25: each mode's throughput floor is relative to the "
    "fastest plan that fits in that mode, so plain auto must be faster than full), 60 s "
    "time limit; `auto at full's throughput` holds auto to the full plan's throughput "
    "instead (the same floor for both).",
]


if __name__ == "__main__":
    raise SystemExit(main())
