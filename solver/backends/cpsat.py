"""CP-SAT backend of the prefix formulation (``solver/backends/formulation.py``): exact integers.

Every coefficient and bound is the cost model's own integer (bytes, ns), so the model objective is
exact; relay and transient variables are integers too. CP-SAT needs every linear expression's range
inside int64, which ``_check_ranges`` verifies before building (an :class:`InputError` otherwise).
A solution is checked as it comes back: the split is rebuilt from y and validated, and its
objective, recomputed with the cost model, must not exceed the model's (auxiliaries only
overcount) and must equal it at the optimum. The bound is CP-SAT's best objective bound or the
static one of :class:`solver.backends.presolve.Presolve`, whichever is larger.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
from ortools.sat.python import cp_model

from solver.backends.formulation import PrefixFormulation
from solver.backends.presolve import (
    Presolve,
    make_solution,
    split_from_prefix,
)
from solver.backends.problem import (
    FEASIBLE,
    INFEASIBLE,
    OPTIMAL,
    UNKNOWN,
    UTILIZATION,
    StageProblem,
    StageSolution,
)
from solver.backends.stoppable import run_stoppable
from solver.costs import PPM
from solver.errors import InputError

logger = logging.getLogger(__name__)

MAX_CP_SAT_VALUE = 2**62
"""CP-SAT needs every linear expression's range to fit in int64; keep a factor 2 of headroom."""


class CpSatFormulation(PrefixFormulation):
    """The model of ``solver/backends/formulation.py``, in exact integer bytes and nanoseconds."""

    backend = "cp-sat"

    def __init__(
        self, problem: StageProblem, presolve: Presolve | None = None, *, stop_at: float = math.inf
    ):
        super().__init__(problem, presolve, stop_at=stop_at)
        self._check_ranges()
        self.model = cp_model.CpModel()
        self._build()

    def _check_ranges(self) -> None:
        """Every expression must stay inside int64 for CP-SAT (exact integers, no scaling)."""
        problem, pre = self.problem, self.presolve
        placement = problem.placement
        group_costs = [self.costs] if placement is None else placement.group_costs
        iteration_ub = 0  # on the slowest group: every group's time rows are in the model
        for costs in group_costs:
            _, _, time_ub = costs.bounding_coefficients(np.maximum)
            config = costs.config
            iteration_ub = max(
                iteration_ub,
                (config.num_microbatches + 1) * int(time_ub.sum())
                + 2 * int(costs.tail_ns.sum())
                + (config.num_microbatches * config.virtual_stages + config.pp + 1)
                * costs.microbatch_overhead_ns,
            )
        ranges = [("stage peak", pre.peak_ub_bytes), ("iteration", iteration_ub)]
        if placement is not None and placement.memory_objective == UTILIZATION:
            # 10^6 P[s][k] <= C_k U with P[s][k] <= C_k and U <= 10^6
            ranges.append(("utilization row", 2 * PPM * max(placement.capacity_bytes)))
        for name, value in ranges:
            if value >= MAX_CP_SAT_VALUE:
                raise InputError(
                    f"{name} upper bound {value} >= 2^62: too large for CP-SAT "
                    f"({problem.costs.config.label()})"
                )

    # -- backend ---------------------------------------------------------------------------------

    def _new_bool(self, name: str) -> cp_model.IntVar:
        return self.model.new_bool_var(name)

    def _new_var(self, lo: int, hi: int, name: str) -> cp_model.IntVar:
        return self.model.new_int_var(lo, hi, name)

    _new_int = _new_var
    utilization_row_scale = PPM

    def _bytes(self, value: int) -> int:
        return int(value)

    _ns = _bytes
    _sum = staticmethod(sum)

    def _add(self, constraint, name: str) -> None:
        """CP-SAT takes a Python bool too (constants folded to one); the name is not kept."""
        self.model.add(constraint)

    def _minimize(self, expression) -> None:
        self.model.minimize(expression)

    def _hint(self, variable, value: int) -> None:
        self.model.add_hint(variable, value)

    # -- solve -----------------------------------------------------------------------------------

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
        # Ctrl-C: stop_search from the main thread (solver.backends.stoppable), not CP-SAT's
        # own SIGINT handler, which ends the solve quietly as if its time limit were reached
        solver.parameters.catch_sigint_signal = False
        status = run_stoppable(lambda: solver.solve(self.model), solver.stop_search)
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
        groups = self.groups_from(solver.value)
        recomputed = self._recomputed(solver.value)
        reason = self.problem.violation(split, recomputed, groups)
        if reason is not None:
            raise AssertionError(f"CP-SAT returned an invalid split {split} {groups}: {reason}")
        objective = self.problem.objective_value(split, recomputed, groups)
        model_objective = round(solver.objective_value)
        if objective > model_objective:  # auxiliaries are lower-bounded: they may only overcount
            raise AssertionError(f"the model under-counts: {model_objective} < {objective}")
        if status == cp_model.OPTIMAL:
            if objective != model_objective:
                raise AssertionError(f"optimal model value {model_objective} != {objective}")
            return make_solution(
                OPTIMAL,
                self.backend,
                bound=objective,
                split=split,
                objective=objective,
                groups=groups,
                recomputed=recomputed,
            )
        return make_solution(
            FEASIBLE,
            self.backend,
            bound=min(bound, objective),
            split=split,
            objective=objective,
            groups=groups,
            recomputed=recomputed,
        )


def solve_cpsat(
    problem: StageProblem,
    *,
    time_limit_s: float = 10.0,
    hint: list[int] | None = None,
    hint_recomputed: list[bool] | None = None,
    hint_groups: list[int] | None = None,
    num_workers: int = 1,
    seed: int = 0,
    dump_path: str | None = None,
) -> StageSolution:
    """Exact assignment by CP-SAT; ``hint`` is a split (layer -> stage) to start from, with
    ``hint_recomputed`` flags under selective recomputation and ``hint_groups`` (group of each
    stage) with a placement (a placed problem gets a complete start without them too)."""
    return CpSatFormulation.solve_problem(
        problem,
        hint=hint,
        hint_recomputed=hint_recomputed,
        hint_groups=hint_groups,
        dump_path=dump_path,
        time_limit_s=time_limit_s,
        num_workers=num_workers,
        seed=seed,
    )
