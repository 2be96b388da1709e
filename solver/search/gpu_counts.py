"""The smallest GPU count that fits: the counts some config can use (:func:`valid_gpu_counts`)
and an exact search over them that only needs a ``fits(count)`` answer
(:func:`smallest_fitting_count`).

Two callers answer ``fits`` their own way: ``solver.sweep.min_gpus`` (``--find min-gpus``) with
sweep rows solved on worker processes, and the planner's infeasibility explanation (exit 3) with
the searches of :func:`solver.plan` on that count, under what is left of the call's time limit.
Both get the same answer because both search the same way here; this module imports neither.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from solver.errors import InputError
from solver.graph import LayerGraph
from solver.search.candidates import divisors
from solver.search.config_search import Deadline, build_entries
from solver.specs import Cluster, TrainingConfig


def valid_gpu_counts(
    num_layers: int, cluster: Cluster, training: TrainingConfig, *, max_gpus: int | None = None
) -> list[int]:
    """Every GPU count N <= max_gpus with at least one candidate config (candidates.py rules:
    N = pp * tp * cp * dp, pp <= layers, tp | gpus per node, cp one of the candidate degrees,
    dp * b | global batch, pins), sorted."""
    dps = [
        d
        for d in divisors(training.global_batch)
        if any(training.global_batch % (d * b) == 0 for b in training.micro_batch_sizes)
    ]
    counts = {
        pp * tp * cp * dp
        for pp in range(1, num_layers + 1)
        if training.pp in (None, pp)
        for tp in divisors(cluster.gpus_per_node)
        if training.tp in (None, tp)
        for cp in set(training.cp)
        for dp in dps
        if training.dp in (None, dp)
    }
    return sorted(n for n in counts if max_gpus is None or n <= max_gpus)


def memory_may_fit(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig, num_gpus: int
) -> bool:
    """False when every config on ``num_gpus`` GPUs of ``cluster``'s kind has a memory lower
    bound over its usable memory, capacity - reserve (no solve; a homogeneous cluster)."""
    try:
        entries = build_entries(graph, dataclasses.replace(cluster, num_gpus=num_gpus), training)
    except InputError:
        return False
    usable = training.usable_bytes(cluster.gpu_memory_bytes)  # capacity - reserve
    return min(entry.memory_bound for entry in entries) <= usable


@dataclass(kw_only=True)
class CountSearch:
    """What :func:`smallest_fitting_count` found, and how far it got."""

    gpus: int | None
    """The smallest count shown to fit; None when none was."""
    complete: bool
    """True: ``gpus`` is the smallest count of the list that fits (None: none fits). False: the
    search stopped early (``fits`` had no answer or the deadline passed); ``gpus`` fits but a
    smaller count from ``open_from`` up may fit too."""
    open_from: int | None = None
    """Stopped early: the smallest count neither ruled out nor shown to fit (every smaller count
    was ruled out); None when complete or when nothing is left open."""
    solved: list[int] = field(default_factory=list)
    """Counts ``fits`` was asked about, in the order asked."""
    skipped: int = 0
    """Counts below the answer ruled out by ``may_fit`` (memory lower bounds) alone, without
    asking ``fits``."""


@dataclass(kw_only=True)
class GpuCountAdvice:
    """A count search as an infeasibility message says it
    (``solver.search.planner.smallest_fitting_gpus``)."""

    search: CountSearch
    counts: list[int]
    """Every count some config can use (what was searched)."""
    label: str | None
    """Config of the plan on ``gpus`` (None when no count was found to fit)."""
    wall_s: float

    @property
    def gpus(self) -> int | None:
        return self.search.gpus

    def text(self, verb: str) -> str:
        """The message's GPU count clause; ``verb``: "fits" or "meets it"."""
        found, searched = self.search, len(self.search.solved)
        work = (
            f"{searched} {'count' if searched == 1 else 'counts'} solved, {found.skipped} ruled "
            "out by memory bounds"
        )
        settled = found.complete or found.open_from is None  # nothing below left open
        if settled and found.gpus is None:
            span = f", {self.counts[0]}..{self.counts[-1]}" if self.counts else ""
            return (
                f"no GPU count {verb} either (every count some config can use{span}: {work}, "
                f"{self.wall_s:.1f} s)"
            )
        if settled:
            return (
                f"smallest GPU count that {verb}: {found.gpus} ({self.label}; every count some "
                f"config can use checked as by --find min-gpus: {work}, {self.wall_s:.1f} s)"
            )
        stopped = (
            f"stopped looking after {searched} {'count' if searched == 1 else 'counts'} at the "
            f"time limit ({self.wall_s:.1f} s)"
        )
        ruled = (
            f"every count below {found.open_from} was ruled out"
            if self.counts and found.open_from > self.counts[0]
            else "no smaller count was ruled out"
        )
        hint = "raise --time-limit or run python -m solver.sweep GRAPH --find min-gpus --gpus auto"
        if found.gpus is None:
            return f"{stopped}: no count found that {verb}, {ruled}; {hint}"
        return f"{stopped}: {found.gpus} {verb} ({self.label}), {ruled}; {hint}"


class _Stopped(Exception):
    """``fits`` had no answer, or the deadline passed: the search ends with what it knows."""


def smallest_fitting_count(
    counts: Sequence[int],
    fits: Callable[[int], bool | None],
    *,
    may_fit: Callable[[int], bool] | None = None,
    prepare: Callable[[Sequence[int]], object] | None = None,
    chunk: int = 1,
    deadline: Deadline | None = None,
    known: dict[int, bool] | None = None,
) -> CountSearch:
    """The smallest of ``counts`` (increasing) for which ``fits(count)`` is True.

    1. binary search as if "fits" were monotone in the GPU count: a few answers find a count U
       that fits (and, usually, the answer);
    2. every smaller count in increasing order, because monotonicity is not guaranteed (whether
       a config exists depends on divisibility: pp <= layers, tp | gpus per node, dp * b |
       global batch; a relative throughput constraint moves with the fastest plan): first
       ``may_fit(count)`` (a cheap necessary condition, e.g. memory lower bounds), then
       ``fits`` on the survivors, ``chunk`` at a time (``prepare(chunk_counts)`` is called first,
       so a caller can answer them in parallel), until one fits.

    The answer is exact when ``complete``. ``fits`` returns None when it cannot decide (its time
    ran out), and the search stops there, as it does once ``deadline`` has passed; ``known``
    holds answers already decided (e.g. the count a plan was just proven infeasible on).
    """
    state = _State(fits, dict(known or {}), deadline)
    counts = list(counts)
    ruled_out: set[int] = set()
    upper = None
    try:
        upper = _bisect_fit(counts, state.ask)
        below = counts[: bisect.bisect_left(counts, upper)] if upper is not None else counts
        survivors: list[int] = []
        for index, count in enumerate(below):
            state.check_deadline()
            if count in state.answers or may_fit is None or may_fit(count):
                survivors.append(count)
            else:
                ruled_out.add(count)
            if len(survivors) == max(1, chunk) or (survivors and index == len(below) - 1):
                found = state.first_fit(survivors, prepare)
                if found is not None:
                    skipped = sum(1 for n in ruled_out if n < found)
                    return state.result(found, complete=True, skipped=skipped)
                survivors = []
        return state.result(upper, complete=True, skipped=len(ruled_out))
    except _Stopped:
        fitting = [n for n, ok in state.answers.items() if ok]
        found = min(fitting, default=None)
        left = [
            n
            for n in counts
            if (found is None or n < found) and n not in ruled_out and n not in state.answers
        ]
        return state.result(
            found, complete=False, skipped=len(ruled_out), open_from=min(left, default=None)
        )


class _State:
    """The answers of one search (each count asked once) and its deadline."""

    def __init__(self, fits, answers: dict[int, bool], deadline: Deadline | None) -> None:
        self.fits = fits
        self.answers = answers
        self.deadline = deadline
        self.solved: list[int] = []

    def check_deadline(self) -> None:
        if self.deadline is not None and self.deadline.expired():
            raise _Stopped

    def ask(self, count: int) -> bool:
        if count not in self.answers:
            self.check_deadline()
            answer = self.fits(count)
            if answer is None:
                raise _Stopped
            self.solved.append(count)
            self.answers[count] = answer
        return self.answers[count]

    def first_fit(self, counts: list[int], prepare) -> int | None:
        """The smallest of ``counts`` that fits; ``prepare`` sees those not answered yet."""
        todo = [n for n in counts if n not in self.answers]
        if prepare is not None and todo:
            self.check_deadline()
            prepare(todo)
        return next((n for n in counts if self.ask(n)), None)

    def result(self, gpus, *, complete: bool, skipped: int, open_from=None) -> CountSearch:
        return CountSearch(
            gpus=gpus,
            complete=complete,
            open_from=open_from,
            solved=list(self.solved),
            skipped=skipped,
        )


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
