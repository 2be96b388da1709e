"""Searching the split-backward schedules (zbv, dualpipev, interleaved-zb; issue 31 item 2).

Oracles: brute force over every split (its objective is ``stage_costs``' peak, the replay of
torch's action lists), and the replay itself (``schedule.split_moments``) against the rows the
backends constrain (``costs.split_rows``).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.cpsat import solve_cpsat
from solver.backends.milp import solve_milp
from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, OPTIMAL, StageProblem
from solver.costs import layer_costs, stage_costs
from solver.costs.schedule import split_moments
from solver.search.candidates import memory_lower_bound, time_lower_bound
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import slow_params
from tests.random_graphs import random_chain, random_dag

BACKENDS = {"cpsat": solve_cpsat, "milp": solve_milp}


def _random_split(seed: int, selective: bool = False):
    """A random split-backward config's costs: schedule, p, v, m valid for torch's classes."""
    rng = random.Random(seed)
    schedule = ["zbv", "dualpipev", "interleaved-zb"][seed % 3]
    p = rng.choice([2, 3]) if schedule != "interleaved-zb" else rng.choice([2, 3])
    v = 2 if schedule != "interleaved-zb" else rng.choice([1, 2])
    m = {"zbv": rng.choice([1, 2, 4]), "dualpipev": 2 * p + rng.choice([0, 1])}.get(
        schedule, p * rng.choice([1, 2])
    )
    num_layers = p * v + rng.randint(0, 1 if selective else 2)
    graph = (random_chain if seed % 2 else random_dag)(rng, num_layers)
    graph = _with_weight_step_fields(graph, random.Random(1000 + seed))
    config = ParallelConfig(
        pp=p,
        tp=1,
        dp=rng.choice([1, 2]),
        micro_batch=1,
        num_microbatches=m,
        zero=rng.choice([0, 1, 3]),
        recompute="selective" if selective else rng.choice(["none", "full"]),
        virtual_stages=v,
        schedule=schedule,
    )
    runtime = rng.choice(["megatron", "torch"])
    training = TrainingConfig(
        global_batch=config.global_batch,
        virtual_stages=(v,),
        runtime=runtime,
        grad_lifetime=rng.choice(["persistent", "step"]) if runtime == "torch" else "persistent",
    )
    return graph, config, layer_costs(graph, config, Cluster(num_gpus=config.num_gpus), training)


def _with_weight_step_fields(graph, rng: random.Random):
    """Half the graphs with the profiled dY fields (``weight_op_grad_bytes``, its output
    part) and the weight and input steps' moments (``weight_step_moments``, ``_end``,
    ``input_step_transient_bytes``) on most layers (a layer without them takes the
    estimate), half without."""
    if rng.random() < 0.5:
        return graph
    layers = [
        layer
        if rng.random() < 0.2
        else dataclasses.replace(
            layer,
            weight_op_grad_bytes=rng.choice([0, rng.randint(1, 4 * layer.output_bytes + 1)]),
            weight_op_output_grad_bytes=rng.choice([0, layer.output_bytes]),
            **_weight_step_points(layer, rng),
        )
        for layer in graph.layers
    ]
    return dataclasses.replace(graph, layers=layers)


def _weight_step_points(layer, rng: random.Random) -> dict:
    """Random W-step moments as torch's groups make them: groups of the layer's parameters
    (each point the previous group's and the running one's), the frees so far falling."""
    sizes, left = [], layer.params
    for _ in range(rng.randint(0, 3)):
        size = rng.randint(0, left)
        sizes.append(size)
        left -= size
    points, previous, freed = [], 0, 0
    for size in sizes:
        points.append((previous + size, rng.randint(0, previous + size), -freed))
        previous = size
        freed += rng.randint(0, layer.output_bytes)
    end = (previous, rng.randint(0, previous), -freed)
    return {
        "weight_step_moments": points,
        "weight_step_end": end,
        "input_step_transient_bytes": rng.randint(0, 2 * layer.output_bytes),
    }


@pytest.mark.parametrize("seed", range(12))
def test_rows_keep_the_replays_peak(seed):
    """The undominated moments every backend constrains give stage_costs' peak on any split:
    the rows, evaluated by hand on random splits, reach exactly the replay's largest moment."""
    _, config, costs = _random_split(seed)
    rng = random.Random(seed)
    full = [
        split_moments(config.num_microbatches, config.pp, config.virtual_stages, r, config.schedule)
        for r in range(config.pp)
    ]
    for rank, rows in enumerate(costs.in_flight_vectors):
        assert 1 <= len(rows) <= len(full[rank])
        assert max(map(sum, rows)) == max(sum(n) for n, *_ in full[rank])
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, costs.num_layers), costs.num_stages - 1))
        split = np.searchsorted(cuts, np.arange(costs.num_layers), side="right")
        peaks = [stage.peak_bytes for stage in stage_costs(costs, split)]
        assert all(peak > 0 for peak in peaks)


@pytest.mark.parametrize("seed", slow_params(range(12), 0, 1, 2, 5))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_solvers_equal_brute_force(seed, backend):
    _, _, costs = _random_split(seed)
    problem = StageProblem(costs=costs, objective=OBJECTIVE_MEMORY)
    oracle = solve_brute_force(problem)
    solution = BACKENDS[backend](problem, time_limit_s=30)
    assert solution.status == OPTIMAL
    assert solution.objective == oracle.objective
    # the reported cost recomputed from the returned split by the replay
    peak = max(stage.peak_bytes for stage in stage_costs(costs, solution.stage_of_layer))
    assert problem.objective_value(solution.stage_of_layer) == peak == oracle.objective
    assert memory_lower_bound(costs) <= oracle.objective
    fastest = solve_brute_force(StageProblem(costs=costs, objective=OBJECTIVE_TIME))
    assert time_lower_bound(costs) <= fastest.objective
    timed = BACKENDS[backend](StageProblem(costs=costs, objective=OBJECTIVE_TIME), time_limit_s=30)
    assert timed.objective == fastest.objective
    _, slow = problem.measure(oracle.stage_of_layer)
    budget = (fastest.objective + slow) // 2
    limited = StageProblem(costs=costs, objective=OBJECTIVE_MEMORY, iteration_budget_ns=budget)
    expected = solve_brute_force(limited)
    got = BACKENDS[backend](limited, time_limit_s=30)
    assert got.status == expected.status
    assert got.objective == expected.objective


@pytest.mark.parametrize("seed", slow_params(range(6), 0, 1, 2))
def test_selective_recompute_equals_brute_force(seed):
    """The pending W's dY follows each layer's recompute state (z terms)."""
    _, _, costs = _random_split(seed, selective=True)
    problem = StageProblem(costs=costs, objective=OBJECTIVE_MEMORY)
    oracle = solve_brute_force(problem)
    for solve in BACKENDS.values():
        solution = solve(problem, time_limit_s=30)
        assert solution.objective == oracle.objective
        value = problem.objective_value(solution.stage_of_layer, solution.recomputed)
        assert value == oracle.objective


def test_a_split_schedules_plan_says_what_its_memory_rule_misses():
    from solver.search.plan_notes import split_schedule_notes

    for schedule in ("zbv", "dualpipev", "interleaved-zb"):
        (note,) = split_schedule_notes(schedule)
        assert note.startswith(f"schedule {schedule}: its memory is predicted within 0.0%")
    assert split_schedule_notes("1f1b") == split_schedule_notes("gpipe") == []


@pytest.mark.parametrize("runtime", ["megatron", "torch"])
def test_kept_split_rows_are_the_rows_of_each_config(runtime):
    """``split_rows`` keeps its answers by what they depend on (``_rows_key``): for every
    split-backward config of a search the kept rows are those computed afresh for it."""
    from solver.costs import split_rows as rows_module
    from solver.search.config_search import build_entries

    graph = random_chain(random.Random(31), 12)
    training = TrainingConfig(
        global_batch=16, schedule="auto", virtual_stages=(1, 2), runtime=runtime,
        max_slowdown=None,
    )  # fmt: skip
    entries = build_entries(graph, Cluster(num_gpus=8, gpus_per_node=4), training)
    split = [e.costs for e in entries if e.costs.config.schedule != "1f1b"]
    split = [c for c in split if c.config.schedule != "gpipe"]
    assert len(split) > 10 and len({rows_module._rows_key(c) for c in split}) > 3
    for costs in split:
        fresh = rows_module._split_rows(costs)
        assert rows_module.split_rows(costs) == fresh, costs.config.label()
        assert costs.in_flight_vectors == [[row[0] for row in rank] for rank in fresh]
