"""The exact DP over a DAG's ideals (``solver.backends.dag``): its ideals against networkx's
antichains, its optimum against brute force on random DAGs (megatron and torch runtimes, 1F1B
and GPipe, ZeRO 0-3, both gradient lifetimes, the optimizer-step temporary, capacity, iteration
budget, memory and time objectives, torch's per-tensor buffer adjustments), against CP-SAT on a
medium DAG and on T5 through ``plan``; the prefix fallback on a DAG too wide for it; backend
selection."""

from __future__ import annotations

import dataclasses
import random

import networkx as nx
import numpy as np
import pytest

from solver.backends import resolve_backend
from solver.backends.brute_force import solve_brute_force
from solver.backends.chain import solve_chain
from solver.backends.cpsat import solve_cpsat
from solver.backends.dag import (
    MAX_IDEALS,
    _run,
    _structure,
    dag_applies,
    dag_fits_graph,
    enumerate_ideals,
    solve_dag,
    topological_split,
)
from solver.backends.problem import (
    FEASIBLE,
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OBJECTIVE_TIME,
    OPTIMAL,
    UNKNOWN,
    StageProblem,
)
from solver.costs import layer_costs
from solver.errors import InputError
from solver.graph import graph_from_dict, load_graph
from solver.search import incumbents
from solver.search.planner import plan
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import T5_DAG
from tests.random_graphs import random_chain, random_config, random_dag, random_layer
from tests.test_boundary_roles import flagged_dag

GIB = 2**30


def ideal_sets(graph) -> set[frozenset[int]]:
    """Every ideal as the down-closure of an antichain (networkx), by layer position."""
    dag = nx.DiGraph()
    dag.add_nodes_from(range(graph.num_layers))
    position = {layer.name: i for i, layer in enumerate(graph.layers)}
    dag.add_edges_from((position[e.src], position[e.dst]) for e in graph.edges)
    return {
        frozenset().union(*({node} | nx.ancestors(dag, node) for node in antichain))
        for antichain in nx.antichains(dag)
    }


def costs_for(graph, config: ParallelConfig, **options):
    training = TrainingConfig(global_batch=config.global_batch, **options)
    return layer_costs(graph, config, Cluster(num_gpus=config.num_gpus), training)


def wide_graph(width: int):
    """An input layer, ``width`` parallel layers, an output layer reading all of them: 2^width
    + 2 ideals."""
    rng = random.Random(width)
    names = ["in", *(f"b{i}" for i in range(width)), "out"]
    edges = [{"src": "in", "dst": f"b{i}", "bytes": 10} for i in range(width)]
    edges += [{"src": f"b{i}", "dst": "out", "bytes": 10} for i in range(width)]
    document = {
        "format": "layer-graph",
        "version": 1,
        "model": "wide",
        "layers": [random_layer(rng, name) for name in names],
        "edges": edges,
    }
    return graph_from_dict(document)


def assert_matches_oracle(problem: StageProblem) -> None:
    oracle = solve_brute_force(problem)
    solution = solve_dag(problem)
    assert solution.status == oracle.status
    assert solution.objective == oracle.objective
    if solution.has_solution:
        assert solution.bound == solution.objective
        assert problem.violation(solution.stage_of_layer) is None
        assert problem.objective_value(solution.stage_of_layer) == solution.objective


# -- ideals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_ideals_are_the_down_closures_of_antichains(seed):
    rng = random.Random(70000 + seed)
    graph = random_dag(rng, rng.randint(2, 9))
    costs = costs_for(graph, ParallelConfig(pp=1, tp=1, dp=1, micro_batch=1, num_microbatches=1))
    members = enumerate_ideals(graph.num_layers, costs.edge_src.tolist(), costs.edge_dst.tolist())
    found = {frozenset(np.flatnonzero(row).tolist()) for row in members}
    assert len(found) == len(members)  # no duplicates
    assert found == ideal_sets(graph)
    assert not members[0].any() and members[-1].all()
    assert (np.diff(members.sum(axis=1)) >= 0).all()  # by size


def test_ideal_limit_and_t5_counts():
    costs = costs_for(
        wide_graph(13), ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=2)
    )
    src, dst = costs.edge_src.tolist(), costs.edge_dst.tolist()
    assert len(enumerate_ideals(costs.num_layers, src, dst)) == 2**13 + 2
    assert enumerate_ideals(costs.num_layers, src, dst, limit=MAX_IDEALS) is None
    assert not dag_fits_graph(costs)
    # T5: 8 encoder prefixes x dec_embed in or out, then 7 decoder prefixes (+ head)
    t5 = costs_for(
        load_graph(T5_DAG), ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=2)
    )
    assert len(_structure(t5).members) == 9 * 2 + 7
    # one structure per graph, shared by every config
    other = costs_for(
        load_graph(T5_DAG), ParallelConfig(pp=4, tp=2, dp=1, micro_batch=2, num_microbatches=4)
    )
    assert _structure(t5) is _structure(other)


# -- against brute force ----------------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["megatron", "torch"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("seed", range(8))
def test_dp_matches_brute_force(runtime, schedule, seed):
    """Random DAGs of 3-7 layers, ZeRO 0-3 in turn; memory and time objectives; every third
    with a capacity and an iteration budget near the unconstrained optimum's (binding or
    infeasible); torch with both gradient lifetimes and the foreach step temporary, megatron
    with and without deallocating sent outputs."""
    rng = random.Random(71000 + 100 * seed + 10 * (runtime == "torch") + (schedule == "gpipe"))
    graph = random_dag(rng, rng.randint(3, 7))
    config = dataclasses.replace(random_config(rng, graph.num_layers), schedule=schedule)
    config = dataclasses.replace(config, zero=seed % 4)
    options = {"runtime": runtime}
    if runtime == "torch":
        options["grad_lifetime"] = rng.choice(["persistent", "step"])
        options["optimizer_impl"] = rng.choice(["fused", "foreach"])
    else:
        options["deallocate_pipeline_outputs"] = rng.choice([True, False])
    objective = OBJECTIVE_TIME if seed % 2 else OBJECTIVE_MEMORY
    problem = StageProblem(costs=costs_for(graph, config, **options), objective=objective)
    if seed % 3 == 0:
        free = solve_brute_force(problem)
        peak, iteration = problem.measure(free.stage_of_layer)
        problem.capacity_bytes = peak - rng.randint(0, peak // 20)
        problem.iteration_budget_ns = iteration - rng.randint(0, iteration // 20)
    assert_matches_oracle(problem)


@pytest.mark.parametrize("seed", range(8))
def test_dp_matches_brute_force_with_budget_only(seed):
    """Memory under an iteration budget alone: the branch and bound over alpha = max AR_s."""
    rng = random.Random(72000 + seed)
    graph = random_dag(rng, rng.randint(4, 7))
    config = random_config(rng, graph.num_layers)
    problem = StageProblem(costs=costs_for(graph, config))
    fastest = solve_brute_force(dataclasses.replace(problem, objective=OBJECTIVE_TIME))
    problem.iteration_budget_ns = fastest.objective + fastest.objective // rng.choice([5, 20, 100])
    assert_matches_oracle(problem)


@pytest.mark.parametrize("lifetime", ["step", "persistent"])
@pytest.mark.parametrize("seed", range(6))
def test_dp_matches_brute_force_with_flagged_tensors(seed, lifetime):
    """torch runtime, tensors sent to several consumers with requires_grad / saved / charged
    fields (``direct_buffer_adjustments``), both schedules and lifetimes."""
    rng = random.Random(73000 + seed)
    graph = flagged_dag(rng, rng.randint(4, 6))
    schedule = rng.choice(["gpipe", "1f1b"])
    config = ParallelConfig(
        pp=rng.randint(2, 3),
        tp=1,
        dp=1,
        micro_batch=rng.choice([1, 2]),
        num_microbatches=rng.randint(1, 4),
        schedule=schedule,
        zero=rng.choice([0, 1, 2, 3]),
    )
    costs = costs_for(
        graph, config, runtime="torch", grad_lifetime=lifetime, optimizer_impl="foreach"
    )
    assert not costs.plain_boundaries
    assert_matches_oracle(StageProblem(costs=costs, objective=OBJECTIVE_MEMORY))


def test_infeasible_capacity_is_proven():
    rng = random.Random(74000)
    graph = random_dag(rng, 5)
    costs = costs_for(graph, ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=2))
    problem = StageProblem(costs=costs, capacity_bytes=1)
    solution = solve_dag(problem)
    assert solution.status == INFEASIBLE == solve_brute_force(problem).status


# -- against CP-SAT and through plan ----------------------------------------------------------


def test_dp_matches_cpsat_on_a_medium_dag():
    rng = random.Random(75000)
    graph = random_dag(rng, 14)
    config = ParallelConfig(pp=4, tp=1, dp=2, micro_batch=1, num_microbatches=8)
    problem = StageProblem(costs=costs_for(graph, config))
    exact = solve_dag(problem)
    reference = solve_cpsat(problem, time_limit_s=30)
    assert exact.status == reference.status == OPTIMAL
    assert exact.objective == reference.objective
    assert problem.objective_value(exact.stage_of_layer) == exact.objective


@pytest.mark.slow
def test_t5_plan_matches_cpsat():
    """T5 (an encoder chain, a decoder chain whose every block reads the encoder output, an
    independent decoder embedding) through ``plan``: auto picks the DP, proves CP-SAT's
    optimum, and the plan's stages are the cost model's."""
    graph = load_graph(T5_DAG)
    cluster = Cluster(num_gpus=8, gpu_memory_bytes=80 * GIB)
    training = TrainingConfig(global_batch=32)
    ours = plan(graph, cluster, training, time_limit_s=60, suggest_gpus=False)
    reference = plan(graph, cluster, training, backend="cpsat", time_limit_s=60, suggest_gpus=False)
    assert ours.solver.backend == "dag" and ours.solver.status == OPTIMAL
    assert reference.solver.status == OPTIMAL
    assert ours.solver.objective == reference.solver.objective
    assert ours.config == reference.config


def test_optimum_along_the_layer_order_when_one_ties():
    """T5 configs: the value is the raw DP's; when the best split along the layer order reaches
    it, that split is returned (what pipeline() split points cut); otherwise the DAG optimum is
    strictly smaller and some stage is not a run of the order."""
    graph = load_graph(T5_DAG)
    ordered_ties = strict = 0
    for pp, runtime in ((2, "megatron"), (3, "torch"), (4, "megatron"), (6, "torch")):
        config = ParallelConfig(pp=pp, tp=1, dp=1, micro_batch=1, num_microbatches=4)
        problem = StageProblem(costs=costs_for(graph, config, runtime=runtime))
        raw = _run(problem, _structure(problem.costs), None, proven=True)
        found = solve_dag(problem)
        along = topological_split(problem, time_limit_s=None)
        assert found.status == OPTIMAL and found.objective == raw.objective == found.bound
        assert problem.objective_value(found.stage_of_layer) == found.objective
        ordered = bool((np.diff(found.stage_of_layer) >= 0).all())
        if along.objective == found.objective:
            assert ordered
            ordered_ties += not bool((np.diff(raw.stage_of_layer) >= 0).all())
        else:
            assert along.objective > found.objective and not ordered
            strict += 1
    assert ordered_ties and strict  # both cases occur among these configs


# -- the prefix fallback -----------------------------------------------------------------------


def test_topological_split_on_a_wide_dag_is_a_valid_feasible_split():
    graph = wide_graph(14)
    config = ParallelConfig(pp=3, tp=1, dp=1, micro_batch=1, num_microbatches=4)
    costs = costs_for(graph, config)
    problem = StageProblem(costs=costs)
    assert not dag_applies(costs)
    with pytest.raises(InputError, match="ideals"):
        solve_dag(problem)
    found = topological_split(problem, time_limit_s=10)
    assert found.status == FEASIBLE and found.bound == 0
    assert problem.violation(found.stage_of_layer) is None
    assert problem.objective_value(found.stage_of_layer) == found.objective
    stages = np.asarray(found.stage_of_layer)
    assert (np.diff(stages) >= 0).all()  # consecutive runs of the layer order


@pytest.mark.slow  # ~0.5 s validating the 520-layer graph
def test_too_many_layers_for_either_structure():
    """520 layers with one skip edge: 521 ideals but 135,460 pairs x 520 layers over the cap,
    for the exact DP and the prefix DP alike: auto leaves it to CP-SAT (without a start), the
    prefix DP says UNKNOWN."""
    names = [f"l{i}" for i in range(520)]
    edges = [{"src": a, "dst": b, "bytes": 10} for a, b in zip(names[:-1], names[1:], strict=True)]
    graph = graph_from_dict(
        {
            "format": "layer-graph",
            "version": 1,
            "model": "long",
            "layers": [
                {"name": name, "params": 10, "activation_bytes": 10, "output_bytes": 10}
                for name in names
            ],
            "edges": [*edges, {"src": names[0], "dst": names[-1], "bytes": 10}],
        }
    )
    costs = costs_for(graph, ParallelConfig(pp=4, tp=1, dp=1, micro_batch=1, num_microbatches=4))
    assert not dag_fits_graph(costs)
    found = topological_split(StageProblem(costs=costs), time_limit_s=10)
    assert found.status == UNKNOWN and not found.has_solution


def test_topological_split_is_optimal_on_a_chain():
    rng = random.Random(76000)
    graph = random_chain(rng, 9)
    config = ParallelConfig(pp=3, tp=1, dp=1, micro_batch=1, num_microbatches=6)
    problem = StageProblem(costs=costs_for(graph, config), objective=OBJECTIVE_TIME)
    found = topological_split(problem, time_limit_s=10)
    assert found.status == OPTIMAL
    assert found.objective == solve_chain(problem).objective == found.bound


def test_time_limit_returns_what_it_has():
    rng = random.Random(77000)
    problem = StageProblem(
        costs=costs_for(
            random_dag(rng, 8), ParallelConfig(pp=3, tp=1, dp=1, micro_batch=1, num_microbatches=3)
        )
    )
    solution = solve_dag(problem, time_limit_s=0.0)
    assert solution.status in (UNKNOWN, FEASIBLE)


# -- backend selection -------------------------------------------------------------------------


def test_backend_selection():
    assert resolve_backend("auto", False, dag_fits=True) == "dag"
    assert resolve_backend("auto", False, dag_fits=False) == "cpsat"
    assert resolve_backend("auto", True, dag_fits=True) == "chain"
    assert resolve_backend("auto", False, dag_fits=True, interleaved=True) == "cpsat"
    assert resolve_backend("auto", False, dag_fits=True, selective=True) == "cpsat"
    assert resolve_backend("auto", False, dag_fits=True, heterogeneous=True) == "cpsat"
    assert resolve_backend("dag", False) == "dag"
    for flag, words in (
        ("interleaved", "interleaved"),
        ("selective", "recomputed"),
        ("heterogeneous", "node groups"),
    ):
        with pytest.raises(InputError, match=words):
            resolve_backend("dag", False, **{flag: True})


def test_plan_on_a_wide_dag_uses_cpsat_from_the_topological_split(monkeypatch):
    """auto on a DAG beyond the ideal cap: CP-SAT, started from the prefix DP's split; a
    forced --backend dag is refused in one line."""
    graph = wide_graph(13)
    cluster = Cluster(num_gpus=2, gpu_memory_bytes=80 * GIB)
    training = TrainingConfig(global_batch=4, micro_batch_sizes=(1,), max_slowdown=None)
    starts = []

    def recorded(problem, *, time_limit_s):
        found = topological_split(problem, time_limit_s=time_limit_s)
        starts.append(found)
        return found

    methods = [
        dataclasses.replace(m, split=recorded) if m.name == "topological" else m
        for m in incumbents.QUICK_METHODS
    ]
    monkeypatch.setattr(incumbents, "QUICK_METHODS", methods)
    result = plan(graph, cluster, training, time_limit_s=30, suggest_gpus=False)
    assert result.solver.backend == "cpsat" and result.solver.status == OPTIMAL
    # one stage: the only split; pp > 1: a split along the layer order, not proven
    assert starts and {found.status for found in starts} <= {OPTIMAL, FEASIBLE}
    assert any(found.status == FEASIBLE for found in starts)
    assert result.solver.objective <= min(f.objective for f in starts if f.has_solution)
    with pytest.raises(InputError, match="--backend dag: this graph has more than 4096 ideals"):
        plan(graph, cluster, training, backend="dag", time_limit_s=30, suggest_gpus=False)
