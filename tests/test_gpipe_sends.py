"""torch's GPipe keeps its send works until ``step()`` returns (``schedule.boundary_copies``): in
its backward phase a stage holding h micro-batches still holds the outputs and sent input
gradients of the m - h already back-propagated, so its buffers grow as its activations shrink,
and the stage peak counts the moments after a backward at h = m - 1 and h = 1
(``LayerCosts.after_moments``). Every backend reads them from the coefficients: they agree with
brute force, and the replay of the schedule's actions peaks at the stage's peak."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.cpsat import solve_cpsat
from solver.backends.dag import solve_dag
from solver.backends.milp import solve_milp
from solver.backends.problem import OPTIMAL, StageProblem
from solver.costs import layer_costs, rank_memory, stage_costs
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.random_graphs import random_chain, random_config, random_dag
from tests.test_agreement import solve_all

# a wide input (x: 1000 B per sample) into a head that outputs little: under full recomputation
# the head's stage stores only its output, far less than two copies of its input
GRAPH = graph_from_dict(
    {
        "format": "layer-graph",
        "version": 1,
        "model": "wide-input",
        "layers": [
            {"name": "x", "params": 100, "activation_bytes": 400, "output_bytes": 1000},
            {
                "name": "head",
                "params": 50,
                "activation_bytes": 2000,
                "output_bytes": 10,
                "transient_bytes": 30,
            },
        ],
    }
)


def _costs(m: int, recompute: str = "full", lifetime: str = "persistent"):
    config = ParallelConfig(
        pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=m, schedule="gpipe", recompute=recompute
    )
    training = TrainingConfig(global_batch=m, runtime="torch", grad_lifetime=lifetime)
    return layer_costs(GRAPH, config, Cluster(num_gpus=2), training)


@pytest.mark.parametrize("lifetime", ["persistent", "step"])
def test_the_last_backward_is_the_peak_where_a_stage_stores_less_than_its_input(lifetime):
    """m = 4, full recomputation: the head's stage keeps 10 B per micro-batch and receives
    1000 B. After m - h backwards it holds 2 (m - h) copies of its input (m - h idle receive
    buffers, m - h sent input gradients): the moment with one micro-batch left, 6 copies, is
    its peak, 4000 B above the one after the first backward (2 copies)."""
    m = 4
    costs = _costs(m, lifetime=lifetime)
    assert costs.after_moments == [((3, 1), (1, 3)), ((3, 1), (1, 3))]
    assert costs.copies_at(1, 3, 1) == (2, 0) and costs.copies_at(1, 1, 3) == (6, 0)
    assert costs.copies_at(0, 1, 3) == (0, 2 * m)  # the first stage's: m outputs + m gradients
    head = stage_costs(costs, [0, 1])[1]
    kept = int(costs.stored_bytes[1])
    assert kept == 10  # its output only (full recomputation)
    assert head.moment == "last backward"
    assert head.activation_bytes == 1 * kept
    assert head.buffer_bytes == 2 * (m - 1) * 1000
    assert head.grad_bytes == int(costs.grad_bytes[1])  # every gradient exists then
    assert head.transient_bytes == int(costs.transient_bytes[1])
    replay = rank_memory(costs, [0, 1])[1]
    assert replay.peak_bytes == head.peak_bytes
    # the replay's moments after the 2nd and the 3rd backward: 2 more copies of the input, one
    # micro-batch fewer (the first backward's value is its largest layer moment)
    after = replay.action_bytes[m:]
    assert after[2] - after[1] == 2 * 1000 - kept
    assert after[2] == head.peak_bytes


def test_without_recomputation_the_moment_after_the_first_backward_is_the_larger():
    """The head stores its 2000 B of activations: a micro-batch's backward frees more than the
    two copies of its input it adds, so h = m - 1 is the larger end."""
    costs = _costs(4, recompute="none")
    head = stage_costs(costs, [0, 1])[1]
    assert head.peak_bytes == rank_memory(costs, [0, 1])[1].peak_bytes
    assert head.moment in ("forward", "first backward", "after first backward")


def test_megatron_and_one_f_one_b_have_no_backward_phase_moments():
    costs = _costs(4)
    megatron = layer_costs(
        GRAPH,
        costs.config,
        Cluster(num_gpus=2),
        TrainingConfig(global_batch=4, runtime="megatron"),
    )
    assert megatron.after_moments == [(), ()]
    one_f_one_b = layer_costs(
        GRAPH,
        dataclasses.replace(costs.config, schedule="1f1b"),
        Cluster(num_gpus=2),
        TrainingConfig(global_batch=4, runtime="torch"),
    )
    assert one_f_one_b.after_moments == [(), ()]
    assert _costs(1).after_moments == [(), ()]  # one micro-batch: no backward phase


def _wide(rng: random.Random, graph):
    """``graph`` with boundary tensors as large as its activations and smaller weights, so
    that the backward phase's buffers can set a stage's peak."""
    document = graph.to_dict()
    for layer in document["layers"]:
        layer["params"] = max(1, layer["params"] // 100)
        layer["tp_params"] = min(layer.get("tp_params", 0), layer["params"])
        layer["output_bytes"] = rng.randint(1, 40) * 100
    for edge in document.get("edges", []):
        edge["bytes"] = rng.randint(1, 40) * 100
    return graph_from_dict(document)


def _gpipe_problem(rng: random.Random, graph) -> StageProblem:
    """A random config under torch's GPipe, m >= 2, either gradient lifetime."""
    config = random_config(rng, graph.num_layers)
    config = dataclasses.replace(
        config,
        pp=rng.randint(2, min(4, graph.num_layers)),
        schedule="gpipe",
        num_microbatches=rng.choice([2, 3, 5]),
        recompute=rng.choice(["none", "full"]),
    )
    training = TrainingConfig(
        global_batch=config.global_batch,
        runtime="torch",
        grad_lifetime=rng.choice(["persistent", "step"]),
    )
    costs = layer_costs(graph, config, Cluster(num_gpus=config.num_gpus), training)
    assert all(moments for moments in costs.after_moments)
    return StageProblem(costs=costs)


@pytest.mark.parametrize("seed", range(24))
def test_backends_agree_with_brute_force(seed):
    rng = random.Random(7000 + seed)
    chain = seed % 2 == 0
    graph = _wide(rng, (random_chain if chain else random_dag)(rng, rng.randint(3, 6)))
    problem = _gpipe_problem(rng, graph)
    oracle = solve_brute_force(problem).objective
    if chain:
        assert set(solve_all(problem).values()) == {oracle}
    else:
        for solve in (solve_cpsat, solve_milp):
            solution = solve(problem, time_limit_s=30)
            assert solution.status == OPTIMAL and solution.objective == oracle, solve
    solution = solve_dag(problem)
    assert solution.status == OPTIMAL and solution.objective == oracle


@pytest.mark.parametrize("seed", range(12))
def test_largest_memory_over_the_actions_is_the_stage_peak(seed):
    rng = random.Random(8000 + seed)
    graph = _wide(rng, random_chain(rng, rng.randint(3, 8)))
    costs = _gpipe_problem(rng, graph).costs
    p = costs.config.pp
    bounds = sorted(rng.sample(range(1, graph.num_layers), p - 1))
    split = np.searchsorted(bounds, np.arange(graph.num_layers), side="right")
    for stage, memory in zip(stage_costs(costs, split), rank_memory(costs, split), strict=True):
        assert memory.peak_bytes == stage.peak_bytes, (seed, stage.index, stage.moment)
