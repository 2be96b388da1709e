"""FSDP2 ZeRO 3 under pipelining (torch runtime, dp > 1, pp > 1): a layer's unsharded weights
live from its backward to its next forward (``solver.costs.fsdp.backward_weight_bytes``), so a
stage's moment at layer l holds those of its layers after l, l's own and a gather's flat buffer,
and the moment after a backward every one of them (``LayerCosts.late_column``). Every backend
reads the rule from the coefficients: they agree with brute force, and the memory over the
schedule's actions peaks at the stage's peak."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.dag import solve_dag
from solver.backends.problem import OPTIMAL, StageProblem
from solver.costs import layer_costs, rank_memory, stage_costs
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.random_graphs import random_chain, random_config, random_dag
from tests.test_agreement import solve_all
from tests.test_cost_model import SPLIT, costs_for


def _fsdp3_costs(rng: random.Random, graph, **changes):
    """Random coefficients of FSDP2 ZeRO 3 under pipelining (pp 2-4, dp 2 or 4)."""
    config = random_config(rng, graph.num_layers)
    config = dataclasses.replace(
        config, pp=rng.randint(2, min(4, graph.num_layers)), dp=rng.choice([2, 4]), zero=3
    )
    config = dataclasses.replace(config, **changes)
    training = TrainingConfig(global_batch=config.global_batch, runtime="torch")
    return layer_costs(graph, config, Cluster(num_gpus=config.num_gpus), training)


def test_a_stage_holds_the_unsharded_weights_of_the_layers_after_the_running_one():
    """By hand (tests/test_cost_model.py's graph: P = 1000, 200, 300, 50 at tp 1; w = g = 2,
    dp 2): 1F1B, m 4, p 3, stage 1 holds b and c (k = 2). Its peak is b's moment: c's unsharded
    weights (600, its backward done) beside the shards, b's own (400) and the flat buffer b's
    backward prefetches for the layer before it as transients; a's (2000) is counted though a
    runs on stage 0, whose prefetch torch does not make from stage 1 (over, never under)."""
    config = ParallelConfig(pp=3, tp=1, dp=2, micro_batch=2, num_microbatches=4, zero=3)
    costs = costs_for(config)
    assert costs.first_backward_peak == [True, True, True]
    assert costs.backward_weight_bytes.tolist() == [2000, 400, 600, 100]
    # a gather's part of each transient: the own weights and the previous layer's flat buffer
    assert costs.gather_bytes.tolist() == [2000 + 0, 400 + 2000, 600 + 400, 100 + 600]
    zero2 = costs_for(dataclasses.replace(config, zero=2))
    # ZeRO 2 (reshard after forward "never") keeps every unsharded weight as a state
    assert (costs.weight_bytes == zero2.weight_bytes).all()
    middle = stage_costs(costs, SPLIT)[1]
    assert middle.breakdown() == {
        "weights": (400 + 600) // 2 + 600,  # the shards, c's unsharded
        "grads": 1000 + 500,  # unsharded and their shards: every gradient exists
        "optimizer": 3000,
        "activations": (200 + 100) + 200,  # one micro-batch whole, the running one's b
        "buffers": 480,
        # b's own (200, as ZeRO 2 has it), its unsharded weights, a's flat buffer
        "transient": zero2.transient_bytes[1] + 400 + 2000,
    }
    assert middle.peak_bytes == sum(middle.breakdown().values())


@pytest.mark.parametrize("seed", range(24))
def test_backends_agree_with_brute_force(seed):
    rng = random.Random(5000 + seed)
    chain = seed % 2 == 0
    graph = (random_chain if chain else random_dag)(rng, rng.randint(3, 7))
    costs = _fsdp3_costs(rng, graph)
    assert costs.backward_weight_bytes is not None
    problem = StageProblem(costs=costs)
    oracle = solve_brute_force(problem).objective
    if chain:
        assert set(solve_all(problem).values()) == {oracle}
    solution = solve_dag(problem)
    assert solution.status == OPTIMAL and solution.objective == oracle


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_largest_memory_over_the_actions_is_the_stage_peak(schedule):
    for seed in range(10):
        rng = random.Random(6000 + seed)
        graph = random_chain(rng, rng.randint(4, 8))
        costs = _fsdp3_costs(rng, graph, schedule=schedule, num_microbatches=rng.randint(1, 6))
        p = costs.config.pp
        bounds = sorted(rng.sample(range(1, graph.num_layers), p - 1))
        split = np.searchsorted(bounds, np.arange(graph.num_layers), side="right")
        stages = stage_costs(costs, split)
        for stage, memory in zip(stages, rank_memory(costs, split), strict=True):
            assert memory.peak_bytes == stage.peak_bytes, (seed, stage.index)
