"""MILP backend of the prefix formulation (PuLP; HiGHS through highspy, or CBC).

The model is the one of ``solver/backends/formulation.py``
(prefix variables y[l][s] = [stage(l) <= s],
linear stage membership, edge crossings and buffers, relay indicators, transient maxima), with two
differences that a floating-point solver needs:

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
optimum is an integer), or the static bound of
:class:`solver.backends.presolve.Presolve`, whichever is
larger. CBC (the fallback) gives no dual bound through PuLP: it reports the static bound unless it
proves optimality.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings

import highspy
import numpy as np
import pulp

from solver.backends.formulation import PrefixFormulation
from solver.backends.presolve import (
    Presolve,
    make_solution,
    split_from_prefix,
)
from solver.backends.problem import (
    FEASIBLE,
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OPTIMAL,
    UNKNOWN,
    StageProblem,
    StageSolution,
)
from solver.backends.stoppable import run_stoppable
from solver.errors import InputError

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


class MilpFormulation(PrefixFormulation):
    """The model of ``solver/backends/formulation.py`` in scaled units, for PuLP."""

    backend = "milp"

    def __init__(
        self, problem: StageProblem, presolve: Presolve | None = None, *, stop_at: float = math.inf
    ):
        super().__init__(problem, presolve, stop_at=stop_at)
        self.bytes_scale, self.ns_scale = self._scales()
        self.model = pulp.LpProblem("stage_assignment", pulp.LpMinimize)
        self.start: dict[pulp.LpVariable, float] = {}
        """Start values from a hint (warm start)."""
        self._build()

    def _scales(self) -> tuple[int, int]:
        """Powers of two for bytes and ns, from every coefficient that can appear in a row."""
        costs, k = self.costs, max(self.costs.in_flight)
        byte_coefficients = np.concatenate(
            [
                costs.state_bytes + k * costs.stored_bytes,
                k * np.abs(costs.recompute_stored_bytes - costs.stored_bytes),
                costs.transient_bytes,
                np.abs(costs.recompute_transient_bytes - costs.transient_bytes),
                max(k, *costs.most_copies, costs.config.num_microbatches)
                * costs.edge_bytes,
                [costs.constant_bytes],
                [1],
            ]
        )
        time_coefficients = np.concatenate(
            [costs.time_ns, costs.recompute_time_ns - costs.time_ns, costs.dp_sync_ns, [1]]
        )
        if self.problem.placement is not None:
            placement = self.problem.placement
            byte_coefficients = np.concatenate([byte_coefficients, placement.capacity_bytes])
            time_coefficients = np.concatenate(
                [time_coefficients]
                + [
                    [
                        c.bounding_coefficients(np.maximum)[2].sum(),  # M^k
                        c.dp_sync_ns.sum(),
                        *c.time_ns,
                        *(c.recompute_time_ns - c.time_ns),
                        *c.dp_sync_ns,
                    ]
                    for c in placement.group_costs
                ]
            )
        return power_of_two_scale(byte_coefficients), power_of_two_scale(time_coefficients)

    @classmethod
    def backend_of(cls, options: dict) -> str:
        return f"milp-{options.get('solver', 'highs')}"

    # -- backend ---------------------------------------------------------------------------------

    def _new_bool(self, name: str) -> pulp.LpVariable:
        return self.model.add_variable(name, cat=pulp.LpBinary)

    def _new_var(self, lo: float, hi: float, name: str) -> pulp.LpVariable:
        """Continuous: at integer y the smallest feasible value is the exact one."""
        return self.model.add_variable(name, lo, hi)

    def _new_int(self, lo: int, hi: int, name: str) -> pulp.LpVariable:
        return self.model.add_variable(name, lo, hi, cat=pulp.LpInteger)

    def _bytes(self, value: int) -> float:
        return int(value) / self.bytes_scale

    def _ns(self, value: int) -> float:
        return int(value) / self.ns_scale

    _sum = staticmethod(pulp.lpSum)

    def _add(self, constraint, name: str) -> None:
        """One without variables is checked here (PuLP rejects it)."""
        if isinstance(constraint, bool) or not constraint.keys():
            holds = constraint if isinstance(constraint, bool) else constraint.valid()
            if holds:
                return
            constraint = pulp.lpSum([]) >= 1  # 0 >= 1: no assignment exists
        self.model += constraint, name

    def _minimize(self, expression) -> None:
        self.model.setObjective(expression)

    def _hint(self, variable: pulp.LpVariable, value: float) -> None:
        self.start[variable] = value

    # -- solve -----------------------------------------------------------------------------------

    def objective_scale(self) -> int:
        if self.problem.objective != OBJECTIVE_MEMORY:
            return self.ns_scale
        return 1 if self.vars.utilization is not None else self.bytes_scale

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
            return _HighsWithStart(
                warm_start=bool(self.start),
                stop_at=time.perf_counter() + options["timeLimit"],
                **options,
                **tolerances,
            )
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
        groups = self.groups_from(lambda var: var.varValue or 0.0)
        recomputed = self._recomputed(lambda rc: rc.varValue or 0.0)
        reason = self.problem.violation(split, recomputed, groups)
        if reason is not None:
            logger.info("%s: the rounded split %s is not valid: %s", backend, split, reason)
            return make_solution(UNKNOWN, backend, bound=bound), True
        objective = self.problem.objective_value(split, recomputed, groups)
        model_objective = pulp.value(self.model.objective) * scale
        margin = RELATIVE_MARGIN * max(1.0, abs(model_objective))
        if outcome == OPTIMAL and objective <= model_objective + margin:
            return make_solution(
                OPTIMAL,
                backend,
                bound=objective,
                split=split,
                objective=objective,
                recomputed=recomputed,
                groups=groups,
            ), False
        if outcome == OPTIMAL:
            logger.warning(
                "%s: rounding raised the objective from %.1f to %d; not proven optimal",
                backend,
                model_objective,
                objective,
            )
        return make_solution(
            FEASIBLE,
            backend,
            bound=min(bound, objective),
            split=split,
            objective=objective,
            groups=groups,
            recomputed=recomputed,
        ), False


class _HighsWithStart(pulp.HiGHS):
    """PuLP's HiGHS interface plus a warm start (PuLP ignores initial values for HiGHS)."""

    banner_shown = False
    """HiGHS prints a banner on stdout when the process builds its first model (before any
    option can turn it off), which would corrupt a CLI's JSON output: that one is built with
    stdout sent to /dev/null."""

    def __init__(self, *, warm_start: bool = False, stop_at: float = math.inf, **options):
        super().__init__(**options)
        self.warm_start = warm_start
        self.stop_at = stop_at
        """``time.perf_counter()`` by which HiGHS must stop: PuLP copies the model into HiGHS
        first (seconds for a large model), so the limit is set again when the solve starts."""

    def createAndConfigureSolver(self, lp):  # noqa: N802 (PuLP's name)
        if not _HighsWithStart.banner_shown:
            _HighsWithStart.banner_shown = True
            _without_stdout(highspy.Highs)
        super().createAndConfigureSolver(lp)

    def callSolver(self, lp):  # noqa: N802 (PuLP's name)
        highs = lp.solverModel
        if self.warm_start:
            columns = [var for var in lp.variables() if var.varValue is not None]
            highs.setSolution(
                len(columns),
                np.asarray([var.index for var in columns], dtype=np.int32),
                np.asarray([var.varValue for var in columns], dtype=np.float64),
            )
        if math.isfinite(self.stop_at):
            highs.setOptionValue("time_limit", max(0.01, self.stop_at - time.perf_counter()))
        # Ctrl-C: cancelSolve from the main thread (solver.backends.stoppable); HiGHS checks
        # the request in its interrupt callbacks
        highs.HandleUserInterrupt = True
        run_stoppable(highs.run, highs.cancelSolve)


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
    hint_recomputed: list[bool] | None = None,
    hint_groups: list[int] | None = None,
    solver: str = "highs",
    dump_path: str | None = None,
) -> StageSolution:
    """Exact assignment by MILP: ``solver`` is "highs" (HiGHS via highspy) or "cbc" (fallback)."""
    if solver not in SOLVERS:
        raise InputError(f"MILP solver must be one of {SOLVERS}, got {solver!r}")
    return MilpFormulation.solve_problem(
        problem,
        hint=hint,
        hint_recomputed=hint_recomputed,
        hint_groups=hint_groups,
        dump_path=dump_path,
        time_limit_s=time_limit_s,
        solver=solver,
    )
