"""The planning API: graph + cluster + training options -> the memory-optimal :class:`Plan`.

Here: :func:`plan`, the throughput budget and its re-search loop, and the infeasibility
explanation with its GPU count probes (a planning call explains itself by planning other counts,
so they share this module). Beside it: ``plan_result`` (the :class:`Plan`), ``ties`` (the
tie-break on the secondary objective), ``plan_notes`` (the solver report and its notes),
``infeasible`` (the messages of an infeasible call).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, OPTIMAL, StageSolution
from solver.costs.moe import num_routed_experts
from solver.costs.schedule_time import MAX_SCHEDULE_ACTIONS
from solver.engine_rules import ModelFacts, degrees_of
from solver.errors import InfeasibleError, InputError, NoSolutionError, PlannerError
from solver.evaluation import Evaluation, evaluate_assignment, prepare_training
from solver.graph import LayerGraph
from solver.parallel import check_searched
from solver.search.best_baselines import best_baselines
from solver.search.candidates import candidate_configs, selective_fallback
from solver.search.config_search import (
    ConfigEntry,
    Deadline,
    Progress,
    SearchResult,
    bound_entries,
    build_entries,
    search,
)
from solver.search.finishing import check_time_to_finish, finishing_seconds
from solver.search.gpu_counts import (
    GpuCountAdvice,
    memory_may_fit,
    smallest_fitting_count,
    valid_gpu_counts,
)
from solver.search.infeasible import (
    _explain_heterogeneous,
    _memory_exceeded,
    _throughput_unmet,
)
from solver.search.plan_notes import _solver_report, split_schedule_notes, unbounded_note
from solver.search.plan_result import Plan, _baseline_evaluations, _plan_exports
from solver.search.rule_checks import skipped_rules_note
from solver.search.seeds import Seed, baseline_seeds, seed_note
from solver.search.ties import _break_ties, _Choice, _matching_stages, _time_invariant
from solver.specs import Cluster, TrainingConfig
from solver.units import format_bytes

log = logging.getLogger(__name__)


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

    ``training.recompute`` "auto" searches no and full recomputation first (the exact
    chain/DAG algorithms), and per-layer selective recomputation (CP-SAT/MILP) only when neither
    fits, in at most ``SELECTIVE_SHARE`` of the time left; the plan then says so in a note.

    Raises InputError for bad options, InfeasibleError when nothing fits: which constraint, the
    smallest peak found and, with ``suggest_gpus``, the smallest GPU count that fits (the
    search of ``solver.sweep.min_gpus`` with ``--gpus auto``, in what is left of the time limit:
    :func:`smallest_fitting_gpus`). A sweep passes ``suggest_gpus=False``: it searches the
    counts itself. NoSolutionError when the time runs out before any plan is found.
    """
    started = time.perf_counter()
    deadline = Deadline.after(time_limit_s) if deadline is None else deadline
    check_searched(training.schedule)
    training = prepare_training(graph, cluster, training)
    call = functools.partial(
        _plan_space,
        graph,
        cluster,
        training,
        backend=backend,
        time_limit_s=time_limit_s,
        num_workers=num_workers,
        deadline=deadline,
        progress=progress,
        suggest_gpus=suggest_gpus,
        started=started,
    )
    selective = selective_fallback(training)
    if selective is None:
        return call(training)
    try:  # --recompute auto: none and full first, by the exact algorithms
        return call(training, explain=False)
    except InfeasibleError:
        pass
    share = Deadline(end=time.perf_counter() + SELECTIVE_SHARE * deadline.remaining())
    try:
        result = call(selective, explain=False, deadline=share)
    except InfeasibleError:
        searched = "with no, full or per-layer selective recomputation"
    except NoSolutionError:
        searched = (
            "with no or full recomputation (per-layer selective found no plan in its share of "
            "the time limit)"
        )
    else:
        result.solver.notes.insert(0, SELECTIVE_NOTE)
        return result
    try:  # explained by the exact search without it, and its GPU count
        return call(training)
    except InfeasibleError as error:
        raise InfeasibleError(
            f"{searched}: {error}",
            best_peak_bytes=error.best_peak_bytes,
            capacity_bytes=error.capacity_bytes,
            suggested_gpus=error.suggested_gpus,
        ) from None


SELECTIVE_NOTE = (
    "no config fits with no or full recomputation: per-layer selective recomputation was "
    "searched (--recompute auto)"
)
"""The plan's note when ``--recompute auto`` fell back to selective recomputation."""
SELECTIVE_SHARE = 0.5
"""The most of the time left the selective fallback of ``--recompute auto`` takes; the rest is
the explanation's when it fits nothing (its smallest peak and GPU count are those with no or
full recomputation: exact and fast)."""


def _plan_space(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    space: TrainingConfig,
    *,
    backend: str,
    time_limit_s: float | None,
    num_workers: int,
    deadline: Deadline,
    progress: Progress | None,
    suggest_gpus: bool,
    started: float,
    explain: bool = True,
) -> Plan:
    """:func:`plan` over the candidate configs of ``space`` (``training``, or its selective
    fallback); ``explain`` False: an InfeasibleError without the explanation (quick)."""
    entries, unbounded = bound_entries(graph, cluster, space, deadline=deadline)
    # the searches stop early enough for the evaluations, report and exports after them
    finishing_s = finishing_seconds(graph, cluster, training, entries)
    if finishing_s:
        stages = max(entry.costs.num_stages for entry in entries)
        check_time_to_finish(finishing_s, deadline.remaining(), stages)
        deadline = Deadline(end=deadline.end - finishing_s)
    call = _PlanningCall(
        graph=graph,
        cluster=cluster,
        training=training,
        entries=entries,
        backend=backend,
        deadline=deadline,
        num_workers=num_workers,
        time_limit_s=time_limit_s,
        progress=progress,
        suggest_gpus=suggest_gpus,
        explain=explain,
    )
    limit = _throughput_limit(call)
    if training.objective == "memory":
        result, choice, notes = _within_budget(call, limit)
    else:
        result = limit.fastest
        choice, notes = _fastest_choice(call, limit, limit.budget_ns)
    # a throughput budget taken from an unproven fastest plan is not proven either
    proven = result.proven and (limit.fastest is None or limit.fastest.proven) and not unbounded
    plan = _build_plan(call, choice, result, limit, proven=proven, started=started)
    if unbounded:  # nothing bounds the configs not reached
        plan.solver.bound = 0.0
        plan.solver.notes.append(unbounded_note(unbounded, len(entries) + len(unbounded)))
    if limit.seed is not None:
        notes.insert(0, seed_note(limit.seed, limit.searched_ns))
    plan.solver.notes += notes + _long_schedule_notes(graph, cluster, training)
    plan.solver.notes += split_schedule_notes(plan.config.schedule)
    plan.solver.notes += skipped_rules_note(
        degrees_of(plan.config), ModelFacts.of_graph(graph), training.runtime
    )
    return plan


def _long_schedule_notes(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig
) -> list[str]:
    """A note when configs were left out of the search for their schedules' length
    (``candidates.candidate_configs``)."""
    long = candidate_configs(
        graph.num_layers,
        cluster,
        training,
        num_experts=num_routed_experts(graph),
        long_schedules=True,
        facts=ModelFacts.of_graph(graph),
    )
    if not long:
        return []
    return [
        f"{len(long)} candidate config{'s' * (len(long) > 1)} not searched (e.g. "
        f"{long[-1].label()}): their schedules have more than {MAX_SCHEDULE_ACTIONS} forwards "
        "and backwards to simulate; pin --pp, or give a larger --micro-batch, to plan them"
    ]


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
    try:
        first = result = call.best(
            OBJECTIVE_MEMORY, budget_ns=budget, retry_open=True, quiet=limit.seed is not None
        )
    except InfeasibleError:
        if limit.seed is None:
            raise
        # only the seed (a baseline layout) is that fast: it is the last resort
        result, choice = _fastest_within(call, limit, budget)
        return result, choice, []
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
                found = call.best(
                    OBJECTIVE_MEMORY, budget_ns=search_budget, retry_open=True, quiet=True
                )
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
        _take_seed(call, limit, call.deadline)
    if limit.fastest_ns > budget:
        raise call.throughput_unmet(budget)
    choice, _ = _fastest_choice(call, limit, budget)
    return limit.fastest, choice


def _fastest_choice(
    call: _PlanningCall, limit: _ThroughputLimit, budget: int | None
) -> tuple[_Choice, list[str]]:
    """The fastest plan's split: a seed's own layout (a baseline's recomputed blocks, kept as
    they are), else the search's, tie-broken on the peak."""
    if limit.seed is not None:
        return limit.seed.choice, []
    return _break_ties(call, limit.fastest, budget_ns=budget)


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
    seeded: bool = True
    """Baseline layouts seed the fastest plan (``solver.search.seeds``); False for the probes,
    which ask only whether anything fits."""
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

    def seeds(self, faster_than_ns: int, deadline: Deadline) -> list[Seed]:
        """The baseline layouts faster than ``faster_than_ns`` may be, fastest first
        (``solver.search.seeds``), found by ``deadline``."""
        if not self.seeded or self.cluster.is_heterogeneous:
            return []
        return baseline_seeds(
            self.graph,
            self.cluster,
            self.training,
            entries=self.entries,
            faster_than_ns=faster_than_ns,
            deadline=deadline,
        )

    def best(
        self,
        objective: str,
        *,
        budget_ns: int | None,
        retry_open: bool,
        quiet: bool = False,
        deadline: Deadline | None = None,
    ) -> SearchResult:
        """The best config for ``objective`` within the capacity and the iteration budget, by
        ``deadline`` (default: the call's); raises why there is none (NoSolutionError or
        InfeasibleError; ``quiet``: without the explanation, for a caller that has another
        answer)."""
        result = search(
            self.entries,
            objective=objective,
            capacity_bytes=self.capacity_bytes,
            iteration_budget_ns=budget_ns,
            backend=self.backend,
            deadline=self.deadline if deadline is None else deadline,
            num_workers=self.num_workers,
            retry_open=retry_open,
            progress=self.progress,
        )
        self.searches.append((objective, result))
        if result.entry is None:
            raise self._no_plan(result, budget_ns, quiet=quiet)
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

    def _no_plan(
        self, result: SearchResult, budget_ns: int | None, *, quiet: bool = False
    ) -> PlannerError:
        """NoSolutionError when the time ran out first, else the infeasibility explanation."""
        if not result.proven:
            return NoSolutionError(
                f"time limit ({self.time_limit_s} s) reached before any plan was found "
                f"({result.solved} of {len(self.entries)} configs solved; no quick split tried "
                "fits the limits); raise --time-limit"
            )
        if not self.explain or quiet:
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
    seed: Seed | None = None
    """The baseline layout that is the fastest plan, when one beat the search's
    (``_take_seed``)."""
    searched_ns: int | None = None
    """With a seed: the search's fastest simulated iteration, ns."""

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


BUDGET_SEARCH_SHARE = 0.5
"""The most of the time left that the fastest-plan search behind a --max-slowdown budget takes;
the rest is the smallest-peak search's (``--schedule auto`` on Llama-2 x 64 at 30 s spent it
all on the budget and returned a peak a third above 1F1B's alone under the same budget)."""


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
        # only the last search spends the time left on configs that did not close; a budget
        # search leaves the answer's search its share of the time
        last = training.objective == "throughput"
        share = 1.0 if last else BUDGET_SEARCH_SHARE
        deadline = call.deadline.capped(share * call.deadline.remaining())
        limit.fastest = call.best(
            OBJECTIVE_TIME, budget_ns=limit.budget_ns, retry_open=last, deadline=deadline
        )
        limit.fastest_ns = _simulated_ns(call, limit.fastest)
        _take_seed(call, limit, deadline)
        if training.objective == "memory" and training.min_throughput is None:
            limit.budget_ns = math.floor(training.max_slowdown * limit.fastest_ns)
            # a graph without FLOPs or times runs in 0 ns: no throughput to require
            limit.required = (
                training.global_batch * 1e9 / limit.budget_ns if limit.budget_ns else None
            )
    return limit


def _take_seed(call: _PlanningCall, limit: _ThroughputLimit, deadline: Deadline) -> None:
    """The fastest seed (``solver.search.seeds``, found by ``deadline``) becomes the fastest
    plan when its simulated iteration is shorter than the search's and meets the budget: a
    search result of its own config and split, the search's proof (the seeds are evaluated
    exactly) and bound kept."""
    seeds = call.seeds(limit.fastest_ns, deadline)
    if not seeds:
        return
    seed = seeds[0]
    seed_ns = seed.evaluation.iteration_ns
    if seed_ns >= limit.fastest_ns or (limit.budget_ns is not None and seed_ns > limit.budget_ns):
        return
    entry, split, recomputed = seed.choice.entry, seed.choice.split, seed.choice.recomputed
    objective = seed.evaluation.iteration_bound_ns
    solution = StageSolution(
        status=OPTIMAL,
        stage_of_layer=split,
        objective=objective,
        bound=objective,
        wall_s=0.0,
        backend="baseline",
        recomputed=recomputed,
    )
    call.evaluations[(entry.order, tuple(split), tuple(recomputed), None)] = seed.evaluation
    limit.fastest = dataclasses.replace(
        limit.fastest,
        entry=entry,
        solution=solution,
        ties=[(entry, solution)],
        bound=min(limit.fastest.bound, objective),
    )
    limit.searched_ns, limit.fastest_ns, limit.seed = limit.fastest_ns, seed_ns, seed


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
    baselines = functools.partial(
        _baseline_evaluations,
        call.graph,
        choice.entry.costs,
        cluster=call.cluster,
        training=call.training,
        recomputed=choice.recomputed,
        placed=placed,
    )
    if call.deadline.expired():  # each is a full evaluation: seconds on 10^4 stages or 10^6 layers
        baselines = dict
        report.notes.append(
            "time limit reached before the baseline splits (even, parameters) were evaluated: "
            "none shown"
        )
    return Plan(
        evaluation=evaluation,
        solver=report,
        make_exports=functools.partial(
            _plan_exports, call.graph, call.training, evaluation, choice.entry.costs, placed
        ),
        make_baselines=baselines,
        make_best_baselines=functools.partial(
            best_baselines, call.graph, call.cluster, call.training, deadline=call.deadline
        ),
        required_throughput=limit.required,
        fastest_throughput=limit.fastest_throughput(call.training.global_batch),
        iteration_budget_ns=limit.budget_ns,
        fastest_iteration_ns=limit.fastest_ns,
    )


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
            seeded=False,
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
