"""``python -m profiling.validate PLAN.json --model PRESET``: run a plan for real, compare peaks.

Runs the plan on this machine with ``profiling.run.run_plan`` (pp * dp * tp processes: gloo on
CPU, or NCCL with one GPU per rank with ``--device cuda``; the plan must be small enough to fit)
on torch.distributed.pipelining, or on megatron-core with ``--engine megatron``,
prints predicted, measured and error % rank by rank, and exits non-zero when any rank's absolute
error exceeds ``--tolerance`` percent. Time: each rank's last instrumented iteration
(``iter_ms``, with the live-tensor tracker counting) and the clean step time (``step_ms``: the
slowest rank's, tracker off, median of ``--step-iterations``), next to the plan's
``iteration_ms``; ranks run with ``--threads`` CPU threads (default: the graph's
``meta.timing.threads``, else ``cpu_count // world``).
Exit codes: 0 within tolerance, 2 bad input (a bad --json path: before the run), 5 a rank failed
or timed out, 6 error above tolerance, 7 --json could not be written; 130, 143, 129 after Ctrl-C,
SIGTERM, SIGHUP (the ranks, their fork server and the run's files ended or removed first).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from profiling.export import MAX_THREADS, parse_overrides
from solver.console import (
    OneLineErrorParser,
    check_outputs,
    int_in,
    interrupted,
    number_in,
    positive_int,
    print_error,
    run_main,
    write_json,
)
from solver.errors import InputError, PlannerError
from solver.files.plan_file import load_plan

TOLERANCE_EXCEEDED = 6
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest --timeout, seconds (a week)."""


def parser() -> argparse.ArgumentParser:
    result = OneLineErrorParser(
        prog="python -m profiling.validate",
        description="Run a plan for real and compare per-rank peaks.",
    )
    result.add_argument(
        "plan",
        help="plan JSON written by python -m solver.plan --json (or solver.evaluate --json)",
    )
    result.add_argument(
        "--model",
        required=True,
        help="the model the plan was made for: a zoo preset, hf:NAME or package.module:factory "
        "(the last two are cut by torch.distributed.pipelining.pipeline at the plan's layers)",
    )
    result.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="model config override, as given to profiling.export (default: the overrides the "
        "plan's graph was exported with, when its graph file is readable)",
    )
    result.add_argument(
        "--seq",
        type=positive_int,
        help="sequence length (default: the one the plan's graph was exported with, else the "
        "model's)",
    )
    result.add_argument(
        "--iterations",
        type=positive_int,
        default=2,
        help="training iterations; the last one is measured (default 2: the "
        "optimizer state exists from the first step on)",
    )
    result.add_argument(
        "--step-iterations",
        type=int_in(0, 1000),
        default=1,
        help="clean timed iterations after the measured ones, memory instrumentation off "
        "(default 1; 0: none): step_ms, the slowest rank's time, median over them",
    )
    result.add_argument(
        "--threads",
        type=int_in(1, MAX_THREADS),
        help="CPU threads per rank (default: the count the plan's graph timed its layers with, "
        "meta.timing.threads, when its file is readable; else cpu_count // ranks)",
    )
    result.add_argument(
        "--tolerance",
        type=number_in(0, 1e6, unit=" percent"),
        default=10.0,
        help="largest allowed |error| in percent (default 10)",
    )
    result.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (gloo, default) or cuda (NCCL, one GPU per rank; also reports "
        "torch.cuda.max_memory_allocated)",
    )
    result.add_argument(
        "--engine",
        choices=("torch", "megatron"),
        default="torch",
        help="torch (torch.distributed.pipelining, default) or megatron (megatron-core, CPU "
        'over gloo; needs pip install -e ".[megatron]" and a plan for --runtime megatron)',
    )
    result.add_argument(
        "--timeout",
        type=number_in(0, MAX_TIMEOUT_S, low_open=True, unit=" seconds"),
        default=300.0,
        help="seconds for the whole run (default 300)",
    )
    result.add_argument("--json", metavar="OUT", help="also write the per-rank reports as JSON")
    result.add_argument(
        "--plot-schedule",
        metavar="FILE",
        help="also draw the plan's pipeline schedule with each rank's predicted memory over the "
        "step and, over it, the measured memory at each action (torch engine; .png, .pdf or "
        ".svg)",
    )
    result.add_argument(
        "--graph",
        metavar="GRAPH.json",
        help="with --plot-schedule: the plan's layer graph (default: the file the plan records)",
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        from profiling.run import format_reports, rank_threads, run_plan, step_ms

        check_outputs(args)  # --json and --plot-schedule, before the run
        plan = load_plan(args.plan)  # checked (docs/plan.md): a PlanFile
        evaluation = _schedule_evaluation(plan, args)
        exported = _export_settings(plan)
        threads, threads_from = rank_threads(plan, args.device, args.threads)
        overrides = parse_overrides(args.set) if args.set else exported.get("overrides", {})
        reports = run_plan(
            args.model,
            plan,
            iterations=args.iterations,
            overrides=overrides,
            seq=args.seq or exported.get("seq_len"),
            timeout_s=args.timeout,
            device=args.device,
            engine=args.engine,
            threads=threads,
            step_iterations=args.step_iterations,
        )
        print(format_reports(reports))
        timing = _timing(reports, plan.iteration_ms, threads, threads_from, step_ms(reports))
        print(_format_timing(timing))
        if args.json:
            rows = [{k: v for k, v in asdict(r).items() if k != "grads"} for r in reports]
            write_json(
                args.json,
                {"plan": args.plan, "model": args.model} | timing | {"ranks": rows},
                protect=[args.plan],
            )
        if evaluation is not None:
            _plot_schedule(evaluation, reports, args.plot_schedule, args.engine)
        worst = max((abs(r.error_pct) for r in reports if r.error_pct is not None), default=0.0)
        if worst > args.tolerance:
            print_error(
                f"largest per-rank error {worst:.1f}% exceeds --tolerance {args.tolerance:g}%"
            )
            _runtime_note(args.plan, plan.runtime, args.engine)
            return TOLERANCE_EXCEEDED
        print(f"all ranks within {args.tolerance:g}% (largest |error| {worst:.1f}%)")
        _runtime_note(args.plan, plan.runtime, args.engine)
    except PlannerError as error:
        print_error(error)
        return error.exit_code
    except KeyboardInterrupt:  # the ranks of a run were stopped on the way out
        return interrupted()
    return 0


def _schedule_evaluation(plan, args: argparse.Namespace):
    """The plan evaluated again on its graph (--graph, else the file it records) for
    --plot-schedule, before the run; None without it."""
    if args.plot_schedule is None:
        if args.graph is not None:
            raise InputError("--graph is the plan's graph for --plot-schedule: give both")
        return None
    from solver.files.plan_file import evaluate_plan

    return evaluate_plan(plan, args.graph, pass_graph="profiling.validate ... --graph GRAPH.json")


def _plot_schedule(evaluation, reports, path: str, engine: str) -> None:
    """--plot-schedule: the schedule picture with each stage's measured memory at each action
    (its first rank's: dp 0, tp 0), where the engine recorded one per action."""
    from solver.costs.schedule_orders import ZERO_BUBBLE_SCHEDULES, zero_bubble_actions
    from solver.report.schedule_plot import plot_schedule

    config = evaluation.config
    m, p, v = config.num_microbatches, config.pp, config.virtual_stages

    def actions(rank: int) -> int:
        """The rank's F and B steps (F, I, W and B of torch's list for split backwards)."""
        if config.schedule in ZERO_BUBBLE_SCHEDULES:
            return len(zero_bubble_actions(config.schedule, m, p, v, rank))
        return 2 * m * v

    measured = {
        report.stage: report.action_bytes
        for report in reports
        if report.dp_rank == 0
        and report.tp_rank == 0
        and len(report.action_bytes) == actions(report.stage)
    }
    plot_schedule(evaluation, path, measured=measured)
    if len(measured) < config.pp:
        print(
            f"note: --plot-schedule {path}: the {engine} engine recorded no memory per action "
            f"on {config.pp - len(measured)} of {config.pp} stages; their rows show the "
            "prediction only",
            file=sys.stderr,
        )


def _export_settings(plan) -> dict:
    """``overrides`` and ``seq_len`` from the meta of the graph file the plan records, when that
    file is there and still the plan's graph; else nothing (the run takes the model's own)."""
    from profiling.run import recorded_graph

    graph = recorded_graph(plan)
    if graph is None:
        return {}
    return {key: graph.meta[key] for key in ("overrides", "seq_len") if graph.meta.get(key)}


def _timing(reports, plan_ms: float, threads: int, threads_from: str, step: float | None) -> dict:
    """The run's times (the JSON's top-level keys): the clean step time ``step_ms`` (slowest
    rank, median over the clean iterations; None without them), the slowest rank's last
    instrumented iteration ``iteration_ms``, the plan's ``plan_iteration_ms``, and the threads
    per rank with where that count came from."""
    instrumented = [r.iteration_ms[-1] for r in reports if r.iteration_ms]
    return {
        "step_ms": step,
        "iteration_ms": max(instrumented) if instrumented else None,
        "plan_iteration_ms": plan_ms,
        "threads": threads,
        "threads_from": threads_from,
    }


def _format_timing(timing: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    plan_ms, step = timing["plan_iteration_ms"], timing["step_ms"]
    versus = f" ({100 * (plan_ms - step) / step:+.1f}% plan vs step)" if step else ""
    return (
        f"time: step {ms(step)} (clean, slowest rank), instrumented iteration "
        f"{ms(timing['iteration_ms'])}, plan {ms(plan_ms)}{versus}; "
        f"{timing['threads']} threads per rank ({timing['threads_from']})"
    )


def _runtime_note(path: str, runtime: str, engine: str) -> None:
    """After the result (never before an error): a plan for another runtime than the one run."""
    if engine == "torch" and runtime != "torch":
        print(
            f"note: {path} was planned for the {runtime} runtime; this run uses "
            "torch.distributed.pipelining, which keeps more boundary buffers (plan with "
            "--runtime torch to compare like for like)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    run_main(main)
