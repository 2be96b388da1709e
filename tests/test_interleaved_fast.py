"""The chunk-size relaxation of interleaved chains (``solver.backends.interleaved``).

Oracle: every split of a chain into p v non-empty virtual stages (a composition of L, at most a
few hundred here), each evaluated with the cost model. The relaxation's bound is never above the
optimum, its verdict "infeasible" is never wrong, its split is what it says, and where the middle
layers are alike (embedding, identical blocks, head) the bound is the optimum. CP-SAT and the MILP
with the relaxation in front of them (closing a solve, or as a cut and a start) still equal brute
force. GPT-3 175B at pp 16 closes in well under a second.
"""

from __future__ import annotations

import itertools
import random
import time

import numpy as np
import pytest

from solver.backends.cpsat import solve_cpsat
from solver.backends.interleaved import ChunkSizeBound, _ChunkSizes, applies, chunk_size_bound
from solver.backends.milp import solve_milp
from solver.backends.problem import (
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OBJECTIVE_TIME,
    OPTIMAL,
    StageProblem,
)
from solver.costs import layer_costs
from solver.graph import graph_from_dict, load_graph
from solver.report.baselines import even_split
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import slow_params
from tests.random_graphs import random_chain, random_layer

BACKENDS = {"cpsat": solve_cpsat, "milp": solve_milp}


def _uniform_chain(rng: random.Random, num_layers: int):
    """An embedding, identical blocks and a head, each drawn at random; the embedding's output
    is the blocks' (the hidden states every layer passes on, as in a transformer)."""
    block = random_layer(rng, "block")
    layers = [random_layer(rng, "embed") | {"output_bytes": block["output_bytes"]}]
    layers += [block | {"name": f"b{i}"} for i in range(num_layers - 2)]
    layers.append(random_layer(rng, "head"))
    return graph_from_dict(
        {"format": "layer-graph", "version": 1, "model": "uniform-chain", "layers": layers}
    )


def _costs(seed: int, *, uniform: bool = False, **training_options):
    """A random interleaved chain config (p, v in {2, 3}, a few layers more than p v)."""
    rng = random.Random(seed)
    p, v = rng.choice([(2, 2), (2, 3), (3, 2)])
    num_layers = p * v + rng.randint(0, 4)
    graph = (_uniform_chain if uniform else random_chain)(rng, num_layers)
    config = ParallelConfig(
        pp=p,
        tp=rng.choice([1, 2]),
        dp=rng.choice([1, 2]),
        micro_batch=rng.choice([1, 2]),
        num_microbatches=p * rng.choice([1, 2, 3]),
        zero=rng.choice([0, 1, 3]),
        recompute=rng.choice(["none", "full"]),
        virtual_stages=v,
    )
    options = {
        "global_batch": config.global_batch,
        "virtual_stages": (v,),
        "runtime": rng.choice(["megatron", "torch"]),
        "deallocate_pipeline_outputs": rng.choice([True, False]),
    }
    training = TrainingConfig(**(options | training_options))
    return layer_costs(graph, config, Cluster(num_gpus=config.num_gpus), training)


def _every_split(num_layers: int, num_stages: int):
    """Every chain split into non-empty stages: the stage of each layer."""
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        sizes = np.diff((0, *cuts, num_layers))
        yield np.repeat(np.arange(num_stages), sizes).tolist()


_MEASURED: dict[int, tuple[object, list[tuple[int, int]]]] = {}


def _measures(costs) -> list[tuple[int, int]]:
    """(largest peak, iteration ns) of every split of the config, from the cost model (kept
    per costs object, which the cache holds so that its id is not reused: every problem of a
    test shares them)."""
    cached = _MEASURED.get(id(costs))
    if cached is None or cached[0] is not costs:
        free = StageProblem(costs=costs)
        splits = _every_split(costs.num_layers, costs.num_stages)
        cached = _MEASURED[id(costs)] = (costs, [free.measure(split) for split in splits])
    return cached[1]


def _oracle(problem: StageProblem) -> int | None:
    """The optimum by enumeration, None when no split is within the limits (every split of
    ``_every_split`` is in order and has no empty stage: only the limits can rule it out)."""
    capacity, budget = problem.capacity_bytes, problem.iteration_budget_ns
    values = [
        peak if problem.objective == OBJECTIVE_MEMORY else iteration
        for peak, iteration in _measures(problem.costs)
        if (capacity is None or peak <= capacity) and (budget is None or iteration <= budget)
    ]
    return min(values, default=None)


def _limited(costs, seed: int) -> list[StageProblem]:
    """Memory and time objectives, without limits and with a capacity and a budget between the
    extremes (some of them infeasible)."""
    free = StageProblem(costs=costs, objective=OBJECTIVE_MEMORY)
    peaks, times = zip(*_measures(costs), strict=True)
    rng = random.Random(seed)
    capacity = rng.randint(min(peaks), max(peaks))
    budget = rng.randint(min(times), max(times))
    return [
        free,
        StageProblem(costs=costs, objective=OBJECTIVE_TIME),
        StageProblem(costs=costs, objective=OBJECTIVE_MEMORY, iteration_budget_ns=budget),
        StageProblem(costs=costs, objective=OBJECTIVE_TIME, capacity_bytes=capacity),
        StageProblem(
            costs=costs,
            objective=OBJECTIVE_MEMORY,
            capacity_bytes=capacity,
            iteration_budget_ns=budget,
        ),
    ]


def _check_against_oracle(problem: StageProblem, bound: ChunkSizeBound) -> int | None:
    optimum = _oracle(problem)
    if bound.lower_bound is None:
        assert optimum is None, "the relaxation called a feasible problem infeasible"
        return optimum
    if optimum is not None:
        assert bound.lower_bound <= optimum
    split = bound.split
    assert len(split) == problem.num_layers and sorted(set(split)) == list(
        range(problem.num_stages)
    )
    assert split == sorted(split)  # a chain split: contiguous stages in order
    if problem.violation(split) is None:
        assert problem.objective_value(split) >= bound.lower_bound
    return optimum


@pytest.mark.parametrize("seed", range(24))
def test_bound_never_above_the_optimum(seed):
    costs = _costs(seed)
    assert applies(StageProblem(costs=costs))
    for problem in _limited(costs, seed):
        _check_against_oracle(problem, chunk_size_bound(problem))
        # stopped after its first box, the bound is weaker but still valid
        _check_against_oracle(problem, chunk_size_bound(problem, time_limit_s=0))


@pytest.mark.parametrize("seed", range(16))
def test_alike_middle_layers_make_the_bound_the_optimum(seed):
    """Embedding, identical blocks, head: every window of a size costs the same, so the
    relaxation of the memory objective is exact and its split optimal (what GPT-3 175B relies
    on). The time rows leave out the ranks before each rank (its predecessors' first chunks):
    a bound there, not the optimum."""
    costs = _costs(seed, uniform=True)
    for problem in _limited(costs, seed):
        bound = chunk_size_bound(problem)
        optimum = _check_against_oracle(problem, bound)
        if problem.objective == OBJECTIVE_TIME or problem.iteration_budget_ns is not None:
            continue
        assert bound.lower_bound == optimum
        if optimum is not None:
            assert problem.violation(bound.split) is None
            assert problem.objective_value(bound.split) == optimum


@pytest.mark.parametrize("seed", slow_params(range(8), 0, 1, 7))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_solvers_with_the_relaxation_equal_brute_force(seed, backend):
    """Closed by the relaxation (alike layers) or cut and started by it (random layers): the
    answer is still the optimum, proven."""
    for uniform in (True, False):
        costs = _costs(seed, uniform=uniform)
        for problem in _limited(costs, seed)[2:4]:  # budgeted memory, capacity-bound time
            optimum = _oracle(problem)
            solution = BACKENDS[backend](problem, time_limit_s=30, hint=None)
            if optimum is None:
                assert solution.status == INFEASIBLE
                continue
            assert solution.status == OPTIMAL
            assert solution.objective == optimum == problem.objective_value(solution.stage_of_layer)


def test_size_vectors_are_every_composition():
    for num_layers, p, v in [(98, 16, 2), (40, 8, 3), (12, 2, 3), (9, 2, 2)]:
        sizes = object.__new__(_ChunkSizes)
        sizes.num_layers, sizes.num_ranks, sizes.num_chunks = num_layers, p, v
        total = num_layers - (p - 1) * v
        expected = {
            tuple(np.diff((0, *bars)).tolist())
            for bars in itertools.combinations(range(1, total + 1), v)
        }
        got = [tuple(row) for row in sizes._size_vectors().tolist()]
        assert len(got) == len(expected) and set(got) == expected


def test_applies_to_interleaved_chains_with_fixed_costs_only():
    graph = _uniform_chain(random.Random(1), 8)

    def costs(virtual_stages: int, recompute: str = "none"):
        config = ParallelConfig(
            pp=2,
            tp=1,
            dp=1,
            micro_batch=1,
            num_microbatches=4,
            recompute=recompute,
            virtual_stages=virtual_stages,
        )
        training = TrainingConfig(global_batch=4, virtual_stages=(virtual_stages,))
        return layer_costs(graph, config, Cluster(num_gpus=2), training)

    assert applies(StageProblem(costs=costs(2)))
    assert not applies(StageProblem(costs=costs(1)))
    assert chunk_size_bound(StageProblem(costs=costs(2, "selective"))) is None


@pytest.mark.slow
@pytest.mark.parametrize("v", slow_params([2, 3, 4], 3, 4))
def test_gpt3_175b_pp16_closes_in_a_fraction_of_a_second(v):
    """examples/gpt3-175b.json (96 identical blocks between embedding and head) at pp 16 tp 8
    m 1536 within 75 GiB: the relaxation's split meets its bound for the peak, under a
    throughput budget too, and beats Megatron's even split of the virtual stages; for the time
    its bound (without the ranks before each rank) is within 0.2% of its split's."""
    graph = load_graph("examples/gpt3-175b.json")
    config = ParallelConfig(
        pp=16, tp=8, dp=1, micro_batch=1, num_microbatches=1536, sp=True, virtual_stages=v
    )
    training = TrainingConfig(global_batch=1536, virtual_stages=(v,))
    costs = layer_costs(graph, config, Cluster(num_gpus=128), training)
    even = even_split(graph, costs.num_stages)
    usable = 75 * 2**30
    fastest = StageProblem(costs=costs, objective=OBJECTIVE_TIME, capacity_bytes=usable)
    free = StageProblem(costs=costs, objective=OBJECTIVE_MEMORY, capacity_bytes=usable)
    for problem in (fastest, free):
        started = time.process_time()
        bound = chunk_size_bound(problem)
        assert time.process_time() - started < 2.0
        assert problem.violation(bound.split) is None
        if problem is fastest:
            value = problem.objective_value(bound.split)
            assert bound.lower_bound <= value <= 1.002 * bound.lower_bound
            assert value <= problem.objective_value(even)
            budget = int(1.25 * value)  # the planner's default throughput limit
        else:
            assert problem.objective_value(bound.split) == bound.lower_bound
            assert bound.lower_bound <= problem.objective_value(even)
    budgeted = StageProblem(costs=costs, capacity_bytes=usable, iteration_budget_ns=budget)
    solution = solve_cpsat(budgeted, time_limit_s=5)
    assert solution.status == OPTIMAL
    assert solution.objective < budgeted.objective_value(even)
