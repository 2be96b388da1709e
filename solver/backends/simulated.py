"""Bound and simulate: the exact search of a problem whose time is the SIMULATED iteration.

Every backend's model constrains and minimises the iteration bound (``costs.iteration_bound_ns``,
docs/cost-model.md "Time"), never above the simulated schedule (``costs.stages_iteration_ns``)
but below it where the schedule waits in ways the bound's terms do not see (interleaved 1F1B,
the split-backward schedules). A plan's time is the simulation, so (``StageProblem.simulated``):

- objective time: the incumbent U is the best SIMULATED split so far (the start: the config's
  incumbent, e.g. its even and chunk-balanced splits). Each round solves the bound problem with
  the bound held below U (budget U - 1) and every split simulated so far cut off
  (``StageProblem.excluded``), simulates the split found and keeps it when it beats U. No split
  left with a bound below U: U is optimal (OPTIMAL). The time limit first: FEASIBLE, with the
  honest lower bound min(U, the last round's bound) (a split not cut off has a simulated time
  >= its bound; one cut off >= U).
- a budget on the time (a throughput floor): the split found passes only when its simulated
  time meets the budget; one that does not is cut off and the problem solved again. The last
  round's bound stays a lower bound (only splits over the budget were cut).

Backends that take cuts (:data:`CUT_BACKENDS`: the CP-SAT and MILP formulation, the only ones
that solve these schedules) run these rounds; one that could not leave a split out would solve
the bound once, its answer OPTIMAL only when its simulated time equals its bound, else FEASIBLE
with that gap. 1F1B and GPipe at one chunk per rank keep the bound (``needs_simulation``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from solver.backends.problem import (
    FEASIBLE,
    INFEASIBLE,
    OBJECTIVE_TIME,
    OPTIMAL,
    UNKNOWN,
    StageProblem,
    StageSolution,
    assignment_key,
)

CUT_BACKENDS = ("cpsat", "milp")
"""Backends whose model takes the cut-off splits (``PrefixFormulation._add_excluded``)."""
MIN_ROUND_S = 0.01
"""The least time limit of one round's solve."""

BoundSolve = Callable[..., StageSolution]
"""``solve_bound(problem, *, time_limit_s, hint, hint_recomputed, hint_groups)``: one backend's
solve of the bound problem (``simulated`` False)."""


def needs_simulation(problem: StageProblem) -> bool:
    """The problem's time (objective or budget) is the simulated one and has times at all, on
    an interleaved or split-backward schedule (``LayerCosts.rank_rows``). Without them (1F1B,
    GPipe at one chunk per rank) the search keeps the bound as it was: NOT exact either (the
    simulation runs a few ns over the bound on every split tried, and GPipe's bound-optimal
    split can simulate ~10% slower than the best one), left for a follow-up."""
    timed = problem.objective == OBJECTIVE_TIME or problem.iteration_budget_ns is not None
    costs = problem.costs
    return problem.simulated and timed and costs.rank_rows and costs.has_compute_time


@dataclasses.dataclass
class _Incumbent:
    """The best simulated assignment so far."""

    value: int
    solution: StageSolution


def solve_simulated(
    problem: StageProblem,
    solve_bound: BoundSolve,
    *,
    cuts: bool,
    time_limit_s: float,
    hint: list[int] | None = None,
    hint_recomputed: list[bool] | None = None,
    hint_groups: list[int] | None = None,
) -> StageSolution:
    """The module docstring's search: ``problem.simulated`` must be True; ``solve_bound`` solves
    its bound problem, taking cuts when ``cuts``."""
    started = time.perf_counter()
    end = started + time_limit_s
    relaxed = dataclasses.replace(problem, simulated=False)
    excluded: list[tuple] = []
    best: _Incumbent | None = None
    if problem.objective == OBJECTIVE_TIME and hint is not None:
        flags = hint_recomputed if problem.selective else None
        if problem.violation(hint, flags, hint_groups) is None:
            value = problem.objective_value(hint, flags, hint_groups)
            best = _Incumbent(value, _solution(hint, flags, hint_groups, value, "hint"))
            excluded.append(assignment_key(hint, flags, hint_groups))
            hint = hint_recomputed = hint_groups = None
    lower = None  # the rounds' best bound (None: nothing left below the incumbent)
    floor = 0  # every round's space is within the first's: its bound holds for all of them
    while True:
        budget = relaxed.iteration_budget_ns
        if problem.objective == OBJECTIVE_TIME and best is not None:
            budget = best.value - 1 if budget is None else min(budget, best.value - 1)
        rounds = dataclasses.replace(relaxed, iteration_budget_ns=budget, excluded=tuple(excluded))
        found = solve_bound(
            rounds,
            time_limit_s=max(end - time.perf_counter(), MIN_ROUND_S),
            hint=hint,
            hint_recomputed=hint_recomputed,
            hint_groups=hint_groups,
        )
        hint = hint_recomputed = hint_groups = None
        floor = max(floor, found.bound) if found.status != INFEASIBLE else floor
        lower = None if found.status == INFEASIBLE else floor
        if not found.has_solution:
            break  # INFEASIBLE: nothing left below U; UNKNOWN: the time ran out
        split, flags, groups = found.stage_of_layer, found.recomputed, found.group_of_stage
        simulated = problem.iteration_of(rounds.stages(split, flags, groups), split)
        if problem.objective != OBJECTIVE_TIME:
            if simulated <= problem.iteration_budget_ns or not cuts:
                # the first split of the least bound that passes (a DP: the bound's answer)
                return _finish(found, found.objective, found.bound, started)
        else:
            if best is None or simulated < best.value:
                best = _Incumbent(simulated, dataclasses.replace(found, objective=simulated))
            if found.status == OPTIMAL and found.objective == simulated:
                lower = None  # every split left has a simulated time >= this split's bound
                break
            if not cuts:
                break
        if time.perf_counter() >= end:
            break
        excluded.append(assignment_key(split, flags, groups))
    if problem.objective != OBJECTIVE_TIME:  # no split found meets the budget
        empty = _empty(found.backend, 0 if lower is None else lower)
        status = INFEASIBLE if lower is None else UNKNOWN
        return dataclasses.replace(empty, status=status, wall_s=time.perf_counter() - started)
    if best is None:
        return dataclasses.replace(found, wall_s=time.perf_counter() - started)
    bound = best.value if lower is None else min(best.value, lower)
    return _finish(best.solution, best.value, bound, started)


def _finish(solution: StageSolution, value: int, bound: int, started: float) -> StageSolution:
    """The solution with its objective and proven lower bound; OPTIMAL when they meet."""
    return dataclasses.replace(
        solution,
        status=OPTIMAL if bound >= value else FEASIBLE,
        objective=value,
        bound=min(bound, value),
        wall_s=time.perf_counter() - started,
    )


def _solution(split, flags, groups, value: int, backend: str) -> StageSolution:
    return StageSolution(
        status=FEASIBLE,
        stage_of_layer=[int(s) for s in split],
        objective=value,
        bound=0,
        wall_s=0.0,
        backend=backend,
        group_of_stage=None if groups is None else list(groups),
        recomputed=None if flags is None else [bool(f) for f in flags],
    )


def _empty(backend: str, bound: int) -> StageSolution:
    return StageSolution(
        status=UNKNOWN, stage_of_layer=None, objective=None, bound=bound, wall_s=0.0,
        backend=backend,
    )


__all__ = ["CUT_BACKENDS", "needs_simulation", "solve_simulated"]
