"""Heterogeneous clusters with selective recomputation, and the complete start of placed problems.

Oracle: brute force over splits x group assignments x recompute sets on small random chains and
DAGs, for CP-SAT and MILP; "none" and "full" are choices of the selective model on every
placement, so its optimum is never worse than either; plans respect every group's capacity.
The start
(``solver.backends.placement_start``) is checked for validity and for the optimality of its
group assignment on a fixed split.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.cpsat import solve_cpsat
from solver.backends.milp import solve_milp
from solver.backends.placement_start import complete_start, groups_by_peak, placement_start
from solver.backends.presolve import check_hint
from solver.backends.problem import (
    ABSOLUTE,
    FEASIBLE,
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OBJECTIVE_TIME,
    OPTIMAL,
    UTILIZATION,
    Placement,
    StageProblem,
)
from solver.costs import layer_costs
from solver.errors import InputError
from solver.evaluation import evaluate
from solver.plan_check import check_plan
from solver.search.planner import plan
from solver.specs import Cluster, TrainingConfig
from tests.conftest import cluster_group, cluster_of, slow_params
from tests.random_graphs import random_chain, random_config, random_dag

BACKENDS = {"cpsat": solve_cpsat, "milp": solve_milp}
MAX_CASES = 6000
"""Brute force tries p**L splits x 2**L recompute sets x the group assignments."""


def _placed(seed: int, recompute: str = "selective", *, objective=OBJECTIVE_MEMORY):
    """A random 2-group problem (odd seeds chains, even seeds DAGs, activations comparable to
    the model states): group 1 slower or faster,
    capacities around an even split's peak with nothing recomputed (recomputing may be needed
    to fit), the utilization or absolute objective; with the same seed and another
    ``recompute`` mode, the same graph, config and groups."""
    rng = random.Random(seed)
    while True:
        num_layers = rng.randint(3, 5)
        graph = (random_chain if seed % 2 else random_dag)(rng, num_layers)
        config = random_config(rng, num_layers)
        if config.pp >= 2 and config.pp**num_layers * 2**num_layers * 2**config.pp <= MAX_CASES:
            break
    # activations comparable to the model states, so that recomputing matters
    graph.layers = [
        dataclasses.replace(
            layer,
            activation_bytes=200 * layer.activation_bytes,
            tp_activation_bytes=200 * layer.tp_activation_bytes,
        )
        for layer in graph.layers
    ]
    config = dataclasses.replace(config, recompute=recompute)
    training = TrainingConfig(global_batch=config.global_batch)
    group_costs = [
        layer_costs(graph, config, Cluster(num_gpus=config.num_gpus, gpu_flops=flops), training)
        for flops in (989e12, rng.choice([312e12, 2e15]))
    ]
    plain = dataclasses.replace(config, recompute="none")
    even = [min(i * config.pp // num_layers, config.pp - 1) for i in range(num_layers)]
    reference = layer_costs(graph, plain, Cluster(num_gpus=config.num_gpus), training)
    peak = max(s.peak_bytes for s in StageProblem(costs=reference).stages(even))
    small = rng.randint(1, config.pp - 1)
    placement = Placement(
        group_costs=group_costs,
        capacity_bytes=[int(peak * rng.uniform(0.4, 0.9)), int(peak * rng.uniform(0.9, 1.6))],
        stages_per_group=[small, config.pp - small],
        names=["small", "large"],
        memory_objective=UTILIZATION if seed % 3 else ABSOLUTE,
    )
    return StageProblem(costs=group_costs[0], objective=objective, placement=placement), rng


def _with_budget(problem: StageProblem, rng: random.Random) -> StageProblem:
    """A throughput budget between the fastest assignment and the one with every layer
    recomputed (so recomputing is a trade-off)."""
    fastest = solve_brute_force(dataclasses.replace(problem, objective=OBJECTIVE_TIME))
    if not fastest.has_solution:
        return problem
    budget = int(fastest.objective * rng.uniform(1.0, 1.4))
    return dataclasses.replace(problem, iteration_budget_ns=budget)


def _check(problem: StageProblem, solution) -> None:
    assert len(solution.recomputed) == problem.num_layers
    args = (solution.stage_of_layer, solution.recomputed, solution.group_of_stage)
    assert problem.violation(*args) is None
    assert problem.objective_value(*args) == solution.objective
    for stage, k in zip(problem.stages(*args), solution.group_of_stage, strict=True):
        assert stage.peak_bytes <= problem.placement.capacity_bytes[k]


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("seed", slow_params(range(8), 4, 5, 6, 7))
def test_placed_selective_equals_brute_force(backend, seed):
    """Memory objective free and under a throughput budget, and the time objective."""
    problem, rng = _placed(seed)
    for case in (
        problem,
        _with_budget(problem, rng),
        dataclasses.replace(problem, objective=OBJECTIVE_TIME),
    ):
        expected = solve_brute_force(case)
        solution = BACKENDS[backend](case, time_limit_s=30)
        assert solution.status == expected.status
        assert solution.status in (OPTIMAL, INFEASIBLE)
        assert solution.objective == expected.objective
        if solution.has_solution:
            _check(case, solution)


@pytest.mark.parametrize("seed", range(6))
def test_placed_selective_never_worse_than_none_and_full(seed):
    """Same graph, config and groups: the selective optimum <= the none and full optima (each
    by brute force over its splits and placements)."""
    selective, _ = _placed(seed)
    solution = solve_cpsat(selective, time_limit_s=30)
    for mode in ("none", "full"):
        uniform, _ = _placed(seed, mode)
        reference = solve_brute_force(uniform)
        if reference.has_solution:
            assert solution.has_solution
            assert solution.objective <= reference.objective
    if solution.has_solution:
        _check(selective, solution)


def _cluster(small_bytes: int, large_bytes: int, *, tflops: float = 989) -> Cluster:
    """2 GPUs of ``small_bytes`` at ``tflops`` and 2 of ``large_bytes`` at 989 (one node each)."""
    return cluster_of(
        cluster_group("small", small_bytes, tflops=tflops), cluster_group("large", large_bytes)
    )


@pytest.mark.slow
@pytest.mark.parametrize("memory_objective", [UTILIZATION, ABSOLUTE])
def test_selective_on_a_heterogeneous_cluster(memory_objective):
    """recompute selective respects every group's capacity and GPU count, and is never worse
    than none or full on the same cluster; auto, where both fit, is the better of them."""
    graph = random_chain(random.Random(5), 6)
    base = TrainingConfig(
        global_batch=8, pp=2, max_slowdown=None, memory_objective=memory_objective
    )
    reference = plan(graph, _cluster(2**36, 2**36), dataclasses.replace(base, recompute="none"))
    cluster = _cluster(int(reference.peak_bytes * 0.7), int(reference.peak_bytes * 1.1))
    # every mode fits on this (seeded) cluster, so the comparison below always runs; a change
    # that makes none or full infeasible here fails loudly rather than skipping it
    results = {
        mode: plan(graph, cluster, dataclasses.replace(base, recompute=mode))
        for mode in ("selective", "auto", "none", "full")
    }
    auto = results["selective"]
    assert auto.config.recompute == "selective"
    assert check_plan(auto) == []
    evaluation = auto.evaluation
    assert evaluation.fits
    assert len(evaluation.recomputed) == graph.num_layers
    for k, group in enumerate(cluster.groups):
        hosted = evaluation.group_of_stage.count(k)
        assert hosted * auto.config.tp * auto.config.dp == group.num_gpus
    for stage, k in zip(auto.stages, evaluation.group_of_stage, strict=True):
        assert stage.peak_bytes <= cluster.groups[k].gpu_memory_bytes
    for mode in ("none", "full"):
        assert auto.solver.objective <= results[mode].solver.objective
    uniform = min(results[mode].solver.objective for mode in ("none", "full"))
    assert results["auto"].solver.objective == uniform


def test_recomputed_layers_take_their_groups_time():
    """evaluate() on a heterogeneous cluster: a recomputed layer's forward runs again at its
    group's speed."""
    graph = random_chain(random.Random(2), 4)
    cluster = _cluster(2**36, 2**36, tflops=312)
    config = dataclasses.replace(
        random_config(random.Random(0), 4), pp=2, tp=1, dp=2, recompute="selective"
    )
    flags = [True, False, True, False]
    common = dict(cluster=cluster, group_of_stage=[0, 1])
    kept = evaluate(graph, config, [0, 0, 1, 1], **common)
    recomputed = evaluate(graph, config, [0, 0, 1, 1], recomputed=flags, **common)
    slow = [s.time_ns for s in recomputed.stages]
    assert slow[0] > kept.stages[0].time_ns and slow[1] > kept.stages[1].time_ns
    swapped = evaluate(
        graph, config, [0, 0, 1, 1], recomputed=flags, **common | {"group_of_stage": [1, 0]}
    )
    assert swapped.stages[0].time_ns < slow[0]  # stage 0 on the 989 TFLOP/s group now
    assert [s.recomputed for s in recomputed.stages] == [[0], [2]]


# -- the complete start ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_groups_by_peak_is_the_best_placement_of_a_split(seed):
    """For a fixed split, heaviest stages on the largest GPUs minimise the memory objective
    (brute force over every group assignment with the right counts)."""
    problem, rng = _placed(seed, "none")
    split = sorted(rng.choices(range(problem.num_stages), k=problem.num_layers))
    split[: problem.num_stages] = range(problem.num_stages)
    split.sort()
    peaks = [s.peak_bytes for s in StageProblem(costs=problem.costs).stages(split)]
    placement = problem.placement
    best = min(
        problem.memory_value(problem.stages(split, None, list(groups)), list(groups))
        for groups in itertools.product(range(placement.num_groups), repeat=problem.num_stages)
        if all(groups.count(k) == n for k, n in enumerate(placement.stages_per_group))
    )
    groups = groups_by_peak(problem, peaks)
    assert problem.memory_value(problem.stages(split, None, groups), groups) == best
    assert [groups.count(k) for k in range(2)] == placement.stages_per_group


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("seed", range(8))
def test_placement_start_is_complete_and_valid(seed, recompute):
    """With capacities no stage can exceed, the start is a valid assignment (chain algorithm
    on chains, balanced contiguous runs on DAGs); a budget the start meets leaves it valid."""
    problem, _ = _placed(seed, recompute)
    problem.placement.capacity_bytes = [2**36, 2**36]
    split, groups, recomputed = placement_start(problem, time_limit_s=5)
    assert (recomputed is not None) == problem.selective
    assert problem.violation(split, recomputed, groups) is None
    complete = complete_start(problem, split, recomputed)
    assert [complete.count(k) for k in range(2)] == problem.placement.stages_per_group


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_placed_solve_returns_its_start_when_out_of_time(backend):
    """At a time limit too short to search, the start (with its groups) comes back FEASIBLE."""
    problem, _ = _placed(3, "none")
    problem.placement.capacity_bytes = [2**36, 2**36]
    solution = BACKENDS[backend](problem, time_limit_s=0.001)
    assert solution.status in (FEASIBLE, OPTIMAL)
    assert problem.violation(solution.stage_of_layer, None, solution.group_of_stage) is None


def test_hint_groups_are_checked():
    problem, _ = _placed(1, "none")
    split = [min(i, problem.num_stages - 1) for i in range(problem.num_layers)]
    with pytest.raises(InputError, match="hint groups"):
        check_hint(problem, split, [0] * (problem.num_stages + 1))
    with pytest.raises(InputError, match="hint groups"):
        check_hint(problem, split, [2] * problem.num_stages)
    with pytest.raises(InputError, match="hint groups"):
        check_hint(StageProblem(costs=problem.costs), split, [0] * problem.num_stages)
    check_hint(problem, split, [0] * problem.num_stages)  # counts are the solver's business


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_given_placement_hint_is_kept(backend):
    """A feasible hint with groups is returned when the solver has no time to improve on it."""
    problem, _ = _placed(5, "none")
    problem.placement.capacity_bytes = [2**36, 2**36]
    expected = solve_brute_force(problem)
    solution = BACKENDS[backend](
        problem,
        time_limit_s=0.001,
        hint=expected.stage_of_layer,
        hint_groups=expected.group_of_stage,
    )
    assert solution.objective == expected.objective
    assert problem.violation(solution.stage_of_layer, None, solution.group_of_stage) is None


@pytest.mark.slow
def test_plan_json_lists_recomputed_layers_per_group(tmp_path):
    graph = random_chain(random.Random(5), 6)
    training = TrainingConfig(global_batch=8, pp=2, max_slowdown=None, recompute="selective")
    reference = plan(graph, _cluster(2**36, 2**36), dataclasses.replace(training, recompute="none"))
    result = plan(graph, _cluster(int(reference.peak_bytes * 0.7), 2**36), training)
    from solver.report.plan_report import plan_to_dict

    document = json.loads(json.dumps(plan_to_dict(result)))
    assert document["config"]["recompute"] == "selective"
    assert all("recomputed" in stage and "group" in stage for stage in document["stages"])
