"""Tie-breaking: among configs tied on the primary objective, the best on the secondary one
(the fastest split at the optimal peak, or the smallest peak at the fastest iteration)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, UTILIZATION
from solver.costs import LayerCosts, StageCost, iteration_bound_ns, stage_costs
from solver.search.config_search import ConfigEntry, Deadline, Progress, SearchResult, refine
from solver.specs import Cluster, TrainingConfig


class _PlanningCall(Protocol):
    """What the tie-break reads of a planning call (``solver.search.planner._PlanningCall``)."""

    cluster: Cluster
    training: TrainingConfig
    deadline: Deadline
    num_workers: int
    progress: Progress | None

    @property
    def capacity_bytes(self) -> int | None: ...


class _Choice(NamedTuple):
    """The chosen config and its split."""

    entry: ConfigEntry
    split: list[int]
    recomputed: list[bool] | None
    """Recompute flag of each layer (selective recomputation only)."""
    groups: list[int] | None
    """Node group of each stage (heterogeneous clusters only)."""
    stages: list[StageCost] | None = None
    """The split's stage costs when the backend computed them (``StageSolution.stages``)."""


def _break_ties(
    call: _PlanningCall, result: SearchResult, *, budget_ns: int | None
) -> tuple[_Choice, list[str]]:
    """Among configs tied on the primary objective, the best on the secondary one (then the
    earliest in candidate order). Each tie is re-solved for its best secondary value while
    keeping the primary optimum as a hard limit (with selective recomputation this also drops
    recomputed layers the peak does not need); the re-solved split replaces the one found only
    when it is strictly better on the secondary objective. A tie whose split already reaches
    its config's lower bound on the secondary objective (every split of a config whose costs
    take no time: :func:`_time_invariant`) is not re-solved: no split could beat it, so the
    re-solve would keep it. Ties the time limit leaves no time for keep their split and rank
    after the re-solved ones; the notes say so."""
    limits = _secondary_limits(call, result, budget_ns=budget_ns)
    best_key, best, settled_count = None, None, 0
    for index, (entry, solution) in enumerate(result.ties):
        found = _Choice(
            entry,
            solution.stage_of_layer,
            solution.recomputed,
            solution.group_of_stage,
            solution.stages,
        )
        if call.deadline.expired():
            key = (math.inf, entry.order)
            if best is None or key < best_key:
                best_key, best = key, found
            continue
        settled_count += 1
        if call.progress is not None:
            call.progress("ties", index, len(result.ties), "")
        value = _secondary_value(call, entry, solution)
        if value is None or value > _secondary_bound(call, entry):
            refined = refine(
                entry,
                **limits,
                backend=result.backend,
                deadline=call.deadline,
                hint=solution.stage_of_layer,
                hint_recomputed=solution.recomputed,
                hint_groups=solution.group_of_stage,
                num_workers=call.num_workers,
            )
            if refined is not None and (value is None or refined.objective < value):
                value = refined.objective
                found = _Choice(
                    entry,
                    refined.stage_of_layer,
                    refined.recomputed,
                    refined.group_of_stage,
                    refined.stages,
                )
        key = (math.inf if value is None else value, entry.order)
        if best is None or key < best_key:
            best_key, best = key, found
    notes = []
    if settled_count < len(result.ties):
        secondary = "throughput" if call.training.objective == "memory" else "peak"
        notes.append(
            f"time limit reached before tie-breaking: {settled_count} of {len(result.ties)} "
            f"configs tied on the optimum were re-solved for the best {secondary}; the others "
            "keep the split found and rank after them"
        )
    return best, notes


def _time_invariant(costs: LayerCosts) -> bool:
    """Every split of this config takes 0 ns (``LayerCosts.has_compute_time``), so the time
    model cannot tell splits apart."""
    return not costs.has_compute_time


def _secondary_value(call: _PlanningCall, entry: ConfigEntry, solution) -> int | None:
    """The secondary objective of the split the primary search found: its iteration bound (ns) under
    the memory objective, its largest peak (bytes) under the throughput objective; None where
    the re-solve may also change what the split does not say (a heterogeneous cluster's
    placement, selective recomputation's recomputed layers), which always re-solves."""
    costs = entry.costs
    if entry.placement is not None or costs.selective:
        return None
    if call.training.objective == "memory" and _time_invariant(costs):
        return 0
    stages = _matching_stages(entry, solution.stage_of_layer, solution.stages)
    if stages is None:
        stages = stage_costs(costs, solution.stage_of_layer)
    if call.training.objective == "memory":
        return iteration_bound_ns(costs, stages)
    return max(stage.peak_bytes for stage in stages)


def _matching_stages(
    entry: ConfigEntry, split: list[int], stages: list[StageCost] | None
) -> list[StageCost] | None:
    """``stages`` when they are the cost model's stage costs of ``split`` on the entry's own
    coefficients (a backend's ``StageSolution.stages``: a plain config, each stage holding
    exactly its layers of the split), else None: the caller evaluates the split itself."""
    if stages is None or entry.placement is not None or entry.costs.selective:
        return None
    if len(stages) != entry.costs.num_stages or sum(len(s.layers) for s in stages) != len(split):
        return None
    if any(split[layer] != stage.index for stage in stages for layer in stage.layers):
        return None
    return stages


def _secondary_bound(call: _PlanningCall, entry: ConfigEntry) -> int:
    """No split of the entry's config is better on the secondary objective than this."""
    return entry.time_bound if call.training.objective == "memory" else entry.memory_bound


def _secondary_limits(
    call: _PlanningCall, result: SearchResult, *, budget_ns: int | None
) -> dict[str, Any]:
    """The secondary objective and the limits that hold the primary optimum, as arguments of
    :func:`solver.search.config_search.refine`: the fastest split at the optimal peak (or the
    optimal largest
    utilization of a heterogeneous cluster), or the smallest peak at the fastest iteration."""
    if call.training.objective != "memory":
        return {
            "objective": OBJECTIVE_MEMORY,
            "capacity_bytes": call.capacity_bytes,
            "iteration_budget_ns": result.value,
        }
    if call.cluster.is_heterogeneous and call.training.memory_objective == UTILIZATION:
        return {
            "objective": OBJECTIVE_TIME,
            "capacity_bytes": None,
            "iteration_budget_ns": budget_ns,
            "utilization_limit_ppm": result.value,
        }
    return {
        "objective": OBJECTIVE_TIME,
        "capacity_bytes": result.value,
        "iteration_budget_ns": budget_ns,
    }
