"""``python -m solver.evaluate``: parse, call :func:`solver.evaluation.evaluate` on a given
config and split (or :func:`solver.files.plan_file.evaluate_plan` on a plan file, ``--plan``),
print the per-stage table, write its JSON and plot."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from solver.cli.common import (
    add_graph_and_cluster,
    add_plot_option,
    add_plot_schedule_option,
    bytes_per_param,
    calibration_from_args,
    cluster_from_args,
    precision_words,
    warn_implementation,
)
from solver.console import (
    OneLineErrorParser,
    check_outputs,
    input_files,
    interrupted,
    positive_int,
    print_error,
    print_output,
    write_json,
)
from solver.engine_rules import ModelFacts, check_config
from solver.errors import InputError, PlannerError, StalePlanError
from solver.graph import load_graph
from solver.parallel import EXPERTS_WITHIN_DP, tensor_parallel_fits
from solver.specs import (
    RECOMPUTE_MODES,
    ZERO_STAGES,
    Cluster,
    ParallelConfig,
    TrainingConfig,
    default_sequence_parallel,
)

REQUIRED = ("graph", "pp", "split", "global_batch")
"""Required unless --plan gives them."""
WITH_PLAN = ("plan", "graph", "json", "quiet", "plot", "plot_schedule")
"""The arguments --plan takes (the plan gives the rest)."""


def evaluate_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m solver.evaluate",
        description="Per-stage peak memory and time of a given split and config, or of a plan "
        "file's own (--plan).",
    )
    parser.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="evaluate this plan (solver.plan --json or solver.evaluate --json) again: its config, "
        "split, recomputed layers, stage groups, cluster and training options, on the graph it "
        "records (or GRAPH); exit code 6 when the numbers differ from the plan's",
    )
    parser.add_argument(
        "--pp", type=positive_int, help="pipeline-parallel degree (pipeline ranks); required"
    )
    parser.add_argument(
        "--tp", type=positive_int, default=1, help="tensor-parallel degree (default 1)"
    )
    parser.add_argument(
        "--dp", type=positive_int, default=1, help="data-parallel degree (default 1)"
    )
    parser.add_argument(
        "--micro-batch", type=positive_int, default=1, help="samples per micro-batch (default 1)"
    )
    parser.add_argument(
        "--zero", type=int, choices=ZERO_STAGES, default=0, help="ZeRO stage (default 0)"
    )
    parser.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
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
        help="even | parameters | layer counts per stage (5,7,7,5) | a stage index per layer "
        "(with --virtual-stages v: per virtual stage, p v of them, in pipeline order)",
    )
    parser.add_argument(
        "--stage-groups",
        metavar="NAMES",
        help="with a heterogeneous --cluster: the node group of each stage, comma-separated "
        "group names (e.g. a100-80g,a100-40g)",
    )
    add_plot_option(
        parser,
        drawing="the split's per-stage memory, next to the even split of the same config "
        "unless it is the even split",
    )
    add_plot_schedule_option(parser)
    add_graph_and_cluster(parser, graph_optional=True)
    return parser


def evaluate_main(argv: list[str] | None = None) -> int:
    parser = evaluate_parser()
    args = parser.parse_args(argv)
    if args.plan is None:
        missing = [name for name in REQUIRED if getattr(args, name) is None]
        if missing:
            names = [name if name == "graph" else "--" + name.replace("_", "-") for name in missing]
            parser.error(f"the following arguments are required: {', '.join(names)}")
    try:
        check_outputs(args)
        if args.plan is not None:
            return _evaluate_plan(parser, args)
        _evaluate_split(parser, args)
    except PlannerError as error:
        print_error(error)
        return error.exit_code
    except KeyboardInterrupt:
        return interrupted()
    return 0


def _evaluate_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--plan: evaluate the plan's own layout; StalePlanError when its numbers differ."""
    from solver.files.plan_file import evaluate_plan, load_plan, plan_differences

    given = [
        "--" + dest.replace("_", "-")
        for dest, value in vars(args).items()
        if dest not in WITH_PLAN and value != parser.get_default(dest)
    ]
    if given:
        raise InputError(
            f"--plan {args.plan} gives the config, split, cluster and training options: drop "
            f"{', '.join(given)}"
        )
    plan = load_plan(args.plan)
    result = evaluate_plan(plan, args.graph)
    warn_implementation(result.graph, plan.training.runtime, result.graph.source)
    where = f"{result.graph.model} on {result.config.num_gpus} GPUs"
    _output(args, result, f"Plan {args.plan} evaluated again: {where}")
    differences = plan_differences(plan, result)
    if differences:
        shown = "; ".join(differences[:3]) + ("; ..." if len(differences) > 3 else "")
        raise StalePlanError(
            f"{args.plan}: {len(differences)} number(s) differ from the plan's ({shown}); the "
            "plan was edited or the cost model changed since it was written: re-create it with "
            "python -m solver.plan"
        )
    if not args.quiet:
        print_output(
            f"plan check: every stage's peak, breakdown and time equal {args.plan}'s "
            f"({plan.peak_bytes} B peak, {plan.iteration_ms:.6g} ms per iteration)"
        )
    return 0


def _output(args: argparse.Namespace, result: Any, title: str) -> None:
    """--json, --plot, --plot-schedule and the table (unless --quiet)."""
    from solver.report.plan_report import evaluation_to_dict, format_evaluation

    if args.json:
        write_json(args.json, evaluation_to_dict(result), protect=input_files(args))
    if args.plot:
        _plot_evaluation(result, args.plot)
    if args.plot_schedule:
        from solver.report.schedule_plot import plot_schedule

        plot_schedule(result, args.plot_schedule)
    if not args.quiet:
        print_output(format_evaluation(result, title))


def _evaluate_split(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The config, split and options of the flags."""
    from solver.evaluation import evaluate

    graph = load_graph(args.graph)
    config = _config_from_args(args)
    cluster = cluster_from_args(parser, args, config.num_gpus)
    _check_cluster(args, config, cluster)
    groups = _stage_groups(args, cluster)
    recomputed = _recompute_layers(args, graph)
    training = _training_from_args(args, config)
    check_config(config, ModelFacts.of_graph(graph), training.runtime, where="")
    result = evaluate(
        graph,
        config,
        _split_from_args(args),
        cluster=cluster,
        training=training,
        group_of_stage=groups,
        recomputed=recomputed,
    )
    warn_implementation(graph, training.runtime, args.graph)
    _output(args, result, f"Split {args.split} of {graph.model} on {config.num_gpus} GPUs")


def _config_from_args(args: argparse.Namespace) -> ParallelConfig:
    """The config being evaluated; the global batch must split into dp x micro-batch."""
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
    if len(args.cp) != 1:
        raise InputError(
            f"--cp {','.join(map(str, args.cp))}: evaluate takes one value (the context-parallel "
            "degree of the layout)"
        )
    return ParallelConfig(
        pp=args.pp,
        tp=args.tp,
        cp=args.cp[0],
        dp=args.dp,
        micro_batch=args.micro_batch,
        num_microbatches=args.global_batch // (args.dp * args.micro_batch),
        zero=args.zero,
        recompute=args.recompute,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages[0],
        sp=_sequence_parallel(args, args.tp),
        ep=_expert_degree(args),
    )


def _sequence_parallel(args: argparse.Namespace, tp: int) -> bool:
    """Whether the config runs SP: --sequence-parallel, or the runtime's default
    (``specs.default_sequence_parallel``); auto: exactly when tp > 1, as the search's
    candidates."""
    choice = args.sequence_parallel or default_sequence_parallel(args.runtime)
    return choice == "on" or (choice == "auto" and tp > 1)


def _expert_degree(args: argparse.Namespace) -> int:
    """evaluate checks one layout: --ep takes one degree (auto: 1, no expert parallelism)."""
    if args.ep is None:
        return 1
    if len(args.ep) != 1:
        raise InputError(
            f"--ep {','.join(map(str, args.ep))}: evaluate takes one value (the expert-parallel "
            "degree of the layout)"
        )
    if args.dp % args.ep[0]:
        raise InputError(
            f"--ep {args.ep[0]} does not divide --dp {args.dp}: {EXPERTS_WITHIN_DP}; "
            "pick an --ep that divides the data-parallel degree"
        )
    return args.ep[0]


def _check_cluster(args: argparse.Namespace, config: ParallelConfig, cluster: Cluster) -> None:
    """On a homogeneous cluster, tp divides the GPUs per node and a --cluster file has exactly
    the config's GPU count."""
    if cluster.is_heterogeneous:
        return
    if not tensor_parallel_fits(args.tp, cluster.gpus_per_node):
        raise InputError(f"--tp {args.tp} must divide --gpus-per-node {cluster.gpus_per_node}")
    if args.cluster is not None:
        config.dims.check_gpus(cluster.num_gpus, where=f" of --cluster {args.cluster}")


def _split_from_args(args: argparse.Namespace) -> str | list[int]:
    """--split: "even", "parameters", or a list of integers (counts or stage indices)."""
    if args.split in ("even", "parameters"):
        return args.split
    if not all(part.strip() for part in args.split.split(",")):
        raise InputError(
            f"--split {args.split!r}: empty item; write comma-separated integers like 5,7,7,5"
        )
    try:
        return [int(part) for part in args.split.split(",")]
    except ValueError:
        raise InputError(
            f"--split {args.split!r}: use even, parameters, or comma-separated integers"
        ) from None


def _training_from_args(args: argparse.Namespace, config: ParallelConfig) -> TrainingConfig:
    """The evaluated config's own training options (``evaluation.default_training``: its global
    batch, micro-batch, ZeRO stage, recompute, schedule, virtual stages and sequence
    parallelism) with the flags' runtime, output deallocation, memory model, calibration,
    precision, optimizer, reserve and bytes per parameter (the table's for the precision,
    optimizer and runtime unless --bytes-per-param gives them; the precision is the graph's
    unless --precision gives it)."""
    from solver.evaluation import default_training

    calibration = calibration_from_args(args)
    return dataclasses.replace(
        default_training(config),
        runtime=args.runtime,
        deallocate_pipeline_outputs=args.deallocate_pipeline_outputs,
        grad_lifetime=args.grad_lifetime,
        optimizer_impl=args.optimizer_impl,
        memory_model=args.memory_model,
        moe_capacity_factor=args.moe_capacity_factor,
        calibration=calibration,
        **precision_words(args, calibration),
        **bytes_per_param(args),
    )


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
    if not all(given):
        raise InputError(
            f"--stage-groups {args.stage_groups!r}: empty item; name one group per stage, "
            f"comma-separated (names: {', '.join(names)})"
        )
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
    from solver.report.plots import plot_plan

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
