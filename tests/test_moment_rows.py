"""The layer moments' rows of CP-SAT and the MILP (``solver.backends.formulation_moments``) stay
exact where they read only a window of layers: on graphs whose transients outweigh their stored
bytes (windows of every length, running sums past ``WINDOW_MAX``), with gradients that appear at
the first backward (negative c), under selective recomputation and on DAGs, CP-SAT, the MILP
(and the chain algorithm on chains) prove brute force's optimum; a GPT chain's model keeps the
size of the persistent moment's."""

from __future__ import annotations

import dataclasses
import random

import pytest

from solver.backends import formulation_moments
from solver.backends.brute_force import solve_brute_force
from solver.backends.cpsat import CpSatFormulation
from solver.backends.problem import OPTIMAL, StageProblem
from solver.costs import layer_costs, stage_costs
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import solve_everywhere
from tests.random_graphs import random_config, random_dag, short_pipeline


def _heavy(graph, rng: random.Random):
    """``graph`` with transients from 0 to 30 times a layer's activation bytes (a window of
    up to ~30 layers) and, at random, one layer with a huge one (beyond ``WINDOW_MAX``)."""
    document = graph.to_dict()
    for layer in document["layers"]:
        scale = rng.choice([0, 0, 1, 3, 10, 30])
        layer["transient_bytes"] = scale * layer["activation_bytes"] * rng.randint(1, 4)
    if rng.random() < 0.5:
        rng.choice(document["layers"])["transient_bytes"] = 10**6
    return graph_from_dict(document)


def _chain(rng: random.Random, num_layers: int):
    layers = [
        {
            "name": f"l{i}",
            "params": rng.randint(1, 60) * 1000,
            "activation_bytes": rng.randint(1, 40) * 100,
            "output_bytes": rng.randint(1, 30) * 10,
            "fwd_flops": rng.randint(1, 50) * 1e9,
        }
        for i in range(num_layers)
    ]
    document = {"format": "layer-graph", "version": 1, "model": "chain", "layers": layers}
    return _heavy(graph_from_dict(document), rng)


def _problem(
    rng: random.Random, graph, *, selective: bool = False, late: bool = False
) -> StageProblem:
    """A random config (short pipelines: gradients at the first backward where the lifetime is
    "step") on the torch or megatron runtime; ``late``: torch, step lifetime, GPipe (every
    stage's gradients appear at its first backward)."""
    config = random_config(rng, graph.num_layers)
    config = short_pipeline(
        rng, dataclasses.replace(config, pp=min(config.pp, 3)), selective=selective
    )
    runtime = "torch" if late else rng.choice(["torch", "megatron"])
    lifetime = rng.choice(["step", "persistent"]) if runtime == "torch" else "persistent"
    if late:
        lifetime, config = "step", dataclasses.replace(config, schedule="gpipe")
    training = TrainingConfig(
        global_batch=config.global_batch, runtime=runtime, grad_lifetime=lifetime
    )
    costs = layer_costs(graph, config, Cluster(num_gpus=config.num_gpus), training)
    return StageProblem(costs=costs)


def _assert_exact(problem: StageProblem, chain: bool) -> None:
    oracle = solve_brute_force(problem)
    assert oracle.status == OPTIMAL
    assert solve_everywhere(problem, chain) == {oracle.objective}


@pytest.mark.slow
@pytest.mark.parametrize("window_max", [1, 3, formulation_moments.WINDOW_MAX])
@pytest.mark.parametrize("seed", range(12))
def test_heavy_transient_chains_match_brute_force(seed, window_max, monkeypatch):
    monkeypatch.setattr(formulation_moments, "WINDOW_MAX", window_max)
    rng = random.Random(7000 + seed)
    graph = _chain(rng, rng.randint(4, 8))
    _assert_exact(_problem(rng, graph), chain=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_heavy_transient_first_backward_chains_match_brute_force(seed):
    rng = random.Random(7300 + seed)
    graph = _chain(rng, rng.randint(4, 8))
    problem = _problem(rng, graph, late=True)
    assert all(problem.costs.first_backward_peak)
    _assert_exact(problem, chain=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_heavy_transient_dags_match_brute_force(seed):
    rng = random.Random(7100 + seed)
    graph = _heavy(random_dag(rng, rng.randint(4, 7)), rng)
    _assert_exact(_problem(rng, graph), chain=False)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_heavy_transient_selective_matches_brute_force(seed):
    rng = random.Random(7200 + seed)
    graph = _chain(rng, rng.randint(3, 5))
    _assert_exact(_problem(rng, graph, selective=True), chain=False)


def test_first_backward_moment_binds_on_an_early_layer():
    """GPipe, step lifetime: gradients appear at the first backward, so c = stored - grad < 0
    on the parameter-heavy last layers and the first layer's moment (its transient, every later
    gradient made) is the peak: the rows hold it exactly."""
    layers = [
        {
            "name": "a",
            "params": 10,
            "activation_bytes": 100,
            "output_bytes": 10,
            "transient_bytes": 10**6,
        },
        {"name": "b", "params": 4000, "activation_bytes": 10, "output_bytes": 10},
        {"name": "c", "params": 4000, "activation_bytes": 10, "output_bytes": 10},
        {"name": "d", "params": 10, "activation_bytes": 100, "output_bytes": 10},
    ]
    graph = graph_from_dict({"format": "layer-graph", "version": 1, "model": "m", "layers": layers})
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=2, schedule="gpipe")
    training = TrainingConfig(global_batch=2, runtime="torch", grad_lifetime="step")
    costs = layer_costs(graph, config, Cluster(num_gpus=2), training)
    assert all(costs.first_backward_peak)
    problem = StageProblem(costs=costs)
    _assert_exact(problem, chain=True)
    first = stage_costs(costs, [0, 0, 0, 1])[0]
    assert first.moment == "first backward" and first.transient_bytes == 10**6


def test_gpt_chain_model_keeps_the_persistent_size(gpt_graph):
    """Every layer of a GPT chain reads one window of one layer: no running sum (no B_s, no
    D[l][s]), one T_s per stage; the model's variables are y, T and the peak."""
    config = ParallelConfig(pp=4, tp=1, dp=2, micro_batch=1, num_microbatches=16)
    training = TrainingConfig(global_batch=config.global_batch)
    costs = layer_costs(gpt_graph, config, Cluster(num_gpus=config.num_gpus), training)
    formulation = CpSatFormulation(StageProblem(costs=costs))
    names = [v.name for v in formulation.model.Proto().variables]
    assert not formulation._layer_sums
    assert not [n for n in names if n.startswith(("D_", "B_"))]
    assert sum(n.startswith("T_s") for n in names) == config.pp
    assert len(names) == gpt_graph.num_layers * (config.pp - 1) + config.pp + 1
