"""The model's output the torch pipeline keeps for its loss stays live through the backward of
every layer of the last layer's stage (``LayerCosts.moment_transient``): the cost model's stage
peaks, and every backend's optimum on graphs that carry it (``meta.unsaved_output_bytes``)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.chain import solve_chain
from solver.backends.cpsat import solve_cpsat
from solver.backends.dag import solve_dag
from solver.backends.milp import solve_milp
from solver.backends.presolve import Presolve
from solver.backends.problem import OBJECTIVE_MEMORY, OPTIMAL, StageProblem
from solver.costs import layer_costs, stage_costs
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.random_graphs import random_chain, random_config, random_dag, with_unsaved_output

HELD = 1000
"""Bytes per sample of the output the pipeline keeps, in these tests."""


def _costs(graph, config: ParallelConfig, runtime: str, **options):
    training = TrainingConfig(global_batch=config.global_batch, runtime=runtime, **options)
    return layer_costs(graph, config, Cluster(num_gpus=config.num_gpus), training)


def _three_layers(unsaved: int, head_transient: int):
    """A 3-layer chain whose middle layer's transient (5000 B) or the head's is the largest."""
    layers = [
        {"name": f"l{i}", "params": 100, "activation_bytes": 400, "output_bytes": 40}
        for i in range(3)
    ]
    layers[1]["transient_bytes"] = 5000
    layers[2]["transient_bytes"] = head_transient
    document = {"format": "layer-graph", "version": 1, "model": "three", "layers": layers}
    return with_unsaved_output(graph_from_dict(document), unsaved)


@pytest.mark.parametrize("head_transient", [0, 20000])
@pytest.mark.parametrize("runtime", ["torch", "megatron"])
def test_the_last_stage_holds_the_output_at_every_layers_moment(runtime, head_transient):
    """pp 2, 1F1B, m 4, b 2: stage 1 (layers 1, 2) holds k = 1 micro-batch. With the output the
    torch pipeline keeps (b 1000 B), stage 1's peak rises by exactly b 1000 whether its middle
    layer's moment (the output still held, beside its transient) or the head's is the peak;
    stage 0 and the megatron runtime (its loss frees the logits in the last layer) not at all."""
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=2, num_microbatches=4)
    split = [0, 1, 1]
    without = stage_costs(_costs(_three_layers(0, head_transient), config, runtime), split)
    costs = _costs(_three_layers(HELD, head_transient), config, runtime)
    held = stage_costs(costs, split)
    rise = 2 * HELD if runtime == "torch" else 0
    assert costs.held_output_bytes == rise
    assert held[0].peak_bytes == without[0].peak_bytes
    assert held[1].peak_bytes - without[1].peak_bytes == costs.in_flight[1] * rise
    if runtime == "torch" and not head_transient:  # the middle layer's moment: in its transient
        assert held[1].transient_bytes == 2 * 5000 + rise


def _oracle_and_backends(problem: StageProblem, backends) -> None:
    oracle = solve_brute_force(problem)
    assert oracle.status == OPTIMAL
    presolve = Presolve.of(problem)
    assert presolve.peak_lb_bytes <= oracle.objective <= presolve.peak_ub_bytes
    for name, solve in backends.items():
        solution = solve(problem)
        assert solution.status == OPTIMAL, name
        assert solution.objective == oracle.objective, name
        value = problem.objective_value(solution.stage_of_layer, solution.recomputed)
        assert value == solution.objective, name


def _torch_problem(rng: random.Random, graph, **options) -> StageProblem:
    config = random_config(rng, graph.num_layers)
    if config.recompute == "none" and rng.random() < 0.5:
        config = dataclasses.replace(config, recompute="full")
    graph = with_unsaved_output(graph, rng.choice([HELD, 4 * HELD]))
    costs = _costs(graph, config, "torch", **options)
    assert costs.held_output_bytes > 0
    return StageProblem(costs=costs, objective=OBJECTIVE_MEMORY)


@pytest.mark.parametrize("seed", range(40))
def test_backends_agree_with_the_held_output_on_chains(seed):
    rng = random.Random(91000 + seed)
    options = {"grad_lifetime": rng.choice(["persistent", "step"])}
    options["optimizer_impl"] = rng.choice(["fused", "foreach"])
    problem = _torch_problem(rng, random_chain(rng, rng.randint(3, 7)), **options)
    backends = {"chain": solve_chain, "dag": solve_dag, "cpsat": solve_cpsat, "milp": solve_milp}
    _oracle_and_backends(problem, backends)


@pytest.mark.parametrize("seed", range(30))
def test_backends_agree_with_the_held_output_on_dags(seed):
    rng = random.Random(92000 + seed)
    options = {"grad_lifetime": rng.choice(["persistent", "step"])}
    problem = _torch_problem(rng, random_dag(rng, rng.randint(4, 7)), **options)
    _oracle_and_backends(problem, {"dag": solve_dag, "cpsat": solve_cpsat, "milp": solve_milp})


@pytest.mark.parametrize("seed", range(12))
def test_formulations_agree_with_the_held_output_choosing_recomputed_layers(seed):
    """Selective recomputation: CP-SAT and MILP choose the recomputed layers as brute force."""
    rng = random.Random(93000 + seed)
    graph = random_chain(rng, rng.randint(3, 6)) if seed % 2 else random_dag(rng, 5)
    problem = _torch_problem(rng, graph)
    config = dataclasses.replace(problem.costs.config, recompute="selective")
    costs = layer_costs(
        with_unsaved_output(graph, HELD),
        config,
        Cluster(num_gpus=config.num_gpus),
        TrainingConfig(global_batch=config.global_batch, runtime="torch", recompute="selective"),
    )
    problem = StageProblem(costs=costs, objective=OBJECTIVE_MEMORY)
    _oracle_and_backends(problem, {"cpsat": solve_cpsat, "milp": solve_milp})
