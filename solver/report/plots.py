"""Pictures of plans, sweeps and Pareto fronts (matplotlib, Agg, written to a file; display only).

matplotlib is imported inside the functions, so ``import solver`` stays light. Figures are built
with ``matplotlib.figure.Figure`` on an Agg canvas (no pyplot global state, no display) and written
by the one writing path (``solver.files.output_file``: atomically to a regular file, through to a
device, a FIFO or a link's target). Every size axis is in GiB.

Call :func:`check_plot_path` before any work, so a bad path fails in one line at once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from solver.errors import InputError
from solver.files.output_file import check_output, write_output
from solver.units import format_bytes

GIB = 2**30
PLOT_FORMATS = ("png", "pdf", "svg")
DPI = 100

COMPONENTS = (
    ("weights", "weights", "#4c72b0"),
    ("grads", "gradients", "#55a868"),
    ("optimizer", "optimizer states", "#8172b2"),
    ("activations", "activations", "#dd8452"),
    ("buffers", "boundary buffers", "#937860"),
    ("transient", "transient", "#da8bc3"),
    ("constant", "calibration constant", "#8c8c8c"),
)
"""(breakdown key, legend label, colour) of each stacked segment, bottom to top."""
CAPACITY_COLOUR = "#c44e52"
SWEEP_PEAK_KEYS = ("peak_bytes", "even_peak_bytes", "parameters_peak_bytes")
SWEEP_THROUGHPUT_KEYS = ("throughput", "even_throughput", "parameters_throughput")
"""Sweep row keys of the plan, the even split and the parameter-balanced split, drawn as solid,
dashed and dotted lines (the plan's with markers)."""


def check_plot_extension(path: str | os.PathLike, *, flag: str = "--plot") -> None:
    """InputError (one line) unless ``path`` ends in .png, .pdf or .svg."""
    suffix = Path(path).suffix
    if suffix.lower().lstrip(".") not in PLOT_FORMATS:
        raise InputError(
            f"{flag} {os.fspath(path)}: unsupported extension {suffix or '(none)'!r}; "
            f"use {', '.join('.' + name for name in PLOT_FORMATS)}"
        )


def check_plot_path(
    path: str | os.PathLike, *, protect: Iterable[str] = (), flag: str = "--plot"
) -> Path:
    """The plot path, or InputError (one line) for an unsupported extension or a path the one
    writing path refuses (``solver.files.output_file.check_output``: a folder, a missing or
    read-only folder, one of the input files ``protect``, ...)."""
    check_plot_extension(path, flag=flag)
    return check_output(path, flag=flag, protect=protect).path


def plot_plan(
    evaluation: Any,
    path: str | os.PathLike,
    *,
    baseline: Any | None = None,
    title: str | None = None,
) -> Path:
    """Per-stage stacked peak memory of ``evaluation`` (a ``solver.Evaluation``) with the GPU
    capacity line; with ``baseline`` (the even split of the same config) a second panel on the
    same y scale. Returns the path written."""
    target = check_plot_path(path)
    panels = [("plan", evaluation)] + ([] if baseline is None else [("even split", baseline)])
    figure, axes = _figure(1, len(panels), width=1.0 + 5.5 * len(panels), height=4.8, sharey=True)
    capacity = evaluation.cluster.gpu_memory_bytes
    top = max(capacity, *(ev.peak_bytes for _, ev in panels))
    for ax, (name, ev) in zip(axes, panels, strict=True):
        _stage_bars(ax, ev)
        ax.axhline(capacity / GIB, color=CAPACITY_COLOUR, linestyle="--", linewidth=1.5)
        verdict = "fits" if ev.fits else "does not fit"
        ax.set_title(f"{name}: peak {format_bytes(ev.peak_bytes)} ({verdict})", fontsize=10)
        ax.set_xlabel("pipeline stage")
        ax.set_ylim(0, 1.1 * top / GIB)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("peak memory per GPU (GiB)")
    handles, labels = _component_legend(axes[0], capacity)
    columns = len(labels) if len(panels) > 1 else math.ceil(len(labels) / 2)
    figure.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize=8)
    config, graph = evaluation.config, evaluation.graph
    heading = f"{graph.model}: {config.label()} on {config.num_gpus} GPUs"
    summary = f"peak {format_bytes(evaluation.peak_bytes)}"
    if baseline is not None and baseline.peak_bytes > 0:
        saving = 100 * (baseline.peak_bytes - evaluation.peak_bytes) / baseline.peak_bytes
        summary += f", {saving:.1f}% less than the even split ({format_bytes(baseline.peak_bytes)})"
    figure.suptitle(title or f"{heading}\n{summary}", fontsize=11)
    return _save(figure, target)


def plot_sweep(
    rows: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, title: str | None = None
) -> Path:
    """Peak memory and throughput vs GPU count (log2 axis), one series per GPU memory size.

    ``rows``: dicts with ``gpus, gpu_memory_bytes, status, config, peak_bytes, throughput, fits,
    even_peak_bytes, even_throughput, parameters_peak_bytes, parameters_throughput`` (None where
    absent), as ``solver.sweep`` writes them. Points where no plan fits are drawn as crosses (at
    their best peak when known, else at the capacity line); failed points as hollow diamonds."""
    target = check_plot_path(path)
    if not rows:
        raise InputError("plot_sweep: no rows to plot")
    figure, (memory_ax, speed_ax) = _figure(1, 2, width=12.0, height=4.8, sharey=False)
    colours = _palette()
    sizes = sorted({int(row["gpu_memory_bytes"]) for row in rows})
    marked = {"infeasible": False, "error": False}
    for index, size in enumerate(sizes):
        colour = colours[index % len(colours)]
        series = sorted((r for r in rows if int(r["gpu_memory_bytes"]) == size), key=_gpus)
        _capacity_line(memory_ax, size, colour)
        solved = [r for r in series if _solved(r)]
        _sweep_lines(memory_ax, solved, SWEEP_PEAK_KEYS, colour, scale=GIB)
        _sweep_lines(speed_ax, solved, SWEEP_THROUGHPUT_KEYS, colour)
        for row in series:
            if not _solved(row):
                _unsolved_marker(memory_ax, speed_ax, row, size, colour, marked)
    gpus = sorted({_gpus(r) for r in rows})
    for ax, ylabel in (
        (memory_ax, "peak memory per GPU (GiB)"),
        (speed_ax, "throughput (samples/s)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(g) for g in gpus], minor=False)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    memory_ax.set_title("largest per-GPU peak memory", fontsize=10)
    speed_ax.set_title("throughput (crosses: no plan fits)", fontsize=10)
    figure.legend(
        *_sweep_legend(memory_ax, sizes, colours),
        loc="outside lower center",
        ncols=8,
        fontsize=8,
    )
    if title:
        figure.suptitle(title, fontsize=11)
    return _save(figure, target)


def _capacity_line(ax, size: int, colour: str) -> None:
    """A dashed horizontal line at the GPU memory ``size``, labelled at its left end."""
    ax.axhline(size / GIB, color=colour, linestyle="--", linewidth=1, alpha=0.7)
    ax.annotate(
        f"capacity {format_bytes(size).replace('.00 ', ' ')}",
        (0.01, size / GIB),
        xycoords=("axes fraction", "data"),
        textcoords="offset points",
        xytext=(0, 2),
        color=colour,
        fontsize=8,
    )


def _sweep_lines(
    ax, solved: list[Mapping[str, Any]], keys: tuple[str, str, str], colour: str, *, scale=1
) -> None:
    """One line per partitioner over the solved rows (values / ``scale``)."""
    for key, style in zip(keys, ("-", "--", ":"), strict=True):
        points = [(_gpus(r), r[key] / scale) for r in solved if r.get(key) is not None]
        if points:
            ax.plot(
                *zip(*points, strict=True),
                linestyle=style,
                marker="o" if key == keys[0] else None,
                markersize=4,
                color=colour,
            )


def _unsolved_marker(
    memory_ax, speed_ax, row: Mapping[str, Any], size: int, colour: str, marked: dict[str, bool]
) -> None:
    """A cross where no plan fits (at the best peak when known, else at the capacity) or a hollow
    diamond where the point failed (at the capacity), on both panels; the first of each kind is
    labelled for the legend (``marked``)."""
    failed = str(row.get("status", "")).upper() == "ERROR"
    kind = "error" if failed else "infeasible"
    peak = row.get("peak_bytes")
    y = (peak if peak is not None and not failed else size) / GIB
    style = (
        {"marker": "D", "facecolors": "none", "edgecolors": colour}
        if failed
        else {"marker": "x", "color": colour}
    )
    label = None
    if not marked[kind]:
        label = "error (see the table)" if failed else "no plan fits"
        marked[kind] = True
    memory_ax.scatter([_gpus(row)], [y], s=60, zorder=5, label=label, **style)
    speed_ax.scatter(
        [_gpus(row)], [0.03], s=60, zorder=5, transform=speed_ax.get_xaxis_transform(), **style
    )


def plot_pareto(
    points: Sequence[Any],
    path: str | os.PathLike,
    *,
    capacity_bytes: int | None = None,
    title: str | None = None,
    group_capacities: Sequence[tuple[str, int]] = (),
    utilization: bool = False,
) -> Path:
    """Throughput against peak memory of non-dominated plans, each labelled with its config.

    ``points``: Evaluations (or objects / dicts with ``peak_bytes``, ``throughput`` and ``config``,
    a ParallelConfig or its label). A heterogeneous cluster's front: ``group_capacities`` (name,
    bytes) draws a capacity line per group; ``utilization`` puts the largest utilization (% of
    the stage's GPU memory; Evaluations, or dicts with ``max_utilization``) on the x axis."""
    target = check_plot_path(path)
    if not points:
        raise InputError("plot_pareto: no points to plot")
    data = sorted((_memory(p, utilization), _field(p, "throughput"), _label(p)) for p in points)
    figure, (ax,) = _figure(1, 1, width=7.5, height=4.8, sharey=False)
    peaks = [memory for memory, _, _ in data]
    speeds = [speed for _, speed, _ in data]
    ax.step(peaks, speeds, where="post", color="#4c72b0", alpha=0.4, linewidth=1)
    ax.plot(peaks, speeds, "o", color="#4c72b0", label="non-dominated plans")
    previous = None
    for x, y, (_, _, text) in zip(peaks, speeds, data, strict=True):
        if text != previous:  # label where the config changes
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
        previous = text
    lines = [] if capacity_bytes is None else [("GPU capacity", capacity_bytes)]
    lines += [(f"{name} capacity", capacity) for name, capacity in group_capacities]
    if utilization:
        ax.axvline(100, color=CAPACITY_COLOUR, linestyle="--", label="each GPU's capacity")
    else:
        for i, (label, capacity) in enumerate(lines):
            style = ("--", ":", "-.")[i % 3]
            ax.axvline(
                capacity / GIB,
                color=CAPACITY_COLOUR,
                linestyle=style,
                label=f"{label} ({format_bytes(capacity)})",
            )
    ax.set_xlabel(
        "largest utilization (% of the stage's GPU memory)"
        if utilization
        else "largest per-GPU peak memory (GiB)"
    )
    ax.set_ylabel("throughput (samples/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or f"Pareto front: {len(data)} plans (memory vs throughput)", fontsize=11)
    return _save(figure, target)


def _memory(point: Any, utilization: bool) -> float:
    """x of a Pareto point: peak in GiB, or largest utilization in %."""
    if not utilization:
        return _field(point, "peak_bytes") / GIB
    if isinstance(point, Mapping):
        return 100 * point["max_utilization"]
    return max(point.utilization_ppm) / 1e4


# -- helpers -----------------------------------------------------------------------------------


def _figure(rows: int, columns: int, *, width: float, height: float, sharey: bool):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, sharey=sharey, squeeze=False)
    return figure, list(axes.flat)


def _save(figure, target: Path, *, flag: str = "--plot") -> Path:
    """Write by the one writing path (solver.files.output_file: atomic for a regular file, written
    through for a device, a FIFO or a link's target; nothing left behind on failure)."""
    extension = target.suffix.lower().lstrip(".")
    return write_output(
        target, lambda stream: figure.savefig(stream, format=extension, dpi=DPI), flag=flag
    )


def _stage_bars(ax, evaluation) -> None:
    stages = evaluation.stages
    positions = list(range(len(stages)))
    bottoms = [0.0] * len(stages)
    for key, label, colour in COMPONENTS:
        heights = [stage.breakdown().get(key, 0) / GIB for stage in stages]
        if key == "constant" and not any(heights):
            continue
        ax.bar(positions, heights, bottom=bottoms, color=colour, label=label, width=0.8)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    step = max(1, math.ceil(len(stages) / 16))
    ticks = positions[::step]
    ax.set_xticks(ticks, [f"{i}\n{len(stages[i].layers)}L" for i in ticks], fontsize=8)
    ax.set_xlim(-0.6, len(stages) - 0.4)


def _component_legend(ax, capacity: int):
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    handles, labels = handles[::-1], labels[::-1]  # top segment first, as stacked
    handles.append(Line2D([], [], color=CAPACITY_COLOUR, linestyle="--"))
    labels.append(f"GPU capacity ({format_bytes(capacity)})")
    return handles, labels


def _sweep_legend(ax, sizes: list[int], colours: list[str]):
    """One entry per GPU memory size (colour), per partitioner (line style), and the markers."""
    from matplotlib.lines import Line2D

    handles, labels = [], []
    for index, size in enumerate(sizes):
        handles.append(Line2D([], [], color=colours[index % len(colours)], linewidth=4))
        labels.append(f"{format_bytes(size).replace('.00 ', ' ')} GPUs")
    for style, name in (("-", "plan"), ("--", "even split"), (":", "parameter-balanced")):
        handles.append(Line2D([], [], color="black", linestyle=style))
        labels.append(name)
    markers, marker_labels = ax.get_legend_handles_labels()  # the crosses and diamonds
    return handles + markers, labels + marker_labels


def _palette() -> list[str]:
    return ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860"]


def _gpus(row: Mapping[str, Any]) -> int:
    return int(row["gpus"])


def _solved(row: Mapping[str, Any]) -> bool:
    status = str(row.get("status", "")).upper()
    return status not in ("INFEASIBLE", "ERROR", "UNKNOWN") and row.get("peak_bytes") is not None


def _field(point: Any, name: str) -> Any:
    return point[name] if isinstance(point, Mapping) else getattr(point, name)


def _label(point: Any) -> str:
    """Short config text: 'pp8 tp8 b1', with ' z1' / ' rc' / ' src' for ZeRO and recompute."""
    config = _field(point, "config")
    if not isinstance(config, Mapping):
        if not hasattr(config, "to_dict"):
            return str(config)
        config = config.to_dict()
    text = f"pp{config['pp']} tp{config['tp']} dp{config['dp']} b{config['micro_batch']}"
    text += f" z{config['zero']}" if config.get("zero") else ""
    return text + {"full": " rc", "selective": " src"}.get(config.get("recompute"), "")


__all__ = ["check_plot_extension", "check_plot_path", "plot_pareto", "plot_plan", "plot_sweep"]
