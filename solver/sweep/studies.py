"""Questions answered by searching over points: the smallest GPU count that fits
(:func:`min_gpus`; the search itself is :mod:`solver.search.gpu_counts`, shared with the planner's
infeasibility message) and the largest model size that fits (:func:`max_scale`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from solver.errors import InputError
from solver.graph import LayerGraph
from solver.search.gpu_counts import memory_may_fit, smallest_fitting_count, valid_gpu_counts
from solver.search.planner import Plan
from solver.specs import Cluster, TrainingConfig
from solver.sweep.rows import fits
from solver.sweep.runner import PointOptions, progress_bar, solve_point, sweep, sweep_points

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class MinGpusResult:
    """The smallest GPU count that fits, its plan, and the rows solved to prove it."""

    gpus: int | None
    """None when no candidate fits."""
    plan: Plan | None
    rows: list[dict] = field(default_factory=list)
    """Every point solved (a binary-search probe or a scanned count), in GPU order."""
    skipped: int = 0
    """Counts below the answer ruled out by their configs' memory lower bounds alone."""


def min_gpus(
    graph: LayerGraph,
    gpu_memory_bytes: int,
    training: TrainingConfig,
    cluster_template: Cluster,
    *,
    candidates: Sequence[int] | None = None,
    max_gpus: int | None = None,
    workers: int | None = None,
    progress: bool = False,
    backend: str = "auto",
    time_limit_s: float | None = 60.0,
) -> MinGpusResult:
    """The smallest GPU count on which a plan fits ``gpu_memory_bytes`` under the throughput
    constraint of ``training``.

    With ``candidates``, they are solved in increasing order, ``workers`` at a time, until one
    fits. Without, the candidates are every count some config can use (:func:`valid_gpu_counts`,
    up to ``max_gpus``) and the search is :func:`solver.search.gpu_counts.smallest_fitting_count`:
    binary search as if "fits" were monotone, then every smaller count, first by its configs'
    memory lower bounds (no solve), then by an exact solve, ``workers`` at a time (the same
    search gives the GPU count of ``solver.plan``'s infeasibility message).

    The answer is therefore exact (up to the time limit of each solve: a NO_SOLUTION count is
    treated as not fitting and kept in ``rows``).
    """
    options = PointOptions(
        graph=graph,
        training=training,
        cluster=cluster_template,
        backend=backend,
        time_limit_s=time_limit_s,
    )
    solved = _SolvedCounts(
        options,
        gpu_memory_bytes,
        workers=workers,
        bar=progress_bar(None, desc="min-gpus", unit="count") if progress else None,
    )
    skipped = 0
    try:
        if candidates is not None:
            answer = solved.first_fit(sorted({g for g, _ in sweep_points(list(candidates), [1])}))
        else:
            counts = valid_gpu_counts(
                graph.num_layers, cluster_template, training, max_gpus=max_gpus
            )
            capacity = dataclasses.replace(cluster_template, gpu_memory_bytes=gpu_memory_bytes)
            search = smallest_fitting_count(
                counts,
                lambda n: fits(solved.rows_of([n])[0]),
                may_fit=lambda n: memory_may_fit(graph, capacity, training, n),
                prepare=solved.rows_of,
                chunk=solved.chunk,
            )
            answer, skipped = search.gpus, search.skipped
    finally:
        if solved.bar is not None:
            solved.bar.close()
    best = None
    if answer is not None:
        best = solve_point(options, answer, gpu_memory_bytes)[1]
    return MinGpusResult(
        gpus=answer, plan=best, rows=[solved.rows[n] for n in sorted(solved.rows)], skipped=skipped
    )


class _SolvedCounts:
    """The sweep rows :func:`min_gpus` solved, by GPU count (each count is solved once)."""

    def __init__(self, options: PointOptions, gpu_memory_bytes: int, *, workers, bar) -> None:
        self.options = options
        self.gpu_memory_bytes = gpu_memory_bytes
        self.workers = workers
        self.bar = bar
        self.rows: dict[int, dict] = {}

    @property
    def chunk(self) -> int:
        """Counts solved at a time (as many as there are workers)."""
        return max(1, self.workers or os.cpu_count() or 1)

    def rows_of(self, counts: Sequence[int]) -> list[dict]:
        """The rows of ``counts``, solving (in parallel) those not solved yet."""
        todo = [n for n in counts if n not in self.rows]
        if todo:
            found = sweep(
                self.options.graph,
                todo,
                [self.gpu_memory_bytes],
                self.options.training,
                self.options.cluster,
                workers=self.workers,
                on_row=None if self.bar is None else lambda _: self.bar.update(1),
                backend=self.options.backend,
                time_limit_s=self.options.time_limit_s,
            )
            self.rows.update((row["gpus"], row) for row in found)
        return [self.rows[n] for n in counts]

    def first_fit(self, counts: Sequence[int]) -> int | None:
        """The smallest of ``counts`` that fits, solving them in increasing order, as many at a
        time as there are workers."""
        for start in range(0, len(counts), self.chunk):
            rows = self.rows_of(counts[start : start + self.chunk])
            fitting = [r["gpus"] for r in rows if fits(r)]
            if fitting:
                return min(fitting)
        return None


SCALES = {"layers": "layers", "hidden": "hidden"}
"""--scale name -> the model config field it overrides."""


@dataclass(kw_only=True)
class MaxScaleResult:
    """The largest size that fits, the plan that proves it, and the first size that does not."""

    scale: str
    size: int | None
    """None when even the smallest size of the range does not fit (``too_big`` is then the
    smallest size)."""
    plan: Plan | None
    too_big: int | None
    """The next size (size + step), shown not to fit; None when the range's top fits."""
    too_big_detail: str = ""
    rows: dict[int, dict] = field(default_factory=dict)
    """Size -> the row of every size solved."""


def max_scale(
    graph_of: Callable[[int], LayerGraph],
    sizes: Sequence[int],
    cluster: Cluster,
    training: TrainingConfig,
    *,
    start: int = 0,
    scale: str = "size",
    backend: str = "auto",
    time_limit_s: float | None = 60.0,
) -> MaxScaleResult:
    """The largest of ``sizes`` (increasing) whose graph ``graph_of(size)`` fits ``cluster``.

    Galloping then binary search from ``sizes[start]``: up (1, 2, 4, ... steps) while it fits,
    or down while it does not, then bisection of the last gap, so the few graphs profiled stay
    near the answer. It assumes a larger model never fits where a smaller one does not. That
    holds for the memory of any one config, but a deeper model also allows more pipeline stages
    (pp <= layers), so near the small end it can fail; the result is always a proven boundary
    (``size`` fits, ``too_big`` = the next size does not, both solved), and the largest size
    whenever fitting is monotone over the range.
    """
    if not sizes:
        raise InputError("max-scale: empty size range")
    rows: dict[int, dict] = {}
    plans: dict[int, Plan | None] = {}

    def fit(index: int) -> bool:
        size = sizes[index]
        if size not in rows:
            options = PointOptions(
                graph=graph_of(size),
                training=training,
                cluster=cluster,
                backend=backend,
                time_limit_s=time_limit_s,
            )
            rows[size], plans[size] = solve_point(
                options, cluster.num_gpus, cluster.gpu_memory_bytes
            )
            log.info("%s %d: %s", scale, size, rows[size]["status"])
        return fits(rows[size])

    low, high = _gallop(len(sizes), fit, min(max(start, 0), len(sizes) - 1))
    return MaxScaleResult(
        scale=scale,
        size=None if low is None else sizes[low],
        plan=None if low is None else plans[sizes[low]],
        too_big=None if high is None else sizes[high],
        too_big_detail="" if high is None else rows[sizes[high]]["detail"],
        rows=dict(sorted(rows.items())),
    )


def _gallop(n: int, fit: Callable[[int], bool], start: int) -> tuple[int | None, int | None]:
    """(last index that fits, the next index, which does not) by galloping from ``start`` and
    bisecting; None for an end that does not exist (nothing fits / everything fits)."""
    jump = 1
    if fit(start):
        low = start
        while True:
            probe = min(low + jump, n - 1)
            if probe == low:
                return low, None
            if not fit(probe):
                high = probe
                break
            low, jump = probe, 2 * jump
    else:
        high = start
        while True:
            probe = max(high - jump, 0)
            if probe == high:
                return None, high
            if fit(probe):
                low = probe
                break
            high, jump = probe, 2 * jump
    while high - low > 1:  # low fits, high does not
        middle = (low + high) // 2
        if fit(middle):
            low = middle
        else:
            high = middle
    return low, high
