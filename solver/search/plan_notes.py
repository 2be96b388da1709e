"""The solver report of a plan: each search's status and the notes that say why a plan is not
proven optimal."""

from __future__ import annotations

import time
from typing import Protocol

from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, OPTIMAL
from solver.parallel import ZERO_BUBBLE_SCHEDULES
from solver.report.baselines import BASELINES
from solver.search.config_search import Deadline, SearchResult
from solver.search.incumbents import QUICK_METHODS
from solver.specs import SearchStatus, SolverReport, TrainingConfig


class _PlanningCall(Protocol):
    """What the report reads of a planning call (``solver.search.planner._PlanningCall``)."""

    training: TrainingConfig
    deadline: Deadline
    time_limit_s: float | None
    searches: list[tuple[str, SearchResult]]


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
        return [
            "time limit reached: best plan found, not proven optimal",
            time_dependence_note(None if call is None else call.time_limit_s),
        ]
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
    if notes:
        notes.append(time_dependence_note(call.time_limit_s))
    return notes


def time_dependence_note(time_limit_s: float | None) -> str:
    """The last note of a plan not proven optimal: every unproven search stopped at the time
    limit (or its share of it), so the plan depends on the time given and the machine's speed."""
    longer = "a longer --time-limit" if not time_limit_s else f"--time-limit {2 * time_limit_s:g}"
    return (
        "the result depends on the time given: a search stopped at its time limit without "
        "proving optimality, so runs with the same inputs may return different plans (the "
        f"machine's speed and load decide how far each gets); give it longer ({longer} or more) "
        "to prove or improve it"
    )


SPLIT_SCHEDULE_ACCURACY = (
    "its memory is predicted within 0.0% to +0.42% of the torch engine's live tensors "
    "(benchmarks/bench_accuracy_schedules.md's 28 ranks, median |error| 0.0%, none under); "
    "check it on your model with python -m profiling.validate"
)
"""How close the split-backward schedules' per-action moments are measured to be (issue 31;
docs/cost-model.md, "Zero-bubble and V schedules")."""


def split_schedule_notes(schedule: str) -> list[str]:
    """A note on a plan run by a split-backward schedule (``ZERO_BUBBLE_SCHEDULES``): how close
    its per-rank peaks were measured and what they miss (``SPLIT_SCHEDULE_ACCURACY``)."""
    if schedule not in ZERO_BUBBLE_SCHEDULES:
        return []
    return [f"schedule {schedule}: {SPLIT_SCHEDULE_ACCURACY}"]


def unbounded_note(unbounded: list, total: int) -> str:
    """Why a plan is not proven when the time limit passed while its configs were bounded
    (``config_search.bound_entries``): which were left out."""
    return (
        f"time limit reached while bounding the candidate configs: {len(unbounded)} of {total} "
        f"(e.g. {unbounded[0].label()}) were neither bounded nor searched, so this plan is the "
        "best of the others and its gap is not bounded; raise --time-limit, or pin --schedule "
        "or --pp to search them"
    )
