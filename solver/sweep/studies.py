"""Questions answered by searching over points: the smallest GPU count that fits
(:func:`min_gpus`) and the largest model size that fits (:func:`max_scale`)."""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from solver.candidates import divisors
from solver.errors import InputError
from solver.graph import LayerGraph
from solver.planner import Plan
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
    up to ``max_gpus``) and the search is:

    1. binary search over them as if "fits" were monotone in the GPU count: a few plans find a
       count N that fits (and, usually, the answer);
    2. a brute-force check below N, because monotonicity is not guaranteed: whether a config
       exists depends on divisibility (pp <= layers, tp | gpus per node, dp * b | global batch),
       and a relative throughput constraint moves with the fastest plan. Each smaller count is
       first tested with its configs' memory lower bounds (no solve), then the survivors are
       solved in increasing order until one fits.

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
            answer, skipped = _bisect_then_scan(solved, counts)
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
        chunk = max(1, self.workers or os.cpu_count() or 1)
        for start in range(0, len(counts), chunk):
            rows = self.rows_of(counts[start : start + chunk])
            fitting = [r["gpus"] for r in rows if fits(r)]
            if fitting:
                return min(fitting)
        return None


def _bisect_then_scan(solved: _SolvedCounts, counts: list[int]) -> tuple[int | None, int]:
    """Steps 1 and 2 of :func:`min_gpus`: a count that fits by binary search, then the smallest
    below it that fits; returns (answer, counts ruled out by their memory lower bounds)."""
    upper = _bisect_fit(counts, lambda n: fits(solved.rows_of([n])[0]))
    below = counts[: bisect.bisect_left(counts, upper)] if upper is not None else counts
    possible = [n for n in below if _may_fit(solved.options, n, solved.gpu_memory_bytes)]
    answer = solved.first_fit(possible)
    return (upper if answer is None else answer), len(below) - len(possible)


def valid_gpu_counts(
    num_layers: int, cluster: Cluster, training: TrainingConfig, *, max_gpus: int | None = None
) -> list[int]:
    """Every GPU count N <= max_gpus with at least one candidate config (candidates.py rules:
    N = pp * tp * dp, pp <= layers, tp | gpus per node, dp * b | global batch, pins), sorted."""
    dps = [
        d
        for d in divisors(training.global_batch)
        if any(training.global_batch % (d * b) == 0 for b in training.micro_batch_sizes)
    ]
    counts = {
        pp * tp * dp
        for pp in range(1, num_layers + 1)
        if training.pp in (None, pp)
        for tp in divisors(cluster.gpus_per_node)
        if training.tp in (None, tp)
        for dp in dps
        if training.dp in (None, dp)
    }
    return sorted(n for n in counts if max_gpus is None or n <= max_gpus)


def _bisect_fit(counts: list[int], fit: Callable[[int], bool]) -> int | None:
    """The smallest count that fits if fitting were monotone (None if the largest does not)."""
    if not counts or not fit(counts[-1]):
        return None
    low, high = 0, len(counts) - 1  # counts[high] fits
    while low < high:
        middle = (low + high) // 2
        if fit(counts[middle]):
            high = middle
        else:
            low = middle + 1
    return counts[high]


def _may_fit(options: PointOptions, gpus: int, gpu_memory_bytes: int) -> bool:
    """False when every config of this count has a memory lower bound over the capacity."""
    from solver.search import build_entries

    cluster = dataclasses.replace(options.cluster, num_gpus=gpus, gpu_memory_bytes=gpu_memory_bytes)
    try:
        entries = build_entries(options.graph, cluster, options.training)
    except InputError:
        return False
    return min(entry.memory_bound for entry in entries) <= gpu_memory_bytes


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
