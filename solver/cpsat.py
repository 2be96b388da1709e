"""CP-SAT formulation of the per-config assignment problem (exact: integer bytes and ns).

Layers are in topological order l = 0..L-1, stages s = 0..p-1, edges e = (u, v) with eb_e bytes.
The formulation (``milp.py`` builds the same one, method for method):

  y[l][s] in {0, 1}, s = 0..p-2      y[l][s] = 1 iff stage(l) <= s (prefix variables);
                                     y[l][-1] = 0 and y[l][p-1] = 1 are constants
  x[l][s] = y[l][s] - y[l][s-1]      layer l sits on stage s (linear, no variable)
  c[e][s] = y[u][s] - y[v][s]        edge e crosses the boundary s | s+1 (in {0, 1} by precedence)
  r[e][s] >= y[u][s-1] - y[v][s]     edge e is relayed by stage s: stage(u) < s < stage(v)
  tr[s] >= transient_l x[l][s]       largest transient of stage s

  monotone     y[l][s] <= y[l][s+1]
  precedence   y[v][s] <= y[u][s]                          stage(u) <= stage(v)
  non-empty    sum_l x[l][s] >= 1
  memory       peak >= sum_l (state_l + k_s stored_l) x[l][s] + sum_e eb_e (c[e][s-1] + c[e][s])
                       + k_s sum_e eb_e r[e][s] + tr[s]
  time         T >= sum_l time_l x[l][s],  AR >= sum_l sync_l x[l][s]
  limits       peak <= capacity;  F T + AR <= budget      (F = m + p - 1)
  objective    min peak ("memory") or min F T + AR ("time")

The buffer term is exact: an edge leaving s crosses s | s+1 only, one entering s crosses s-1 | s
only, and a relayed one crosses both (2 eb_e). Prefix variables make all of this linear with no
big-M; r is the only product, and ``y[u][s-1] - y[v][s]`` is the tightest linear lower bound of it
(at least as strong as ``c[e][s-1] + c[e][s] - 1``). Every auxiliary variable is only bounded from
below, so a solution's model objective can exceed the true one; it is always recomputed with the
cost model, and at the optimum the two agree.

Cuts and static bounds: :class:`solver.presolve.Presolve`.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
from ortools.sat.python import cp_model

from solver.cost_model import LayerCosts, stage_costs
from solver.errors import InputError
from solver.presolve import (
    Presolve,
    check_hint,
    keep_hint_if_better,
    make_solution,
    split_from_prefix,
)
from solver.problem import (
    FEASIBLE,
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OBJECTIVE_TIME,
    OPTIMAL,
    UNKNOWN,
    StageProblem,
    StageSolution,
)

logger = logging.getLogger(__name__)

MAX_CP_SAT_VALUE = 2**62
"""CP-SAT needs every linear expression's range to fit in int64; keep a factor 2 of headroom."""


@dataclass
class CpSatVariables:
    """prefix[l][s] = y[l][s] for s = 0..p-2; relay[(e, s)] = r[e][s] (only where an edge can be
    relayed); transient[s] = tr[s]; None where the objective and limits do not need the term."""

    prefix: list[list[cp_model.IntVar]] = field(default_factory=list)
    relay: dict[tuple[int, int], cp_model.IntVar] = field(default_factory=dict)
    transient: list[cp_model.IntVar] = field(default_factory=list)
    peak: cp_model.IntVar | None = None
    slowest_stage_ns: cp_model.IntVar | None = None
    slowest_sync_ns: cp_model.IntVar | None = None


class CpSatFormulation:
    """The model of the module docstring, in exact integer bytes and nanoseconds."""

    backend = "cp-sat"

    def __init__(self, problem: StageProblem, presolve: Presolve | None = None):
        self.problem = problem
        self.costs: LayerCosts = problem.costs
        self.presolve = presolve or Presolve.of(problem)
        self.edges = list(
            zip(self.costs.edge_src.tolist(), self.costs.edge_dst.tolist(), strict=True)
        )
        """(u, v) of every edge, in the order of costs.edge_*."""
        self.needs_memory = (
            problem.objective == OBJECTIVE_MEMORY or problem.capacity_bytes is not None
        )
        self.needs_time = (
            problem.objective == OBJECTIVE_TIME or problem.iteration_budget_ns is not None
        )
        self._check_ranges()
        self.model = cp_model.CpModel()
        self.vars = CpSatVariables()
        self._build_variables()
        self._add_constraints()
        self._set_objective()

    # -- expressions -----------------------------------------------------------------------------

    def _y(self, layer: int, stage: int):
        """y[l][s] with the constants y[l][-1] = 0 and y[l][p-1] = 1."""
        if stage < 0:
            return 0
        if stage >= self.problem.num_stages - 1:
            return 1
        return self.vars.prefix[layer][stage]

    def _member(self, layer: int, stage: int):
        """x[l][s] = y[l][s] - y[l][s-1]."""
        return self._y(layer, stage) - self._y(layer, stage - 1)

    def _crossing(self, edge: int, boundary: int):
        """c[e][s] = y[u][s] - y[v][s]: edge e crosses s | s+1 (0 outside s = 0..p-2)."""
        if not 0 <= boundary < self.problem.num_stages - 1:
            return 0
        u, v = self.edges[edge]
        return self._y(u, boundary) - self._y(v, boundary)

    def _layers_of(self, stage: int) -> list[int]:
        return [
            layer
            for layer in range(self.problem.num_layers)
            if self.presolve.can_hold(layer, stage)
        ]

    def _stage_bytes(self, stage: int):
        """Peak of stage s as a linear expression (module docstring, 'memory')."""
        costs, k = self.costs, self.costs.in_flight[stage]
        per_layer = costs.state_bytes + k * costs.stored_bytes
        terms = [
            int(per_layer[layer]) * self._member(layer, stage) for layer in self._layers_of(stage)
        ]
        terms += [
            int(nbytes) * (self._crossing(e, stage - 1) + self._crossing(e, stage))
            for e, nbytes in enumerate(costs.edge_bytes.tolist())
            if nbytes
        ]
        terms += [
            k * int(costs.edge_bytes[e]) * relay
            for (e, s), relay in self.vars.relay.items()
            if s == stage
        ]
        if self.vars.transient:
            terms.append(self.vars.transient[stage])
        return sum(terms)

    def _stage_sum(self, per_layer: np.ndarray, stage: int):
        """sum_l per_layer[l] x[l][s]."""
        return sum(
            int(per_layer[layer]) * self._member(layer, stage) for layer in self._layers_of(stage)
        )

    def _add(self, constraint) -> None:
        """Adds a linear constraint (CP-SAT takes a Python bool too: constants folded to one)."""
        self.model.add(constraint)

    # -- model -----------------------------------------------------------------------------------

    def _check_ranges(self) -> None:
        """Every expression must stay inside int64 for CP-SAT (exact integers, no scaling)."""
        problem, pre = self.problem, self.presolve
        iteration_ub = self.costs.pipeline_factor * int(self.costs.time_ns.sum()) + int(
            self.costs.dp_sync_ns.sum()
        )
        for name, value in (("stage peak", pre.peak_ub_bytes), ("iteration", iteration_ub)):
            if value >= MAX_CP_SAT_VALUE:
                raise InputError(
                    f"{name} upper bound {value} >= 2^62: too large for CP-SAT "
                    f"({problem.costs.config.label()})"
                )

    def _build_variables(self) -> None:
        """y[l][s], r[e][s] where stage(u) < s < stage(v) is possible, tr[s], peak, T, AR."""
        problem, pre, model, costs = self.problem, self.presolve, self.model, self.costs
        p = problem.num_stages
        self.vars.prefix = [
            [model.new_bool_var(f"y_l{layer}_s{s}") for s in range(p - 1)]
            for layer in range(problem.num_layers)
        ]
        if self.needs_memory:
            for e, (u, v) in enumerate(self.edges):
                if pre.max_span[e] < 2 or not costs.edge_bytes[e]:
                    continue
                for s in range(max(1, pre.first_stage[u] + 1), min(p - 1, pre.last_stage[v])):
                    self.vars.relay[(e, s)] = model.new_bool_var(f"r_e{e}_s{s}")
            top = int(costs.transient_bytes.max(initial=0))
            if top:
                self.vars.transient = [model.new_int_var(0, top, f"tr_s{s}") for s in range(p)]
            self.vars.peak = model.new_int_var(pre.peak_lb_bytes, pre.peak_ub_bytes, "peak")
        if self.needs_time:
            self.vars.slowest_stage_ns = model.new_int_var(
                pre.stage_time_lb_ns, max(pre.stage_time_lb_ns, int(costs.time_ns.sum())), "T"
            )
            self.vars.slowest_sync_ns = model.new_int_var(
                pre.sync_lb_ns, max(pre.sync_lb_ns, int(costs.dp_sync_ns.sum())), "AR"
            )

    def _add_constraints(self) -> None:
        """Every constraint family; memory rows only with a memory objective or a capacity, time
        rows only with a time objective or a budget."""
        self._add_stage_ranges()
        self._add_monotone_prefix()
        self._add_precedence()
        self._add_nonempty_stages()
        self._add_edge_span()
        if self.needs_memory:
            self._add_relay()
            self._add_transient()
            self._add_stage_memory()
            self._add_capacity()
        if self.needs_time:
            self._add_stage_time()
            self._add_iteration_budget()

    def _add_stage_ranges(self) -> None:
        """y[l][s] = 0 for s < first_l;  y[l][s] = 1 for s >= last_l."""
        pre = self.presolve
        for layer, row in enumerate(self.vars.prefix):
            for s, y in enumerate(row):
                if s < pre.first_stage[layer]:
                    self._add(y == 0)
                if s >= pre.last_stage[layer]:
                    self._add(y == 1)

    def _add_monotone_prefix(self) -> None:
        """y[l][s] <= y[l][s+1]."""
        for row in self.vars.prefix:
            for low, high in itertools.pairwise(row):
                self._add(low <= high)

    def _add_precedence(self) -> None:
        """y[v][s] <= y[u][s] for every edge u -> v."""
        for u, v in self.edges:
            for s in range(self.problem.num_stages - 1):
                self._add(self._y(v, s) <= self._y(u, s))

    def _add_nonempty_stages(self) -> None:
        """sum_l x[l][s] >= 1."""
        for s in range(self.problem.num_stages):
            self._add(sum(self._member(layer, s) for layer in range(self.problem.num_layers)) >= 1)

    def _add_edge_span(self) -> None:
        """y[v][s] >= y[u][s - span_e]: stage(v) <= stage(u) + span_e."""
        p = self.problem.num_stages
        for e, (u, v) in enumerate(self.edges):
            span = self.presolve.max_span[e]
            for s in range(span, p - 1):
                self._add(self._y(v, s) >= self._y(u, s - span))

    def _add_relay(self) -> None:
        """r[e][s] >= y[u][s-1] - y[v][s]."""
        for (e, s), relay in self.vars.relay.items():
            u, v = self.edges[e]
            self._add(relay >= self._y(u, s - 1) - self._y(v, s))

    def _add_transient(self) -> None:
        """tr[s] >= transient_l x[l][s]."""
        if not self.vars.transient:
            return
        for s, largest in enumerate(self.vars.transient):
            for layer in self._layers_of(s):
                if self.costs.transient_bytes[layer]:
                    self._add(
                        largest >= int(self.costs.transient_bytes[layer]) * self._member(layer, s)
                    )

    def _add_stage_memory(self) -> None:
        """peak >= states_s + k_s stored_s + buffers_s + k_s relay_s + tr[s]."""
        for s in range(self.problem.num_stages):
            self._add(self.vars.peak >= self._stage_bytes(s))

    def _add_capacity(self) -> None:
        """peak <= capacity_bytes."""
        if self.problem.capacity_bytes is not None:
            self._add(self.vars.peak <= self.problem.capacity_bytes)

    def _add_stage_time(self) -> None:
        """T >= sum_l time_l x[l][s];  AR >= sum_l sync_l x[l][s]."""
        for s in range(self.problem.num_stages):
            self._add(self.vars.slowest_stage_ns >= self._stage_sum(self.costs.time_ns, s))
            self._add(self.vars.slowest_sync_ns >= self._stage_sum(self.costs.dp_sync_ns, s))

    def _add_iteration_budget(self) -> None:
        """F T + AR <= iteration_budget_ns."""
        if self.problem.iteration_budget_ns is not None:
            self._add(self._iteration() <= self.problem.iteration_budget_ns)

    def _iteration(self):
        return self.costs.pipeline_factor * self.vars.slowest_stage_ns + self.vars.slowest_sync_ns

    def _set_objective(self) -> None:
        """min peak ("memory") or min F T + AR ("time")."""
        if self.problem.objective == OBJECTIVE_MEMORY:
            self.model.minimize(self.vars.peak)
        else:
            self.model.minimize(self._iteration())

    # -- solve -----------------------------------------------------------------------------------

    def add_hint(self, stage_of_layer: list[int]) -> None:
        """A complete hint: y from the split, every auxiliary variable at its exact value."""
        for layer, row in enumerate(self.vars.prefix):
            for s, y in enumerate(row):
                self.model.add_hint(y, int(stage_of_layer[layer] <= s))
        for (e, s), relay in self.vars.relay.items():
            u, v = self.edges[e]
            self.model.add_hint(relay, int(stage_of_layer[u] < s < stage_of_layer[v]))
        stages = stage_costs(self.costs, stage_of_layer)
        for s, largest in enumerate(self.vars.transient):
            self.model.add_hint(largest, stages[s].transient_bytes)
        if self.vars.peak is not None:
            self.model.add_hint(self.vars.peak, max(st.peak_bytes for st in stages))
        if self.vars.slowest_stage_ns is not None:
            self.model.add_hint(self.vars.slowest_stage_ns, max(st.time_ns for st in stages))
            self.model.add_hint(self.vars.slowest_sync_ns, max(st.dp_sync_ns for st in stages))

    def dump(self, path: str) -> None:
        """Writes the model proto (text when ``path`` ends with 'txt', else binary)."""
        if not self.model.export_to_file(str(path)):
            raise OSError(f"could not write the CP-SAT model to {path}")

    def solve(self, *, time_limit_s: float, num_workers: int = 1, seed: int = 0) -> StageSolution:
        """Solves; 1 worker with a fixed seed is deterministic (up to the time limit)."""
        start = time.perf_counter()
        solution = self._solve(time_limit_s=time_limit_s, num_workers=num_workers, seed=seed)
        solution.wall_s = time.perf_counter() - start
        return solution

    def _solve(self, *, time_limit_s: float, num_workers: int, seed: int) -> StageSolution:
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = float(time_limit_s)
        solver.parameters.num_workers = int(num_workers)
        solver.parameters.random_seed = int(seed)
        # All constraints in the LP relaxation: over 32 random 40-60-layer problems, half the
        # total time of the default level and a 5x smaller worst case with one worker.
        solver.parameters.linearization_level = 2
        status = solver.solve(self.model)
        if status == cp_model.MODEL_INVALID:
            raise AssertionError(f"invalid CP-SAT model: {self.model.validate()}")
        if status == cp_model.INFEASIBLE:
            return make_solution(INFEASIBLE, self.backend, bound=0)
        bound = self.presolve.objective_lower_bound(self.problem)
        if math.isfinite(solver.best_objective_bound):
            bound = max(bound, math.ceil(solver.best_objective_bound - 1e-9))
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return make_solution(UNKNOWN, self.backend, bound=bound)
        prefix_values = [[solver.value(y) for y in row] for row in self.vars.prefix]
        split = split_from_prefix(prefix_values, self.problem.num_stages)
        reason = self.problem.violation(split)
        if reason is not None:
            raise AssertionError(f"CP-SAT returned an invalid split {split}: {reason}")
        objective = self.problem.objective_value(split)
        model_objective = round(solver.objective_value)
        if objective > model_objective:  # auxiliaries are lower-bounded: they may only overcount
            raise AssertionError(f"the model under-counts: {model_objective} < {objective}")
        if status == cp_model.OPTIMAL:
            if objective != model_objective:
                raise AssertionError(f"optimal model value {model_objective} != {objective}")
            return make_solution(
                OPTIMAL, self.backend, bound=objective, split=split, objective=objective
            )
        return make_solution(
            FEASIBLE, self.backend, bound=min(bound, objective), split=split, objective=objective
        )


def solve_cpsat(
    problem: StageProblem,
    *,
    time_limit_s: float = 10.0,
    hint: list[int] | None = None,
    num_workers: int = 1,
    seed: int = 0,
    dump_path: str | None = None,
) -> StageSolution:
    """Exact assignment by CP-SAT; ``hint`` is a split (layer -> stage) to start from."""
    start = time.perf_counter()
    check_hint(problem, hint)
    formulation = CpSatFormulation(problem)
    if hint is not None:
        formulation.add_hint(hint)
    if dump_path is not None:
        formulation.dump(dump_path)
    solution = formulation.solve(time_limit_s=time_limit_s, num_workers=num_workers, seed=seed)
    solution = keep_hint_if_better(problem, solution, hint)
    solution.wall_s = time.perf_counter() - start
    return solution
