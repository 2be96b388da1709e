"""The option groups the solver's CLIs share: graph and cluster, training, search space and
solver, and turning them into a ``Cluster`` and a ``TrainingConfig``.

The CLIs only parse, call the API, print and write JSON; the plumbing every CLI of the project
shares (parser, argument types, errors, outputs, Ctrl-C) is ``solver/console.py``.
"""

from __future__ import annotations

import argparse
from typing import Any

from solver.calibration import Calibration, load_calibration
from solver.console import (
    float_or_nan,
    format_count,
    int_in,
    int_list_in,
    number_in,
    positive_float,
)
from solver.errors import InputError, quote
from solver.parallel import check_searched
from solver.precision import (
    BYTE_FIELDS,
    DEFAULT_OPTIMIZER_IMPL,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
)
from solver.reserve import MemoryReserve, default_reserve, parse_reserve
from solver.specs import (
    DEFAULT_GRAD_LIFETIME,
    GB_PER_S_RANGE,
    GPU_TFLOPS_RANGE,
    GRAD_BYTES_PER_PARAM,
    GRAD_LIFETIMES,
    MAX_BYTES_PER_PARAM,
    MAX_CAPACITY_FACTOR,
    MAX_DEGREE,
    MAX_GLOBAL_BATCH,
    MAX_GPU_MEMORY_BYTES,
    MAX_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_P2P_LATENCY_US,
    MAX_SLOWDOWN,
    MAX_VIRTUAL_STAGES,
    MEMORY_MODELS,
    MEMORY_OBJECTIVES,
    MOE_DROPLESS,
    RECOMPUTE_CHOICES,
    RUNTIMES,
    SEQUENCE_PARALLEL_CHOICES,
    ZERO_STAGES,
    Cluster,
    TrainingConfig,
)
from solver.units import parse_bytes

MAX_WORKERS = 256
"""Most CP-SAT worker threads --workers takes."""
DEFAULT_MICRO_BATCHES = (1, 2, 3, 4)
"""--micro-batch's default: the sizes a user sweeps by hand."""


def slowdown(text: str) -> float | None:
    if text.lower() == "none":
        return None
    value = float_or_nan(text)
    if not 1 <= value <= MAX_SLOWDOWN:
        raise argparse.ArgumentTypeError(
            f"must be >= 1 (a number in [1, {MAX_SLOWDOWN:g}]) or 'none', got {quote(text)}"
        )
    return value


def expert_degrees(text: str) -> list[int] | None:
    """--ep: 'auto' (None: every ep dividing the experts and dp on an MoE graph, 1 on a dense
    one) or comma-separated degrees."""
    if text.strip().lower() == "auto":
        return None
    return int_list_in(1, MAX_DEGREE)(text)


def capacity_factor(text: str) -> float | str:
    """--moe-capacity-factor: 'dropless' or a number in [1, MAX_CAPACITY_FACTOR]."""
    if text.strip().lower() == MOE_DROPLESS:
        return MOE_DROPLESS
    value = float_or_nan(text)
    if not 1 <= value <= MAX_CAPACITY_FACTOR:
        raise argparse.ArgumentTypeError(
            f"must be a number in [1, {MAX_CAPACITY_FACTOR:g}] (each expert takes at most that "
            f"many times its balanced share of the tokens) or 'dropless', got {quote(text)}"
        )
    return value


def memory_size(text: str) -> int:
    try:
        return parse_bytes(text, what="size", maximum=MAX_GPU_MEMORY_BYTES)
    except InputError as error:  # argparse names the flag
        raise argparse.ArgumentTypeError(str(error).removeprefix("size: ")) from None


def size_list(text: str) -> list[int]:
    """'40GiB,80GiB' -> sizes in bytes; empty items and bad sizes are errors."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"expected comma-separated sizes like 40GiB,80GiB, got {quote(text)}"
        )
    if any(not part for part in parts):
        raise argparse.ArgumentTypeError(
            f"empty item in {quote(text)}; write comma-separated sizes like 40GiB,80GiB"
        )
    return [memory_size(part) for part in parts]


def add_graph_and_cluster(parser: argparse.ArgumentParser, *, graph_optional: bool = False) -> None:
    """The graph argument, --cluster and the cluster and training flags, --json and --quiet;
    ``graph_optional``: the graph and --global-batch may be left out (solver.evaluate --plan)."""
    parser.add_argument(
        "graph",
        nargs="?" if graph_optional else None,
        help="layer-graph JSON file (docs/layer-graph.md)"
        + ("; with --plan, default: the graph the plan records" if graph_optional else ""),
    )
    add_cluster_file_option(parser)
    add_cluster_options(parser)
    add_training_options(parser, batch_required=not graph_optional)
    parser.add_argument("--json", metavar="OUT", help="also write the result as JSON to OUT")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


CLUSTER_FLAGS = (
    "gpu_memory",
    "gpus_per_node",
    "gpu_tflops",
    "flops_efficiency",
    "intra_node_gbps",
    "inter_node_gbps",
    "memory_gbps",
    "p2p_latency_us",
)
"""Destinations of the flags a cluster file replaces."""


def add_cluster_file_option(parser: argparse.ArgumentParser) -> None:
    """--cluster FILE: node groups (docs/cluster.md); replaces --gpus and the cluster flags."""
    parser.add_argument(
        "--cluster",
        metavar="FILE",
        help="cluster JSON file (docs/cluster.md): node groups with GPU count, memory, TFLOP/s "
        "and bandwidths; two or more groups make a heterogeneous cluster. Replaces --gpus and "
        "the cluster flags (giving both is an error)",
    )


def cluster_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, num_gpus: int | None
) -> Cluster:
    """The cluster of --cluster FILE, or of the flags with ``num_gpus`` GPUs (None: --gpus
    missing). A cluster file excludes --gpus and any cluster flag set to a non-default value."""
    if args.cluster is None:
        if num_gpus is None:
            raise InputError("give --gpus N or --cluster FILE")
        return cluster_from_flags(args, num_gpus)
    from solver.files.cluster_file import load_cluster

    given = [
        "--" + name.replace("_", "-")
        for name in CLUSTER_FLAGS
        if getattr(args, name) != parser.get_default(name)
    ]
    if getattr(args, "gpus", None) is not None:
        given.insert(0, "--gpus")
    if given:
        raise InputError(
            f"--cluster {args.cluster} describes the GPUs: drop {', '.join(given)} (or drop "
            "--cluster)"
        )
    return load_cluster(args.cluster)


def add_cluster_options(parser: argparse.ArgumentParser, *, memory_list: bool = False) -> None:
    """--gpu-memory and the other Cluster fields but the GPU count; ``memory_list``: --gpu-memory
    takes comma-separated sizes (``args.gpu_memory`` is then a list)."""
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument(
        "--gpu-memory",
        type=size_list if memory_list else memory_size,
        default=[80 * 2**30] if memory_list else 80 * 2**30,
        help="memory per GPU, e.g. 80GiB, 40GB (default 80GiB)"
        + ("; several: 40GiB,80GiB" if memory_list else ""),
    )
    cluster.add_argument(
        "--gpus-per-node",
        type=int_in(1, MAX_GPUS_PER_NODE),
        default=8,
        help="GPUs per node; tensor parallelism stays inside a node (default 8)",
    )
    cluster.add_argument(
        "--gpu-tflops",
        type=number_in(*GPU_TFLOPS_RANGE, unit=" TFLOP/s"),
        default=989.0,
        help="peak dense TFLOP/s per GPU (default 989, H100 bf16)",
    )
    cluster.add_argument(
        "--flops-efficiency",
        type=number_in(0, 1, low_open=True),
        default=0.5,
        help="fraction of peak FLOP/s reached (default 0.5)",
    )
    cluster.add_argument(
        "--intra-node-gbps",
        type=number_in(*GB_PER_S_RANGE, unit=" GB/s"),
        default=450.0,
        help="per-GPU intra-node bandwidth, GB/s (default 450)",
    )
    cluster.add_argument(
        "--inter-node-gbps",
        type=number_in(*GB_PER_S_RANGE, unit=" GB/s"),
        default=50.0,
        help="per-GPU inter-node bandwidth, GB/s (default 50)",
    )
    cluster.add_argument(
        "--memory-gbps",
        type=number_in(*GB_PER_S_RANGE, unit=" GB/s"),
        default=3350.0,
        help="GPU memory bandwidth, GB/s: the optimizer step's time when the graph has no "
        "profiled one (default 3350, H100 SXM)",
    )
    cluster.add_argument(
        "--p2p-latency-us",
        type=number_in(0, MAX_P2P_LATENCY_US, unit=" us"),
        default=0.0,
        help="latency of one pipeline send between stages, us, added to its bytes / bandwidth "
        "(default 0)",
    )


def add_training_options(parser: argparse.ArgumentParser, *, batch_required: bool = True) -> None:
    """--global-batch, --schedule, --runtime, --deallocate-pipeline-outputs, --precision,
    --optimizer, --bytes-per-param, --reserve, --calibration, --memory-model,
    --sequence-parallel, --cp, --ep, --moe-capacity-factor."""
    training = parser.add_argument_group("training")
    training.add_argument(
        "--global-batch",
        type=int_in(1, MAX_GLOBAL_BATCH),
        required=batch_required,
        help="samples per optimizer step",
    )
    _add_schedule_options(training)
    _add_memory_options(training)
    _add_parallel_options(training)


def _add_schedule_options(training) -> None:
    """--schedule, --virtual-stages, --runtime, --deallocate-pipeline-outputs."""
    training.add_argument(
        "--schedule",
        default="1f1b",
        help="pipeline schedule: 1f1b (at most p - s micro-batches in flight on stage s), "
        "gpipe (all m in flight), or torch's split-backward schedules interleaved-zb, zbv and "
        "dualpipev (zbv and dualpipev with --virtual-stages 2: rank r runs virtual stages r and "
        "2p - 1 - r); default 1f1b. The planner and sweeps also take a comma list or auto (all "
        "five): the schedule is then a decision, and a (schedule, pp, v, m) the schedule cannot "
        "run is skipped",
    )
    training.add_argument(
        "--virtual-stages",
        type=int_list_in(1, MAX_VIRTUAL_STAGES),
        default=[1],
        metavar="V",
        help="model chunks per pipeline rank (interleaved 1F1B when > 1, Megatron's virtual "
        "pipeline stages; megatron runtime); solver.plan searches a list such as 1,2,4 "
        "(default 1)",
    )
    training.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="megatron",
        help="pipeline runtime whose boundary buffers to count: megatron (Megatron-LM, DeepSpeed: "
        "one receive buffer per direction) or torch (torch.distributed.pipelining: one per "
        "micro-batch, kept for the run; what profiling.run executes). Default megatron",
    )
    training.add_argument(
        "--deallocate-pipeline-outputs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="megatron runtime: a sent pipeline output's data is freed at once, as Megatron-LM "
        "sets it; --no-deallocate-pipeline-outputs keeps the outputs of a stage's in-flight "
        "micro-batches until their backward (megatron-core's TransformerConfig default). The "
        "torch runtime ignores it",
    )


def _add_memory_options(training) -> None:
    """--precision, --optimizer, --grad-lifetime, --optimizer-impl, --bytes-per-param,
    --reserve, --calibration, --memory-model: what each parameter and GPU holds."""
    training.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="fp32, bf16 (pure bf16, no master copy), bf16-mixed or fp16-mixed (16-bit weights, "
        "fp32 master copy and optimizer state); with --optimizer and --runtime it gives the "
        "bytes per parameter (solver/precision.py, docs/cost-model.md). Default: the graph's "
        "dtype (fp32 -> fp32, bf16 -> bf16-mixed, fp16 -> fp16-mixed; none -> bf16-mixed)",
    )
    training.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adam",
        help="adam, adamw (2 state tensors per parameter), lion, sgd-momentum (1) or sgd (0); "
        "default adam",
    )
    training.add_argument(
        "--grad-lifetime",
        choices=GRAD_LIFETIMES,
        default=None,
        help="when gradients exist: persistent (the whole step: a gradient buffer, megatron's "
        "main_grad, DDP buckets, zero_grad(set_to_none=False)) or step (optimizer.zero_grad() "
        "with torch's default set_to_none=True: each layer's gradients appear at its first "
        "backward, so a GPipe peak holds only part of them). Default by --runtime: "
        + ", ".join(f"{lifetime} on {name}" for name, lifetime in DEFAULT_GRAD_LIFETIME.items())
        + " (persistent under DDP, whose buckets persist; docs/cost-model.md)",
    )
    training.add_argument(
        "--optimizer-impl",
        choices=OPTIMIZER_IMPLS,
        default=None,
        help="how the optimizer step runs: foreach (torch.optim's multi-tensor kernels, its "
        "default on a GPU: Adam's step makes sqrt(exp_avg_sq) of every parameter at once, a "
        "temporary of one state element per parameter) or fused (fused=True, torchtitan's "
        "default; TransformerEngine/apex FusedAdam: in place). Default by --runtime: "
        + ", ".join(f"{impl} on {name}" for name, impl in DEFAULT_OPTIMIZER_IMPL.items())
        + " (docs/cost-model.md)",
    )
    defaults = "; ".join(f"2,{g},12 on {name}" for name, g in GRAD_BYTES_PER_PARAM.items())
    training.add_argument(
        "--bytes-per-param",
        type=int_list_in(0, MAX_BYTES_PER_PARAM),
        default=None,
        metavar="W,G,O",
        help="weights,grads,optimizer bytes per parameter: overrides what --precision and "
        f"--optimizer give (always wins; bf16-mixed Adam: {defaults}; megatron's bf16 "
        "training accumulates fp32 gradients, main_grad; docs/cost-model.md)",
    )
    training.add_argument(
        "--reserve",
        type=reserve_size,
        default=None,
        metavar="SIZE|PCT",
        help="memory per GPU the job never gets (CUDA context, NCCL buffers, cuBLAS "
        "workspaces, allocator fragmentation): peaks must fit in --gpu-memory minus it. A size "
        "(3GiB), a share (8%%) or both (1GiB+5%%); 0: the whole memory. Default 1GiB+5%% "
        "(solver/reserve.py), or 0 with a --calibration that has a per-GPU constant",
    )
    training.add_argument(
        "--calibration",
        metavar="FILE",
        help="calibration JSON from python -m profiling.calibrate (scales per memory component "
        "and a constant per GPU); default: the analytic model alone",
    )
    training.add_argument(
        "--memory-model",
        choices=MEMORY_MODELS,
        default="analytic",
        help="analytic (default: the cost model's terms) or empirical: the graph's per-layer "
        "mem_isolated/mem_added statistics (mCAP/CAPSlog), pipeline-only configs of a chain",
    )


def _add_parallel_options(training) -> None:
    """--sequence-parallel, --cp, --ep, --moe-capacity-factor."""
    training.add_argument(
        "--sequence-parallel",
        choices=SEQUENCE_PARALLEL_CHOICES,
        default=None,
        help="Megatron's sequence parallelism with tp > 1 (activations TP leaves replicated and "
        "the tensors sent between stages split over the tp ranks too): off, on (every config "
        "with tp > 1; a pinned --tp 1 is an error) or auto (SP whenever tp > 1, as Megatron-LM "
        "and torchtitan run it); default auto",
    )
    training.add_argument(
        "--cp",
        type=int_list_in(1, MAX_DEGREE),
        default=[1],
        metavar="C",
        help="context-parallel degree (Megatron's --context-parallel-size: each sequence split "
        "over C GPUs, ring attention; pp x tp x cp x dp GPUs); solver.plan and solver.sweep "
        "search a list such as 1,2,4; C must divide the graph's seq_len (default 1)",
    )
    add_expert_options(training)


def add_expert_options(group) -> None:
    """--ep and --moe-capacity-factor (mixture-of-experts graphs)."""
    group.add_argument(
        "--ep",
        type=expert_degrees,
        default=None,
        metavar="E1,E2|auto",
        help="expert-parallel degrees (Megatron's --expert-model-parallel-size: the routed "
        "experts sharded over ep of the data-parallel ranks, ep | dp and ep | experts); auto "
        "(default): every such ep on a mixture-of-experts graph, 1 on a dense one",
    )
    group.add_argument(
        "--moe-capacity-factor",
        type=capacity_factor,
        default=1.0,
        metavar="FLOAT|dropless",
        help="routed tokens one GPU's experts hold, as a multiple of the balanced share: a "
        "capacity factor c (Megatron's --moe-expert-capacity-factor c with padding to "
        "capacity; default 1.0, a balanced routing) or dropless: the worst case a dropless "
        "router reaches, ep * min(k, E/ep) / k (docs/cost-model.md)",
    )


def cluster_from_flags(
    args: argparse.Namespace, num_gpus: int, gpu_memory_bytes: int | None = None
) -> Cluster:
    """The Cluster of the flags (each flag's type checked its range; the GPU count is checked
    here, and named --gpus)."""
    if num_gpus > MAX_GPUS:
        raise InputError(
            f"{num_gpus} GPUs (--gpus, or pp x tp x dp): at most {format_count(MAX_GPUS)}"
        )
    return Cluster(
        num_gpus=num_gpus,
        gpu_memory_bytes=args.gpu_memory if gpu_memory_bytes is None else gpu_memory_bytes,
        gpus_per_node=args.gpus_per_node,
        gpu_flops=args.gpu_tflops * 1e12,
        flops_efficiency=min(args.flops_efficiency, 1.0),
        intra_node_gb_per_s=args.intra_node_gbps,
        inter_node_gb_per_s=args.inter_node_gbps,
        memory_gb_per_s=args.memory_gbps,
        p2p_latency_us=args.p2p_latency_us,
    )


def reserve_size(text: str) -> MemoryReserve:
    """--reserve: '3GiB', '8%', '1GiB+5%' or '0' (``solver.reserve.parse_reserve``)."""
    try:
        return parse_reserve(text)
    except InputError as error:  # argparse names the flag
        raise argparse.ArgumentTypeError(str(error).removeprefix("size: ")) from None


def precision_words(args: argparse.Namespace, calibration: Calibration | None) -> dict[str, Any]:
    """The TrainingConfig fields of --precision, --optimizer and --reserve: precision None is
    the graph's; without --reserve, ``reserve.default_reserve(calibration)`` (1 GiB + 5%, or
    none under a calibration with a per-GPU constant)."""
    reserve = getattr(args, "reserve", None)
    return {
        "precision": getattr(args, "precision", None),
        "optimizer": getattr(args, "optimizer", "adam"),
        "reserve": default_reserve(calibration) if reserve is None else reserve,
    }


def bytes_per_param(args: argparse.Namespace) -> dict[str, int | None]:
    """The TrainingConfig fields of --bytes-per-param: all three when given, else all None
    (the table of ``solver.precision`` for --precision, --optimizer and --runtime)."""
    if args.bytes_per_param is None:
        return {name: None for name in BYTE_FIELDS}
    if len(args.bytes_per_param) != 3:
        raise InputError(
            f"--bytes-per-param: give 3 numbers (weights,grads,optimizer), got "
            f"{quote(args.bytes_per_param)}"
        )
    w, g, o = args.bytes_per_param
    return {"weight_bytes_per_param": w, "grad_bytes_per_param": g, "optimizer_bytes_per_param": o}


def add_plot_option(parser: argparse.ArgumentParser, *, drawing: str) -> None:
    """--plot FILE; ``drawing`` says what this CLI draws."""
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help=f"also draw {drawing} (.png, .pdf or .svg; solver/report/plots.py)",
    )


def add_plot_schedule_option(parser: argparse.ArgumentParser) -> None:
    """--plot-schedule FILE: the pipeline schedule picture (solver/report/schedule_plot.py)."""
    parser.add_argument(
        "--plot-schedule",
        metavar="FILE",
        help="also draw the pipeline schedule: each rank's forwards and backwards over the "
        "simulated step and, under each, its predicted memory with the peak and the usable GPU "
        "memory (.png, .pdf or .svg)",
    )


def calibration_from_args(args: argparse.Namespace) -> Calibration | None:
    return None if args.calibration is None else load_calibration(args.calibration)


def zero_stages(text: str) -> tuple[int, ...]:
    if text == "auto":
        return ZERO_STAGES
    return (int(text),)


def add_plan_options(parser: argparse.ArgumentParser, *, cpsat_workers: bool = True) -> None:
    """Search space (--micro-batch, --zero, --recompute, --pp/--tp/--dp), objective and
    constraints, and solver options (--backend, --time-limit, and --workers unless
    ``cpsat_workers`` is False)."""
    search = parser.add_argument_group("search space")
    search.add_argument(
        "--micro-batch",
        type=int_list_in(1, MAX_GLOBAL_BATCH),
        default=list(DEFAULT_MICRO_BATCHES),
        help="candidate micro-batch sizes, those dividing global batch / dp (default 1,2,3,4)",
    )
    search.add_argument(
        "--zero",
        choices=[*map(str, ZERO_STAGES), "auto"],
        default="auto",
        help="ZeRO stage, or auto (default): every stage 0..3 the --runtime's engines run with "
        "the config (megatron: 0, 1 = --use-distributed-optimizer, 2/3 = Megatron-FSDP at pp 1 "
        "only; torch: DDP, ZeroRedundancyOptimizer, FSDP2)",
    )
    search.add_argument(
        "--recompute",
        choices=RECOMPUTE_CHOICES,
        default="auto",
        help="activation recomputation: none, full (every layer), selective (the solver picks "
        "the layers, jointly with the split; CP-SAT/MILP, slower) or auto (default): none and "
        "full on every config by the exact algorithms, and selective only when neither fits",
    )
    degree = int_in(1, MAX_DEGREE)
    search.add_argument("--pp", type=degree, help="pin the pipeline degree")
    search.add_argument("--tp", type=degree, help="pin the tensor-parallel degree")
    search.add_argument("--dp", type=degree, help="pin the data-parallel degree")
    goal = parser.add_argument_group("objective and constraints")
    goal.add_argument(
        "--objective",
        choices=["memory", "throughput"],
        default="memory",
        help="memory: minimise the largest per-GPU peak (default); throughput: the fastest plan "
        "that fits",
    )
    goal.add_argument(
        "--memory-objective",
        choices=MEMORY_OBJECTIVES,
        default="utilization",
        help="heterogeneous clusters (--cluster with 2+ groups): minimise the largest stage "
        "peak / its GPU's memory (utilization, default) or the largest peak in bytes (absolute)",
    )
    goal.add_argument(
        "--min-throughput",
        type=positive_float,
        metavar="SAMPLES_PER_S",
        help="plans must reach this many samples/s (overrides --max-slowdown)",
    )
    goal.add_argument(
        "--max-slowdown",
        type=slowdown,
        default=1.25,
        metavar="F",
        help="at most F times slower than the fastest plan that fits (default "
        "1.25; 'none' disables)",
    )
    solver = parser.add_argument_group("solver")
    solver.add_argument(
        "--backend",
        choices=["auto", "cpsat", "milp", "chain", "dag"],
        default="auto",
        help="auto: exact chain algorithm on chains, exact DP over ideals on DAGs (dag), "
        "CP-SAT on DAGs too wide for it and on interleaved, selective or heterogeneous plans",
    )
    solver.add_argument(
        "--time-limit",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="wall-clock limit for the whole search, seconds (default 60)",
    )
    if cpsat_workers:
        solver.add_argument(
            "--workers",
            type=int_in(1, MAX_WORKERS),
            default=1,
            help="CP-SAT worker threads (1 = deterministic)",
        )


FLAG_OF_FIELD = {
    "global_batch": "--global-batch",
    "micro_batch_sizes": "--micro-batch",
    "virtual_stages": "--virtual-stages",
    "cp": "--cp",
    "ep": "--ep",
    "moe_capacity_factor": "--moe-capacity-factor",
    "min_throughput": "--min-throughput",
    "max_slowdown": "--max-slowdown",
}
"""TrainingConfig fields whose errors name their flag on the command line."""


def training_from_args(args: argparse.Namespace) -> TrainingConfig:
    """The TrainingConfig of add_training_options + add_plan_options flags (loads --calibration);
    its errors name the flag."""
    check_searched(args.schedule)  # plan and sweep: before any work
    try:
        return _training_from_args(args)
    except InputError as error:
        field, _, rest = str(error).partition(" ")
        if field in FLAG_OF_FIELD:
            raise InputError(f"{FLAG_OF_FIELD[field]} {_args_value(args, field)}: {rest}") from None
        raise


def _args_value(args: argparse.Namespace, field: str) -> str:
    """The command-line value of a TrainingConfig field, for messages."""
    dest = {"micro_batch_sizes": "micro_batch"}.get(field, field)
    value = getattr(args, dest, None)
    if isinstance(value, list):
        return ",".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def _training_from_args(args: argparse.Namespace) -> TrainingConfig:
    calibration = calibration_from_args(args)
    return TrainingConfig(
        global_batch=args.global_batch,
        micro_batch_sizes=tuple(args.micro_batch),
        zero_stages=zero_stages(args.zero),
        recompute=args.recompute,
        schedule=args.schedule,
        virtual_stages=tuple(args.virtual_stages),
        runtime=args.runtime,
        deallocate_pipeline_outputs=args.deallocate_pipeline_outputs,
        grad_lifetime=args.grad_lifetime,
        optimizer_impl=args.optimizer_impl,
        memory_model=args.memory_model,
        sequence_parallel=args.sequence_parallel,
        cp=tuple(args.cp),
        ep=None if args.ep is None else tuple(args.ep),
        moe_capacity_factor=args.moe_capacity_factor,
        pp=args.pp,
        tp=args.tp,
        dp=args.dp,
        min_throughput=args.min_throughput,
        max_slowdown=args.max_slowdown,
        objective=args.objective,
        memory_objective=getattr(args, "memory_objective", "utilization"),
        calibration=calibration,
        **precision_words(args, calibration),
        **bytes_per_param(args),
    )


def warn_implementation(graph: Any, runtime: str, name: str) -> None:
    """One stderr line when ``graph`` profiles other modules than ``runtime`` runs
    (:func:`solver.engine_rules.implementation_warning`)."""
    import sys

    from solver.engine_rules import implementation_warning

    line = implementation_warning(graph.meta, runtime, graph=name)
    if line is not None:
        print(line, file=sys.stderr)
