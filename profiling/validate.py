"""``python -m profiling.validate PLAN.json --model PRESET``: run a plan for real, compare peaks.

Runs the plan on this machine with ``profiling.run.run_plan`` (pp * dp * tp processes: gloo on
CPU, or NCCL with one GPU per rank with ``--device cuda``; the plan must be small enough to fit)
on torch.distributed.pipelining, or on megatron-core with ``--engine megatron``,
prints predicted, measured and error % rank by rank, and exits non-zero when any rank's absolute
error exceeds ``--tolerance`` percent.
Exit codes: 0 within tolerance, 2 bad input (a bad --json path: before the run), 5 a rank failed
or timed out, 6 error above tolerance, 7 --json could not be written.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from profiling.export import parse_overrides
from solver.cli.common import (
    OneLineErrorParser,
    check_outputs,
    number_in,
    positive_int,
    print_error,
    write_json,
)
from solver.cli.terminal import interrupted
from solver.errors import PlannerError
from solver.plan_file import load_plan

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
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        from profiling.run import format_reports, run_plan

        check_outputs(args)  # --json, before the run
        plan = load_plan(args.plan)  # checked (docs/plan.md): a PlanFile
        exported = _export_settings(plan)
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
        )
        print(format_reports(reports))
        if args.json:
            rows = [{k: v for k, v in asdict(r).items() if k != "grads"} for r in reports]
            write_json(
                args.json,
                {"plan": args.plan, "model": args.model, "ranks": rows},
                protect=[args.plan],
            )
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


def _export_settings(plan) -> dict:
    """``overrides`` and ``seq_len`` from the meta of the graph file the plan records, when that
    file is there and still the plan's graph; else nothing (the run takes the model's own)."""
    from pathlib import Path

    from solver.graph import load_graph

    record = plan.graph
    if record is None or not record.path or not Path(record.path).is_file():
        return {}
    try:
        graph = load_graph(record.path)
    except (PlannerError, OSError, ValueError):
        return {}
    if graph.sha256() != record.sha256:
        return {}
    return {key: graph.meta[key] for key in ("overrides", "seq_len") if graph.meta.get(key)}


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
    raise SystemExit(main())
