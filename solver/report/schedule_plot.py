"""The pipeline schedule picture (``--plot-schedule FILE``): one row per pipeline rank with its
forwards and backwards over the step, as the time simulation runs them
(``solver.costs.schedule_time``), and under each row that rank's memory over the step from the
cost model (``solver.costs.schedule_memory``), with its predicted peak and the GPU's usable
memory marked; ``profiling.validate`` adds the measured memory at each action where a run
recorded it. Times and memory in the units that suit the step (``figure_scale``).

The zero-bubble and V schedules' input-gradient ("I") and weight-gradient ("W") steps have their
colours in ``ACTION_COLOURS``: the rows draw whatever kinds the simulated actions carry.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from solver.costs import layer_costs
from solver.costs.schedule import ScheduleAction
from solver.costs.schedule_memory import rank_memory
from solver.costs.schedule_time import schedule_inputs, simulate_schedule
from solver.parallel import V_SCHEDULES
from solver.report.plots import CAPACITY_COLOUR, DPI, _save, check_plot_path
from solver.units import format_bytes

ACTION_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
"""Colour of each kind of action: forward, full backward (input and weight gradients), a split
schedule's input gradient, its weight gradient."""
ACTION_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
TAIL_COLOUR = "#8c8c8c"
PREDICTED_COLOUR = "#4c72b0"
MEASURED_COLOUR = "#222222"
MAX_DRAWN_RANKS = 16
"""Ranks drawn at most; a deeper pipeline shows this many, spread over it, the fullest included."""
MAX_LABELS = 2000
"""Action labels drawn at most (each is a text artist); the narrowest are left out first."""
LABEL_PX_PER_CHAR = 7.0
UNTIMED_FORWARD = 1_000_000
"""A forward's slot where the graph has no layer times, ns (a backward takes two)."""
TIME_UNITS = (("ms", 1e6), ("µs", 1e3), ("ns", 1.0))
MEMORY_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
USABLE_IN_VIEW = 1.5
"""The usable-memory line is in view when at most this times the largest memory drawn;
higher, the rows keep the curves' scale and say where it is."""


class Scale(NamedTuple):
    """The figure's units: time in ``time_unit`` (``ns_per_unit`` ns each), memory in
    ``memory_unit`` (``bytes_per_unit`` bytes each), and the memory axis' top, in that unit."""

    time_unit: str
    ns_per_unit: float
    memory_unit: str
    bytes_per_unit: float
    top: float


def figure_scale(
    series: list[RankSchedule],
    makespan_ns: int,
    measured: Mapping[int, Sequence[int]] | None = None,
) -> Scale:
    """The units that show ``series``: the largest time unit the iteration fills once, the
    largest memory unit the largest peak (or measured value) fills once, and a top above it (and
    above the usable memory when that is within ``USABLE_IN_VIEW`` of it)."""
    time_unit, ns = next(
        ((name, ns) for name, ns in TIME_UNITS if makespan_ns >= ns), TIME_UNITS[-1]
    )
    largest = max(rank.peak_bytes for rank in series)
    for values in (measured or {}).values():
        largest = max(largest, *values)
    memory_unit, size = next(
        ((name, size) for name, size in MEMORY_UNITS if largest >= size), MEMORY_UNITS[-1]
    )
    usable = max(rank.usable_bytes for rank in series)
    top = max(largest, usable) if usable <= USABLE_IN_VIEW * largest else largest
    return Scale(time_unit, ns, memory_unit, size, 1.1 * top / size)


@dataclass(frozen=True, kw_only=True)
class RankSchedule:
    """One rank's simulated actions with the cost model's memory at each; ns and bytes."""

    rank: int
    actions: tuple[ScheduleAction, ...]
    start_ns: tuple[int, ...]
    end_ns: tuple[int, ...]
    action_bytes: tuple[int, ...]
    """The memory at each action (``solver.costs.RankMemory.action_bytes``)."""
    end_of_rank_ns: int
    """The rank's end: its last backward + gradient sync + optimizer step."""
    step_start_ns: int
    """The optimizer step's start (its end is ``end_of_rank_ns``)."""
    step_bytes: int | None
    peak_bytes: int
    """The stage's predicted peak (``StageCost.peak_bytes``)."""
    usable_bytes: int
    """The memory it may fill: its GPU's capacity - the reserve."""


def schedule_series(evaluation: Any) -> tuple[list[RankSchedule], int]:
    """(every rank's actions, times and memory, the simulated iteration in ns) of an evaluation
    (``solver.Evaluation``): the action lists and times its throughput comes from (where the
    graph has no layer times, its iteration is 0 ns: then each forward takes
    ``UNTIMED_FORWARD`` and each backward twice that, nothing else, to show the order), and the
    memory of the cost model its peaks come from (coefficients rebuilt for its config; a
    heterogeneous cluster's first group's, as ``evaluate_assignment`` takes them: memory does
    not depend on the group, and the stages carry their groups' times)."""
    cluster = evaluation.cluster
    if evaluation.group_of_stage is not None:
        cluster = cluster.group_cluster(0)
    costs = layer_costs(evaluation.graph, evaluation.config, cluster, evaluation.training)
    inputs = schedule_inputs(costs, evaluation.stages, evaluation.stage_of_layer)
    timeline = simulate_schedule(**inputs)
    if not costs.has_compute_time:  # no layer times: the order in slots (F 1, B 2)
        stages = len(inputs["forward_ns"])
        inputs |= {
            "forward_ns": [UNTIMED_FORWARD] * stages,
            "backward_ns": [2 * UNTIMED_FORWARD] * stages,
            "microbatch_overhead_ns": 0,
            "transfer_ns": None,
            "gradient_ns": None,
            "dp_sync_ns": None,
            "optimizer_step_ns": 0,
        }
        timeline = simulate_schedule(**inputs)
    memory = rank_memory(costs, evaluation.stage_of_layer, evaluation.recomputed)
    steps = inputs["optimizer_step_ns"]
    series = []
    for rank, (done, rank_mem) in enumerate(zip(timeline.actions, memory, strict=True)):
        assert tuple(action for action, _, _ in done) == rank_mem.actions, "one action list"
        end = done[-1][2] + timeline.tail_ns[rank]
        series.append(
            RankSchedule(
                rank=rank,
                actions=rank_mem.actions,
                start_ns=tuple(start for _, start, _ in done),
                end_ns=tuple(finish for _, _, finish in done),
                action_bytes=rank_mem.action_bytes,
                end_of_rank_ns=end,
                step_start_ns=end - int(steps[rank] if isinstance(steps, list) else steps),
                step_bytes=rank_mem.step_bytes,
                peak_bytes=evaluation.stages[rank].peak_bytes,
                usable_bytes=evaluation.usable_bytes[rank],
            )
        )
    return series, timeline.makespan_ns


def memory_curve(rank: RankSchedule, values: Sequence[int] | None = None):
    """(x in ns, y in bytes) of a rank's memory: during each action from the value after the
    previous one to its own, level while the rank waits, then through its gradient sync and
    optimizer step, at the optimizer step's moment where the model has one. ``values``: per
    action (default the predicted ones; given ones stop at the last action)."""
    predicted = values is None
    values = rank.action_bytes if predicted else values
    xs, ys = [], []
    for index, (start, end, value) in enumerate(
        zip(rank.start_ns, rank.end_ns, values, strict=True)
    ):
        if index:
            xs.append(start)
            ys.append(ys[-1])
        xs.append(end)
        ys.append(value)
    if predicted and rank.step_bytes is not None:
        xs += [rank.step_start_ns, rank.step_start_ns, rank.end_of_rank_ns]
        ys += [ys[-1], rank.step_bytes, rank.step_bytes]
    elif predicted and rank.end_of_rank_ns > xs[-1]:  # the last moment through sync and step
        xs.append(rank.end_of_rank_ns)
        ys.append(ys[-1])
    return xs, ys


def schedule_figure(
    evaluation: Any,
    *,
    measured: Mapping[int, Sequence[int]] | None = None,
    title: str | None = None,
):
    """The picture (a matplotlib ``Figure``): per drawn rank a row of its actions and under it
    its memory. ``measured``: per rank, the measured bytes at each of its actions (the order of
    ``RankSchedule.actions``), drawn over the predicted curve."""
    series, makespan_ns = schedule_series(evaluation)
    untimed = evaluation.iteration_ns == 0
    drawn = _drawn_ranks(series)
    figure, axes = _rows(len(drawn))
    scale = figure_scale(series, makespan_ns, measured)
    labels = _label_budget(series, drawn, makespan_ns)
    for position, rank in enumerate(drawn):
        row, memory_ax = axes[2 * position], axes[2 * position + 1]
        _action_row(
            row, series[rank], labels, scale, multiple_chunks=evaluation.config.virtual_stages > 1
        )
        values = None if measured is None else measured.get(rank)
        _memory_row(memory_ax, series[rank], values, scale)
    axes[-1].set_xlabel(
        "schedule slots (the graph has no layer times: a forward 1, a backward 2)"
        if untimed
        else f"time in the step ({scale.time_unit}, simulated)"
    )
    axes[-1].set_xlim(0, makespan_ns / scale.ns_per_unit)
    figure.legend(*_legend(axes, series), loc="outside lower center", ncols=4, fontsize=8)
    config = evaluation.config
    heading = f"{evaluation.graph.model}: {config.label()} on {config.num_gpus} GPUs"
    shown = "" if len(drawn) == len(series) else f"; ranks {_ranks_text(drawn)} of {len(series)}"
    iteration = (
        "no layer times"
        if untimed
        else f"iteration {makespan_ns / scale.ns_per_unit:.4g} {scale.time_unit}"
    )
    interleaved = " interleaved" if config.virtual_stages > 1 else ""
    if config.schedule in V_SCHEDULES:
        interleaved = " (V placement)"
    summary = (
        f"{config.schedule}{interleaved}, "
        f"{config.num_microbatches} micro-batches, {iteration}, "
        f"peak {format_bytes(evaluation.peak_bytes)}{shown}"
    )
    figure.suptitle(title or f"{heading}\n{summary}", fontsize=11)
    return figure


def plot_schedule(
    evaluation: Any,
    path: str | os.PathLike,
    *,
    measured: Mapping[int, Sequence[int]] | None = None,
    title: str | None = None,
    flag: str = "--plot-schedule",
) -> Path:
    """Draw :func:`schedule_figure` to ``path`` (.png, .pdf or .svg) by the one writing path;
    returns the path written."""
    target = check_plot_path(path, flag=flag)
    return _save(schedule_figure(evaluation, measured=measured, title=title), target, flag=flag)


# -- rows --------------------------------------------------------------------------------------


def _rows(num_ranks: int):
    """The figure and its axes: per rank an action row and a memory row, one time axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13.0, 1.4 + 2.2 * num_ranks), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(2 * num_ranks, 1, height_ratios=[1, 2] * num_ranks)
    axes = []
    for index in range(2 * num_ranks):
        axes.append(figure.add_subplot(grid[index], sharex=axes[0] if axes else None))
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    return figure, axes


def _action_row(
    ax, rank: RankSchedule, labels: set, scale: Scale, *, multiple_chunks: bool
) -> None:
    """The rank's actions as boxes coloured by kind (lighter for later chunks), each labelled
    with its micro-batch (micro-batch.chunk with interleaving) where it is wide enough, and its
    tail (gradient sync and optimizer step) in grey."""
    by_kind: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for action, start, end in zip(rank.actions, rank.start_ns, rank.end_ns, strict=True):
        by_kind.setdefault((action.kind, action.chunk), []).append(
            (start / scale.ns_per_unit, (end - start) / scale.ns_per_unit)
        )
    for (kind, chunk), boxes in sorted(by_kind.items()):
        ax.broken_barh(
            boxes,
            (0.1, 0.8),
            facecolors=ACTION_COLOURS.get(kind, "#937860"),
            alpha=1.0 - 0.35 * min(chunk, 2) / 2,
            edgecolor="white",
            linewidth=0.5,
            label=f"{kind} chunk {chunk}",
        )
    last_end, unit = rank.end_ns[-1], scale.ns_per_unit
    if rank.end_of_rank_ns > last_end:
        ax.broken_barh(
            [(last_end / unit, (rank.end_of_rank_ns - last_end) / unit)],
            (0.1, 0.8),
            facecolors=TAIL_COLOUR,
            alpha=0.5,
            label="sync + step",
        )
    for index, (action, start, end) in enumerate(
        zip(rank.actions, rank.start_ns, rank.end_ns, strict=True)
    ):
        if (rank.rank, index) in labels:
            ax.text(
                (start + end) / 2 / unit,
                0.5,
                _action_text(action, multiple_chunks),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_ylim(0, 1)
    ax.set_yticks([0.5], [f"rank {rank.rank}"], fontsize=8)
    ax.tick_params(axis="y", length=0)


def _memory_row(ax, rank: RankSchedule, measured: Sequence[int] | None, scale: Scale) -> None:
    """The rank's predicted memory, its peak and its usable memory (and the measured one)."""
    ns, size = scale.ns_per_unit, scale.bytes_per_unit
    xs, ys = memory_curve(rank)
    xs, ys = [x / ns for x in xs], [y / size for y in ys]
    ax.plot(xs, ys, color=PREDICTED_COLOUR, linewidth=1.2, label="predicted memory")
    peak = rank.peak_bytes / size
    ax.axhline(
        peak,
        color=PREDICTED_COLOUR,
        linestyle=":",
        linewidth=1,
        label=f"predicted peak {format_bytes(rank.peak_bytes)}",
    )
    at = [x for x, y in zip(xs, ys, strict=True) if y == peak][:1]
    ax.plot(at, [peak] * len(at), "o", color=PREDICTED_COLOUR, markersize=4)
    usable = rank.usable_bytes / size
    ax.axhline(
        usable,
        color=CAPACITY_COLOUR,
        linestyle="--",
        linewidth=1.2,
        label=f"usable {format_bytes(rank.usable_bytes)}",
    )
    if usable > scale.top:  # far above the curves: say where it is
        ax.text(
            0.995,
            0.95,
            f"usable {format_bytes(rank.usable_bytes)} (above)",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=7,
            color=CAPACITY_COLOUR,
        )
    if measured is not None:
        mx, my = memory_curve(rank, measured)
        ax.plot(
            [x / ns for x in mx],
            [y / size for y in my],
            color=MEASURED_COLOUR,
            linewidth=1,
            marker=".",
            markersize=2,
            label=f"measured (peak {format_bytes(max(measured))})",
        )
    ax.set_ylim(0, scale.top)
    ax.set_ylabel(scale.memory_unit, fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="y", alpha=0.3)


def _action_text(action: ScheduleAction, multiple_chunks: bool) -> str:
    """Micro-batch (0-based), with interleaving micro-batch.chunk."""
    return f"{action.microbatch}.{action.chunk}" if multiple_chunks else f"{action.microbatch}"


def _label_budget(series: list[RankSchedule], drawn: list[int], span_ns: int) -> set:
    """(rank, action index) of the labels to draw: boxes wide enough for their text on a figure
    about 1100 px wide, the widest first, at most ``MAX_LABELS``."""
    px_per_ns = 1100.0 / max(1, span_ns)
    fits = []
    for rank in drawn:
        entry = series[rank]
        for index, (action, start, end) in enumerate(
            zip(entry.actions, entry.start_ns, entry.end_ns, strict=True)
        ):
            width_px = (end - start) * px_per_ns
            needed = LABEL_PX_PER_CHAR * len(_action_text(action, True)) + 2
            if width_px >= needed:
                fits.append((-width_px, rank, index))
    fits.sort()
    return {(rank, index) for _, rank, index in fits[:MAX_LABELS]}


def _drawn_ranks(series: list[RankSchedule]) -> list[int]:
    """Every rank up to ``MAX_DRAWN_RANKS``; beyond, that many spread evenly, the fullest one
    (largest peak) among them."""
    p = len(series)
    if p <= MAX_DRAWN_RANKS:
        return list(range(p))
    fullest = max(range(p), key=lambda r: series[r].peak_bytes)
    spread = {round(i * (p - 1) / (MAX_DRAWN_RANKS - 2)) for i in range(MAX_DRAWN_RANKS - 1)}
    return sorted(spread | {fullest})


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _legend(axes, series: list[RankSchedule]):
    """One entry per kind of action present, the tail, the curves and the lines."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    kinds = sorted({action.kind for rank in series for action in rank.actions}, key="FBIW".find)
    handles = [Patch(color=ACTION_COLOURS.get(kind, "#937860")) for kind in kinds]
    labels = [f"{kind}: {ACTION_NAMES.get(kind, kind)}" for kind in kinds]
    handles.append(Patch(color=TAIL_COLOUR, alpha=0.5))
    labels.append("gradient sync + optimizer step")
    handles += [
        Line2D([], [], color=PREDICTED_COLOUR),
        Line2D([], [], color=PREDICTED_COLOUR, linestyle=":"),
        Line2D([], [], color=CAPACITY_COLOUR, linestyle="--"),
    ]
    labels += ["predicted memory (cost model)", "predicted peak", "usable GPU memory"]
    if any(line.get_label().startswith("measured") for ax in axes for line in ax.get_lines()):
        handles.append(Line2D([], [], color=MEASURED_COLOUR, marker="."))
        labels.append("measured memory at each action")
    return handles, labels


__all__ = ["RankSchedule", "memory_curve", "plot_schedule", "schedule_figure", "schedule_series"]
