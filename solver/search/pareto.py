"""The Pareto front of peak memory and throughput on one cluster (``solver.plan --pareto``).

A plan is non-dominated when no other plan (any config, any split) that fits the GPU memory has a
smaller or equal largest peak and a shorter or equal iteration, one of the two strictly. The
global batch is fixed, so higher throughput is the same as a shorter iteration (integer ns).
The iteration the walk is exact on is the solvers' iteration bound
(``costs.iteration_bound_ns``); every point also carries its simulated iteration (its
throughput), which is at least the bound and may order two points differently by a few
percent.

Method (epsilon constraint, exact with the existing backends): ``lexicographic(level)`` is the
fastest plan whose peak is <= level, and among those the one with the smallest peak; it is
non-dominated by construction. The front runs from F = lexicographic(capacity) (fastest) to
S (smallest peak, then fastest). Walking F, then lexicographic(previous peak - 1), ... visits every
non-dominated (peak, iteration) pair in order and ends at S: the complete front. When it has
more than ``max_points`` points the walk stops and the front is sampled instead at
``max_points`` peak levels evenly spaced from F's peak to S's peak (each point still exact and
non-dominated; ``complete`` is then False). Each lexicographic step is two config searches
(``solver.search.config_search``), which prune configs by their lower bounds.

``TrainingConfig.min_throughput`` applies as a floor (on the bound in the walk, then on each
point's simulated iteration: a point that misses it is left out); ``max_slowdown`` and
``objective`` do not (the front shows the whole trade-off they pick a point on).

On a heterogeneous cluster (two or more node groups) every plan also places each stage on a
group, and the memory axis is what ``TrainingConfig.memory_objective`` says: the largest
utilization (stage peak / its group's GPU memory, ppm, default) or the largest peak (bytes). The
walk runs in that unit (a utilization limit in ppm, or a peak limit in bytes, on top of each
group's capacity), so the front is the non-dominated (memory, iteration) pairs over every config,
split and assignment of stages to groups; each point carries its ``group_of_stage``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, UTILIZATION
from solver.errors import InputError, NoSolutionError, PlannerError
from solver.evaluation import Evaluation, evaluate_assignment, prepare_training
from solver.files.plan_file import PLAN_VERSION, check_pareto
from solver.graph import LayerGraph
from solver.parallel import check_searched
from solver.report.plan_report import cluster_to_dict, evaluation_fields
from solver.reserve import usable_text
from solver.search.config_search import Deadline, SearchResult, build_entries, search
from solver.specs import Cluster, TrainingConfig
from solver.units import format_bytes, format_throughput

PARETO_FORMAT = "pareto"
PARETO_VERSION = PLAN_VERSION
"""Version 2: every point records the graph, the complete cluster and the training options."""


@dataclass(kw_only=True)
class ParetoFront:
    """Non-dominated plans, smallest peak (slowest) first."""

    points: list[Evaluation]
    complete: bool
    """True: every non-dominated (peak, throughput) pair is listed (one plan each); False: a
    sample of ``max_points`` of them spread over the peak range, or the time limit was hit."""
    proven: bool
    """Every config search finished within the time limit (each point is exact)."""
    searches: int
    """Config searches run (two per point)."""
    wall_s: float
    memory_unit: str = "bytes"
    """The memory axis: "bytes" (largest peak) or "ppm" (largest utilization, heterogeneous
    clusters under the utilization objective)."""

    @property
    def memory(self) -> list[int]:
        """Each point's memory-axis value (peak bytes, or largest utilization in ppm)."""
        return [memory_value(point, self.memory_unit) for point in self.points]


@dataclass(frozen=True)
class _Point:
    memory: int
    """Peak bytes, or largest utilization (ppm)."""
    bound_ns: int
    """The iteration bound: the axis the walk is exact on."""
    evaluation: Evaluation


def memory_value(evaluation: Evaluation, unit: str) -> int:
    """The memory axis of a point: its largest peak (bytes) or largest utilization (ppm)."""
    return max(evaluation.utilization_ppm) if unit == "ppm" else evaluation.peak_bytes


def pareto_front(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    max_points: int | None = 10,
    backend: str = "auto",
    time_limit_s: float | None = 60.0,
    num_workers: int = 1,
    deadline: Deadline | None = None,
) -> ParetoFront:
    """Non-dominated (peak memory, throughput) plans that fit the usable memory,
    ``cluster.gpu_memory_bytes`` - ``training.memory_reserve`` (on a heterogeneous cluster: each
    stage its group's usable memory; memory is then the largest
    utilization or the largest peak, as ``training.memory_objective`` says).

    ``max_points``: at most this many points (>= 2; None: the complete front, however long).
    Every search ends by ``deadline`` (default: ``time_limit_s`` from now).
    Raises InfeasibleError when no plan fits, NoSolutionError when the time runs out first.
    """
    if max_points is not None and max_points < 2:
        raise InputError(f"--pareto-points {max_points}: need at least 2 (both ends of the front)")
    started = time.perf_counter()
    check_searched(training.schedule)
    training = prepare_training(graph, cluster, training)
    walk = _FrontWalk(
        graph,
        cluster,
        training,
        backend=backend,
        deadline=Deadline.after(time_limit_s) if deadline is None else deadline,
        num_workers=num_workers,
    )
    first = walk.fastest_within(walk.capacity)
    if first is None:
        raise walk.no_plan(time_limit_s)
    points, complete = walk.points_from(first, max_points)
    if walk.budget_ns is not None:  # the floor holds the bound; a point must meet it simulated
        points = [p for p in points if p.evaluation.iteration_ns <= walk.budget_ns]
    front = _non_dominated(points)
    return ParetoFront(
        points=[p.evaluation for p in front],
        complete=complete and walk.proven,
        proven=walk.proven,
        searches=walk.searches,
        wall_s=time.perf_counter() - started,
        memory_unit=walk.unit,
    )


class _FrontWalk:
    """The config searches of one :func:`pareto_front` call: the lexicographic steps, in the
    front's memory unit, and how many searches ran and whether all of them finished."""

    def __init__(
        self,
        graph: LayerGraph,
        cluster: Cluster,
        training: TrainingConfig,
        *,
        backend: str,
        deadline: Deadline,
        num_workers: int,
    ) -> None:
        self.graph = graph
        self.cluster = cluster
        self.training = training
        self.backend = backend
        self.deadline = deadline
        self.num_workers = num_workers
        self.entries = build_entries(graph, cluster, training, deadline=deadline)
        self.budget_ns = (
            None
            if training.min_throughput is None
            else math.floor(training.global_batch * 1e9 / training.min_throughput)
        )
        heterogeneous = cluster.is_heterogeneous
        self.unit = "ppm" if heterogeneous and training.memory_objective == UTILIZATION else "bytes"
        # each group's capacity is in its entries' placement; the cluster's is the only limit else
        self.capacity = None if heterogeneous else training.usable_bytes(cluster.gpu_memory_bytes)
        self.searches = 0
        self.proven = True

    def search_within(self, objective: str, level: int | None, budget: int | None) -> SearchResult:
        """One config search with memory <= level (None: only the GPU capacities) in the
        front's unit: a peak limit in bytes, or a utilization limit in ppm."""
        self.searches += 1
        result = search(
            self.entries,
            objective=objective,
            capacity_bytes=None if self.unit == "ppm" else level,
            utilization_limit_ppm=level if self.unit == "ppm" else None,
            iteration_budget_ns=budget,
            backend=self.backend,
            deadline=self.deadline,
            num_workers=self.num_workers,
        )
        self.proven &= result.proven
        return result

    def fastest_within(self, level: int | None) -> _Point | None:
        """Fastest plan with memory <= level; among those, the smallest memory."""
        fastest = self.search_within(OBJECTIVE_TIME, level, self.budget_ns)
        if fastest.entry is None:
            return None
        smallest = self.search_within(OBJECTIVE_MEMORY, level, fastest.value)
        return self._point(smallest if smallest.entry is not None else fastest)

    def _point(self, result: SearchResult) -> _Point:
        """The result's plan evaluated by the cost model."""
        solution, placement = result.solution, result.entry.placement
        placed = (
            {}
            if placement is None
            else {"group_costs": placement.group_costs, "group_of_stage": solution.group_of_stage}
        )
        evaluation = evaluate_assignment(
            self.graph,
            result.entry.costs,
            solution.stage_of_layer,
            cluster=self.cluster,
            training=self.training,
            recomputed=solution.recomputed,
            **placed,
        )
        return _Point(
            memory_value(evaluation, self.unit), evaluation.iteration_bound_ns, evaluation
        )

    def no_plan(self, time_limit_s: float | None) -> PlannerError:
        """Why not even the fastest plan was found: the time limit, or nothing fits."""
        if not self.proven:
            return NoSolutionError(
                f"time limit ({time_limit_s} s) reached before any plan was found; "
                "raise --time-limit"
            )
        from solver.search.planner import explain_infeasible

        return explain_infeasible(
            self.graph,
            self.cluster,
            self.training,
            self.entries,
            self.backend,
            self.budget_ns,
            deadline=self.deadline,
        )

    def points_from(self, first: _Point, max_points: int | None) -> tuple[list[_Point], bool]:
        """Points of the front from the fastest plan ``first`` to the smallest-memory one, and
        whether the walk visited all of them (else a sample of ``max_points`` evenly spaced
        memory levels, or what the time limit allowed)."""
        smallest = self.search_within(OBJECTIVE_MEMORY, self.capacity, self.budget_ns)
        last = (
            first
            if smallest.entry is None or smallest.value >= first.memory
            else self.fastest_within(smallest.value)
        )
        walk, complete = self._walk(first, last, max_points)
        if not complete and last is not None and max_points is not None:
            return self._sample(first, last, max_points), complete
        return walk, complete

    def _walk(
        self, first: _Point, last: _Point | None, max_points: int | None
    ) -> tuple[list[_Point], bool]:
        """Every non-dominated point from ``first`` down to ``last``, each step the fastest
        plan below the previous memory; stops (incomplete) after ``max_points`` points or when
        a step finds nothing in time."""
        walk = [first]
        while last is not None and walk[-1].memory > last.memory:
            if max_points is not None and len(walk) == max_points:
                return walk, False
            following = self.fastest_within(walk[-1].memory - 1)
            if following is None:  # time limit
                return walk, False
            walk.append(following)
        return walk, True

    def _sample(self, first: _Point, last: _Point, max_points: int) -> list[_Point]:
        """``first``, ``last`` and the fastest plans at ``max_points - 2`` memory levels evenly
        spaced between them."""
        levels = [
            first.memory - (first.memory - last.memory) * i // (max_points - 1)
            for i in range(1, max_points - 1)
        ]
        return [first, *(p for p in map(self.fastest_within, levels) if p is not None), last]


def _non_dominated(points: list[_Point]) -> list[_Point]:
    """Distinct non-dominated points, smallest memory first (the first plan of a tied pair)."""
    front: list[_Point] = []
    for candidate in sorted(points, key=lambda p: (p.memory, p.bound_ns)):
        if not front or candidate.bound_ns < front[-1].bound_ns:
            front.append(candidate)
    return front


def dominated(a: tuple[int, float], b: tuple[int, float]) -> bool:
    """Whether (peak, throughput) ``a`` is dominated by ``b``."""
    return b[0] <= a[0] and b[1] >= a[1] and b != a


def pareto_to_dict(front: ParetoFront) -> dict[str, Any]:
    """The --json document: every point as the plan JSON's evaluation fields (on a
    heterogeneous cluster with each stage's group, capacity and utilization), plus its value on
    the memory axis (``memory``, in ``memory_unit``)."""
    first = front.points[0]
    cluster = first.cluster
    points = [
        evaluation_fields(point) | {"layer_counts": point.layer_counts, "memory": memory}
        for point, memory in zip(front.points, front.memory, strict=True)
    ]
    document = {
        "format": PARETO_FORMAT,
        "version": PARETO_VERSION,
        "model": first.graph.model,
        "cluster": cluster_to_dict(cluster),
        "memory_unit": front.memory_unit,
        "complete": front.complete,
        "proven": front.proven,
        "searches": front.searches,
        "wall_s": front.wall_s,
        "points": points,
    }
    if cluster.is_heterogeneous:
        document["memory_objective"] = first.training.memory_objective
    check_pareto(document)  # the writer's invariant: the schema (plan.schema.json) accepts it
    return document


def format_pareto(front: ParetoFront) -> str:
    """Text table: one row per point, smallest memory first (on a heterogeneous cluster with
    the largest utilization and each stage's group)."""
    first = front.points[0]
    cluster = first.cluster
    reserve = first.training.memory_reserve
    where = (
        f"{cluster.num_gpus} GPUs x {format_bytes(cluster.gpu_memory_bytes)} "
        f"({usable_text(reserve, cluster.gpu_memory_bytes)})"
    )
    placed = cluster.is_heterogeneous
    if placed:
        where = " + ".join(
            f"{g.num_gpus} x {format_bytes(g.gpu_memory_bytes)} ({g.name})" for g in cluster.groups
        )
        where += (
            f"; memory objective: {first.training.memory_objective}; reserve "
            f"{reserve.label()} per GPU ({reserve.source})"
        )
    lines = [
        f"Pareto front of {first.graph.model} on {where}: {len(front.points)} non-dominated plans"
        + ("" if front.complete else " (a sample of the front)")
    ]
    header = ["peak", "throughput", "config", "split (layers per stage)"]
    if placed:
        header[1:1] = ["max util"]
        header.append("groups (per stage)")
    rows = []
    for point in front.points:
        row = [
            format_bytes(point.peak_bytes),
            format_throughput(point.throughput, why=False),
            point.config.label(),
            ",".join(str(count) for count in point.layer_counts),
        ]
        if placed:
            row[1:1] = [f"{max(point.utilization_ppm) / 1e4:.1f}%"]
            row.append(",".join(point.group_names))
        rows.append(row)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    status = "exact" if front.proven else "NOT proven: time limit reached"
    lines.append(f"solver: {front.searches} config searches, {front.wall_s:.2f} s ({status})")
    return "\n".join(lines)


__all__ = [
    "ParetoFront",
    "dominated",
    "format_pareto",
    "memory_value",
    "pareto_front",
    "pareto_to_dict",
]
