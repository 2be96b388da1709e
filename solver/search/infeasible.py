"""The messages of an infeasible planning call: which constraint fails, by how much, and what
to try (``solver.search.planner.explain_infeasible`` runs the searches behind them)."""

from __future__ import annotations

from solver.errors import InfeasibleError
from solver.reserve import usable_text
from solver.search.config_search import ConfigEntry, SearchResult
from solver.search.gpu_counts import GpuCountAdvice
from solver.specs import Cluster, TrainingConfig
from solver.units import format_bytes


def _throughput_unmet(
    cluster: Cluster,
    training: TrainingConfig,
    fastest: SearchResult,
    reached_ns: int | None,
    budget_ns: int,
    counts: GpuCountAdvice | None,
    *,
    best_peak: int,
) -> InfeasibleError:
    """Some plan fits in memory, but none reaches the required throughput (``reached_ns``: the
    fastest plan's simulated iteration)."""
    reached = (
        "no plan was found in time"
        if reached_ns is None
        else f"the fastest plan that fits reaches "
        f"{training.global_batch * 1e9 / reached_ns:.4g} samples/s "
        f"({fastest.entry.costs.config.label()})"
    )
    required = training.global_batch * 1e9 / budget_ns
    more = "add GPUs" if counts is None else f"add GPUs; {counts.text('meets it')}"
    return InfeasibleError(
        f"throughput constraint cannot be met: {required:.4g} samples/s required, {reached};"
        f" lower --min-throughput, raise --max-slowdown, or {more}",
        best_peak_bytes=best_peak,
        capacity_bytes=training.usable_bytes(cluster.gpu_memory_bytes),
        suggested_gpus=None if counts is None else counts.gpus,
    )


def _memory_exceeded(
    cluster: Cluster,
    training: TrainingConfig,
    entries: list[ConfigEntry],
    unconstrained: SearchResult,
    counts: GpuCountAdvice | None,
    best_peak: int,
) -> InfeasibleError:
    """No plan fits in memory: by how much the best one is over the usable memory (capacity -
    reserve), and a GPU count that fits."""
    capacity = training.usable_bytes(cluster.gpu_memory_bytes)
    over = best_peak - capacity
    config_text = (
        "" if unconstrained.entry is None else f" ({unconstrained.entry.costs.config.label()})"
    )
    options = _memory_options(training)
    savers = "".join(f", {option}" for option in options)
    if counts is None:
        tail = (
            "try more GPUs (python -m solver.sweep GRAPH --find min-gpus --gpus auto says how "
            f"many), larger GPUs{savers}"
        )
    elif counts.gpus is None:
        tail = f"{counts.text('fits')}; use larger GPUs{savers}"
    else:
        tail = counts.text("fits") + ("" if not options else f"; or try {' / '.join(options)}")
    reserve = training.memory_reserve
    reserved = reserve.bytes_for(cluster.gpu_memory_bytes)
    if reserved:
        # needs X of usable Y = capacity Z - reserve R
        where = "nothing fits in the usable memory"
        of = (
            f" of usable {format_bytes(capacity)} per GPU = capacity "
            f"{format_bytes(cluster.gpu_memory_bytes)} - reserve {format_bytes(reserved)} "
            f"({reserve.label()})"
        )
        tail += "; or a smaller --reserve"
    else:
        where, of = f"nothing fits in {format_bytes(capacity)} per GPU (--gpu-memory)", ""
    needs = f"needs {format_bytes(best_peak)}{config_text}{of}, "
    if not unconstrained.proven:  # the quick search stopped early: an upper bound only
        needs = f"is proven over it; the best split found in time {needs}"
    return InfeasibleError(
        f"{where}: the best of {len(entries)} configs {needs}"
        f"{format_bytes(over)} ({100 * over / capacity:.1f}%) over; {tail}",
        best_peak_bytes=best_peak,
        capacity_bytes=capacity,
        suggested_gpus=None if counts is None else counts.gpus,
    )


def _memory_options(training: TrainingConfig) -> list[str]:
    """The memory savers the search was not already allowed to use."""
    options = []
    if set(training.zero_stages) != {0, 1, 2, 3}:
        options.append("--zero auto")
    if training.recompute == "none":
        options.append("--recompute auto")
    if min(training.micro_batch_sizes) > 1:
        options.append("a smaller micro-batch")
    return options


def _explain_heterogeneous(
    cluster: Cluster, training: TrainingConfig, entries: list[ConfigEntry], budget_ns: int | None
) -> InfeasibleError:
    """No placement of any config fits the groups' usable memory (or meets the throughput
    constraint)."""
    reserve = training.memory_reserve
    groups = ", ".join(
        f"{g.name} {usable_text(reserve, g.gpu_memory_bytes)}" for g in cluster.groups
    )
    best = min(e.peak_lower_bound for e in entries)
    constraint = "" if budget_ns is None else " and the throughput constraint"
    return InfeasibleError(
        f"no config and placement of stages on the groups ({groups}) satisfies the group "
        f"capacities{constraint}: {len(entries)} configs solved or bounded (the best lower bound "
        f"on a stage peak is {format_bytes(best)}); try --zero auto, --recompute auto, a smaller "
        "micro-batch, --max-slowdown none, or more nodes",
        best_peak_bytes=best,
        capacity_bytes=max(training.usable_bytes(g.gpu_memory_bytes) for g in cluster.groups),
    )
