"""Config search: enumerate configs, bound them, solve the promising ones exactly, pick the best.

For the memory objective the answer is the minimum over configs of the exact per-config optimum
(minimal largest stage peak), subject to GPU capacity and the throughput constraint; ties go to
the higher throughput (each tied config is re-solved for the fastest split at that peak), then to
the earlier config in candidate order. Configs are visited in order of their lower bound and
skipped once the bound exceeds the incumbent, so the result is still proven optimal.

On a heterogeneous cluster each entry carries a
:class:`solver.backends.problem.Placement` (its coefficients
on every node group); "memory" is then the largest utilization (ppm) or the largest peak (bytes),
as ``TrainingConfig.memory_objective`` says, and the bounds are in that unit. Such a problem
builds its own complete start
(``solver.backends.placement_start``), selective recomputation included.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from solver.backends import resolve_backend, solve
from solver.backends.dag import dag_fits_graph
from solver.backends.formulation import (
    MAX_FORMULATION_CELLS,
    MAX_FORMULATION_LAYERS,
    formulation_fits,
    formulation_size_text,
)
from solver.backends.problem import (
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OPTIMAL,
    UTILIZATION,
    Placement,
    StageProblem,
    StageSolution,
)
from solver.costs import LayerCosts, layer_costs, utilization_ppm
from solver.costs.moe import num_routed_experts
from solver.deadline import Deadline
from solver.engine_rules import ModelFacts
from solver.errors import InputError, NoSolutionError
from solver.graph import LayerGraph
from solver.report.baselines import BASELINES
from solver.search.candidates import (
    candidate_configs,
    memory_lower_bound,
    stages_per_group,
    time_lower_bound,
)
from solver.search.incumbents import incumbent
from solver.parallel import ZERO_BUBBLE_SCHEDULES
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from solver.units import format_bytes

log = logging.getLogger(__name__)

INCUMBENT_SHARE = 0.2
"""At most this fraction of the time left goes to the timed quick methods of the incumbent pass
(``solver.search.incumbents.QUICK_METHODS``), shared equally by the configs still to seed."""


@dataclass(kw_only=True)
class ConfigEntry:
    """A candidate config with its coefficients and lower bounds."""

    order: int
    """Position in candidate order (final tie-break)."""
    costs: LayerCosts
    memory_bound: int
    """No split of this config has a smaller memory objective (bytes, or ppm for utilization)."""
    time_bound: int
    """No split of this config has a shorter iteration (ns)."""
    placement: Placement | None = None
    """Node groups (heterogeneous clusters only)."""
    peak_bound_bytes: int | None = None
    """No split has a smaller largest peak (bytes); None: memory_bound is that bound."""
    start: list[int] | None = None
    """A split the solver starts from (interleaved configs: Megatron's even split of the
    virtual stages), or None."""
    splits: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """The baseline splits of the config's (virtual) stages by name (``baselines.BASELINES``):
    candidates of the incumbent pass (``solver.search.incumbents``)."""

    @property
    def peak_lower_bound(self) -> int:
        return self.memory_bound if self.peak_bound_bytes is None else self.peak_bound_bytes


@dataclass(kw_only=True)
class SearchResult:
    """Best (entry, solution) of one search over configs, with proof status."""

    entry: ConfigEntry | None
    solution: StageSolution | None
    ties: list[tuple[ConfigEntry, StageSolution]]
    """Every solved config whose optimum equals the best one (best first)."""
    bound: int
    """Proven lower bound on the objective over all configs."""
    proven: bool
    """True when every config was solved to optimality, proven infeasible, or pruned."""
    solved: int
    pruned: int
    backend: str
    incumbents: int = 0
    """Configs the incumbent pass gave a feasible split (``solver.search.incumbents``)."""
    closed_by_incumbent: int = 0
    """Of those, configs whose quick split met their lower bound: optimal, no exact solve."""
    incumbent_s: float = 0.0
    """Wall time of the incumbent pass (s)."""
    wall_s: float = 0.0
    """Wall time of the whole search (s)."""
    open_configs: int = 0
    """Configs left open with a bound below the best value: why ``proven`` is False."""
    time_limit_reached: bool = False
    """The planning call's deadline passed during this search (else every open config stopped
    at its share of the time, :meth:`_Search._solve_config`)."""

    @property
    def value(self) -> int | None:
        return None if self.solution is None else self.solution.objective


Progress = Callable[[str, int, int, str], None]
"""``progress(step, visited, total, best)``: a search ``step`` (e.g. "smallest peak") has
visited ``visited`` of its ``total`` configs; ``best`` describes the incumbent ("" for none).
Called after every config solved, for a display (``solver.cli.progress.SearchProgress``)."""


def build_entries(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    deadline: Deadline | None = None,
) -> list[ConfigEntry]:
    """Every candidate config with its coefficients and bounds; NoSolutionError when the
    ``deadline`` passes first."""
    return bound_entries(graph, cluster, training, deadline=deadline, partial=False)[0]


SPLIT_BOUNDING_SHARE = 0.5
"""Of the time left once the other configs are bounded, the share that bounding the
split-backward schedules' configs may take (each replays its action lists to find its moments:
seconds on a 96-layer model; ``--schedule auto`` on GPT-3 x 128 spent all of a 30 s limit
there and found no plan, where 1F1B alone is proven in a second): the rest is the search's."""


def bound_entries(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    deadline: Deadline | None = None,
    partial: bool = True,
) -> tuple[list[ConfigEntry], list[ParallelConfig]]:
    """(the candidate configs with their coefficients and bounds, in candidate order; the
    configs left unbounded). The split-backward schedules' configs are bounded last, within
    :data:`SPLIT_BOUNDING_SHARE` of the time left then. With ``partial`` a deadline that passes
    once some config is bounded leaves the rest unbounded (neither bounded nor searched: the
    plan is then not proven); NoSolutionError when none is, or without ``partial``."""
    entries: list[ConfigEntry] = []
    splits_of = _BaselineSplits(graph)
    configs = candidate_configs(
        graph.num_layers,
        cluster,
        training,
        num_experts=num_routed_experts(graph),
        facts=ModelFacts.of_graph(graph),
    )
    visit = sorted(range(len(configs)), key=lambda i: configs[i].schedule in ZERO_BUBBLE_SCHEDULES)
    split_stop, split_phase = math.inf, False
    for done, order in enumerate(visit):
        config = configs[order]
        if partial and deadline is not None and not split_phase and config.schedule in (
            ZERO_BUBBLE_SCHEDULES
        ):
            split_phase = True  # the others are bounded: the split-backward ones get a share
            left = deadline.remaining()  # inf without a time limit
            split_stop = left if left == math.inf else time.perf_counter() + (
                SPLIT_BOUNDING_SHARE * left
            )
        if (deadline is not None and deadline.expired()) or time.perf_counter() > split_stop:
            if partial and entries:
                unbounded = [configs[i] for i in visit[done:]]
                return sorted(entries, key=lambda e: e.order), unbounded
            raise NoSolutionError(
                f"time limit reached while bounding the candidate configs ({done} of "
                f"{len(configs)}); raise --time-limit, or pin --pp/--tp/--dp"
            )
        entries.append(_config_entry(order, graph, config, cluster, training, splits_of))
    return sorted(entries, key=lambda e: e.order), []


def _config_entry(order, graph, config, cluster, training, splits_of) -> ConfigEntry:
    """One candidate config's entry: its coefficients, bounds and baseline splits."""
    if cluster.is_heterogeneous:
        entry = _placed_entry(order, graph, config, cluster, training)
        entry.splits = splits_of(entry.costs.num_stages)
        return entry
    costs = layer_costs(graph, config, cluster, training)
    splits = splits_of(costs.num_stages)
    return ConfigEntry(
        order=order,
        costs=costs,
        memory_bound=memory_lower_bound(costs),
        time_bound=time_lower_bound(costs),
        start=splits["even"] if costs.rank_rows else None,
        splits=splits,
    )


class _BaselineSplits:
    """``baselines.BASELINES`` of a graph by stage count, each computed once (many configs
    share a pipeline depth)."""

    def __init__(self, graph: LayerGraph) -> None:
        self.graph = graph
        self.cache: dict[int, dict[str, list[int]]] = {}

    def __call__(self, num_stages: int) -> dict[str, list[int]]:
        if num_stages not in self.cache:
            self.cache[num_stages] = (
                {name: split(self.graph, num_stages) for name, split in BASELINES.items()}
                if num_stages <= self.graph.num_layers
                else {}
            )
        return self.cache[num_stages]


def _placed_entry(order, graph, config, cluster, training) -> ConfigEntry:
    """An entry of a heterogeneous cluster: coefficients on every group, bounds over groups (a
    layer's time on its fastest group; utilization at the largest capacity)."""
    group_costs = [
        layer_costs(graph, config, cluster.group_cluster(k), training)
        for k in range(len(cluster.groups))
    ]
    placement = Placement(
        group_costs=group_costs,
        capacity_bytes=[training.usable_bytes(g.gpu_memory_bytes) for g in cluster.groups],
        stages_per_group=stages_per_group(cluster, config),
        names=[g.name for g in cluster.groups],
        memory_objective=training.memory_objective,
    )
    fastest = dataclasses.replace(
        group_costs[0],
        time_ns=np.min([c.time_ns for c in group_costs], axis=0),
        dp_sync_ns=np.min([c.dp_sync_ns for c in group_costs], axis=0),
    )
    peak = memory_lower_bound(group_costs[0])
    return ConfigEntry(
        order=order,
        costs=group_costs[0],
        memory_bound=(
            utilization_ppm(peak, max(placement.capacity_bytes))
            if placement.memory_objective == UTILIZATION
            else peak
        ),
        time_bound=time_lower_bound(fastest),
        placement=placement,
        peak_bound_bytes=peak,
    )


def search(
    entries: list[ConfigEntry],
    *,
    objective: str,
    capacity_bytes: int | None,
    iteration_budget_ns: int | None,
    backend: str,
    deadline: Deadline,
    num_workers: int = 1,
    utilization_limit_ppm: int | None = None,
    retry_open: bool = False,
    progress: Progress | None = None,
) -> SearchResult:
    """Exact best config for ``objective`` (memory or time) under the limits (the utilization
    limit applies to heterogeneous entries only). With ``retry_open`` the time left once every
    config was visited goes to the time-shared configs that did not close
    (:meth:`_Search.retry_open`): for the last search of a planning call, which may use the
    whole deadline. ``progress`` hears of every config solved.

    Before any exact solve every config that may hold the optimum gets an incumbent from quick
    methods (:meth:`_Search.seed_incumbents`): the search returns the best of them when the time
    runs out before an exact solve finds better."""
    state = _Search(
        entries,
        objective=objective,
        capacity_bytes=capacity_bytes,
        iteration_budget_ns=iteration_budget_ns,
        backend=backend,
        deadline=deadline,
        num_workers=num_workers,
        utilization_limit_ppm=utilization_limit_ppm,
        progress=progress,
    )
    state.seed_incumbents()
    state.visit_in_bound_order()
    if retry_open:
        state.retry_open()
    return state.result()


CUT_OFF_S = 0.5
"""Seconds past the deadline the cut-off seeding (``_Search._seed_cut_off``) goes on once a
plan stands (each baseline split is a full evaluation: 0.1-1 s on 10^4-10^6 layers)."""
NO_PLAN_GRACE_SHARE = 0.1
"""While no plan stands, the quick splits go on past the deadline for this share of the
search's own time (at least :data:`CUT_OFF_S`), so that a plan is found where one is quick to
find (issue 17: a large DAG at a short limit); then the search ends with none. Without the cap a
split-backward search with no split under the capacity overran a 30 s limit by 50 s."""
DP_BACKENDS = ("chain", "dag")
"""Backends that solve a config exactly in milliseconds (the dynamic programs over a chain's
intervals and a DAG's ideals): their configs skip the quick splits of the incumbent pass."""


class _Search:
    """The state of one :func:`search`: the configs to visit (lowest bound first), the best
    solution found for each, the lower bounds of the configs not proven yet, and the solves
    that were given a share of the time (which :meth:`retry_open` may resume)."""

    def __init__(
        self,
        entries: list[ConfigEntry],
        *,
        objective: str,
        capacity_bytes: int | None,
        iteration_budget_ns: int | None,
        backend: str,
        deadline: Deadline,
        num_workers: int,
        utilization_limit_ppm: int | None,
        progress: Progress | None = None,
    ) -> None:
        self.objective = objective
        self.progress = progress
        self.capacity_bytes = capacity_bytes
        self.iteration_budget_ns = iteration_budget_ns
        self.deadline = deadline
        self.num_workers = num_workers
        self.utilization_limit_ppm = utilization_limit_ppm
        self.chain = bool(entries) and entries[0].costs.is_chain()
        self.placed = bool(entries) and entries[0].placement is not None
        self.requested_backend = backend
        # auto: the exact DP over ideals applies to this graph (config-independent)
        self.dag_fits = (
            bool(entries)
            and backend == "auto"
            and not (self.chain or self.placed)
            and dag_fits_graph(entries[0].costs)
        )
        self.backend = resolve_backend(
            backend,
            self.chain,
            heterogeneous=self.placed,
            selective=any(e.costs.selective for e in entries),
            interleaved=any(e.costs.rank_rows for e in entries),
            dag_fits=self.dag_fits,
        )
        if backend in ("cpsat", "milp"):
            _check_model_sizes(backend, entries, chain=self.chain)
        self.viable = [e for e in entries if self._within_limits(e)]
        self.viable.sort(key=lambda e: (self.bound_of(e), e.order))
        self.pruned = len(entries) - len(self.viable)
        self.solved = 0
        self.results: dict[int, tuple[ConfigEntry, StageSolution]] = {}  # by entry order
        self.open_bounds: dict[int, int] = {}  # entry order -> lower bound of a config not proven
        self.shared: list[tuple[ConfigEntry, StageProblem]] = []  # solves given a share of time
        self.closed: set[int] = set()  # entry orders whose incumbent meets their bound
        self.visited: set[int] = set()  # entry orders solved exactly by the incumbent pass
        self.incumbents = 0
        self.incumbent_s = 0.0
        self.started = time.perf_counter()
        self.time_limit_reached = False
        # while no plan stands, the quick splits go on until then (``NO_PLAN_GRACE_SHARE``)
        self.no_plan_end = max(deadline.end, self.started) + max(
            CUT_OFF_S, NO_PLAN_GRACE_SHARE * (deadline.end - self.started)
        )

    def bound_of(self, entry: ConfigEntry) -> int:
        """The entry's lower bound on the objective searched."""
        return entry.memory_bound if self.objective == OBJECTIVE_MEMORY else entry.time_bound

    def _within_limits(self, entry: ConfigEntry) -> bool:
        """False when the entry's bounds already break a limit: it is pruned unsolved."""
        return (
            (self.capacity_bytes is None or entry.peak_lower_bound <= self.capacity_bytes)
            and (self.iteration_budget_ns is None or entry.time_bound <= self.iteration_budget_ns)
            and (
                entry.placement is None
                or entry.peak_lower_bound <= max(entry.placement.capacity_bytes)
            )
        )

    def backend_of(self, entry: ConfigEntry) -> str:
        """'auto' per config: the chain algorithm stays with the plain configs of a chain even
        when interleaved ones are searched too."""
        return resolve_backend(
            self.requested_backend,
            self.chain,
            heterogeneous=self.placed,
            selective=entry.costs.selective,
            interleaved=entry.costs.rank_rows,
            dag_fits=self.dag_fits,
        )

    def incumbent(self) -> int | None:
        """The best objective found so far (None: no solution yet)."""
        return min((solution.objective for _, solution in self.results.values()), default=None)

    def _report(self, visited: int) -> None:
        """Tell ``progress`` how far the search is, with the incumbent in words."""
        if self.progress is None:
            return
        best, entry = self.incumbent(), None
        if best is not None:
            entry = min(
                (e for e, solution in self.results.values() if solution.objective == best),
                key=lambda e: e.order,
            )
        if best is None:
            text = ""
        elif self.objective != OBJECTIVE_MEMORY:
            text = f"{best / 1e6:.4g} ms/iteration"
        elif self.placed and entry.placement.memory_objective == UTILIZATION:
            text = f"utilization {best / 1e4:.2f}%"
        else:
            text = f"peak {format_bytes(best)}"
        if entry is not None:
            text += f" ({entry.costs.config.label()})"
        step = "fastest plan" if self.objective != OBJECTIVE_MEMORY else "smallest peak"
        self.progress(step, visited, len(self.viable), text)

    def record(self, entry: ConfigEntry, solution: StageSolution, *, retry: bool = False) -> None:
        """Keep the entry's best solution; it stays open, at its best bound, unless proven."""
        self.solved += not retry
        earlier = self.open_bounds.pop(entry.order, self.bound_of(entry))
        if solution.status not in (OPTIMAL, INFEASIBLE):
            self.open_bounds[entry.order] = max(solution.bound, earlier)
        previous = self.results.get(entry.order)
        if solution.has_solution and (
            previous is None or solution.objective < previous[1].objective
        ):
            self.results[entry.order] = (entry, solution)

    def seed_incumbents(self) -> None:
        """Give every config that may hold the optimum (lowest bound first, until a bound
        exceeds the best incumbent) and that CP-SAT or MILP would solve the best split of the
        quick methods of ``solver.search.incumbents`` within the capacity and the iteration budget.
        A config whose split meets its bound is closed (optimal) with no exact solve. The pass
        takes :data:`INCUMBENT_SHARE` of the time left, shared by the timed methods, and goes
        on past it only while no plan stands (the baseline splits are a few cost-model
        evaluations per config, so a plan exists even when the deadline has passed). The
        configs of the dynamic programs (:data:`DP_BACKENDS`) are exact in milliseconds and
        need no start: alone, they are seeded only when the deadline cuts them off
        (:meth:`_seed_cut_off`); next to CP-SAT configs (an interleaved search keeps the plain
        configs of a chain on the chain algorithm) they are solved here, exactly, so that their
        optima prune the CP-SAT configs and stand if those take all the time."""
        started = time.perf_counter()
        end = started + INCUMBENT_SHARE * self.deadline.remaining()
        chain = {e.order for e in self.viable if self.backend_of(e) in DP_BACKENDS}
        if len(chain) == len(self.viable):
            return
        to_seed, exact_s = len(self.viable) - len(chain), 0.0
        # the exact ones first, all of them the bounds allow: milliseconds each, and a search
        # that runs out of time then still holds their optimum (``--schedule auto`` lost the
        # 1F1B optimum to the CP-SAT configs' seeds at a 30 s limit)
        for index, entry in enumerate(self.viable):
            best_value = self.incumbent()
            if best_value is not None and self.bound_of(entry) > best_value:
                break
            if entry.order in chain and self._may_go_on(self.deadline.end):
                solving = time.perf_counter()
                self._solve_config(entry, still_to_visit=len(self.viable) - index)
                self.visited.add(entry.order)
                self._report(len(self.visited))
                exact_s += time.perf_counter() - solving
        for entry in self.viable:
            best_value = self.incumbent()
            if best_value is not None and self.bound_of(entry) > best_value:
                break
            if entry.order in chain:
                continue
            if not self._may_go_on(end):
                break  # the rest are visited in bound order, or stay open at their bounds
            self._seed(entry, max(0.0, end - time.perf_counter()) / max(to_seed, 1))
            to_seed -= 1
        self.incumbent_s = time.perf_counter() - started - exact_s  # the quick splits only

    def _may_go_on(self, end: float) -> bool:
        """Whether the incumbent pass goes on: until ``end`` (a ``time.perf_counter()`` value),
        or while no plan stands until ``no_plan_end`` (a split-backward config's baseline splits
        took a second each on a 96-layer model: with hundreds of configs, a pass that kept
        seeding past the deadline overran a 30 s limit by 25 s)."""
        now = time.perf_counter()
        return now < end or (self.incumbent() is None and now < self.no_plan_end)

    def _seed(self, entry: ConfigEntry, time_limit_s: float) -> None:
        """Record the entry's incumbent, if any quick split is allowed; close it when optimal."""
        solution = incumbent(
            self._problem(entry),
            entry.splits,
            bound=self.bound_of(entry),
            time_limit_s=time_limit_s,
        )
        if solution is None:
            return
        self.incumbents += 1
        previous = self.results.get(entry.order)
        if previous is None or solution.objective < previous[1].objective:
            self.results[entry.order] = (entry, solution)
        if solution.status == OPTIMAL:
            self.closed.add(entry.order)
            self.open_bounds.pop(entry.order, None)

    def _seed_cut_off(self) -> None:
        """The deadline passed: the configs still open with no split (those the chain algorithm
        did not reach) get the baseline splits, so that the best of them stands; for
        :data:`CUT_OFF_S` more once a plan stands, until ``no_plan_end`` while none does."""
        started = time.perf_counter()
        for entry in self.viable:
            best_value = self.incumbent()
            if best_value is not None and self.bound_of(entry) > best_value:
                break
            if best_value is not None and time.perf_counter() > self.deadline.end + CUT_OFF_S:
                break  # a plan stands: the time limit is not overrun for a better one
            if time.perf_counter() > self.no_plan_end:
                break  # none is quick to find
            if entry.order in self.open_bounds and entry.order not in self.results:
                self._seed(entry, 0.0)
        self.incumbent_s += time.perf_counter() - started

    def visit_in_bound_order(self) -> None:
        """Solve the configs lowest bound first, each from its incumbent, until a bound exceeds
        the best value found (the rest are pruned) or the time runs out (the rest stay open at
        their bounds, their incumbents standing). Configs closed by their incumbent need no
        solve."""
        for index, entry in enumerate(self.viable):
            best_value = self.incumbent()
            if best_value is not None and self.bound_of(entry) > best_value:
                self.pruned += len(self.viable) - index
                return
            if entry.order in self.closed or entry.order in self.visited:
                continue
            if self.deadline.expired():
                self.time_limit_reached = True
                self.open_bounds.update(
                    (e.order, self.bound_of(e))
                    for e in self.viable[index:]
                    if e.order not in self.closed and e.order not in self.visited
                )
                return
            self._solve_config(entry, still_to_visit=len(self.viable) - index)
            self._report(index + 1)

    def _problem(self, entry: ConfigEntry) -> StageProblem:
        return StageProblem(
            costs=entry.costs,
            objective=self.objective,
            capacity_bytes=self.capacity_bytes,
            iteration_budget_ns=self.iteration_budget_ns,
            placement=entry.placement,
            utilization_limit_ppm=self.utilization_limit_ppm,
            simulated=True,
        )

    def _solve_config(self, entry: ConfigEntry, *, still_to_visit: int) -> None:
        """Solve one config with the time left and record the result. A large selective or
        interleaved model may not close in that time: it gets a share of it (among the configs
        still to visit) and a known split to start from; what is left at the end goes to those
        that did not close (:meth:`retry_open`)."""
        problem = self._problem(entry)
        time_limit_s = self.deadline.remaining()
        share = problem.selective or entry.costs.rank_rows
        if share:
            time_limit_s /= still_to_visit
        hint, hint_recomputed = self._start(entry, problem)
        seeded = self.results.get(entry.order)
        solution = solve(
            problem,
            self.backend_of(entry),
            time_limit_s=max(time_limit_s, 0.01),
            hint=hint,
            hint_recomputed=hint_recomputed,
            hint_groups=None if seeded is None else seeded[1].group_of_stage,
            num_workers=self.num_workers,
        )
        self.record(entry, solution)
        self._note_deadline(entry, whole=not share or still_to_visit == 1)
        if share and entry.order in self.open_bounds:
            self.shared.append((entry, problem))

    def _note_deadline(self, entry: ConfigEntry, *, whole: bool) -> None:
        """A solve given the whole time left that did not close its config ran to the
        deadline: the time limit was reached (a solve stopped at its share was not)."""
        if whole and entry.order in self.open_bounds:
            self.time_limit_reached = True

    def _start(
        self, entry: ConfigEntry, problem: StageProblem
    ) -> tuple[list[int] | None, list[bool] | None]:
        """The split (and recompute flags) a solve starts from, so that one stopped by its
        time limit is never worse than it: the config's incumbent; without one (no quick split
        is allowed) a known layout to repair, or (None, None)."""
        seeded = self.results.get(entry.order)
        if seeded is not None:
            return seeded[1].stage_of_layer, seeded[1].recomputed
        if entry.costs.rank_rows:
            # Megatron's own layout (equal layers per virtual stage)
            return entry.start, None
        if problem.selective and self.chain and not self.placed:
            # the best all-off / all-on split (a placed problem builds its own start,
            # solver.backends.placement_start), with the time left: the incumbent pass tried
            # it within its share of the time and found none allowed
            return uniform_recompute_hint(problem, self.deadline)
        return None, None

    def retry_open(self) -> None:
        """The time left after every config was visited goes to the configs that had a share
        of it and did not close, lowest bound first, each restarted from its best split: a
        search that ends early is then as close to proven as the time limit allows."""
        retry = [
            (entry, problem) for entry, problem in self.shared if entry.order in self.open_bounds
        ]
        while retry and not self.deadline.expired():
            best_value = self.incumbent()
            retry = [
                (entry, problem)
                for entry, problem in retry
                if best_value is None or self.open_bounds[entry.order] < best_value
            ]
            if not retry:
                return
            retry.sort(key=lambda item: (self.open_bounds[item[0].order], item[0].order))
            entry, problem = retry.pop(0)
            self._restart(entry, problem, still_to_retry=len(retry) + 1)

    def _restart(self, entry: ConfigEntry, problem: StageProblem, *, still_to_retry: int) -> None:
        """Solve an open config again, from its best split so far (else its first start), with
        a share of the time left."""
        previous = self.results.get(entry.order)
        found = None if previous is None else previous[1]
        solution = solve(
            problem,
            self.backend_of(entry),
            time_limit_s=max(self.deadline.remaining() / still_to_retry, 0.01),
            hint=entry.start if found is None else found.stage_of_layer,
            hint_recomputed=None if found is None else found.recomputed,
            hint_groups=None if found is None else found.group_of_stage,
            num_workers=self.num_workers,
        )
        self.record(entry, solution, retry=True)
        self._note_deadline(entry, whole=still_to_retry == 1)

    def result(self) -> SearchResult:
        """The best config, ties in visit order, and the proven bound: a config still open
        whose bound is at least the incumbent cannot beat it, so the optimum is proven when no
        other config is open."""
        if self.deadline.expired():
            self._seed_cut_off()
        best_value = self.incumbent()
        still_open = [b for b in self.open_bounds.values() if best_value is None or b < best_value]
        ties = [
            self.results[e.order]
            for e in self.viable
            if e.order in self.results and self.results[e.order][1].objective == best_value
        ]
        bounds = [*([] if best_value is None else [best_value]), *self.open_bounds.values()]
        if still_open and self.deadline.expired():
            self.time_limit_reached = True
        return SearchResult(
            entry=ties[0][0] if ties else None,
            solution=ties[0][1] if ties else None,
            ties=ties,
            bound=min(bounds, default=0),
            proven=not still_open,
            solved=self.solved,
            pruned=self.pruned,
            backend=self.backend,
            incumbents=self.incumbents,
            closed_by_incumbent=len(self.closed),
            incumbent_s=self.incumbent_s,
            wall_s=time.perf_counter() - self.started,
            open_configs=len(still_open),
            time_limit_reached=self.time_limit_reached,
        )


def _check_model_sizes(backend: str, entries: list[ConfigEntry], *, chain: bool) -> None:
    """--backend cpsat/milp where no config's model fits in memory (``formulation_fits``): an
    InputError naming the sizes and what would work, before any solve."""
    sizes = [(e.costs.num_layers, e.costs.num_stages) for e in entries]
    if not sizes or any(formulation_fits(*size) for size in sizes):
        return
    layers, stages = min(sizes, key=lambda size: size[1])
    coarser = min(MAX_FORMULATION_LAYERS, MAX_FORMULATION_CELLS // stages)
    other = "--backend chain" if chain else "--backend auto (the DAG DP or quick splits)"
    raise InputError(
        f"--backend {backend}: every candidate config is too large to model: the smallest has "
        f"{formulation_size_text(layers, stages)}; use {other}, or a coarser graph of at most "
        f"{coarser} layers"
    )


def uniform_recompute_hint(
    problem: StageProblem, deadline: Deadline
) -> tuple[list[int] | None, list[bool] | None]:
    """The better of the exact chain optima with no layer and with every layer recomputed (both
    are choices of the selective problem, with the same costs), as a start for CP-SAT; so a
    selective solve stopped by its time limit is still no worse than either. (None, None) when
    neither is feasible."""
    from solver.backends.chain import solve_chain

    costs, best = problem.costs, None
    for recompute in (False, True):
        uniform = costs.uniform(recompute)
        solution = solve_chain(
            dataclasses.replace(problem, costs=uniform),
            time_limit_s=max(deadline.remaining(), 0.01),
        )
        if solution.has_solution and (best is None or solution.objective < best[0]):
            best = (solution.objective, solution.stage_of_layer, [recompute] * costs.num_layers)
    return (None, None) if best is None else (best[1], best[2])


def refine(
    entry: ConfigEntry,
    *,
    objective: str,
    capacity_bytes: int | None,
    iteration_budget_ns: int | None,
    backend: str,
    deadline: Deadline,
    hint: list[int] | None,
    hint_recomputed: list[bool] | None = None,
    hint_groups: list[int] | None = None,
    num_workers: int = 1,
    utilization_limit_ppm: int | None = None,
) -> StageSolution | None:
    """Secondary objective on one config: e.g. the fastest split whose peak <= the optimum."""
    problem = StageProblem(
        costs=entry.costs,
        objective=objective,
        capacity_bytes=capacity_bytes,
        iteration_budget_ns=iteration_budget_ns,
        placement=entry.placement,
        utilization_limit_ppm=utilization_limit_ppm,
        simulated=True,
    )
    solution = solve(
        problem,
        backend,
        time_limit_s=max(deadline.remaining(), 0.01),
        hint=hint,
        hint_recomputed=hint_recomputed,
        hint_groups=hint_groups,
        num_workers=num_workers,
    )
    return solution if solution.has_solution else None


__all__ = [
    "ConfigEntry",
    "Deadline",
    "Progress",
    "SearchResult",
    "build_entries",
    "refine",
    "search",
    "uniform_recompute_hint",
]
