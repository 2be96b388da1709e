"""MILP formulation of the per-config assignment problem (PuLP; HiGHS through highspy, or CBC).

The model is the one in ``solver/cpsat.py`` (prefix variables y[l][s] = [stage(l) <= s], linear
stage membership, edge crossings and buffers, relay indicators, transient maxima), method for
method, with two differences that a floating-point solver needs:

- Scaling. Bytes and ns are divided by powers of two chosen from the data, so the largest
  coefficient is at most 2^20 (about 1e6). A power of two keeps every scaled integer exact in a
  double, so nothing is rounded; it only keeps HiGHS's absolute tolerances meaningful.
- Relay and transient variables are continuous: only their lower bounds matter, and at integer
  y the smallest feasible value is exactly the indicator (or the maximum).

Results are never trusted as they come back: the binary y are rounded, the split is rebuilt,
checked with ``problem.violation`` and its objective recomputed with the cost model. When a
tolerance let through a split that is invalid in exact arithmetic (CBC's preprocessing does this
with a limit one unit below the optimum), or CBC says infeasible (its preprocessing also did that
with a limit at the optimum), the model is solved once more, in the time left, with stricter
settings; a split still invalid is not returned (status UNKNOWN, with a warning).

Status and bound. PuLP reports 'Optimal' at a time limit, so the status is read from HiGHS
itself. OPTIMAL means HiGHS closed the gap to half a unit (byte or ns) and the rounded split
reproduces its objective, so the optimum, an integer, is the objective: bound = objective (up to
the solver's tolerances, which is what a floating-point MILP can prove). Otherwise the bound is
HiGHS's dual bound, unscaled, lowered by a relative safety margin of 1e-6 and rounded up (the
optimum is an integer), or the static bound of :class:`solver.cpsat.Presolve`, whichever is
larger. CBC (the fallback) gives no dual bound through PuLP: it reports the static bound unless it
proves optimality.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import highspy
import numpy as np
import pulp

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

SOLVERS = ("highs", "cbc")
MAX_SCALED_COEFFICIENT = 2**20
"""Largest coefficient after scaling (about 1e6)."""
RELATIVE_MARGIN = 1e-6
"""Safety margin on an unscaled dual bound, relative to its magnitude (at least 1 scaled unit
times this)."""


def power_of_two_scale(values: np.ndarray | list[int]) -> int:
    """Smallest 2^k (k >= 0) with max(values) / 2^k <= MAX_SCALED_COEFFICIENT."""
    largest = max((abs(int(v)) for v in values), default=0)
    if largest <= MAX_SCALED_COEFFICIENT:
        return 1
    return 2 ** math.ceil(math.log2(largest / MAX_SCALED_COEFFICIENT))


@dataclass
class MilpVariables:
    """prefix[l][s] = y[l][s] for s = 0..p-2; relay[(e, s)] = r[e][s] (only where an edge can be
    relayed); transient[s] = tr[s]; None where the objective and limits do not need the term.
    Byte quantities are in units of ``bytes_scale`` bytes, times in units of ``ns_scale`` ns."""

    prefix: list[list[pulp.LpVariable]] = field(default_factory=list)
    relay: dict[tuple[int, int], pulp.LpVariable] = field(default_factory=dict)
    transient: list[pulp.LpVariable] = field(default_factory=list)
    peak: pulp.LpVariable | None = None
    slowest_stage_ns: pulp.LpVariable | None = None
    slowest_sync_ns: pulp.LpVariable | None = None


class MilpFormulation:
    """The model of ``solver/cpsat.py`` in scaled units, for PuLP."""

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
        self.bytes_scale, self.ns_scale = self._scales()
        self.model = pulp.LpProblem("stage_assignment", pulp.LpMinimize)
        self.vars = MilpVariables()
        self.start: dict[pulp.LpVariable, float] = {}
        """Start values from a hint (warm start)."""
        self._build_variables()
        self._add_constraints()
        self._set_objective()

    # -- expressions -----------------------------------------------------------------------------

    def _scales(self) -> tuple[int, int]:
        """Powers of two for bytes and ns, from every coefficient that can appear in a row."""
        costs, k = self.costs, max(self.costs.in_flight)
        byte_coefficients = np.concatenate(
            [
                costs.state_bytes + k * costs.stored_bytes,
                costs.transient_bytes,
                k * costs.edge_bytes,
                [1],
            ]
        )
        time_coefficients = np.concatenate([costs.time_ns, costs.dp_sync_ns, [1]])
        return power_of_two_scale(byte_coefficients), power_of_two_scale(time_coefficients)

    def _bytes(self, value: int) -> float:
        return int(value) / self.bytes_scale

    def _ns(self, value: int) -> float:
        return int(value) / self.ns_scale

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

    def _stage_bytes(self, stage: int) -> pulp.LpAffineExpression:
        """Peak of stage s as a linear expression, in scaled bytes."""
        costs, k = self.costs, self.costs.in_flight[stage]
        per_layer = costs.state_bytes + k * costs.stored_bytes
        terms = [
            self._bytes(per_layer[layer]) * self._member(layer, stage)
            for layer in self._layers_of(stage)
        ]
        terms += [
            self._bytes(nbytes) * (self._crossing(e, stage - 1) + self._crossing(e, stage))
            for e, nbytes in enumerate(costs.edge_bytes.tolist())
            if nbytes
        ]
        terms += [
            self._bytes(k * costs.edge_bytes[e]) * relay
            for (e, s), relay in self.vars.relay.items()
            if s == stage
        ]
        if self.vars.transient:
            terms.append(self.vars.transient[stage])
        return pulp.lpSum(terms)

    def _stage_sum(self, per_layer: np.ndarray, stage: int) -> pulp.LpAffineExpression:
        """sum_l per_layer[l] x[l][s], in scaled ns."""
        return pulp.lpSum(
            self._ns(per_layer[layer]) * self._member(layer, stage)
            for layer in self._layers_of(stage)
        )

    def _add(self, constraint, name: str) -> None:
        """Adds a linear constraint; one without variables is checked here (PuLP rejects it)."""
        if isinstance(constraint, bool) or not constraint.keys():
            holds = constraint if isinstance(constraint, bool) else constraint.valid()
            if holds:
                return
            constraint = pulp.lpSum([]) >= 1  # 0 >= 1: no assignment exists
        self.model += constraint, name

    # -- model -----------------------------------------------------------------------------------

    def _build_variables(self) -> None:
        """y[l][s], r[e][s] where stage(u) < s < stage(v) is possible, tr[s], peak, T, AR."""
        problem, pre, costs, model = self.problem, self.presolve, self.costs, self.model
        p = problem.num_stages
        self.vars.prefix = [
            [model.add_variable(f"y_l{layer}_s{s}", cat=pulp.LpBinary) for s in range(p - 1)]
            for layer in range(problem.num_layers)
        ]
        if self.needs_memory:
            for e, (u, v) in enumerate(self.edges):
                if pre.max_span[e] < 2 or not costs.edge_bytes[e]:
                    continue
                for s in range(max(1, pre.first_stage[u] + 1), min(p - 1, pre.last_stage[v])):
                    self.vars.relay[(e, s)] = model.add_variable(f"r_e{e}_s{s}", 0, 1)
            top = int(costs.transient_bytes.max(initial=0))
            if top:
                self.vars.transient = [
                    model.add_variable(f"tr_s{s}", 0, self._bytes(top)) for s in range(p)
                ]
            self.vars.peak = model.add_variable(
                "peak", self._bytes(pre.peak_lb_bytes), self._bytes(pre.peak_ub_bytes)
            )
        if self.needs_time:
            self.vars.slowest_stage_ns = model.add_variable(
                "T",
                self._ns(pre.stage_time_lb_ns),
                self._ns(max(pre.stage_time_lb_ns, int(costs.time_ns.sum()))),
            )
            self.vars.slowest_sync_ns = model.add_variable(
                "AR",
                self._ns(pre.sync_lb_ns),
                self._ns(max(pre.sync_lb_ns, int(costs.dp_sync_ns.sum()))),
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
                    self._add(y == 0, f"range_lo_l{layer}_s{s}")
                if s >= pre.last_stage[layer]:
                    self._add(y == 1, f"range_hi_l{layer}_s{s}")

    def _add_monotone_prefix(self) -> None:
        """y[l][s] <= y[l][s+1]."""
        for layer, row in enumerate(self.vars.prefix):
            for s, (low, high) in enumerate(itertools.pairwise(row)):
                self._add(low <= high, f"monotone_l{layer}_s{s}")

    def _add_precedence(self) -> None:
        """y[v][s] <= y[u][s] for every edge u -> v."""
        for e, (u, v) in enumerate(self.edges):
            for s in range(self.problem.num_stages - 1):
                self._add(self._y(v, s) <= self._y(u, s), f"precedence_e{e}_s{s}")

    def _add_nonempty_stages(self) -> None:
        """sum_l x[l][s] >= 1."""
        for s in range(self.problem.num_stages):
            members = pulp.lpSum(self._member(layer, s) for layer in range(self.problem.num_layers))
            self._add(members >= 1, f"nonempty_s{s}")

    def _add_edge_span(self) -> None:
        """y[v][s] >= y[u][s - span_e]: stage(v) <= stage(u) + span_e."""
        p = self.problem.num_stages
        for e, (u, v) in enumerate(self.edges):
            span = self.presolve.max_span[e]
            for s in range(span, p - 1):
                self._add(self._y(v, s) >= self._y(u, s - span), f"span_e{e}_s{s}")

    def _add_relay(self) -> None:
        """r[e][s] >= y[u][s-1] - y[v][s]."""
        for (e, s), relay in self.vars.relay.items():
            u, v = self.edges[e]
            self._add(relay >= self._y(u, s - 1) - self._y(v, s), f"relay_e{e}_s{s}")

    def _add_transient(self) -> None:
        """tr[s] >= transient_l x[l][s]."""
        if not self.vars.transient:
            return
        for s, largest in enumerate(self.vars.transient):
            for layer in self._layers_of(s):
                if self.costs.transient_bytes[layer]:
                    self._add(
                        largest
                        >= self._bytes(self.costs.transient_bytes[layer]) * self._member(layer, s),
                        f"transient_l{layer}_s{s}",
                    )

    def _add_stage_memory(self) -> None:
        """peak >= states_s + k_s stored_s + buffers_s + k_s relay_s + tr[s]."""
        for s in range(self.problem.num_stages):
            self._add(self.vars.peak >= self._stage_bytes(s), f"memory_s{s}")

    def _add_capacity(self) -> None:
        """peak <= capacity_bytes."""
        if self.problem.capacity_bytes is not None:
            self._add(self.vars.peak <= self._bytes(self.problem.capacity_bytes), "capacity")

    def _add_stage_time(self) -> None:
        """T >= sum_l time_l x[l][s];  AR >= sum_l sync_l x[l][s]."""
        for s in range(self.problem.num_stages):
            self._add(
                self.vars.slowest_stage_ns >= self._stage_sum(self.costs.time_ns, s), f"time_s{s}"
            )
            self._add(
                self.vars.slowest_sync_ns >= self._stage_sum(self.costs.dp_sync_ns, s), f"sync_s{s}"
            )

    def _add_iteration_budget(self) -> None:
        """F T + AR <= iteration_budget_ns."""
        if self.problem.iteration_budget_ns is not None:
            self._add(self._iteration() <= self._ns(self.problem.iteration_budget_ns), "budget")

    def _iteration(self) -> pulp.LpAffineExpression:
        return self.costs.pipeline_factor * self.vars.slowest_stage_ns + self.vars.slowest_sync_ns

    def _set_objective(self) -> None:
        """min peak ("memory") or min F T + AR ("time")."""
        if self.problem.objective == OBJECTIVE_MEMORY:
            self.model.setObjective(self.vars.peak)
        else:
            self.model.setObjective(self._iteration())

    # -- solve -----------------------------------------------------------------------------------

    def objective_scale(self) -> int:
        return self.bytes_scale if self.problem.objective == OBJECTIVE_MEMORY else self.ns_scale

    def set_hint(self, stage_of_layer: list[int]) -> None:
        """Start values for every variable: y from the split, the others at their exact value."""
        start = self.start
        for layer, row in enumerate(self.vars.prefix):
            for s, y in enumerate(row):
                start[y] = int(stage_of_layer[layer] <= s)
        for (e, s), relay in self.vars.relay.items():
            u, v = self.edges[e]
            start[relay] = int(stage_of_layer[u] < s < stage_of_layer[v])
        stages = stage_costs(self.costs, stage_of_layer)
        for s, largest in enumerate(self.vars.transient):
            start[largest] = self._bytes(stages[s].transient_bytes)
        if self.vars.peak is not None:
            start[self.vars.peak] = self._bytes(max(st.peak_bytes for st in stages))
        if self.vars.slowest_stage_ns is not None:
            start[self.vars.slowest_stage_ns] = self._ns(max(st.time_ns for st in stages))
            start[self.vars.slowest_sync_ns] = self._ns(max(st.dp_sync_ns for st in stages))

    def dump(self, path: str) -> None:
        """Writes the model in LP format."""
        self.model.writeLP(str(path))

    def solve(self, *, time_limit_s: float, solver: str = "highs") -> StageSolution:
        """Solves with HiGHS (status and dual bound read from highspy) or CBC.

        When a tolerance let through a solution that is invalid in exact arithmetic, or when CBC
        says infeasible, solves once more, within the time left, with stricter settings (HiGHS:
        feasibility tolerances 1e-9; CBC: no preprocessing, where CBC 2.10 loses exactness: it
        returned a split 1 byte over the capacity and called a problem whose capacity equals the
        optimum infeasible, on random 3-4-layer problems).
        """
        start = time.perf_counter()
        for strict in (False, True):
            left = time_limit_s - (time.perf_counter() - start)
            if strict and left < 0.05:
                break
            for var in self.model.variables():
                var.varValue = None  # the last attempt's values are no start
            for var, value in self.start.items():
                var.setInitialValue(value)
            self.model.solve(self._engine(solver, time_limit_s=left, strict=strict))
            outcome, dual_bound = (
                _highs_outcome(self.model) if solver == "highs" else _cbc_outcome(self.model)
            )
            solution, rejected = self._interpret(outcome, dual_bound, backend=f"milp-{solver}")
            doubtful = solver == "cbc" and solution.status == INFEASIBLE
            if not (rejected or doubtful):
                break
        if rejected:
            logger.warning(
                "milp-%s: solver tolerances admitted only invalid solutions; none is reported",
                solver,
            )
        solution.wall_s = time.perf_counter() - start
        return solution

    def _engine(self, solver: str, *, time_limit_s: float, strict: bool) -> pulp.LpSolver:
        options = dict(
            msg=False,
            timeLimit=max(0.01, float(time_limit_s)),
            gapRel=0.0,
            gapAbs=0.5 / self.objective_scale(),
        )
        if solver == "highs":
            tolerances = (
                dict(mip_feasibility_tolerance=1e-9, primal_feasibility_tolerance=1e-9)
                if strict
                else {}
            )
            return _HighsWithStart(warm_start=bool(self.start), **options, **tolerances)
        return _cbc(
            warmStart=bool(self.start), options=["preprocess off"] if strict else [], **options
        )

    def _interpret(
        self, outcome: str, dual_bound: float | None, *, backend: str
    ) -> tuple[StageSolution, bool]:
        """Rounds, rebuilds and checks the split; unscales the bound (see the module docstring).
        The flag says that the solver's solution was rejected as invalid."""
        scale = self.objective_scale()
        bound = self.presolve.objective_lower_bound(self.problem)
        if dual_bound is not None and math.isfinite(dual_bound):
            margin = RELATIVE_MARGIN * max(1.0, abs(dual_bound))
            bound = max(bound, math.ceil((dual_bound - margin) * scale))
        if outcome == INFEASIBLE:
            return make_solution(INFEASIBLE, backend, bound=0), False
        if outcome == UNKNOWN:
            return make_solution(UNKNOWN, backend, bound=bound), False
        values = [[y.varValue or 0.0 for y in row] for row in self.vars.prefix]
        split = split_from_prefix(values, self.problem.num_stages)
        reason = self.problem.violation(split)
        if reason is not None:
            logger.info("%s: the rounded split %s is not valid: %s", backend, split, reason)
            return make_solution(UNKNOWN, backend, bound=bound), True
        objective = self.problem.objective_value(split)
        model_objective = pulp.value(self.model.objective) * scale
        margin = RELATIVE_MARGIN * max(1.0, abs(model_objective))
        if outcome == OPTIMAL and objective <= model_objective + margin:
            return make_solution(
                OPTIMAL, backend, bound=objective, split=split, objective=objective
            ), False
        if outcome == OPTIMAL:
            logger.warning(
                "%s: rounding raised the objective from %.1f to %d; not proven optimal",
                backend,
                model_objective,
                objective,
            )
        return make_solution(
            FEASIBLE, backend, bound=min(bound, objective), split=split, objective=objective
        ), False


class _HighsWithStart(pulp.HiGHS):
    """PuLP's HiGHS interface plus a warm start (PuLP ignores initial values for HiGHS)."""

    banner_shown = False
    """HiGHS prints a banner on stdout when the process builds its first model (before any
    option can turn it off), which would corrupt a CLI's JSON output: that one is built with
    stdout sent to /dev/null."""

    def __init__(self, *, warm_start: bool = False, **options):
        super().__init__(**options)
        self.warm_start = warm_start

    def createAndConfigureSolver(self, lp):  # noqa: N802 (PuLP's name)
        if not _HighsWithStart.banner_shown:
            _HighsWithStart.banner_shown = True
            _without_stdout(highspy.Highs)
        super().createAndConfigureSolver(lp)

    def callSolver(self, lp):  # noqa: N802 (PuLP's name)
        if self.warm_start:
            columns = [var for var in lp.variables() if var.varValue is not None]
            lp.solverModel.setSolution(
                len(columns),
                np.asarray([var.index for var in columns], dtype=np.int32),
                np.asarray([var.varValue for var in columns], dtype=np.float64),
            )
        super().callSolver(lp)


def _without_stdout(function):
    """Calls ``function()`` with file descriptor 1 sent to /dev/null (C++ output included)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout to protect
        return function()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        return function()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _cbc(**options) -> pulp.LpSolver:
    """An installed CBC (COIN_CMD), else the one bundled with PuLP (deprecated in PuLP 3.3)."""
    installed = pulp.COIN_CMD(**options)
    if installed.available():
        return installed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(**options)


def _highs_outcome(model: pulp.LpProblem) -> tuple[str, float | None]:
    """OPTIMAL / FEASIBLE / INFEASIBLE / UNKNOWN and the dual bound (scaled), read from HiGHS."""
    highs = model.solverModel
    status = highs.getModelStatus()
    info = highs.getInfo()
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    dual_bound = info.mip_dual_bound
    if status == highspy.HighsModelStatus.kOptimal:
        return OPTIMAL, dual_bound
    if status in (
        highspy.HighsModelStatus.kInfeasible,
        highspy.HighsModelStatus.kUnboundedOrInfeasible,
    ):
        return INFEASIBLE, None
    if status != highspy.HighsModelStatus.kTimeLimit:
        logger.warning("HiGHS stopped with %s", highs.modelStatusToString(status))
    return (FEASIBLE if has_solution else UNKNOWN), dual_bound


def _cbc_outcome(model: pulp.LpProblem) -> tuple[str, float | None]:
    """CBC through PuLP: sol_status 1 optimal, 2 a solution at a limit, -1 infeasible."""
    if model.sol_status == pulp.LpSolutionOptimal:
        return OPTIMAL, None
    if model.sol_status == pulp.LpSolutionIntegerFeasible:
        return FEASIBLE, None
    if model.status == pulp.LpStatusInfeasible:
        return INFEASIBLE, None
    return UNKNOWN, None


def solve_milp(
    problem: StageProblem,
    *,
    time_limit_s: float = 10.0,
    hint: list[int] | None = None,
    solver: str = "highs",
    dump_path: str | None = None,
) -> StageSolution:
    """Exact assignment by MILP: ``solver`` is "highs" (HiGHS via highspy) or "cbc" (fallback)."""
    if solver not in SOLVERS:
        raise InputError(f"MILP solver must be one of {SOLVERS}, got {solver!r}")
    start = time.perf_counter()
    check_hint(problem, hint)
    formulation = MilpFormulation(problem)
    if hint is not None:
        formulation.set_hint(hint)
    if dump_path is not None:
        formulation.dump(dump_path)
    solution = formulation.solve(time_limit_s=time_limit_s, solver=solver)
    solution = keep_hint_if_better(problem, solution, hint)
    solution.wall_s = time.perf_counter() - start
    return solution
