"""CP-SAT, MILP and the exact chain algorithm agree on the optimum (and with brute force where
enumeration is tractable); every reported peak recomputes from the cost model."""

from __future__ import annotations

import dataclasses
import random

import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.chain import solve_chain
from solver.backends.cpsat import solve_cpsat
from solver.backends.milp import solve_milp
from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, OPTIMAL, StageProblem
from solver.costs import layer_costs
from solver.specs import Cluster, TrainingConfig
from tests.random_graphs import random_chain, random_config, random_dag, random_problem

BACKENDS = {"chain": solve_chain, "cpsat": solve_cpsat, "milp": solve_milp}


def solve_all(problem):
    solutions = {
        name: solve(problem, time_limit_s=30) if name != "chain" else solve(problem)
        for name, solve in BACKENDS.items()
    }
    for name, solution in solutions.items():
        assert solution.status == OPTIMAL, (name, solution)
        assert problem.violation(solution.stage_of_layer) is None, name
        assert solution.objective == problem.objective_value(solution.stage_of_layer), name
        assert solution.bound == solution.objective, name
    return {name: solution.objective for name, solution in solutions.items()}


@pytest.mark.parametrize("seed", range(50))
def test_three_backends_and_brute_force_agree_on_small_chains(seed):
    rng = random.Random(1000 + seed)
    graph = random_chain(rng, rng.randint(3, 7))
    objective = OBJECTIVE_TIME if seed % 5 == 4 else OBJECTIVE_MEMORY
    problem = random_problem(rng, graph, objective=objective)
    if seed % 3 == 0:  # a binding throughput budget: halfway between fastest and slowest split
        fastest = solve_brute_force(random_problem_like(problem, OBJECTIVE_TIME)).objective
        problem.iteration_budget_ns = fastest + (fastest // 10)
    values = solve_all(problem)
    oracle = solve_brute_force(problem)
    assert set(values.values()) == {oracle.objective}


@pytest.mark.parametrize("seed", range(6))
def test_three_backends_agree_on_larger_chains(seed):
    rng = random.Random(2000 + seed)
    graph = random_chain(rng, rng.randint(16, 30))
    problem = random_problem(rng, graph)
    values = solve_all(problem)
    assert len(set(values.values())) == 1, values


@pytest.mark.parametrize("seed", range(20))
def test_backends_agree_when_megatron_keeps_sent_outputs(seed):
    """deallocate_pipeline_outputs False: every non-last stage keeps 1 + k_s copies of what it
    sends (LayerCosts.send_copies, which every backend reads); the optimum is brute force's."""
    rng = random.Random(3000 + seed)
    graph = random_chain(rng, rng.randint(3, 7))
    problem = random_problem(rng, graph, deallocate_pipeline_outputs=False)
    costs = problem.costs
    last = costs.num_stages - 1
    assert costs.send_copies == [0 if s == last else 1 + k for s, k in enumerate(costs.in_flight)]
    values = solve_all(problem)
    assert set(values.values()) == {solve_brute_force(problem).objective}


@pytest.mark.parametrize("seed", range(16))
def test_backends_agree_with_sequence_parallelism(seed):
    """config.sp divides every stored activation and edge by t (rounded up per layer); chains go
    through all three backends, DAGs (skip edges relayed, [s/t, b, h] each) through CP-SAT and
    the MILP; brute force is the oracle."""
    rng = random.Random(4000 + seed)
    chain = seed % 2 == 0
    graph = (random_chain if chain else random_dag)(rng, rng.randint(3, 6))
    config = dataclasses.replace(random_config(rng, graph.num_layers), tp=rng.choice([2, 4]))
    config = dataclasses.replace(config, sp=True)
    training = TrainingConfig(
        global_batch=config.global_batch, runtime=rng.choice(["megatron", "torch"])
    )
    costs = layer_costs(graph, config, Cluster(num_gpus=config.num_gpus), training)
    plain = layer_costs(
        graph, dataclasses.replace(config, sp=False), Cluster(num_gpus=config.num_gpus), training
    )
    assert (costs.edge_bytes <= plain.edge_bytes).all() and (costs.edge_bytes > 0).all()
    problem = StageProblem(costs=costs)
    oracle = solve_brute_force(problem).objective
    if chain:
        assert set(solve_all(problem).values()) == {oracle}
        return
    for name in ("cpsat", "milp"):
        solution = BACKENDS[name](problem, time_limit_s=30)
        assert solution.status == OPTIMAL, name
        assert solution.objective == oracle == problem.objective_value(solution.stage_of_layer)


def random_problem_like(problem, objective):
    return StageProblem(
        costs=problem.costs, objective=objective, capacity_bytes=problem.capacity_bytes
    )
