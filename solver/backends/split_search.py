"""The outer search of the chain and DAG backends: incumbent, proven lower bound, and the
best-first branch and bound over the first stage's tail X_0 (``chain.py``'s module docstring,
step 3), generic over a "splitter" that solves the min-max stage problem under per-stage limits
(``chain._Chain``, ``dag._DagSplitter``)."""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from solver.backends.problem import (
    FEASIBLE,
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OPTIMAL,
    UNKNOWN,
    StageProblem,
    StageSolution,
)

INF = 2**62
"""'No value' for int64 arrays; far above any byte count or nanosecond total, and INF + a sum of
layer costs stays inside int64."""
PEAK, TIME = "peak", "time"


@dataclass(frozen=True)
class _Limits:
    """A min-max stage problem: minimise max_s (kind of stage s) under per-stage limits."""

    kind: str
    """peak (bytes) or time (the stage's term of the iteration bound, ns)."""
    cap_bytes: int | None = None
    """peak_s <= cap (kind time; for kind peak the caller folds it into the ceiling)."""
    budget_ns: int | None = None
    """time_s <= budget: the iteration bound within the budget (kind peak)."""
    first_tail_ns: int = 0
    """X_0 as every stage's time term takes it (a lower bound on the first stage's tail)."""
    first_tail_max_ns: int | None = None
    """The first stage's tail <= this."""


class _TimeUp(Exception):
    """The time limit ran out."""


def run_search(
    problem: StageProblem,
    make_splitter: Callable[[float | None], Any],
    *,
    time_limit_s: float | None,
    backend: str,
) -> StageSolution:
    """The optimum of ``problem`` by the outer search over the splitter that ``make_splitter``
    builds for a deadline (a ``time.perf_counter()`` value, None: none); when the time is up,
    the best split found (FEASIBLE) or none (UNKNOWN)."""
    start = time.perf_counter()
    deadline = None if time_limit_s is None else start + time_limit_s
    search = _Search(problem, make_splitter(deadline), backend=backend)
    timed_out = False
    try:
        search.run()
    except _TimeUp:
        timed_out = True
    return search.solution(timed_out, time.perf_counter() - start)


class _Search:
    """The outer search for one problem: incumbent, proven lower bound, branch and bound.

    Generic over its splitter (``chain``): ``backends.chain._Chain`` on chains,
    ``backends.dag._DagSplitter`` on DAGs. A splitter offers ``measure(split)`` (max peak,
    iteration bound), ``minimise(limits, ...)``, ``first_tails()``, ``first_tail(split)``,
    ``check_time`` and ``stage_of_layer(split)``; a split is whatever its ``minimise`` returns
    (stage starts for the chain)."""

    def __init__(self, problem: StageProblem, chain: Any, *, backend: str) -> None:
        self.problem = problem
        self.chain = chain
        self.backend = backend
        """The name its solutions carry."""
        self.best_value: int | None = None
        self.best_starts: np.ndarray | None = None
        self.lower = 0

    def run(self) -> None:
        if self.problem.num_stages > self.problem.num_layers:
            return  # some stage would be empty
        only = getattr(self.chain, "only_split", None)
        if self.problem.num_stages == self.problem.num_layers and only is not None:
            self.offer(only())  # one layer a stage: the only split, optimal if allowed
            self.lower = self.lower if self.best_value is None else self.best_value
            return
        if self.problem.objective == OBJECTIVE_MEMORY:
            self._memory()
        else:
            self._time()

    def offer(self, starts: np.ndarray) -> None:
        """Keep ``starts`` when it satisfies every constraint and beats the incumbent."""
        problem, chain = self.problem, self.chain
        peak, iteration = chain.measure(starts)
        if problem.capacity_bytes is not None and peak > problem.capacity_bytes:
            return
        if problem.iteration_budget_ns is not None and iteration > problem.iteration_budget_ns:
            return
        value = peak if problem.objective == OBJECTIVE_MEMORY else iteration
        if self.best_value is None or value < self.best_value:
            self.best_value, self.best_starts = value, starts

    def raise_lower(self, value: int) -> None:
        self.lower = max(self.lower, value)

    def _memory(self) -> None:
        """The smallest largest peak with the iteration bound within the budget: without a
        budget one stage problem, with one the branch and bound over X_0."""
        problem, chain = self.problem, self.chain
        cap = INF if problem.capacity_bytes is None else problem.capacity_bytes
        budget = problem.iteration_budget_ns
        if budget is None:
            found = chain.minimise(
                _Limits(kind=PEAK), ceiling=cap, offer=self.offer, on_lower=self.raise_lower
            )
            if found is not None:
                self.offer(found[1])
                self.lower = found[0]
            return
        self._branch_and_bound(_Limits(kind=PEAK, budget_ns=budget), ceiling=cap)

    def _time(self) -> None:
        """The smallest iteration bound with every peak within the capacity: branch and bound
        over X_0, a range bounded by its relaxation's optimum."""
        problem = self.problem
        budget = INF if problem.iteration_budget_ns is None else problem.iteration_budget_ns
        self._branch_and_bound(_Limits(kind=TIME, cap_bytes=problem.capacity_bytes), ceiling=budget)

    def _branch_and_bound(self, limits: _Limits, *, ceiling: int) -> None:
        """Best-first branch and bound over X_0 for ``limits`` (kind peak with a budget, or kind
        time), the objective at most ``ceiling`` (the capacity, bytes, or the budget, ns): a range
        of the first stage's tails, bounded by its relaxation's optimum, is settled by its split
        or split at that split's own X_0."""
        chain = self.chain
        tails = chain.first_tails()
        heap = [(0, 0, len(tails) - 1)]
        for bound, low, high in _best_first(heap, self):
            allowed = ceiling if self.best_value is None else min(ceiling, self.best_value - 1)
            if bound > allowed:
                break
            ranged = dataclasses.replace(
                limits, first_tail_ns=int(tails[low]), first_tail_max_ns=int(tails[high])
            )
            found = chain.minimise(ranged, floor=bound, ceiling=allowed, offer=self.offer)
            if found is None:
                continue
            value, split = found
            self.offer(split)
            # the relaxation took the budget (peak) or its value (time) for the iteration bound
            taken = limits.budget_ns if limits.kind == PEAK else value
            if chain.measure(split)[1] > taken:  # its X_0 is above tails[low]: re-split
                _split_range(heap, tails, low, high, chain.first_tail(split), base=value)

    def solution(self, timed_out: bool, wall_s: float) -> StageSolution:
        problem = self.problem
        if self.best_starts is None:
            status = UNKNOWN if timed_out else INFEASIBLE
            return StageSolution(
                status=status,
                stage_of_layer=None,
                objective=None,
                bound=self.lower,
                wall_s=wall_s,
                backend=self.backend,
            )
        stage_of_layer = self.chain.stage_of_layer(self.best_starts)
        stages = problem.stages(stage_of_layer)
        objective = problem.objective_of(stages)
        assert objective == self.best_value, (objective, self.best_value)
        status = FEASIBLE if timed_out else OPTIMAL
        bound = min(self.lower, objective) if timed_out else objective
        return StageSolution(
            status=status,
            stage_of_layer=stage_of_layer,
            objective=objective,
            bound=bound,
            wall_s=wall_s,
            backend=self.backend,
            stages=stages,
        )


def _best_first(heap: list, search: _Search) -> Iterator[tuple[int, int, int]]:
    """Pop ranges of X_0 candidates by bound until none can beat the incumbent; keeps
    search.lower."""
    while heap:
        search.chain.check_time()
        bound, low, high = heapq.heappop(heap)
        search.lower = bound
        if search.best_value is not None and bound >= search.best_value:
            break
        yield bound, low, high
    if search.best_value is not None:
        search.lower = search.best_value


def _split_range(
    heap: list, tails: np.ndarray, low: int, high: int, tail: int, *, base: int
) -> None:
    """Push the candidate range [low, high] (indices of ``tails``) split at the found split's
    own first tail (above tails[low]: the range's relaxation took X_0 lower than it is), both
    parts bounded by ``base``: the upper part's relaxation values that split exactly, the lower
    one excludes it."""
    at = min(max(int(np.searchsorted(tails, tail)), low + 1), high)
    heapq.heappush(heap, (base, low, at - 1))
    heapq.heappush(heap, (base, at, high))
