"""Incumbents and honest status (issue 17, points 1 and 3): every config gets a valid quick split
before any exact solve, a search cut by its time limit still returns a plan, exit 4 only when no
quick split fits in time, and the notes say which search was not proven and why."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from solver import Cluster, TrainingConfig
from solver.backends.brute_force import solve_brute_force
from solver.backends.problem import (
    FEASIBLE,
    OBJECTIVE_MEMORY,
    OBJECTIVE_TIME,
    OPTIMAL,
    StageProblem,
)
from solver.costs import iteration_bound_ns, stage_costs
from solver.errors import NoSolutionError
from solver.search.config_search import Deadline, build_entries, search
from solver.search.incumbents import QUICK_METHODS, QuickMethod, incumbent, one_chunk_per_rank
from solver.search.planner import _PlanningCall, _solver_report, plan
from tests.random_graphs import random_chain, random_dag

CLUSTER = Cluster(num_gpus=8, gpus_per_node=2)


def _entries(graph, **training_options):
    options = {"global_batch": 16, "max_slowdown": None} | training_options
    return build_entries(graph, CLUSTER, TrainingConfig(**options))


def _cost_model_value(problem: StageProblem, solution) -> int:
    """The objective of a solution recomputed from ``costs.stage_costs`` directly."""
    flags = solution.recomputed if problem.selective else None
    stages = stage_costs(problem.costs, solution.stage_of_layer, flags)
    if problem.objective == OBJECTIVE_MEMORY:
        return max(stage.peak_bytes for stage in stages)
    return iteration_bound_ns(problem.costs, stages)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("objective", [OBJECTIVE_MEMORY, OBJECTIVE_TIME])
def test_every_config_gets_a_valid_quick_split_equal_to_the_cost_model(seed, objective):
    """DAGs, interleaved and selective configs: a split every config accepts, its objective
    recomputed by the cost model, no better than the brute-force optimum, no worse than the
    even split, OPTIMAL exactly when it meets the config's bound."""
    rng = random.Random(1700 + seed)
    graph = (random_dag if seed % 2 else random_chain)(rng, 7)
    options = [{}, {"virtual_stages": (1, 2)}, {"recompute": "selective"}][seed % 3]
    entries = _entries(graph, **options)
    assert entries
    for entry in entries:
        problem = StageProblem(costs=entry.costs, objective=objective)
        bound = entry.memory_bound if objective == OBJECTIVE_MEMORY else entry.time_bound
        solution = incumbent(problem, entry.splits, bound=bound, time_limit_s=5.0)
        assert solution is not None, entry.costs.config.label()
        assert problem.violation(solution.stage_of_layer, solution.recomputed) is None
        assert solution.objective == _cost_model_value(problem, solution)
        even = problem.objective_value(entry.splits["even"])
        assert solution.objective <= even
        assert solution.bound == min(bound, solution.objective)
        assert (solution.status == OPTIMAL) == (solution.objective <= bound)
        if problem.num_layers <= 7 and not problem.selective:
            assert solve_brute_force(problem).objective <= solution.objective


@pytest.mark.slow
def test_quick_splits_respect_capacity_and_budget():
    """A split over the capacity or the iteration budget is no incumbent: with the capacity at
    the optimum (below the even split) only a split at the optimum may be returned."""
    rng = random.Random(17)
    graph = random_dag(rng, 8)
    for entry in _entries(graph, pp=4):
        loose = StageProblem(costs=entry.costs)
        optimum = solve_brute_force(loose).objective
        even = loose.objective_value(entry.splits["even"])
        tight = dataclasses.replace(loose, capacity_bytes=optimum)
        found = incumbent(tight, entry.splits, bound=entry.memory_bound, time_limit_s=1.0)
        assert found is None or found.objective == optimum
        if even > optimum and loose.objective_value(entry.splits["parameters"]) > optimum:
            assert found is None
        iteration = loose.measure(entry.splits["even"])[1]
        timed = dataclasses.replace(loose, iteration_budget_ns=iteration - 1)
        found = incumbent(timed, entry.splits, bound=entry.memory_bound, time_limit_s=1.0)
        assert found is None or timed.violation(found.stage_of_layer) is None


def test_selective_chain_tries_the_uniform_recompute_optima():
    """The quick method for selective chains is the better of the exact chain optima with no
    layer and with every layer recomputed: never worse than either baseline split."""
    assert "uniform-recompute" in [method.name for method in QUICK_METHODS]
    graph = random_chain(random.Random(5), 8)
    for entry in _entries(graph, recompute="selective", pp=4):
        problem = StageProblem(costs=entry.costs)
        with_methods = incumbent(problem, entry.splits, bound=entry.memory_bound, time_limit_s=5.0)
        splits_only = incumbent(
            problem, entry.splits, bound=entry.memory_bound, time_limit_s=5.0, methods=[]
        )
        assert with_methods.objective <= splits_only.objective


def _expire_after_bounding(monkeypatch):
    """The planning call's deadline passes as soon as every config is bounded: no exact solve
    gets any time (what a large DAG at a short --time-limit meets)."""
    import solver.search.planner

    real = solver.search.planner.bound_entries

    def bound_then_expire(graph, cluster, training, *, deadline):
        entries, unbounded = real(graph, cluster, training, deadline=deadline)
        deadline.end = 0.0
        return entries, unbounded

    monkeypatch.setattr(solver.search.planner, "bound_entries", bound_then_expire)


def _search_past_its_deadline(entries):
    """A smallest-peak CP-SAT search whose deadline has passed before it starts."""
    return search(
        entries,
        objective=OBJECTIVE_MEMORY,
        capacity_bytes=None,
        iteration_budget_ns=None,
        backend="cpsat",
        deadline=Deadline(end=0.0),
    )


def test_a_search_cut_before_any_solve_returns_its_best_quick_split():
    graph = random_dag(random.Random(3), 6)
    entries = _entries(graph)
    result = _search_past_its_deadline(entries)
    assert result.entry is not None and result.solved == 0
    assert result.incumbents >= 1 and result.time_limit_reached
    assert not result.proven or result.open_configs == 0
    problem = StageProblem(costs=result.entry.costs)
    assert result.value == _cost_model_value(problem, result.solution)
    assert result.bound <= result.value
    full = search(
        entries,
        objective=OBJECTIVE_MEMORY,
        capacity_bytes=None,
        iteration_budget_ns=None,
        backend="cpsat",
        deadline=Deadline.after(30),
    )
    assert full.proven and result.bound <= full.value <= result.value
    assert full.incumbent_s < full.wall_s


def test_plan_cut_by_the_time_limit_is_a_feasible_plan_with_honest_notes(monkeypatch):
    """Before issue 17 this raised NoSolutionError (exit 4): no exact solve had time."""
    from solver.report.plan_report import plan_to_dict

    _expire_after_bounding(monkeypatch)
    graph = random_dag(random.Random(4), 8)
    result = plan(graph, CLUSTER, TrainingConfig(global_batch=16), backend="cpsat")
    report = result.solver
    assert report.status == FEASIBLE and report.time_limit_reached
    assert any(
        note.startswith("time limit reached: best plan found, not proven optimal")
        for note in report.notes
    )
    assert [s.name for s in report.searches] == ["fastest plan", "smallest peak"]
    assert [s.role for s in report.searches] == ["max-slowdown budget", "answer"]
    assert all(s.configs_with_incumbent for s in report.searches)
    answer = report.searches[-1]
    assert answer.time_limit_reached and not answer.proven and answer.configs_open
    assert any("quick" in note for note in report.notes)
    assert any(note.startswith("the result depends on the time given") for note in report.notes)
    assert report.bound <= result.peak_bytes == report.objective
    document = plan_to_dict(result)["solver"]
    assert document["time_limit_reached"] and len(document["searches"]) == 2


def test_exit_4_only_when_no_quick_split_fits_in_time(monkeypatch):
    """The capacity is the optimum and every baseline split needs more: with no time for an
    exact solve nothing is found (exit 4); with time, the optimum is proven."""
    graph = random_chain(random.Random(6), 8)
    pinned = {"global_batch": 16, "pp": 4, "tp": 1, "max_slowdown": None}
    entries = _entries(graph, **pinned)
    optimum = min(solve_brute_force(StageProblem(costs=e.costs)).objective for e in entries)
    quick = min(
        StageProblem(costs=e.costs).objective_value(split)
        for e in entries
        for split in e.splits.values()
    )
    assert quick > optimum  # the baseline splits all break the capacity below
    cluster = dataclasses.replace(CLUSTER, gpu_memory_bytes=optimum)  # the API keeps no reserve
    proven = plan(graph, cluster, TrainingConfig(**pinned), time_limit_s=30)
    assert proven.solver.status == OPTIMAL and proven.peak_bytes == optimum
    _expire_after_bounding(monkeypatch)
    with pytest.raises(NoSolutionError, match="no quick split tried fits") as caught:
        plan(graph, cluster, TrainingConfig(**pinned))
    assert caught.value.exit_code == 4


def test_a_proven_plan_has_no_notes_and_every_search_proven():
    graph = random_chain(random.Random(1), 8)
    result = plan(graph, CLUSTER, TrainingConfig(global_batch=16), time_limit_s=30)
    report = result.solver
    # the one note left is about the graph (no meta.architecture: the engine rules unchecked)
    notes = [note for note in report.notes if not note.startswith("engine rules not checked")]
    assert report.status == OPTIMAL and notes == [] and not report.time_limit_reached
    assert [s.proven for s in report.searches] == [True, True]
    assert all(not s.time_limit_reached and s.configs_open == 0 for s in report.searches)


def test_unproven_fastest_plan_search_is_named_with_a_zero_gap():
    """The smallest-peak search is proven (0% gap) but the fastest-plan search behind the
    --max-slowdown budget left configs open at their share of the time limit, which was not
    reached: the plan is FEASIBLE, the note names that search and does not claim the time
    limit."""
    graph = random_dag(random.Random(2), 8)
    training = TrainingConfig(global_batch=16)
    entries = build_entries(graph, CLUSTER, training)
    common = {"capacity_bytes": None, "backend": "cpsat", "deadline": Deadline.after(30)}
    fastest = search(entries, objective=OBJECTIVE_TIME, iteration_budget_ns=None, **common)
    budget = int(1.25 * fastest.value)
    smallest = search(entries, objective=OBJECTIVE_MEMORY, iteration_budget_ns=budget, **common)
    assert fastest.proven and smallest.proven
    # the fastest-plan search as a share-limited interleaved search ends: two configs open
    unproven = dataclasses.replace(fastest, proven=False, open_configs=2)
    call = _PlanningCall(
        graph=graph,
        cluster=CLUSTER,
        training=training,
        entries=entries,
        backend="cpsat",
        deadline=Deadline.after(30),
        num_workers=1,
        time_limit_s=60.0,
        searches=[(OBJECTIVE_TIME, unproven), (OBJECTIVE_MEMORY, smallest)],
    )
    report = _solver_report(
        smallest, proven=False, configs_total=len(entries), started=0, call=call
    )
    assert report.status == FEASIBLE and report.gap == 0.0 and not report.time_limit_reached
    note, depends = report.notes
    assert depends.startswith("the result depends on the time given: a search stopped at its")
    assert "may return different plans" in depends and "(--time-limit 120 or more)" in depends
    assert note.startswith("the fastest plan search behind the --max-slowdown budget (1.25 x")
    assert "left 2 configs open (each stopped at its share of the time limit (60 s)" in note
    assert "which was not reached" in note and "budget itself is not proven" in note
    assert not note.startswith("time limit reached")


def test_a_plugged_quick_method_is_used_and_checked():
    """A method of the list (here the brute force, exact on small graphs) lifts the incumbent
    to the optimum where the baseline splits miss it; a method whose split breaks the capacity
    is ignored."""
    graph = random_dag(random.Random(6), 8)  # its even and parameter splits miss the optimum
    (entry,) = _entries(graph, pp=4, tp=1, micro_batch_sizes=(1,))
    problem = StageProblem(costs=entry.costs)
    best = solve_brute_force(problem)
    assert min(problem.objective_value(split) for split in entry.splits.values()) > best.objective
    exact = QuickMethod(
        name="exact",
        split=lambda problem, *, time_limit_s: solve_brute_force(problem),
        applies=one_chunk_per_rank,
    )
    found = incumbent(
        problem, entry.splits, bound=entry.memory_bound, time_limit_s=5, methods=[exact]
    )
    assert found.backend == "exact" and found.objective == best.objective
    even = dataclasses.replace(best, stage_of_layer=entry.splits["even"])
    over = QuickMethod(name="over", split=lambda problem, *, time_limit_s: even)
    tight = dataclasses.replace(problem, capacity_bytes=best.objective)
    assert incumbent(tight, {}, bound=entry.memory_bound, time_limit_s=5, methods=[over]) is None
    loose = incumbent(problem, {}, bound=entry.memory_bound, time_limit_s=5, methods=[over])
    assert loose.backend == "over" and loose.objective == problem.objective_value(
        even.stage_of_layer
    )


def test_the_incumbent_pass_stops_at_its_share_once_a_plan_stands(monkeypatch):
    """The exact chain configs give a plan first; then the CP-SAT configs' quick splits run
    only within ``INCUMBENT_SHARE`` of the time left. Before, each config that might beat the
    plan was seeded whatever the time (a second per split-backward config at full size:
    ``--schedule auto`` overran a 30 s limit by 25 s)."""
    import solver.search.config_search as config_search

    graph = random_chain(random.Random(8), 8)
    entries = _entries(graph, virtual_stages=(1, 2))
    seeded = []

    def slow_incumbent(problem, splits, **options):
        seeded.append(problem.costs.config.label())
        time.sleep(0.3)  # past the pass's share (0.2 of 1 s) after the first config
        return incumbent(problem, splits, **options)

    monkeypatch.setattr(config_search, "incumbent", slow_incumbent)
    result = search(
        entries,
        objective=OBJECTIVE_MEMORY,
        capacity_bytes=None,
        iteration_budget_ns=None,
        backend="auto",
        deadline=Deadline.after(1.0),
    )
    plain = [e for e in entries if not e.costs.rank_rows]
    chain_best = min(solve_brute_force(StageProblem(costs=e.costs)).objective for e in plain)
    could_beat = [e for e in entries if e.costs.rank_rows and e.memory_bound <= chain_best]
    assert len(could_beat) > 1  # without the stop every one of them was seeded
    assert len(seeded) == 1
    assert result.value <= chain_best


def test_the_budget_search_leaves_the_answer_its_share_of_the_time(monkeypatch):
    """Under --max-slowdown the fastest-plan search (the budget) ends by
    ``BUDGET_SEARCH_SHARE`` of the time left, so the smallest-peak search that answers has the
    rest; under --objective throughput it is the answer and has all of it."""
    import solver.search.planner as planner

    real = planner.search
    calls = []

    def recorded(entries, **options):
        calls.append((options["objective"], time.perf_counter(), options["deadline"].end))
        return real(entries, **options)

    monkeypatch.setattr(planner, "search", recorded)
    graph = random_dag(random.Random(2), 8)
    plan(graph, CLUSTER, TrainingConfig(global_batch=16), backend="cpsat", time_limit_s=60)
    (fastest, asked, budget_end), (smallest, _, answer_end) = calls
    assert (fastest, smallest) == (OBJECTIVE_TIME, OBJECTIVE_MEMORY)
    share = planner.BUDGET_SEARCH_SHARE
    assert budget_end == pytest.approx(asked + share * (answer_end - asked), abs=0.01)
    assert answer_end - budget_end > 20  # the answer's half of a minute
    calls.clear()
    throughput = TrainingConfig(global_batch=16, objective="throughput")
    started = time.perf_counter()
    plan(graph, CLUSTER, throughput, backend="cpsat", time_limit_s=60)
    assert calls[0][0] == OBJECTIVE_TIME and calls[0][2] > started + 55


def test_with_no_plan_the_quick_splits_stop_at_the_grace_past_the_deadline(monkeypatch):
    """While no plan stands the quick splits go on past the deadline, but only for
    ``NO_PLAN_GRACE_SHARE`` of the search's time (at least ``CUT_OFF_S``): a split-backward
    search whose splits all broke the capacity overran a 30 s limit by 50 s, then found none."""
    import solver.search.config_search as config_search

    graph = random_dag(random.Random(3), 6)
    entries = _entries(graph)
    tried = []

    def slow_and_none(problem, splits, **options):
        tried.append(problem.costs.config.label())
        time.sleep(0.2)
        return None

    monkeypatch.setattr(config_search, "incumbent", slow_and_none)
    started = time.perf_counter()
    result = _search_past_its_deadline(entries)
    took = time.perf_counter() - started
    assert result.entry is None and result.time_limit_reached
    assert len(entries) > 5 > len(tried) >= 1  # 0.5 s of 0.2 s splits, not one per config
    assert took < config_search.CUT_OFF_S + 0.2 + 0.5
