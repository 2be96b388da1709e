"""``python -m profiling.calibrate --model gpt-tiny --out calibration.json``: fit the memory model.

Profiles the model (``profiling.export.export_graph``, fp32), plans a few small layouts with
``solver.plan`` (pinned pipeline / data-parallel degrees, 1F1B and GPipe, several micro-batch
counts; 2-4 processes each), runs every plan on CPU gloo with ``profiling.run.run_plan`` (exact
live-tensor peaks, the last of ``--iterations`` measured), and fits a
``solver.calibration.Calibration`` to the (predicted breakdown, measured peak) pair of every rank.
Prints per rank the analytic, calibrated and measured peaks with their errors, and the
leave-one-out errors (each configuration predicted by a fit on the others: what to expect on a
configuration the fit has not seen). Writes the calibration JSON, whose ``meta`` holds every
sample, so the fit can be redone from the file alone.

From Python (a benchmark): ``calibration, rows = calibrate("gpt-tiny", SMALL_GPT, LAYOUTS[:2])``.
Exit codes: 0 written, 2 bad input (flags, a bad --out path or an existing --out file without
--force, checked before any run), 5 a run failed, 7 --out could not be written; 130, 143, 129
after Ctrl-C, SIGTERM, SIGHUP (the current run's ranks and their fork server ended first).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from profiling.export import parse_overrides
from profiling.validate import MAX_TIMEOUT_S
from solver.calibration import (
    Calibration,
    Sample,
    fit_calibration,
    leave_one_out,
    write_calibration,
)
from solver.console import (
    OneLineErrorParser,
    interrupted,
    number_in,
    positive_int,
    print_error,
    run_main,
)
from solver.errors import InputError, PlannerError
from solver.files.output_file import check_output
from solver.graph import LayerGraph
from solver.specs import TrainingConfig

SMALL_GPT = {
    "layers": 6,
    "hidden": 64,
    "heads": 4,
    "seq_len": 32,
    "vocab_size": 512,
    "dropout": 0.0,
}
"""gpt-tiny's default overrides here (those of scripts/bench_accuracy.py): runs take seconds."""
FP32_ADAM = {"weight_bytes_per_param": 4, "grad_bytes_per_param": 4, "optimizer_bytes_per_param": 8}
"""fp32 weights and gradients, Adam's two fp32 moments: what ``run_plan`` trains."""


class Layout(NamedTuple):
    """One calibration configuration (the tuple order of bench_accuracy's LAYOUTS)."""

    label: str
    num_gpus: int
    pins: dict[str, int]
    """Pinned degrees, e.g. {"pp": 2, "dp": 2} or {"pp": 2, "tp": 2}; tp defaults to 1."""
    global_batch: int
    micro_batch: int
    schedule: str
    zero: int = 0
    recompute: str = "none"
    virtual_stages: int = 1
    """Chunks per pipeline rank (interleaved 1F1B when > 1)."""
    engine: str = "torch"
    """What runs the plan (``profiling.run.ENGINES``): torch (planned for the torch runtime) or
    megatron (megatron-core, planned for the megatron runtime)."""
    sequence_parallel: str = "off"
    """``TrainingConfig.sequence_parallel``: on for Megatron's sequence parallelism with tp > 1."""

    def training(self) -> TrainingConfig:
        """The planner's options for this layout: pinned degrees, fp32 + Adam, the runtime of
        the engine that runs it."""
        return TrainingConfig(
            global_batch=self.global_batch,
            micro_batch_sizes=(self.micro_batch,),
            zero_stages=(self.zero,),
            recompute=self.recompute,
            schedule=self.schedule,
            virtual_stages=(self.virtual_stages,),
            sequence_parallel=self.sequence_parallel,
            runtime="torch" if self.engine == "torch" else "megatron",
            max_slowdown=None,
            **{"tp": 1, **self.pins},
            **FP32_ADAM,
        )


LAYOUTS = (
    Layout("pp2 1f1b m4", 2, {"pp": 2}, 8, 2, "1f1b"),
    Layout("pp2 gpipe m4", 2, {"pp": 2}, 8, 2, "gpipe"),
    Layout("pp3 1f1b m6", 3, {"pp": 3}, 12, 2, "1f1b"),
    Layout("dp2 pp2 1f1b m2", 4, {"pp": 2, "dp": 2}, 8, 2, "1f1b"),
)
"""The default configurations, cheapest first: ``--configs N`` takes the first N. Together they
vary the pipeline depth, the schedule, the micro-batch count and data parallelism."""


@dataclass(kw_only=True)
class CalibrationRow:
    """One rank of one calibration run, with every prediction for it."""

    config: str
    """The layout label (the fit's group)."""
    split: str
    """Layers per stage, e.g. "3/5"."""
    rank: int
    stage: int
    predicted_breakdown: dict[str, int]
    """The analytic ``StageCost.breakdown()`` of the rank's stage (bytes)."""
    analytic_bytes: int
    """The analytic peak, the sum of the breakdown."""
    calibrated_bytes: int
    """``calibration.apply(predicted_breakdown)`` with the fit on every configuration."""
    loo_bytes: int | None
    """The same with the fit that left this configuration out; None with one configuration."""
    measured_bytes: int
    """The rank's measured peak (``RankReport.measured_peak_bytes``)."""

    def error_pct(self, predicted: int | None) -> float | None:
        """100 (predicted - measured) / measured."""
        if predicted is None:
            return None
        return 100.0 * (predicted - self.measured_bytes) / self.measured_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "split": self.split,
            "rank": self.rank,
            "stage": self.stage,
            "predicted_breakdown": dict(self.predicted_breakdown),
            "analytic_bytes": self.analytic_bytes,
            "calibrated_bytes": self.calibrated_bytes,
            "loo_bytes": self.loo_bytes,
            "measured_bytes": self.measured_bytes,
        }


def calibrate(
    preset: str,
    overrides: Mapping[str, Any] | None = None,
    configs: Sequence[Layout | tuple] = LAYOUTS,
    *,
    iterations: int = 2,
    timeout_s: float = 300.0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> tuple[Calibration, list[CalibrationRow]]:
    """Profile, plan and run ``configs`` of ``preset``; fit a calibration to every rank.

    ``configs`` are :class:`Layout` values or tuples in its field order. ``overrides`` go to both
    the profiler and the runs (use dropout 0). Returns the calibration (its ``meta`` holds the
    samples, fit residuals and leave-one-out fits) and one row per rank, in run order. Raises
    ``InputError`` for a bad preset, override or layout and ``RunError`` when a run fails.
    """
    import torch

    from profiling.export import export_graph

    layouts = [_layout(item) for item in configs]
    if not layouts:
        raise InputError("calibrate: no configurations given")
    labels = [layout.label for layout in layouts]
    if len(set(labels)) != len(labels):
        raise InputError(f"calibrate: configuration labels must be unique, got {labels}")
    overrides = dict(overrides or {})
    graph = export_graph(preset, dtype="fp32", overrides=overrides)
    samples, runs, described = _run_layouts(
        preset,
        graph,
        layouts,
        overrides,
        iterations=iterations,
        timeout_s=timeout_s,
        seed=seed,
        progress=progress,
    )
    calibration = fit_calibration(samples)
    loo = leave_one_out(samples) if len(layouts) > 1 else {}
    held_out = {label: held.calibration for label, held in loo.items()}
    rows = _rows(runs, calibration, held_out)
    calibration.meta.update(
        model=preset,
        graph_model=graph.model,
        overrides=overrides,
        dtype="fp32",
        bytes_per_param=FP32_ADAM,
        iterations=iterations,
        seed=seed,
        configs=described,
        samples=[row.to_dict() for row in rows],
        analytic_abs_error_pct=_spread([row.error_pct(row.analytic_bytes) for row in rows]),
        calibrated_abs_error_pct=_spread([row.error_pct(row.calibrated_bytes) for row in rows]),
        leave_one_out={
            label: {
                "scales": held.scales,
                "constant_bytes": held.constant_bytes,
                "fitted": held.meta["fitted"],
                "errors_pct": [round(error, 4) for error in loo[label].errors_pct],
            }
            for label, held in held_out.items()
        },
        leave_one_out_abs_error_pct=(
            _spread([row.error_pct(row.loo_bytes) for row in rows]) if held_out else None
        ),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
    )
    return calibration, rows


def _run_layouts(
    preset: str,
    graph: LayerGraph,
    layouts: list[Layout],
    overrides: dict[str, Any],
    *,
    iterations: int,
    timeout_s: float,
    seed: int,
    progress: Callable[[str], None] | None,
) -> tuple[list[Sample], list[tuple[Layout, str, Any]], list[dict[str, Any]]]:
    """Plan and run each layout on ``graph``: a sample per rank, (layout, split text, report)
    per rank, and each layout's description for the calibration's ``meta.configs``."""
    from profiling.run import run_plan
    from solver import Cluster, plan
    from solver.report.plan_report import plan_to_dict

    samples: list[Sample] = []
    runs: list[tuple[Layout, str, Any]] = []
    described = []
    for layout in layouts:
        cluster = Cluster(num_gpus=layout.num_gpus, gpus_per_node=layout.num_gpus)
        chosen = plan(graph, cluster, layout.training())
        split = _split_text(chosen)
        if progress:
            progress(f"running {layout.label} ({chosen.config.num_gpus} ranks, split {split})")
        reports = run_plan(
            preset,
            plan_to_dict(chosen),
            iterations=iterations,
            overrides=overrides,
            timeout_s=timeout_s,
            seed=seed,
            engine=layout.engine,
        )
        for report in reports:
            samples.append(
                Sample(report.predicted_breakdown, report.measured_peak_bytes, layout.label)
            )
            runs.append((layout, split, report))
        described.append({"label": layout.label, "config": chosen.config.to_dict(), "split": split})
    return samples, runs, described


def _rows(
    runs: list[tuple[Layout, str, Any]], calibration: Calibration, held_out: dict[str, Calibration]
) -> list[CalibrationRow]:
    """One row per rank run: the analytic, calibrated and held-out predictions (bytes) next to
    the measured peak."""
    return [
        CalibrationRow(
            config=layout.label,
            split=split,
            rank=report.rank,
            stage=report.stage,
            predicted_breakdown=dict(report.predicted_breakdown),
            analytic_bytes=sum(report.predicted_breakdown.values()),
            calibrated_bytes=calibration.apply(report.predicted_breakdown),
            loo_bytes=(
                held_out[layout.label].apply(report.predicted_breakdown) if held_out else None
            ),
            measured_bytes=report.measured_peak_bytes,
        )
        for layout, split, report in runs
    ]


def _layout(item: Layout | tuple) -> Layout:
    """A Layout from a Layout or a tuple in its field order; InputError when it is not one."""
    try:
        layout = Layout(*item)
    except TypeError:
        raise InputError(
            f"calibrate: configuration {item!r}: give (label, num_gpus, pins, global_batch, "
            "micro_batch, schedule[, zero[, recompute[, virtual_stages[, engine[, "
            "sequence_parallel]]]]])"
        ) from None
    if not isinstance(layout.pins, dict) or set(layout.pins) - {"pp", "dp", "tp"}:
        raise InputError(
            f"calibrate: configuration {layout.label!r}: pins {layout.pins!r} may only pin pp, "
            "dp and tp"
        )
    return layout


def _split_text(chosen) -> str:
    """Layers per stage, e.g. "3/5"; with interleaving per chunk within a rank, e.g. "1+3/2+2"."""
    if chosen.config.virtual_stages == 1:
        return "/".join(str(len(stage.layers)) for stage in chosen.stages)
    return "/".join("+".join(str(len(chunk)) for chunk in stage.chunks) for stage in chosen.stages)


def _spread(errors: list[float | None]) -> dict[str, float]:
    """Median and max of |error| %."""
    values = [abs(error) for error in errors if error is not None]
    return {"median": round(statistics.median(values), 4), "max": round(max(values), 4)}


def format_rows(calibration: Calibration, rows: list[CalibrationRow]) -> str:
    """Text table per rank (KiB, error %), the calibration and the error summaries."""
    kib = 1024

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:+.1f}"

    header = (
        f"{'config':<18} {'split':<7} rank stage {'analytic_KiB':>12} {'calibrated_KiB':>14} "
        f"{'measured_KiB':>12} {'analytic_%':>10} {'calibrated_%':>12} {'loo_%':>7}"
    )
    lines = [header]
    for row in rows:
        lines.append(
            f"{row.config:<18} {row.split:<7} {row.rank:4d} {row.stage:5d} "
            f"{row.analytic_bytes / kib:12.1f} {row.calibrated_bytes / kib:14.1f} "
            f"{row.measured_bytes / kib:12.1f} {pct(row.error_pct(row.analytic_bytes)):>10} "
            f"{pct(row.error_pct(row.calibrated_bytes)):>12} {pct(row.error_pct(row.loo_bytes)):>7}"
        )
    meta = calibration.meta
    lines.append(f"calibration: {calibration.summary()}")
    lines.append(
        f"fitted: {', '.join(meta['fitted']) or 'nothing'}; kept analytic: "
        f"{', '.join(meta['fixed']) or 'nothing'}"
    )
    for name, key in (
        ("analytic", "analytic_abs_error_pct"),
        ("calibrated (in-sample)", "calibrated_abs_error_pct"),
        ("leave-one-out", "leave_one_out_abs_error_pct"),
    ):
        spread = meta.get(key)
        if spread is None:
            lines.append(f"{name} |error|: - (needs 2 or more configurations)")
        else:
            lines.append(
                f"{name} |error|: median {spread['median']:.1f}%, max {spread['max']:.1f}% over "
                f"{len(rows)} ranks of {len(meta['configs'])} configurations"
            )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    result = OneLineErrorParser(
        prog="python -m profiling.calibrate",
        description="Fit the memory cost model's calibration to real runs of small layouts.",
    )
    result.add_argument("--model", required=True, help="zoo preset, e.g. gpt-tiny")
    result.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"model config override, as for profiling.export (gpt-tiny without any: {SMALL_GPT})",
    )
    result.add_argument(
        "--out",
        default="calibration.json",
        help="calibration JSON to write (default calibration.json)",
    )
    result.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    result.add_argument(
        "--configs",
        type=positive_int,
        default=len(LAYOUTS),
        metavar="N",
        help=f"run the first N of the {len(LAYOUTS)} layouts: "
        + "; ".join(layout.label for layout in LAYOUTS)
        + f" (default {len(LAYOUTS)})",
    )
    result.add_argument(
        "--iterations",
        type=positive_int,
        default=2,
        help="training iterations per run; the last one is measured (default 2)",
    )
    result.add_argument(
        "--timeout",
        type=number_in(0, MAX_TIMEOUT_S, low_open=True, unit=" seconds"),
        default=300.0,
        metavar="S",
        help="seconds per run (default 300; at most a week)",
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.configs > len(LAYOUTS):
            raise InputError(f"--configs {args.configs}: at most {len(LAYOUTS)}")
        out = check_output(args.out, flag="--out")  # before 20-30 s of runs
        if out.replaces is not None and not args.force:
            raise InputError(f"{out.label}: already exists; pass --force to overwrite it")
        overrides = parse_overrides(args.set)
        if not overrides and args.model == "gpt-tiny":
            overrides = dict(SMALL_GPT)
        calibration, rows = calibrate(
            args.model,
            overrides,
            LAYOUTS[: args.configs],
            iterations=args.iterations,
            timeout_s=args.timeout,
            progress=lambda text: print(text, file=sys.stderr, flush=True),
        )
        print(format_rows(calibration, rows))
        write_calibration(args.out, calibration, force=args.force, flag="--out")
        print(f"wrote {args.out}")
    except PlannerError as error:
        print_error(error)
        return error.exit_code
    except KeyboardInterrupt:  # the ranks of the current run were stopped on the way out
        return interrupted()
    return 0


if __name__ == "__main__":
    run_main(main)
