"""The planning API: graph + cluster + training options -> the memory-optimal :class:`Plan`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, OPTIMAL, UTILIZATION
from solver.costs import LayerCosts, StageCost, iteration_bound_ns, stage_costs
from solver.errors import InfeasibleError, InputError, NoSolutionError, PlannerError
from solver.evaluation import Evaluation, evaluate_assignment, prepare_training
from solver.exports import build_exports
from solver.graph import LayerGraph
from solver.report.baselines import BASELINES
from solver.reserve import usable_text
from solver.search.config_search import (
    ConfigEntry,
    Deadline,
    Progress,
    SearchResult,
    build_entries,
    refine,
    search,
)
from solver.search.gpu_counts import (
    GpuCountAdvice,
    memory_may_fit,
    smallest_fitting_count,
    valid_gpu_counts,
)
from solver.search.incumbents import QUICK_METHODS
from solver.specs import Cluster, SearchStatus, SolverReport, TrainingConfig
from solver.units import format_bytes

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Plan:
    """A chosen config and split, its exact costs, how it was found, and its exports."""

    evaluation: Evaluation
    solver: SolverReport
    make_exports: Callable[[], dict[str, Any]] = field(repr=False, compare=False)
    """Builds :attr:`exports` when first read."""
    make_baselines: Callable[[], dict[str, Evaluation]] = field(
        default=dict, repr=False, compare=False
    )
    """Builds :attr:`baselines` when first read."""
    required_throughput: float | None = None
    """The throughput constraint that was applied (samples/s), if any."""
    fastest_throughput: float | None = None
    """Throughput of the fastest plan that fits in memory, when it was computed."""
    iteration_budget_ns: int | None = None
    """The longest simulated iteration the plan was allowed (the throughput constraint), ns."""
    fastest_iteration_ns: int | None = None
    """The simulated iteration of the fastest plan that fits, when it was searched, ns."""

    @functools.cached_property
    def exports(self) -> dict[str, Any]:
        """The plan for each engine (``solver.exports.build_exports``), built when first
        read: a millisecond or two that an in-process caller wanting only the split skips."""
        return self.make_exports()

    @functools.cached_property
    def baselines(self) -> dict[str, Evaluation]:
        """The same config split the usual ways (even, parameters), for comparison: same ZeRO
        stage and recompute mode, the plan's recomputed layers under selective recomputation,
        the plan's stage groups on a heterogeneous cluster; evaluated when first read."""
        return self.make_baselines()

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
    deadline: Deadline | None = None,
    progress: Progress | None = None,
    suggest_gpus: bool = True,
) -> Plan:
    """Minimise the largest per-GPU peak (or, with objective "throughput", the iteration time).

    Everything (bounds, searches, tie-breaking, the infeasibility explanation) ends by
    ``deadline``: by default ``time_limit_s`` from now; a CLI passes the one it started before
    reading the graph. ``progress`` hears of every config solved.

    ``training.precision`` None is the graph's precision (``precision.for_graph``); every peak
    must fit in the usable memory, capacity - ``training.memory_reserve``.

    Raises InputError for bad options, InfeasibleError when nothing fits: which constraint, the
    smallest peak found and, with ``suggest_gpus``, the smallest GPU count that fits (the
    search of ``solver.sweep.min_gpus`` with ``--gpus auto``, in what is left of the time limit:
    :func:`smallest_fitting_gpus`). A sweep passes ``suggest_gpus=False``: it searches the
    counts itself. NoSolutionError when the time runs out before any plan is found.
    """
    started = time.perf_counter()
    deadline = Deadline.after(time_limit_s) if deadline is None else deadline
    training = prepare_training(graph, cluster, training)
    call = _PlanningCall(
        graph=graph,
        cluster=cluster,
        training=training,
        entries=build_entries(graph, cluster, training, deadline=deadline),
        backend=backend,
        deadline=deadline,
        num_workers=num_workers,
        time_limit_s=time_limit_s,
        progress=progress,
        suggest_gpus=suggest_gpus,
    )
    limit = _throughput_limit(call)
    if training.objective == "memory":
        result, choice, notes = _within_budget(call, limit)
    else:
        result = limit.fastest
        choice, notes = _break_ties(call, result, budget_ns=limit.budget_ns)
    # a throughput budget taken from an unproven fastest plan is not proven either
    proven = result.proven and (limit.fastest is None or limit.fastest.proven)
    plan = _build_plan(call, choice, result, limit, proven=proven, started=started)
    plan.solver.notes += notes
    return plan


MAX_BUDGET_ROUNDS = 8
"""Searches at most for a plan whose simulated iteration meets the throughput budget
(``_within_budget``)."""


def _within_budget(
    call: _PlanningCall, limit: _ThroughputLimit
) -> tuple[SearchResult, _Choice, list[str]]:
    """The smallest-peak plan whose simulated iteration (``solver.costs.schedule_time``) is within
    the budget, with notes when it is not proven.

    Every backend holds the iteration *bound* (``costs.iteration_bound_ns``, never above
    the simulation) within the budget, so its optimum is a lower bound, and it is the answer when
    its simulated schedule meets the budget too (the common case: proven). Otherwise its
    schedule's own extra time, simulated minus bound, comes off the budget and the search runs
    again (at most ``MAX_BUDGET_ROUNDS`` times, every round excluding the plan before); the
    first round's peak stays the proven lower bound. With --max-slowdown the fastest plan always
    meets the budget and is the last resort."""
    budget = limit.budget_ns
    first = result = call.best(OBJECTIVE_MEMORY, budget_ns=budget, retry_open=True)
    choice, notes = _break_ties(call, result, budget_ns=budget)
    if budget is None:
        return result, choice, notes
    rounds = 0
    while True:
        simulated, bound = _choice_times(call, choice)
        if simulated <= budget:
            break
        rounds += 1
        search_budget = budget - (simulated - bound)
        found = None
        if rounds <= MAX_BUDGET_ROUNDS and search_budget >= 0:
            try:
                found = call.best(OBJECTIVE_MEMORY, budget_ns=search_budget, retry_open=True)
            except InfeasibleError:
                pass
        if found is None:
            result, choice = _fastest_within(call, limit, budget)
            break
        result = found
        choice, notes = _break_ties(call, result, budget_ns=search_budget)
    if rounds:
        result = dataclasses.replace(result, bound=min(first.bound, result.bound), proven=False)
        notes.append(
            f"the smallest-peak plan under the iteration bound took longer than the budget "
            f"({budget / 1e6:.4g} ms) in its simulated schedule; {rounds} more search"
            f"{'es' * (rounds > 1)} with the budget lowered by each plan's simulated extra time "
            f"found this one: not proven optimal (the peak's lower bound is the first search's "
            f"optimum, {format_bytes(first.value)})"
        )
    return result, choice, notes


def _fastest_within(
    call: _PlanningCall, limit: _ThroughputLimit, budget: int
) -> tuple[SearchResult, _Choice]:
    """The fastest plan when its simulated iteration meets the budget (always, with
    --max-slowdown: the budget is a multiple of it), else InfeasibleError."""
    if limit.fastest is None:
        limit.fastest = call.best(OBJECTIVE_TIME, budget_ns=budget, retry_open=False)
        limit.fastest_ns = _simulated_ns(call, limit.fastest)
    if limit.fastest_ns > budget:
        raise call.throughput_unmet(budget)
    choice, _ = _break_ties(call, limit.fastest, budget_ns=budget)
    return limit.fastest, choice


def _choice_times(call: _PlanningCall, choice: _Choice) -> tuple[int, int]:
    """(simulated iteration, iteration bound) of a chosen split, ns."""
    evaluation = _evaluate_choice(call, choice)
    return evaluation.iteration_ns, evaluation.iteration_bound_ns


def _evaluate_choice(call: _PlanningCall, choice: _Choice) -> Evaluation:
    """The chosen split evaluated by the cost model (its simulated iteration included), once
    per call: the budget check and the plan share it."""
    key = (
        choice.entry.order,
        tuple(choice.split),
        None if choice.recomputed is None else tuple(choice.recomputed),
        None if choice.groups is None else tuple(choice.groups),
    )
    if key not in call.evaluations:
        call.evaluations[key] = _evaluate(call.graph, call.cluster, call.training, choice)
    return call.evaluations[key]


def _evaluate(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig, choice: _Choice
) -> Evaluation:
    """``choice`` evaluated by the cost model: its stages, simulated iteration and bound."""
    placed = (
        {}
        if choice.entry.placement is None
        else {"group_costs": choice.entry.placement.group_costs, "group_of_stage": choice.groups}
    )
    return evaluate_assignment(
        graph,
        choice.entry.costs,
        choice.split,
        cluster=cluster,
        training=training,
        recomputed=choice.recomputed,
        stages=_matching_stages(choice.entry, choice.split, choice.stages),
        **placed,
    )


@dataclass(kw_only=True)
class _PlanningCall:
    """What the searches of one :func:`plan` call share."""

    graph: LayerGraph
    cluster: Cluster
    training: TrainingConfig
    entries: list[ConfigEntry]
    backend: str
    deadline: Deadline
    num_workers: int
    time_limit_s: float | None
    progress: Progress | None = None
    suggest_gpus: bool = True
    """Look for a GPU count that fits when nothing does (the exit-3 message)."""
    explain: bool = True
    """False for the probes of that search: an InfeasibleError without an explanation."""
    searches: list[tuple[str, SearchResult]] = field(default_factory=list)
    """(objective, result) of each search run, in order (the report's ``searches``)."""
    evaluations: dict[tuple, Evaluation] = field(default_factory=dict)
    """Splits evaluated so far (``_evaluate_choice``)."""

    @property
    def capacity_bytes(self) -> int | None:
        """The GPU memory every split must fit in: the usable memory, capacity - reserve; None
        on a heterogeneous cluster, whose usable memories are per group, in each entry's
        placement."""
        if self.cluster.is_heterogeneous:
            return None
        return self.training.usable_bytes(self.cluster.gpu_memory_bytes)

    def best(self, objective: str, *, budget_ns: int | None, retry_open: bool) -> SearchResult:
        """The best config for ``objective`` within the capacity and the iteration budget;
        raises why there is none (NoSolutionError or InfeasibleError)."""
        result = search(
            self.entries,
            objective=objective,
            capacity_bytes=self.capacity_bytes,
            iteration_budget_ns=budget_ns,
            backend=self.backend,
            deadline=self.deadline,
            num_workers=self.num_workers,
            retry_open=retry_open,
            progress=self.progress,
        )
        self.searches.append((objective, result))
        if result.entry is None:
            raise self._no_plan(result, budget_ns)
        return result

    def throughput_unmet(self, budget_ns: int) -> PlannerError:
        """No plan's simulated iteration meets the budget (``_within_budget``)."""
        if not self.explain:
            return InfeasibleError("no plan meets the throughput constraint")
        return self._explanation(budget_ns)

    def _explanation(self, budget_ns: int | None) -> InfeasibleError:
        """``explain_infeasible`` for this call."""
        return explain_infeasible(
            self.graph,
            self.cluster,
            self.training,
            self.entries,
            self.backend,
            budget_ns,
            deadline=self.deadline,
            suggest_gpus=self.suggest_gpus,
        )

    def _no_plan(self, result: SearchResult, budget_ns: int | None) -> PlannerError:
        """NoSolutionError when the time ran out first, else the infeasibility explanation."""
        if not result.proven:
            return NoSolutionError(
                f"time limit ({self.time_limit_s} s) reached before any plan was found "
                f"({result.solved} of {len(self.entries)} configs solved; no quick split of "
                "any config fits the limits); raise --time-limit"
            )
        if not self.explain:
            return InfeasibleError("no plan fits")
        return self._explanation(budget_ns)


@dataclass(kw_only=True)
class _ThroughputLimit:
    """The throughput constraint of one planning call."""

    budget_ns: int | None = None
    """Longest iteration a plan may take (ns); None: no constraint."""
    required: float | None = None
    """The same in samples/s, as reported; None also when the fastest plan takes 0 ns."""
    fastest: SearchResult | None = None
    """The fastest plan that fits (the least iteration bound), when it was searched."""
    fastest_ns: int | None = None
    """Its simulated iteration, ns: what --max-slowdown multiplies."""

    def fastest_throughput(self, global_batch: int) -> float | None:
        if not self.fastest_ns:  # None, or 0 ns: no FLOPs or times
            return None
        return global_batch * 1e9 / self.fastest_ns


def _simulated_ns(call: _PlanningCall, result: SearchResult) -> int:
    """The simulated iteration of a search's best split, ns (``solver.costs.schedule_time``)."""
    return _evaluate_choice(call, _result_choice(result)).iteration_ns


def _result_choice(result: SearchResult) -> _Choice:
    """A search's best split as a choice."""
    solution = result.solution
    return _Choice(
        result.entry,
        solution.stage_of_layer,
        solution.recomputed,
        solution.group_of_stage,
        solution.stages,
    )


def _throughput_limit(call: _PlanningCall) -> _ThroughputLimit:
    """The iteration budget from ``min_throughput``, else ``max_slowdown`` times the fastest plan
    that fits. The fastest plan is searched for that, or as the answer of objective
    "throughput"."""
    training = call.training
    limit = _ThroughputLimit()
    if training.min_throughput is not None:
        limit.budget_ns = math.floor(training.global_batch * 1e9 / training.min_throughput)
        limit.required = training.min_throughput
    slowdown_only = training.min_throughput is None and training.max_slowdown is not None
    if slowdown_only and all(
        entry.placement is None and _time_invariant(entry.costs) for entry in call.entries
    ):
        return limit  # every plan takes 0 ns: a slowdown of the fastest one limits nothing
    if training.objective == "throughput" or slowdown_only:
        # only the last search spends the time left on configs that did not close
        last = training.objective == "throughput"
        limit.fastest = call.best(OBJECTIVE_TIME, budget_ns=limit.budget_ns, retry_open=last)
        limit.fastest_ns = _simulated_ns(call, limit.fastest)
        if training.objective == "memory" and training.min_throughput is None:
            limit.budget_ns = math.floor(training.max_slowdown * limit.fastest_ns)
            # a graph without FLOPs or times runs in 0 ns: no throughput to require
            limit.required = (
                training.global_batch * 1e9 / limit.budget_ns if limit.budget_ns else None
            )
    return limit


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


def _build_plan(
    call: _PlanningCall,
    choice: _Choice,
    result: SearchResult,
    limit: _ThroughputLimit,
    *,
    proven: bool,
    started: float,
) -> Plan:
    """The chosen split evaluated by the cost model, how it was found, its engine exports, and
    the usual splits of the same config for comparison."""
    placed = (
        {}
        if choice.entry.placement is None
        else {"group_costs": choice.entry.placement.group_costs, "group_of_stage": choice.groups}
    )
    evaluation = _evaluate_choice(call, choice)
    report = _solver_report(
        result, proven=proven, configs_total=len(call.entries), started=started, call=call
    )
    return Plan(
        evaluation=evaluation,
        solver=report,
        make_exports=functools.partial(_plan_exports, call.graph, call.training, evaluation),
        make_baselines=functools.partial(
            _baseline_evaluations,
            call.graph,
            choice.entry.costs,
            cluster=call.cluster,
            training=call.training,
            recomputed=choice.recomputed,
            placed=placed,
        ),
        required_throughput=limit.required,
        fastest_throughput=limit.fastest_throughput(call.training.global_batch),
        iteration_budget_ns=limit.budget_ns,
        fastest_iteration_ns=limit.fastest_ns,
    )


def _plan_exports(
    graph: LayerGraph, training: TrainingConfig, evaluation: Evaluation
) -> dict[str, Any]:
    """The engine exports of an evaluated plan (``Plan.exports``)."""
    return build_exports(
        graph,
        evaluation.config,
        evaluation.virtual_stage_layer_names(),
        recomputed=evaluation.virtual_stage_recomputed_names(),
        moe_capacity_factor=training.moe_capacity_factor,
    )


def _baseline_evaluations(
    graph: LayerGraph,
    costs: LayerCosts,
    *,
    cluster: Cluster,
    training: TrainingConfig,
    recomputed: list[bool] | None,
    placed: dict[str, Any],
) -> dict[str, Evaluation]:
    """The usual splits of the plan's config (``Plan.baselines``), like with like: the plan's
    config (ZeRO stage, recompute mode, schedule), and under selective recomputation the plan's
    recomputed layers (a flag per layer, so it applies to any split), and on a heterogeneous
    cluster the plan's stage groups."""
    return {
        name: evaluate_assignment(
            graph,
            costs,
            split_of(graph, costs.num_stages),
            cluster=cluster,
            training=training,
            recomputed=recomputed,
            **placed,
        )
        for name, split_of in BASELINES.items()
    }


def _solver_report(
    result: SearchResult,
    *,
    proven: bool,
    configs_total: int,
    started: float,
    call: _PlanningCall | None = None,
) -> SolverReport:
    """The report of the answer ``result``, with every search of ``call`` and notes that say
    why a plan is not proven: which search left configs open, and whether the time limit was
    reached or each open config stopped at its share of it."""
    searches = [] if call is None else _search_statuses(call)
    reached = any(s.time_limit_reached for s in searches) or (
        call is not None and call.deadline.expired()
    )
    report = SolverReport(
        backend=result.backend,
        status=OPTIMAL if proven else "FEASIBLE",
        objective=result.value,
        bound=result.bound,
        wall_s=time.perf_counter() - started,
        configs_total=configs_total,
        configs_solved=result.solved,
        configs_pruned=result.pruned,
        time_limit_reached=reached,
        searches=searches,
    )
    if not proven:
        report.notes.extend(_unproven_notes(call, result, searches, reached=reached))
    return report


SEARCH_NAMES = {OBJECTIVE_MEMORY: "smallest peak", OBJECTIVE_TIME: "fastest plan"}


def _search_statuses(call: _PlanningCall) -> list[SearchStatus]:
    """Each search of the call as reported: the last one is the answer; an earlier fastest-plan
    search set the --max-slowdown budget."""
    statuses = []
    for index, (objective, result) in enumerate(call.searches):
        last = index == len(call.searches) - 1
        statuses.append(
            SearchStatus(
                name=SEARCH_NAMES[objective],
                role="answer" if last else "max-slowdown budget",
                wall_s=result.wall_s,
                incumbent_s=result.incumbent_s,
                proven=result.proven,
                time_limit_reached=result.time_limit_reached,
                configs_open=result.open_configs,
                configs_with_incumbent=result.incumbents,
                configs_closed_by_incumbent=result.closed_by_incumbent,
            )
        )
    return statuses


QUICK_SPLITS = {*BASELINES, *(method.name for method in QUICK_METHODS)}
"""Names a solution of the incumbent pass carries as its backend (``solver.search.incumbents``)."""


def _unproven_notes(
    call: _PlanningCall | None,
    result: SearchResult,
    searches: list[SearchStatus],
    *,
    reached: bool,
) -> list[str]:
    """Why the plan is not proven: each unproven search, how many configs it left open, and
    whether the time limit was reached; the quick split the plan came from when no exact solve
    improved it."""
    if call is None or not searches:
        return ["time limit reached: best plan found, not proven optimal"]
    notes = []
    limit = "" if call.time_limit_s is None else f" ({call.time_limit_s:g} s)"
    for status in searches:
        if status.proven:
            continue
        if status.time_limit_reached:
            why = f"the time limit{limit} was reached"
        else:
            why = f"each stopped at its share of the time limit{limit}, which was not reached" + (
                "; the time left went to the next search" if status.role != "answer" else ""
            )
        opened = f"{status.configs_open} config{'s' * (status.configs_open != 1)} open"
        if status.role == "answer":
            lead = "time limit reached: " if status.time_limit_reached else ""
            notes.append(
                f"{lead}best plan found, not proven optimal: the {status.name} search left "
                f"{opened} ({why})"
            )
        else:
            slowdown = call.training.max_slowdown
            notes.append(
                f"the {status.name} search behind the --max-slowdown budget ({slowdown:g} x its "
                f"iteration time) left {opened} ({why}), so the budget itself is not proven: a "
                "faster plan may exist and set a tighter budget; the gap is that of the "
                f"{searches[-1].name} search under the budget found"
            )
    if reached and not any(s.time_limit_reached for s in searches) and not notes:
        notes.append("time limit reached: best plan found, not proven optimal")
    quick = result.solution is not None and result.solution.backend in QUICK_SPLITS
    if quick and not result.proven:  # in a proven search the quick split is an optimum
        notes.append(
            f"the best split found is the quick {result.solution.backend} split of its config "
            "(the incumbent pass): no exact solve improved it in time"
        )
    return notes


ADVICE_MIN_S = 2.0
"""The infeasibility explanation (its smallest-peak search and GPU count search) uses what is
left of the planning call's time limit, and at least this many seconds."""

QUICK_SEARCH_S = 10.0
"""At most this long for the smallest peak over all configs (the "needs X GiB" of the
message); the GPU count search gets the rest."""


def explain_infeasible(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    entries: list[ConfigEntry],
    backend: str,
    budget_ns: int | None,
    *,
    deadline: Deadline | None = None,
    suggest_gpus: bool = True,
) -> InfeasibleError:
    """Which constraint fails, by how much, and (``suggest_gpus``) the smallest GPU count that
    would fit, all within ``deadline`` (what is left of the planning call; at least
    :data:`ADVICE_MIN_S`; None: 60 s). A heterogeneous cluster gets no GPU count: its size is
    its node groups."""
    if cluster.is_heterogeneous:
        return _explain_heterogeneous(cluster, training, entries, budget_ns)
    usable = training.usable_bytes(cluster.gpu_memory_bytes)
    advice = _advice_deadline(deadline)
    quick = functools.partial(
        search,
        entries,
        iteration_budget_ns=None,
        backend=backend,
        deadline=Deadline(end=min(advice.end, time.perf_counter() + QUICK_SEARCH_S)),
    )
    unconstrained = quick(objective=OBJECTIVE_MEMORY, capacity_bytes=None)
    best_peak = (
        unconstrained.value
        if unconstrained.value is not None
        else min(e.memory_bound for e in entries)
    )
    throughput_unmet = best_peak <= usable and budget_ns is not None
    if throughput_unmet:
        fastest = quick(objective=OBJECTIVE_TIME, capacity_bytes=usable)
    counts = (
        smallest_fitting_gpus(graph, cluster, training, backend, deadline=advice)
        if suggest_gpus
        else None
    )
    if throughput_unmet:
        reached_ns = (
            None
            if fastest.value is None
            else _evaluate(graph, cluster, training, _result_choice(fastest)).iteration_ns or None
        )
        return _throughput_unmet(
            cluster, training, fastest, reached_ns, budget_ns, counts, best_peak=best_peak
        )
    return _memory_exceeded(cluster, training, entries, unconstrained, counts, best_peak)


def _advice_deadline(deadline: Deadline | None) -> Deadline:
    if deadline is None:
        return Deadline.after(60.0)
    return Deadline(end=max(deadline.end, time.perf_counter() + ADVICE_MIN_S))


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


def smallest_fitting_gpus(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    backend: str,
    *,
    deadline: Deadline,
) -> GpuCountAdvice:
    """The smallest GPU count on which :func:`plan` finds a plan for ``training`` (memory,
    throughput constraint and pins as given): the search of ``solver.sweep.min_gpus`` with
    ``--gpus auto`` (:func:`solver.search.gpu_counts.smallest_fitting_count`), every count planned
    with this call's searches under the shared ``deadline``; ``cluster``'s own count is known
    not to fit. It stops (``search.complete`` False) when the deadline passes."""
    started = time.perf_counter()
    counts = valid_gpu_counts(graph.num_layers, cluster, training)
    smallest: dict[int, _Probe] = {}  # the smallest count found to fit, and how

    def fits(count: int) -> bool | None:
        probe = _probe(
            graph, dataclasses.replace(cluster, num_gpus=count), training, backend, deadline
        )
        if isinstance(probe, _Probe):
            if not smallest or count < min(smallest):
                smallest.clear()
                smallest[count] = probe
            return True
        return probe

    found = smallest_fitting_count(
        counts,
        fits,
        may_fit=lambda n: memory_may_fit(graph, cluster, training, n),
        deadline=deadline,
        known={cluster.num_gpus: False},
    )
    label = None
    if found.gpus is not None:
        call, result, limit = smallest[found.gpus]
        choice, _ = _break_ties(call, result, budget_ns=limit.budget_ns)
        label = choice.entry.costs.config.label()
    return GpuCountAdvice(
        search=found, counts=counts, label=label, wall_s=time.perf_counter() - started
    )


class _Probe(NamedTuple):
    """A count on which the searches of :func:`plan` found a plan."""

    call: _PlanningCall
    result: SearchResult
    limit: _ThroughputLimit


def _probe(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    backend: str,
    deadline: Deadline,
) -> _Probe | bool | None:
    """Whether :func:`plan` finds a plan on ``cluster`` (a :class:`_Probe`), proves there is
    none (False) or runs out of time first (None); its searches only, no tie-break, no
    explanation."""
    try:
        call = _PlanningCall(
            graph=graph,
            cluster=cluster,
            training=training,
            entries=build_entries(graph, cluster, training, deadline=deadline),
            backend=backend,
            deadline=deadline,
            num_workers=1,
            time_limit_s=None,
            explain=False,
        )
        limit = _throughput_limit(call)
        result = (
            call.best(OBJECTIVE_MEMORY, budget_ns=limit.budget_ns, retry_open=False)
            if training.objective == "memory"
            else limit.fastest
        )
    except NoSolutionError:
        return None
    except (InfeasibleError, InputError):
        return False
    return _Probe(call, result, limit)
