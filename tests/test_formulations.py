"""CP-SAT and MILP formulations against the brute-force oracle, on random chains and DAGs.

Every test runs on both backends (same formulation, same method names). Random problems are kept
small enough for brute force: L in 2..7 layers, p <= 4 stages, p**L <= 4096 assignments.
"""

from __future__ import annotations

import itertools
import random
from functools import cache, partial

import numpy as np
import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.cpsat import CpSatFormulation, Presolve, solve_cpsat
from solver.backends.milp import MilpFormulation, solve_milp
from solver.backends.problem import (
    FEASIBLE,
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OBJECTIVE_TIME,
    OPTIMAL,
    UNKNOWN,
    StageProblem,
    StageSolution,
)
from solver.costs import LayerCosts, in_flight_microbatches, layer_costs, stage_costs
from solver.errors import InputError
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.random_graphs import random_chain, random_dag, random_problem

BACKENDS = {"cpsat": solve_cpsat, "milp": solve_milp}
SOLVERS = BACKENDS | {"cbc": partial(solve_milp, solver="cbc")}
"""BACKENDS plus the MILP's CBC fallback, which runs on a subset (a subprocess per solve)."""
MAX_ASSIGNMENTS = 4096


def _random_problem(seed: int, objective: str = OBJECTIVE_MEMORY) -> StageProblem:
    """Odd seeds give chains, even seeds DAGs; redrawn until brute force is cheap, and while
    p = 1 (trivial) except for seeds that are multiples of 10."""
    rng = random.Random(seed)
    while True:
        num_layers = rng.randint(2, 7)
        graph = (random_chain if seed % 2 else random_dag)(rng, num_layers)
        problem = random_problem(rng, graph, objective=objective)
        trivial = problem.num_stages == 1 and seed % 10 != 0
        if problem.num_stages**num_layers <= MAX_ASSIGNMENTS and not trivial:
            return problem


@cache
def _case(seed: int, objective: str = OBJECTIVE_MEMORY) -> tuple[StageProblem, StageSolution]:
    problem = _random_problem(seed, objective)
    return problem, solve_brute_force(problem)


def _with(problem: StageProblem, **changes) -> StageProblem:
    fields = dict(
        costs=problem.costs,
        objective=problem.objective,
        capacity_bytes=problem.capacity_bytes,
        iteration_budget_ns=problem.iteration_budget_ns,
    )
    return StageProblem(**fields | changes)


def _check(problem: StageProblem, solution: StageSolution, expected: StageSolution) -> None:
    """Same status and objective as the oracle; a valid split whose objective is recomputed."""
    assert solution.status == expected.status, (solution, expected)
    assert solution.objective == expected.objective, (solution, expected)
    _check_consistent(problem, solution)


def _check_consistent(problem: StageProblem, solution: StageSolution) -> None:
    if solution.has_solution:
        assert problem.violation(solution.stage_of_layer) is None
        assert solution.objective == problem.objective_value(solution.stage_of_layer)
        assert 0 <= solution.bound <= solution.objective
        assert 0.0 <= solution.gap <= 1.0
    if solution.status == OPTIMAL:
        assert solution.bound == solution.objective
    if solution.status in (INFEASIBLE, UNKNOWN):
        assert solution.stage_of_layer is None and solution.objective is None


# -- against brute force --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(60))
def test_memory_objective_matches_brute_force(backend, seed):
    problem, expected = _case(seed)
    _check(problem, BACKENDS[backend](problem), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(100, 120))
def test_time_objective_matches_brute_force(backend, seed):
    problem, expected = _case(seed, OBJECTIVE_TIME)
    _check(problem, BACKENDS[backend](problem), expected)


LIMIT_CASES = [(backend, seed) for backend in BACKENDS for seed in range(200, 220)] + [
    ("cbc", seed) for seed in range(200, 206)
]


@pytest.mark.parametrize("backend, seed", LIMIT_CASES)
def test_limits_match_brute_force(backend, seed):
    """Capacity and budget at the optimum (feasible) and one unit below it (infeasible)."""
    problem, best_memory = _case(seed)
    _, best_time = _case(seed, OBJECTIVE_TIME)
    peak = best_memory.objective
    fastest = best_time.objective
    peak_of_fastest, _ = problem.measure(best_time.stage_of_layer)
    variants = [
        _with(problem, capacity_bytes=peak),
        _with(problem, capacity_bytes=peak - 1),
        _with(problem, iteration_budget_ns=fastest),
        _with(problem, iteration_budget_ns=fastest - 1),
        _with(problem, objective=OBJECTIVE_TIME, capacity_bytes=(peak + peak_of_fastest) // 2),
        _with(problem, objective=OBJECTIVE_TIME, capacity_bytes=peak - 1),
        _with(problem, capacity_bytes=peak_of_fastest, iteration_budget_ns=fastest),
    ]
    statuses = []
    for variant in variants:
        expected = solve_brute_force(variant)
        _check(variant, SOLVERS[backend](variant), expected)
        statuses.append(expected.status)
    assert statuses[:4] == [OPTIMAL, INFEASIBLE, OPTIMAL, INFEASIBLE]


@pytest.mark.parametrize(
    "seed, objective",
    [(seed, OBJECTIVE_MEMORY) for seed in range(8)]
    + [(seed, OBJECTIVE_TIME) for seed in range(100, 104)],
)
def test_cbc_fallback_matches_brute_force(seed, objective):
    problem, expected = _case(seed, objective)
    _check(problem, SOLVERS["cbc"](problem), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_stages_than_layers_is_infeasible(backend):
    problem, _ = _case(1)
    config = ParallelConfig(
        pp=problem.num_layers + 1, tp=1, dp=1, micro_batch=1, num_microbatches=2
    )
    costs = LayerCosts(
        **{
            name: getattr(problem.costs, name)
            for name in (
                "weight_bytes",
                "grad_bytes",
                "optimizer_bytes",
                "stored_bytes",
                "transient_bytes",
                "time_ns",
                "dp_sync_ns",
                "edge_src",
                "edge_dst",
                "edge_bytes",
            )
        },
        config=config,
        in_flight=[2] * config.pp,
    )
    solution = BACKENDS[backend](StageProblem(costs=costs))
    assert solution.status == INFEASIBLE and not solution.has_solution


# -- a DAG worked out by hand -------------------------------------------------------------------


def _branch_and_skip_dag() -> StageProblem:
    """0 -> 1 -> {2, 3} -> 4 -> 5 with a skip 0 -> 5 (5 bytes); other edges 2 bytes.

    States (bytes) 60 10 30 30 10 60, nothing stored, no transient; p = 3, m = 4 under 1F1B,
    so k = (3, 2, 1). Layer 0 is the only source and 5 the only sink: stages 0 and 2. Hence the
    skip edge always crosses stage 1, which holds it k_1 = 2 times (10 B of activations) and
    receives and sends it (2 x 5 = 10 B of buffers).

    Split {0, 1} {2, 3} {4, 5}:
      stage 0: 70 + out (1->2, 1->3, 0->5) 9                              = 79
      stage 1: 60 + in (1->2, 1->3) 4 + out (2->4, 3->4) 4 + relay 10 + 10 = 88
      stage 2: 70 + in (2->4, 3->4, 0->5) 9                               = 79
    Any other split has a stage with 3 of the heavy layers (>= 100 of state) or a stage 1 of
    more than 60 of state plus the 20 relay bytes ({2, 3, 4}: 70 + 4 + 2 + 20 = 96;
    {1, 2, 3}: 96; {1, 2, 3, 4}: 104), or a single branch on stage 1 with its sibling beside a
    heavy end layer (>= 100 on that stage). So 88 is the unique optimum; without the relay
    stage 1 would hold 68 and this split would peak at 79.
    """
    config = ParallelConfig(pp=3, tp=1, dp=1, micro_batch=1, num_microbatches=4)
    edges = [(0, 1, 2), (0, 5, 5), (1, 2, 2), (1, 3, 2), (2, 4, 2), (3, 4, 2), (4, 5, 2)]
    zeros = np.zeros(6, dtype=np.int64)
    costs = LayerCosts(
        config=config,
        weight_bytes=np.array([60, 10, 30, 30, 10, 60], dtype=np.int64),
        grad_bytes=zeros,
        optimizer_bytes=zeros,
        stored_bytes=zeros,
        transient_bytes=zeros,
        time_ns=np.ones(6, dtype=np.int64),
        dp_sync_ns=zeros,
        edge_src=np.array([u for u, _, _ in edges]),
        edge_dst=np.array([v for _, v, _ in edges]),
        edge_bytes=np.array([b for _, _, b in edges]),
        in_flight=[in_flight_microbatches("1f1b", 4, 3, s) for s in range(3)],
        receive_copies=[0, 1, 1],  # one buffer per boundary side, as worked out above
        send_copies=[1, 1, 0],
    )
    assert costs.in_flight == [3, 2, 1]
    return StageProblem(costs=costs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_branch_and_skip_dag_counts_the_relay(backend):
    problem = _branch_and_skip_dag()
    solution = BACKENDS[backend](problem)
    assert solution.status == OPTIMAL
    assert solution.stage_of_layer == [0, 0, 1, 1, 2, 2]
    assert solution.objective == 88
    middle = stage_costs(problem.costs, solution.stage_of_layer)[1]
    assert middle.activation_bytes == 2 * 5  # k_1 x relayed skip edge
    assert middle.buffer_bytes == 4 + 4 + 2 * 5
    assert [s.peak_bytes for s in stage_costs(problem.costs, solution.stage_of_layer)] == [
        79,
        88,
        79,
    ]
    assert solve_brute_force(problem).objective == 88  # the hand calculation, cross-checked
    tight = BACKENDS[backend](_with(problem, capacity_bytes=88))
    assert tight.status == OPTIMAL and tight.objective == 88
    assert BACKENDS[backend](_with(problem, capacity_bytes=87)).status == INFEASIBLE


def test_presolve_of_branch_and_skip_dag():
    """Source pinned to stage 0, sink to stage 2, 1 before the last stage and 4 after the first
    (one layer on each side at least); a branch layer may sit alone on stage 1 with its sibling
    later, so the edges into and out of the branches can jump a stage, but 0 -> 1 and 4 -> 5
    cannot (no layer fits between them)."""
    presolve = Presolve.of(_branch_and_skip_dag())
    assert presolve.first_stage == [0, 0, 0, 0, 1, 2]
    assert presolve.last_stage == [0, 1, 2, 2, 2, 2]
    assert presolve.max_span == [1, 2, 2, 2, 2, 2, 1]


# -- the cuts are valid ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(0, 40, 3))
def test_presolve_cuts_hold_for_every_valid_split(seed):
    """Stage ranges, edge spans and the objective lower bound never cut off a valid split."""
    problem, expected = _case(seed)
    presolve = Presolve.of(problem)
    costs = problem.costs
    for split in itertools.product(range(problem.num_stages), repeat=problem.num_layers):
        if problem.violation(split) is not None:
            continue
        assert all(presolve.can_hold(layer, s) for layer, s in enumerate(split))
        spans = np.asarray(split)[costs.edge_dst] - np.asarray(split)[costs.edge_src]
        assert np.all(spans <= presolve.max_span)
        assert presolve.objective_lower_bound(problem) <= problem.objective_value(split)
        peak, _ = problem.measure(split)
        assert presolve.peak_lb_bytes <= peak <= presolve.peak_ub_bytes


# -- time limits, hints, dumps, determinism -----------------------------------------------------


def _large_dag(seed: int = 7, num_layers: int = 60, pp: int = 8) -> StageProblem:
    graph = random_dag(random.Random(seed), num_layers)
    config = ParallelConfig(pp=pp, tp=1, dp=2, micro_batch=1, num_microbatches=16)
    costs = layer_costs(
        graph,
        config,
        Cluster(num_gpus=config.num_gpus),
        TrainingConfig(global_batch=config.global_batch),
    )
    return StageProblem(costs=costs)


def _even_split(problem: StageProblem) -> list[int]:
    """Positions are topological, so cutting the order into p runs is a valid split."""
    return [layer * problem.num_stages // problem.num_layers for layer in range(problem.num_layers)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_time_limit_gives_a_sane_status(backend):
    problem = _large_dag()
    solution = BACKENDS[backend](problem, time_limit_s=0.02)
    assert solution.status in (OPTIMAL, FEASIBLE, UNKNOWN)
    _check_consistent(problem, solution)
    assert solution.bound >= Presolve.of(problem).objective_lower_bound(problem)
    if solution.status == FEASIBLE:
        assert solution.bound < solution.objective and solution.gap > 0
    assert solution.wall_s < 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_hint_is_used_under_a_time_limit(backend):
    problem = _large_dag()
    hint = _even_split(problem)
    assert problem.violation(hint) is None
    solution = BACKENDS[backend](problem, time_limit_s=0.05, hint=hint)
    assert solution.status in (OPTIMAL, FEASIBLE)
    assert solution.objective <= problem.objective_value(hint)
    _check_consistent(problem, solution)
    if solution.status == FEASIBLE:
        assert solution.gap > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_optimal_hint_keeps_the_optimum(backend):
    problem, expected = _case(10)
    solution = BACKENDS[backend](problem, hint=expected.stage_of_layer)
    _check(problem, solution, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_hint_is_an_input_error(backend):
    problem, _ = _case(3)
    with pytest.raises(InputError):
        BACKENDS[backend](problem, hint=[0] * (problem.num_layers + 1))
    with pytest.raises(InputError):
        BACKENDS[backend](problem, hint=[problem.num_stages] * problem.num_layers)


def test_unknown_milp_solver_is_an_input_error():
    with pytest.raises(InputError):
        solve_milp(_case(3)[0], solver="gurobi")


@pytest.mark.parametrize(
    "backend, suffix, marker",
    [("cpsat", "model.pb.txt", "variables"), ("milp", "model.lp", "Minimize")],
)
def test_model_dump(backend, suffix, marker, tmp_path):
    problem, _ = _case(4)
    path = tmp_path / suffix
    BACKENDS[backend](problem, dump_path=str(path))
    assert marker in path.read_text()


def test_cpsat_one_worker_is_deterministic():
    problem = _large_dag(seed=11, num_layers=30, pp=6)
    first = solve_cpsat(problem, seed=3)
    second = solve_cpsat(problem, seed=3)
    assert first.status == OPTIMAL
    assert first.stage_of_layer == second.stage_of_layer


def test_same_rules_in_both_formulations():
    """Both backends build the one formulation of solver/backends/formulation.py: every constraint
    family
    is written once there, with a one-line formula docstring, and neither backend overrides it."""
    from solver.backends.formulation import PrefixFormulation

    rules = {  # its own and its mixins' (formulation_rules.py)
        name
        for name in dir(PrefixFormulation)
        if name.startswith(("_add_", "_build_variables", "_set_objective"))
    }
    assert {"_add_precedence", "_add_relay", "_add_iteration_budget", "_set_objective"} <= rules
    for cls in (CpSatFormulation, MilpFormulation):
        assert issubclass(cls, PrefixFormulation)
        assert not rules & set(vars(cls)), f"{cls.__name__} overrides a shared rule"
    for name in rules - {"_add_constraints"}:
        assert getattr(PrefixFormulation, name).__doc__, f"{name} needs a formula docstring"
