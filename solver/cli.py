"""Argument parsing and entry points of ``python -m solver.plan`` and ``python -m solver.evaluate``.

The CLIs only parse, call the API, print and write JSON. Errors: one line on stderr, exit code
2 (bad input), 3 (infeasible), 4 (time limit without a solution); never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from solver.calibration import Calibration, load_calibration
from solver.errors import InputError, PlannerError
from solver.graph import load_graph
from solver.specs import (
    MEMORY_MODELS,
    MEMORY_OBJECTIVES,
    RUNTIMES,
    Cluster,
    ParallelConfig,
    TrainingConfig,
)
from solver.units import parse_bytes


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line with exit code 2 (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _slowdown(text: str) -> float | None:
    if text.lower() == "none":
        return None
    value = _positive_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'none', got {text}")
    return value


def _size(text: str) -> int:
    try:
        return parse_bytes(text, what="--gpu-memory")
    except InputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def size_list(text: str) -> list[int]:
    """'40GiB,80GiB' -> sizes in bytes; empty items and bad sizes are errors."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated sizes like 40GiB,80GiB, got {text!r}"
        )
    return [_size(part) for part in parts]


def _add_graph_and_cluster(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("graph", help="layer-graph JSON file (docs/layer-graph.md)")
    add_cluster_file_option(parser)
    add_cluster_options(parser)
    add_training_options(parser)
    parser.add_argument("--json", metavar="OUT", help="also write the result as JSON to OUT")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


CLUSTER_FLAGS = (
    "gpu_memory",
    "gpus_per_node",
    "gpu_tflops",
    "flops_efficiency",
    "intra_node_gbps",
    "inter_node_gbps",
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
        return _cluster(args, num_gpus)
    from solver.cluster_file import load_cluster

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
        type=size_list if memory_list else _size,
        default=[80 * 2**30] if memory_list else 80 * 2**30,
        help="memory per GPU, e.g. 80GiB, 40GB (default 80GiB)"
        + ("; several: 40GiB,80GiB" if memory_list else ""),
    )
    cluster.add_argument("--gpus-per-node", type=positive_int, default=8)
    cluster.add_argument(
        "--gpu-tflops",
        type=_positive_float,
        default=989.0,
        help="peak dense TFLOP/s per GPU (default 989, H100 bf16)",
    )
    cluster.add_argument(
        "--flops-efficiency",
        type=_positive_float,
        default=0.5,
        help="fraction of peak FLOP/s reached (default 0.5)",
    )
    cluster.add_argument(
        "--intra-node-gbps",
        type=_positive_float,
        default=450.0,
        help="per-GPU intra-node bandwidth, GB/s (default 450)",
    )
    cluster.add_argument(
        "--inter-node-gbps",
        type=_positive_float,
        default=50.0,
        help="per-GPU inter-node bandwidth, GB/s (default 50)",
    )


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """--global-batch, --schedule, --runtime, --bytes-per-param, --calibration, --memory-model."""
    training = parser.add_argument_group("training")
    training.add_argument(
        "--global-batch", type=positive_int, required=True, help="samples per optimizer step"
    )
    training.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    training.add_argument(
        "--virtual-stages",
        type=_int_list,
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
        "--bytes-per-param",
        type=_int_list,
        default=[2, 2, 12],
        help="weights,grads,optimizer bytes per parameter (default 2,2,12)",
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


def _cluster(
    args: argparse.Namespace, num_gpus: int, gpu_memory_bytes: int | None = None
) -> Cluster:
    return Cluster(
        num_gpus=num_gpus,
        gpu_memory_bytes=args.gpu_memory if gpu_memory_bytes is None else gpu_memory_bytes,
        gpus_per_node=args.gpus_per_node,
        gpu_flops=args.gpu_tflops * 1e12,
        flops_efficiency=min(args.flops_efficiency, 1.0),
        intra_node_gb_per_s=args.intra_node_gbps,
        inter_node_gb_per_s=args.inter_node_gbps,
    )


def _bytes_per_param(args: argparse.Namespace) -> dict[str, int]:
    if len(args.bytes_per_param) != 3:
        raise InputError(
            f"--bytes-per-param: give 3 numbers (weights,grads,optimizer), got "
            f"{args.bytes_per_param}"
        )
    w, g, o = args.bytes_per_param
    return {"weight_bytes_per_param": w, "grad_bytes_per_param": g, "optimizer_bytes_per_param": o}


def _inputs(args: argparse.Namespace) -> list[str]:
    """Files the CLI read (--json must not overwrite them)."""
    files = [args.graph] + ([args.calibration] if args.calibration else [])
    return files + ([args.cluster] if getattr(args, "cluster", None) else [])


def _add_plot(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw per-stage memory next to the even split of the same config, or with "
        "--pareto the front (.png, .pdf or .svg; solver/plots.py)",
    )


def _add_pareto(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Pareto front")
    group.add_argument(
        "--pareto",
        action="store_true",
        help="list the non-dominated (peak memory, throughput) plans instead of one plan "
        "(--min-throughput is a floor; --max-slowdown and --objective do not apply); on a "
        "heterogeneous --cluster, memory is what --memory-objective says (largest utilization "
        "or largest peak) and each plan places its stages on the groups",
    )
    group.add_argument(
        "--pareto-points",
        type=positive_int,
        metavar="N",
        help=f"at most N points, spread over the front when it is longer (default {PARETO_POINTS})",
    )


PARETO_POINTS = 10


def _check_outputs(args: argparse.Namespace) -> None:
    """Fail on a bad --plot path (or --plot = --json) before any work."""
    if args.plot is None:
        return
    from solver.plots import check_plot_path

    check_plot_path(args.plot, protect=_inputs(args))
    if args.json and Path(args.json).resolve() == Path(args.plot).resolve():
        raise InputError(f"--plot {args.plot}: same file as --json; choose another path")


def _calibration(args: argparse.Namespace) -> Calibration | None:
    return None if args.calibration is None else load_calibration(args.calibration)


def _zero_stages(text: str) -> tuple[int, ...]:
    if text == "auto":
        return (0, 1, 2, 3)
    return (int(text),)


def write_json(path: str, document: dict[str, Any], *, protect: list[str]) -> None:
    """Write atomically; refuse to overwrite an input file or to write into a missing folder."""
    target = Path(path)
    for given in protect:
        if target.exists() and Path(given).exists() and target.resolve() == Path(given).resolve():
            raise InputError(f"--json {path}: is the input file; choose another output path")
    if not target.parent.exists():
        raise InputError(f"--json {path}: folder {target.parent} does not exist; create it first")
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(handle, "w") as stream:
        json.dump(document, stream, indent=1)
        stream.write("\n")
    os.replace(temporary, target)


def _print(text: str) -> None:
    """Print, tolerating a closed pipe (``... | head``)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def plan_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m solver.plan",
        description="Find the PP x TP x DP config and layer split that minimise the "
        "largest per-GPU peak memory, with a proof of optimality.",
    )
    parser.add_argument("--gpus", type=positive_int, help="number of GPUs (or --cluster FILE)")
    _add_plot(parser)
    _add_pareto(parser)
    _add_graph_and_cluster(parser)
    add_plan_options(parser)
    return parser


def add_plan_options(parser: argparse.ArgumentParser, *, cpsat_workers: bool = True) -> None:
    """Search space (--micro-batch, --zero, --recompute, --pp/--tp/--dp), objective and
    constraints, and solver options (--backend, --time-limit, and --workers unless
    ``cpsat_workers`` is False)."""
    search = parser.add_argument_group("search space")
    search.add_argument(
        "--micro-batch",
        type=_int_list,
        default=[1, 2, 4],
        help="candidate micro-batch sizes (default 1,2,4)",
    )
    search.add_argument(
        "--zero",
        choices=["0", "1", "2", "3", "auto"],
        default="0",
        help="ZeRO stage, or auto to search 0..3 (default 0)",
    )
    search.add_argument(
        "--recompute",
        choices=["none", "full", "selective", "auto"],
        default="none",
        help="activation recomputation: none, full (every layer), selective (the solver picks "
        "the layers, jointly with the split; CP-SAT/MILP), or auto (= selective, which contains "
        "none and full)",
    )
    search.add_argument("--pp", type=positive_int, help="pin the pipeline degree")
    search.add_argument("--tp", type=positive_int, help="pin the tensor-parallel degree")
    search.add_argument("--dp", type=positive_int, help="pin the data-parallel degree")
    goal = parser.add_argument_group("objective and constraints")
    goal.add_argument("--objective", choices=["memory", "throughput"], default="memory")
    goal.add_argument(
        "--memory-objective",
        choices=MEMORY_OBJECTIVES,
        default="utilization",
        help="heterogeneous clusters (--cluster with 2+ groups): minimise the largest stage "
        "peak / its GPU's memory (utilization, default) or the largest peak in bytes (absolute)",
    )
    goal.add_argument(
        "--min-throughput",
        type=_positive_float,
        metavar="SAMPLES_PER_S",
        help="plans must reach this many samples/s (overrides --max-slowdown)",
    )
    goal.add_argument(
        "--max-slowdown",
        type=_slowdown,
        default=1.25,
        metavar="F",
        help="at most F times slower than the fastest plan that fits (default "
        "1.25; 'none' disables)",
    )
    solver = parser.add_argument_group("solver")
    solver.add_argument(
        "--backend",
        choices=["auto", "cpsat", "milp", "chain"],
        default="auto",
        help="auto: exact chain algorithm on chains, CP-SAT on DAGs",
    )
    solver.add_argument(
        "--time-limit",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="wall-clock limit for the whole search, seconds (default 60)",
    )
    if cpsat_workers:
        solver.add_argument(
            "--workers",
            type=positive_int,
            default=1,
            help="CP-SAT worker threads (1 = deterministic)",
        )


def training_from_args(args: argparse.Namespace) -> TrainingConfig:
    """The TrainingConfig of add_training_options + add_plan_options flags (loads --calibration)."""
    return TrainingConfig(
        global_batch=args.global_batch,
        micro_batch_sizes=tuple(args.micro_batch),
        zero_stages=_zero_stages(args.zero),
        recompute=args.recompute,
        schedule=args.schedule,
        virtual_stages=tuple(args.virtual_stages),
        runtime=args.runtime,
        memory_model=args.memory_model,
        pp=args.pp,
        tp=args.tp,
        dp=args.dp,
        min_throughput=args.min_throughput,
        max_slowdown=args.max_slowdown,
        objective=args.objective,
        memory_objective=getattr(args, "memory_objective", "utilization"),
        calibration=_calibration(args),
        **_bytes_per_param(args),
    )


def plan_main(argv: list[str] | None = None) -> int:
    parser = plan_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from solver.planner import plan
        from solver.report import format_plan, plan_to_dict

        _check_outputs(args)
        if args.pareto_points is not None and not args.pareto:
            raise InputError("--pareto-points needs --pareto")
        cluster = cluster_from_args(parser, args, args.gpus)
        graph = load_graph(args.graph)
        training = training_from_args(args)
        if args.pareto:
            _pareto(args, graph, training, cluster)
            return 0
        result = plan(
            graph,
            cluster,
            training,
            backend=args.backend,
            time_limit_s=args.time_limit,
            num_workers=args.workers,
        )
        if args.json:
            write_json(args.json, plan_to_dict(result), protect=_inputs(args))
        if args.plot:
            from solver.plots import plot_plan

            plot_plan(result.evaluation, args.plot, baseline=result.baselines.get("even"))
        if not args.quiet:
            _print(format_plan(result))
    except PlannerError as error:
        sys.stderr.write(f"error: {error}\n")
        return error.exit_code
    return 0


def evaluate_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m solver.evaluate",
        description="Per-stage peak memory and time of a given split and config.",
    )
    parser.add_argument("--pp", type=positive_int, required=True)
    parser.add_argument("--tp", type=positive_int, default=1)
    parser.add_argument("--dp", type=positive_int, default=1)
    parser.add_argument("--micro-batch", type=positive_int, default=1)
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0)
    parser.add_argument(
        "--recompute",
        choices=["none", "full", "selective"],
        default="none",
        help="none, full (every layer), or selective: the layers of --recompute-layers",
    )
    parser.add_argument(
        "--recompute-layers",
        metavar="SPEC",
        help="with --recompute selective: the recomputed layers, comma-separated layer names, "
        "positions in topological order (0-based) and ranges, e.g. 0-3,7,block5 ('' = none; "
        "a plan JSON lists them as stages[i].recomputed)",
    )
    parser.add_argument(
        "--split",
        required=True,
        help="even | parameters | layer counts per stage (5,7,7,5) | a stage index per layer "
        "(with --virtual-stages v: per virtual stage, p v of them, in pipeline order)",
    )
    parser.add_argument(
        "--stage-groups",
        metavar="NAMES",
        help="with a heterogeneous --cluster: the node group of each stage, comma-separated "
        "group names (e.g. a100-80g,a100-40g)",
    )
    _add_plot(parser)
    _add_graph_and_cluster(parser)
    return parser


def evaluate_main(argv: list[str] | None = None) -> int:
    parser = evaluate_parser()
    args = parser.parse_args(argv)
    try:
        from solver.evaluation import evaluate
        from solver.report import evaluation_to_dict, format_evaluation

        _check_outputs(args)
        graph = load_graph(args.graph)
        if args.global_batch % (args.dp * args.micro_batch):
            raise InputError(
                f"--global-batch {args.global_batch} is not a multiple of dp("
                f"{args.dp}) * micro-batch({args.micro_batch})"
            )
        if len(args.virtual_stages) != 1:
            raise InputError(
                f"--virtual-stages {','.join(map(str, args.virtual_stages))}: evaluate takes "
                "one value (the chunks per pipeline rank of the split)"
            )
        config = ParallelConfig(
            pp=args.pp,
            tp=args.tp,
            dp=args.dp,
            micro_batch=args.micro_batch,
            num_microbatches=args.global_batch // (args.dp * args.micro_batch),
            zero=args.zero,
            recompute=args.recompute,
            schedule=args.schedule,
            virtual_stages=args.virtual_stages[0],
        )
        cluster = cluster_from_args(parser, args, config.num_gpus)
        if args.tp > cluster.gpus_per_node or cluster.gpus_per_node % args.tp:
            if not cluster.is_heterogeneous:
                raise InputError(
                    f"--tp {args.tp} must divide --gpus-per-node {cluster.gpus_per_node}"
                )
        if args.cluster is not None and not cluster.is_heterogeneous:
            if config.num_gpus != cluster.num_gpus:
                raise InputError(
                    f"pp({args.pp}) * tp({args.tp}) * dp({args.dp}) = {config.num_gpus} != "
                    f"gpus({cluster.num_gpus}) of --cluster {args.cluster}"
                )
        groups = _stage_groups(args, cluster)
        recomputed = _recompute_layers(args, graph)
        split: str | list[int] = args.split
        if args.split not in ("even", "parameters"):
            try:
                split = [int(part) for part in args.split.split(",")]
            except ValueError:
                raise InputError(
                    f"--split {args.split!r}: use even, parameters, or comma-separated integers"
                ) from None
        training = TrainingConfig(
            global_batch=args.global_batch,
            micro_batch_sizes=(args.micro_batch,),
            zero_stages=(args.zero,),
            recompute=args.recompute,
            schedule=args.schedule,
            virtual_stages=(config.virtual_stages,),
            runtime=args.runtime,
            memory_model=args.memory_model,
            calibration=_calibration(args),
            **_bytes_per_param(args),
        )
        result = evaluate(
            graph,
            config,
            split,
            cluster=cluster,
            training=training,
            group_of_stage=groups,
            recomputed=recomputed,
        )
        if args.json:
            write_json(args.json, evaluation_to_dict(result), protect=_inputs(args))
        if args.plot:
            _plot_evaluation(result, args.plot)
        if not args.quiet:
            _print(
                format_evaluation(
                    result, f"Split {args.split} of {graph.model} on {config.num_gpus} GPUs"
                )
            )
    except PlannerError as error:
        sys.stderr.write(f"error: {error}\n")
        return error.exit_code
    return 0


def _stage_groups(args: argparse.Namespace, cluster: Cluster) -> list[int] | None:
    """--stage-groups names -> group indices (heterogeneous clusters only)."""
    if not cluster.is_heterogeneous:
        if args.stage_groups is not None:
            raise InputError("--stage-groups needs a --cluster file with two or more groups")
        return None
    names = [g.name for g in cluster.groups]
    if args.stage_groups is None:
        raise InputError(
            f"--cluster {args.cluster} has {len(names)} node groups: say where each stage runs "
            f"with --stage-groups (names: {', '.join(names)})"
        )
    given = [part.strip() for part in args.stage_groups.split(",")]
    unknown = [name for name in given if name not in names]
    if unknown:
        raise InputError(f"--stage-groups: unknown group {unknown[0]!r}; names: {', '.join(names)}")
    return [names.index(name) for name in given]


def _recompute_layers(args: argparse.Namespace, graph: Any) -> list[bool] | None:
    """--recompute-layers SPEC -> a flag per layer (needs --recompute selective, and vice versa)."""
    from solver.evaluation import recompute_flags

    if args.recompute != "selective":
        if args.recompute_layers is not None:
            raise InputError(
                f"--recompute-layers needs --recompute selective (got --recompute "
                f"{args.recompute}); add --recompute selective or drop --recompute-layers"
            )
        return None
    if args.recompute_layers is None:
        raise InputError(
            "--recompute selective needs --recompute-layers SPEC: layer names, positions and "
            "ranges such as 0-3,7,block5 ('' for none)"
        )
    return recompute_flags(graph, args.recompute_layers)


def _plot_evaluation(result: Any, path: str) -> None:
    """The evaluated split next to the even split of the same config (alone when it is even)."""
    from solver.evaluation import evaluate
    from solver.plots import plot_plan

    even = evaluate(
        result.graph,
        result.config,
        "even",
        cluster=result.cluster,
        training=result.training,
        group_of_stage=result.group_of_stage,
        recomputed=result.recomputed,
    )
    baseline = None if even.stage_of_layer == result.stage_of_layer else even
    plot_plan(result, path, baseline=baseline)


def _pareto(
    args: argparse.Namespace, graph: Any, training: TrainingConfig, cluster: Cluster
) -> None:
    """solver.plan --pareto: the front as a table, --json document and --plot picture."""
    from solver.pareto import format_pareto, pareto_front, pareto_to_dict

    front = pareto_front(
        graph,
        cluster,
        training,
        max_points=PARETO_POINTS if args.pareto_points is None else args.pareto_points,
        backend=args.backend,
        time_limit_s=args.time_limit,
        num_workers=args.workers,
    )
    if args.json:
        write_json(args.json, pareto_to_dict(front), protect=_inputs(args))
    if args.plot:
        from solver.plots import plot_pareto

        groups = [(g.name, g.gpu_memory_bytes) for g in cluster.groups]
        plot_pareto(
            front.points,
            args.plot,
            capacity_bytes=None if cluster.is_heterogeneous else cluster.gpu_memory_bytes,
            group_capacities=groups if cluster.is_heterogeneous else (),
            utilization=front.memory_unit == "ppm",
            title=f"{graph.model} on {cluster.num_gpus} GPUs: {len(front.points)} non-dominated "
            "plans",
        )
    if not args.quiet:
        _print(format_pareto(front))
