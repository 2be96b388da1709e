"""The pipeline schedule picture (``--plot-schedule FILE``): one row per pipeline rank with its
forwards and backwards over the step, as the time simulation runs them
(``solver.costs.schedule_time``), and under each row that rank's memory over the step from the
cost model (``solver.costs.schedule_memory``), with its predicted peak and the GPU's usable
memory marked; ``profiling.validate`` adds the measured memory at each action where a run
recorded it. Times in ms, memory in GiB.

A new kind of action (a zero-bubble schedule's weight-gradient step "W") needs only its colour in
``ACTION_COLOURS``: the rows draw whatever kinds the simulated actions carry.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solver.costs import layer_costs
from solver.costs.schedule import ScheduleAction
from solver.costs.schedule_memory import rank_memory
from solver.costs.schedule_time import schedule_inputs, simulate_schedule
from solver.report.plots import CAPACITY_COLOUR, DPI, GIB, _save, check_plot_path
from solver.units import format_bytes

ACTION_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
"""Colour of each kind of action: forward, backward (input and weight gradients; a split
schedule's B is the input gradient only), weight gradient."""
ACTION_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
TAIL_COLOUR = "#8c8c8c"
PREDICTED_COLOUR = "#4c72b0"
MEASURED_COLOUR = "#222222"
MAX_DRAWN_RANKS = 16
"""Ranks drawn at most; a deeper pipeline shows this many, spread over it, the fullest included."""
MAX_LABELS = 2000
"""Action labels drawn at most (each is a text artist); the narrowest are left out first."""
LABEL_PX_PER_CHAR = 7.0


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
    (``solver.Evaluation``): the action lists and times its throughput comes from, and the
    memory of the cost model its peaks come from (coefficients rebuilt for its config; a
    heterogeneous cluster's first group's, as ``evaluate_assignment`` takes them: memory does
    not depend on the group, and the stages carry their groups' times)."""
    cluster = evaluation.cluster
    if evaluation.group_of_stage is not None:
        cluster = cluster.group_cluster(0)
    costs = layer_costs(evaluation.graph, evaluation.config, cluster, evaluation.training)
    inputs = schedule_inputs(costs, evaluation.stages, evaluation.stage_of_layer)
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
    """(x in ms, y in GiB) of a rank's memory: during each action from the value after the
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
    return [x / 1e6 for x in xs], [y / GIB for y in ys]


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
    drawn = _drawn_ranks(series)
    figure, axes = _rows(len(drawn))
    span_ms = makespan_ns / 1e6 or 1.0
    top = max(max(rank.peak_bytes, rank.usable_bytes) for rank in series) / GIB
    labels = _label_budget(series, drawn, span_ms)
    for position, rank in enumerate(drawn):
        row, memory_ax = axes[2 * position], axes[2 * position + 1]
        _action_row(row, series[rank], labels, multiple_chunks=evaluation.config.virtual_stages > 1)
        values = None if measured is None else measured.get(rank)
        _memory_row(memory_ax, series[rank], values, top)
    axes[-1].set_xlabel("time in the step (ms, simulated)")
    axes[-1].set_xlim(0, span_ms)
    figure.legend(*_legend(axes, series), loc="outside lower center", ncols=4, fontsize=8)
    config = evaluation.config
    heading = f"{evaluation.graph.model}: {config.label()} on {config.num_gpus} GPUs"
    shown = "" if len(drawn) == len(series) else f"; ranks {_ranks_text(drawn)} of {len(series)}"
    summary = (
        f"{config.schedule}{' interleaved' if config.virtual_stages > 1 else ''}, "
        f"{config.num_microbatches} micro-batches, iteration {makespan_ns / 1e6:.4g} ms, "
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


def _action_row(ax, rank: RankSchedule, labels: set, *, multiple_chunks: bool) -> None:
    """The rank's actions as boxes coloured by kind (lighter for later chunks), each labelled
    with its micro-batch (micro-batch.chunk with interleaving) where it is wide enough, and its
    tail (gradient sync and optimizer step) in grey."""
    by_kind: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for action, start, end in zip(rank.actions, rank.start_ns, rank.end_ns, strict=True):
        by_kind.setdefault((action.kind, action.chunk), []).append(
            (start / 1e6, (end - start) / 1e6)
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
    last_end = rank.end_ns[-1]
    if rank.end_of_rank_ns > last_end:
        ax.broken_barh(
            [(last_end / 1e6, (rank.end_of_rank_ns - last_end) / 1e6)],
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
                (start + end) / 2e6,
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


def _memory_row(ax, rank: RankSchedule, measured: Sequence[int] | None, top: float) -> None:
    """The rank's predicted memory, its peak and its usable memory (and the measured one)."""
    xs, ys = memory_curve(rank)
    ax.plot(xs, ys, color=PREDICTED_COLOUR, linewidth=1.2, label="predicted memory")
    peak = rank.peak_bytes / GIB
    ax.axhline(
        peak,
        color=PREDICTED_COLOUR,
        linestyle=":",
        linewidth=1,
        label=f"predicted peak {format_bytes(rank.peak_bytes)}",
    )
    at = [x for x, y in zip(xs, ys, strict=True) if y == peak]
    ax.plot(at[:1], [peak] * len(at[:1]), "o", color=PREDICTED_COLOUR, markersize=4)
    ax.axhline(
        rank.usable_bytes / GIB,
        color=CAPACITY_COLOUR,
        linestyle="--",
        linewidth=1.2,
        label=f"usable {format_bytes(rank.usable_bytes)}",
    )
    if measured is not None:
        mx, my = memory_curve(rank, measured)
        ax.plot(
            mx,
            my,
            color=MEASURED_COLOUR,
            linewidth=1,
            linestyle="-",
            marker=".",
            markersize=2,
            label=f"measured (peak {format_bytes(max(measured))})",
        )
    ax.set_ylim(0, 1.1 * top)
    ax.set_ylabel("GiB", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="y", alpha=0.3)


def _action_text(action: ScheduleAction, multiple_chunks: bool) -> str:
    """Micro-batch (0-based), with interleaving micro-batch.chunk."""
    return f"{action.microbatch}.{action.chunk}" if multiple_chunks else f"{action.microbatch}"


def _label_budget(series: list[RankSchedule], drawn: list[int], span_ms: float) -> set:
    """(rank, action index) of the labels to draw: boxes wide enough for their text on a figure
    about 1100 px wide, the widest first, at most ``MAX_LABELS``."""
    px_per_ms = 1100.0 / span_ms
    fits = []
    for rank in drawn:
        entry = series[rank]
        for index, (action, start, end) in enumerate(
            zip(entry.actions, entry.start_ns, entry.end_ns, strict=True)
        ):
            width_px = (end - start) / 1e6 * px_per_ms
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

    kinds = sorted({action.kind for rank in series for action in rank.actions}, key="FBW".find)
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
