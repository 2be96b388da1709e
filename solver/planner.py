"""The planning API: graph + cluster + training options -> the memory-optimal :class:`Plan`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, OPTIMAL, UTILIZATION
from solver.baselines import BASELINES
from solver.engine_exports import build_exports
from solver.errors import InfeasibleError, InputError, NoSolutionError, PlannerError
from solver.evaluation import Evaluation, evaluate_assignment
from solver.graph import LayerGraph
from solver.search import ConfigEntry, Deadline, SearchResult, build_entries, refine, search
from solver.specs import Cluster, SolverReport, TrainingConfig
from solver.units import format_bytes

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Plan:
    """A chosen config and split, its exact costs, how it was found, and its exports."""

    evaluation: Evaluation
    solver: SolverReport
    exports: dict[str, Any]
    baselines: dict[str, Evaluation] = field(default_factory=dict)
    """The same config split the usual ways (even, parameters), for comparison."""
    required_throughput: float | None = None
    """The throughput constraint that was applied (samples/s), if any."""
    fastest_throughput: float | None = None
    """Throughput of the fastest plan that fits in memory, when it was computed."""

    @property
    def config(self):
        return self.evaluation.config

    @property
    def stages(self):
        return self.evaluation.stages

    @property
    def peak_bytes(self) -> int:
        return self.evaluation.peak_bytes

    @property
    def throughput(self) -> float:
        return self.evaluation.throughput

    @property
    def stage_of_layer(self) -> list[int]:
        return self.evaluation.stage_of_layer


def plan(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    backend: str = "auto",
    time_limit_s: float | None = 60.0,
    num_workers: int = 1,
) -> Plan:
    """Minimise the largest per-GPU peak (or, with objective "throughput", the iteration time).

    Raises InputError for bad options, InfeasibleError when nothing fits (with the smallest peak
    found and, when found quickly, a GPU count that fits).
    """
    started = time.perf_counter()
    deadline = Deadline.after(time_limit_s)
    entries = build_entries(graph, cluster, training)
    heterogeneous = cluster.is_heterogeneous
    # a heterogeneous cluster's capacities are per group, in each entry's placement
    capacity = None if heterogeneous else cluster.gpu_memory_bytes
    budget_ns = None
    required = None
    fastest = None
    if training.min_throughput is not None:
        budget_ns = math.floor(training.global_batch * 1e9 / training.min_throughput)
        required = training.min_throughput
    run = functools.partial(
        search,
        entries,
        capacity_bytes=capacity,
        backend=backend,
        deadline=deadline,
        num_workers=num_workers,
    )

    def found(result: SearchResult) -> SearchResult:
        if result.entry is None:
            raise _no_plan(
                result, graph, cluster, training, entries, backend, budget_ns, time_limit_s
            )
        return result

    if training.objective == "throughput" or (
        training.min_throughput is None and training.max_slowdown is not None
    ):
        # only the last search spends the time left on configs that did not close
        last = training.objective == "throughput"
        fastest = found(
            run(objective=OBJECTIVE_TIME, iteration_budget_ns=budget_ns, retry_open=last)
        )
        if training.objective == "memory" and training.min_throughput is None:
            budget_ns = math.floor(training.max_slowdown * fastest.value)
            # a graph without FLOPs or times runs in 0 ns: no throughput to require
            required = training.global_batch * 1e9 / budget_ns if budget_ns else None
    if training.objective == "memory":
        result = found(
            run(objective=OBJECTIVE_MEMORY, iteration_budget_ns=budget_ns, retry_open=True)
        )
        secondary, limits = OBJECTIVE_TIME, {"capacity": result.value, "budget": budget_ns}
        if heterogeneous and training.memory_objective == UTILIZATION:
            limits = {"capacity": None, "budget": budget_ns, "utilization": result.value}
    else:
        result = fastest
        secondary, limits = OBJECTIVE_MEMORY, {"capacity": capacity, "budget": result.value}
    entry, split, recomputed, groups = _break_ties(
        result, secondary=secondary, **limits, deadline=deadline, num_workers=num_workers
    )
    # a throughput budget taken from an unproven fastest plan is not proven either
    proven = result.proven and (fastest is None or fastest.proven)
    placed = (
        {}
        if entry.placement is None
        else {"group_costs": entry.placement.group_costs, "group_of_stage": groups}
    )
    evaluation = evaluate_assignment(
        graph,
        entry.costs,
        split,
        cluster=cluster,
        training=training,
        recomputed=recomputed,
        **placed,
    )
    report = SolverReport(
        backend=result.backend,
        status=OPTIMAL if proven else "FEASIBLE",
        objective=result.value,
        bound=result.bound,
        wall_s=time.perf_counter() - started,
        configs_total=len(entries),
        configs_solved=result.solved,
        configs_pruned=result.pruned,
    )
    if not proven:
        report.notes.append("time limit reached: best plan found, not proven optimal")
    return Plan(
        evaluation=evaluation,
        solver=report,
        exports=build_exports(
            graph,
            entry.costs.config,
            evaluation.virtual_stage_layer_names(),
            recomputed=evaluation.virtual_stage_recomputed_names(),
        ),
        baselines={
            name: evaluate_assignment(
                graph,
                entry.costs,
                split_of(graph, entry.costs.num_stages),
                cluster=cluster,
                training=training,
                **placed,
            )
            for name, split_of in BASELINES.items()
        },
        required_throughput=required,
        fastest_throughput=(
            None
            if fastest is None or fastest.value is None
            else training.global_batch * 1e9 / fastest.value
        ),
    )


def _break_ties(
    result: SearchResult,
    *,
    secondary: str,
    capacity: int | None,
    budget: int | None,
    deadline: Deadline,
    num_workers: int,
    utilization: int | None = None,
) -> tuple[ConfigEntry, list[int], list[bool] | None, list[int] | None]:
    """Among configs tied on the primary objective, the best on the secondary one (then the
    earliest in candidate order). Each tie is re-solved for its best secondary value while
    keeping the primary optimum as a hard limit (with selective recomputation this also drops
    recomputed layers the peak does not need). Returns (entry, split, recompute flags, group
    of each stage)."""
    best: tuple[tuple[int, int], ConfigEntry, list[int], list[bool] | None, list[int] | None]
    best = None
    for entry, solution in result.ties:
        refined = refine(
            entry,
            objective=secondary,
            capacity_bytes=capacity,
            iteration_budget_ns=budget,
            backend=result.backend,
            deadline=deadline,
            hint=solution.stage_of_layer,
            hint_recomputed=solution.recomputed,
            hint_groups=solution.group_of_stage,
            num_workers=num_workers,
            utilization_limit_ppm=utilization,
        )
        chosen = refined if refined is not None else solution
        value = refined.objective if refined is not None else math.inf
        key = (value, entry.order)
        if best is None or key < best[0]:
            best = (key, entry, chosen.stage_of_layer, chosen.recomputed, chosen.group_of_stage)
    return best[1], best[2], best[3], best[4]


def _no_plan(
    result: SearchResult,
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    entries: list[ConfigEntry],
    backend: str,
    budget_ns: int | None,
    time_limit_s: float | None,
) -> PlannerError:
    """NoSolutionError when the time ran out first, else the infeasibility explanation."""
    if not result.proven:
        return NoSolutionError(
            f"time limit ({time_limit_s} s) reached before any plan was found "
            f"({result.solved} of {len(entries)} configs solved); raise --time-limit"
        )
    return explain_infeasible(graph, cluster, training, entries, backend, budget_ns)


def explain_infeasible(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    entries: list[ConfigEntry],
    backend: str,
    budget_ns: int | None,
) -> InfeasibleError:
    """Which constraint fails, by how much, and the smallest GPU count that would fit."""
    if cluster.is_heterogeneous:
        return _explain_heterogeneous(cluster, entries, budget_ns)
    capacity = cluster.gpu_memory_bytes
    quick = functools.partial(
        search, entries, iteration_budget_ns=None, backend=backend, deadline=Deadline.after(10.0)
    )
    unconstrained = quick(objective=OBJECTIVE_MEMORY, capacity_bytes=None)
    best_peak = (
        unconstrained.value
        if unconstrained.value is not None
        else min(e.memory_bound for e in entries)
    )
    if best_peak <= capacity and budget_ns is not None:
        fastest = quick(objective=OBJECTIVE_TIME, capacity_bytes=capacity)
        reached = (
            "no plan was found in time"
            if fastest.value is None
            else f"the fastest plan that fits reaches "
            f"{training.global_batch * 1e9 / fastest.value:.4g} samples/s "
            f"({fastest.entry.costs.config.label()})"
        )
        required = training.global_batch * 1e9 / budget_ns
        return InfeasibleError(
            f"throughput constraint cannot be met: {required:.4g} samples/s required, {reached};"
            " lower --min-throughput, raise --max-slowdown, or add GPUs",
            best_peak_bytes=best_peak,
            capacity_bytes=capacity,
        )
    over = best_peak - capacity
    config_text = (
        "" if unconstrained.entry is None else f" ({unconstrained.entry.costs.config.label()})"
    )
    suggestion = smallest_fitting_gpus(graph, cluster, training, backend)
    if suggestion is None:
        tail = (
            f"no cluster of {2 * cluster.num_gpus}..{64 * cluster.num_gpus} GPUs "
            "(doubling) fits either; use larger GPUs, ZeRO (--zero auto), recompute "
            "(--recompute full) or a smaller micro-batch"
        )
    else:
        tail = (
            f"smallest GPU count that fits (trying 2x, 4x, ...): {suggestion[0]} "
            f"({suggestion[1]}); or try --zero auto / --recompute auto"
        )
    needs = f"needs {format_bytes(best_peak)}{config_text}, "
    if not unconstrained.proven:  # the 10 s search stopped early: an upper bound only
        needs = f"is proven over it; the best split found in 10 s needs {needs}"
    return InfeasibleError(
        f"nothing fits in {format_bytes(capacity)} per GPU (--gpu-memory): the best of "
        f"{len(entries)} configs {needs}"
        f"{format_bytes(over)} ({100 * over / capacity:.1f}%) over; {tail}",
        best_peak_bytes=best_peak,
        capacity_bytes=capacity,
        suggested_gpus=None if suggestion is None else suggestion[0],
    )


def _explain_heterogeneous(
    cluster: Cluster, entries: list[ConfigEntry], budget_ns: int | None
) -> InfeasibleError:
    """No placement of any config fits the groups (or meets the throughput constraint)."""
    groups = ", ".join(f"{g.name} {format_bytes(g.gpu_memory_bytes)}" for g in cluster.groups)
    best = min(e.peak_lower_bound for e in entries)
    constraint = "" if budget_ns is None else " and the throughput constraint"
    return InfeasibleError(
        f"no config and placement of stages on the groups ({groups}) satisfies the group "
        f"capacities{constraint}: {len(entries)} configs solved or bounded (the best lower bound "
        f"on a stage peak is {format_bytes(best)}); try --zero auto, --recompute auto, a smaller "
        "micro-batch, --max-slowdown none, or more nodes",
        best_peak_bytes=best,
        capacity_bytes=max(g.gpu_memory_bytes for g in cluster.groups),
    )


def smallest_fitting_gpus(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    backend: str,
    *,
    seconds: float = 10.0,
) -> tuple[int, str] | None:
    """Smallest of 2N, 4N, ..., 64N GPUs on which some plan fits in memory (throughput ignored)."""
    deadline = Deadline.after(seconds)
    relaxed = dataclasses.replace(
        training, min_throughput=None, max_slowdown=None, pp=None, tp=None, dp=None
    )
    num_gpus = cluster.num_gpus
    while num_gpus < 64 * cluster.num_gpus and not deadline.expired():
        num_gpus *= 2
        try:
            entries = build_entries(graph, dataclasses.replace(cluster, num_gpus=num_gpus), relaxed)
        except InputError:
            continue
        if min(e.memory_bound for e in entries) > cluster.gpu_memory_bytes:
            continue
        found = search(
            entries,
            objective=OBJECTIVE_MEMORY,
            capacity_bytes=cluster.gpu_memory_bytes,
            iteration_budget_ns=None,
            backend=backend,
            deadline=deadline,
        )
        if found.entry is not None:
            return num_gpus, found.entry.costs.config.label()
    return None
