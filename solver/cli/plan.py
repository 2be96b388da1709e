"""``python -m solver.plan``: parse, call :func:`solver.search.planner.plan` (or the Pareto front),
print the plan, write its JSON and plot."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from solver.cli.common import (
    add_graph_and_cluster,
    add_plan_options,
    add_plot_option,
    add_plot_schedule_option,
    cluster_from_args,
    training_from_args,
    warn_implementation,
)
from solver.cli.progress import SearchProgress
from solver.console import (
    OneLineErrorParser,
    check_outputs,
    input_files,
    interrupted,
    positive_int,
    print_error,
    print_output,
    shows_progress,
    write_json,
)
from solver.errors import InputError, PlannerError
from solver.graph import load_graph
from solver.parallel import check_searched
from solver.specs import Cluster, TrainingConfig


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


def plan_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m solver.plan",
        description="Find the PP x TP x DP config and layer split that minimise the "
        "largest per-GPU peak memory, with a proof of optimality.",
    )
    parser.add_argument("--gpus", type=positive_int, help="number of GPUs (or --cluster FILE)")
    add_plot_option(
        parser,
        drawing="the plan's per-stage memory next to the even split of the same config; with "
        "--pareto, the front",
    )
    add_plot_schedule_option(parser)
    _add_pareto(parser)
    add_graph_and_cluster(parser)
    add_plan_options(parser)
    return parser


def plan_main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = plan_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    progress = SearchProgress(enabled=shows_progress(args.quiet))
    try:
        from solver.deadline import Deadline
        from solver.report.plan_report import format_plan, plan_to_dict
        from solver.search.planner import plan

        # --time-limit covers the whole command: reading the graph included
        deadline = Deadline(end=started + args.time_limit)
        check_outputs(args)
        check_searched(args.schedule)  # before the graph is read
        if args.pareto_points is not None and not args.pareto:
            raise InputError("--pareto-points needs --pareto")
        if args.plot_schedule and args.pareto:
            raise InputError(
                "--plot-schedule draws one plan's schedule, not a --pareto front: drop one of them"
            )
        cluster = cluster_from_args(parser, args, args.gpus)
        graph = load_graph(args.graph, deadline=deadline)
        training = training_from_args(args)
        if args.pareto:
            _pareto(args, graph, training, cluster, deadline)
            return 0
        result = plan(
            graph,
            cluster,
            training,
            backend=args.backend,
            time_limit_s=args.time_limit,
            num_workers=args.workers,
            deadline=deadline,
            progress=progress if progress.enabled else None,
        )
        progress.close()
        warn_implementation(graph, training.runtime, args.graph)  # a plan came: it applies
        if args.json:
            write_json(args.json, plan_to_dict(result), protect=input_files(args))
        if args.plot:
            from solver.report.plots import plot_plan

            plot_plan(result.evaluation, args.plot, baseline=result.baselines.get("even"))
        if args.plot_schedule:
            from solver.report.schedule_plot import plot_schedule

            plot_schedule(result.evaluation, args.plot_schedule)
        if not args.quiet:
            print_output(format_plan(result))
    except PlannerError as error:
        progress.close()  # before the line, which would otherwise land on the bar
        print_error(error)
        return error.exit_code
    except KeyboardInterrupt:
        progress.close()
        return interrupted()
    return 0


def _pareto(
    args: argparse.Namespace,
    graph: Any,
    training: TrainingConfig,
    cluster: Cluster,
    deadline: Any,
) -> None:
    """solver.plan --pareto: the front as a table, --json document and --plot picture."""
    from solver.search.pareto import format_pareto, pareto_front, pareto_to_dict

    front = pareto_front(
        graph,
        cluster,
        training,
        max_points=PARETO_POINTS if args.pareto_points is None else args.pareto_points,
        backend=args.backend,
        time_limit_s=args.time_limit,
        num_workers=args.workers,
        deadline=deadline,
    )
    if args.json:
        write_json(args.json, pareto_to_dict(front), protect=input_files(args))
    if args.plot:
        from solver.report.plots import plot_pareto

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
        print_output(format_pareto(front))
