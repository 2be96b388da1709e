"""Heterogeneous clusters: cluster files, stage placement on node groups, plans and reports.

Formulations are checked against brute force over splits x group assignments; plans against the
group capacities and GPU counts, against brute force over every config, and against planning as
if every GPU were the small one.
"""

from __future__ import annotations

import json
import random
from functools import partial

import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.cpsat import solve_cpsat
from solver.backends.milp import solve_milp
from solver.backends.problem import (
    ABSOLUTE,
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OBJECTIVE_TIME,
    OPTIMAL,
    UTILIZATION,
    Placement,
    StageProblem,
)
from solver.cli import evaluate_main, plan_main
from solver.costs import layer_costs, stage_costs, utilization_ppm
from solver.errors import InfeasibleError, InputError
from solver.files.cluster_file import load_cluster
from solver.graph import graph_from_dict
from solver.plan_check import check_plan
from solver.report.plan_report import plan_to_dict
from solver.search.config_search import build_entries
from solver.search.planner import plan
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import GPT_1_3B, MIXED_CLUSTER, cluster_group, cluster_of
from tests.random_graphs import random_chain, random_config, random_dag

BACKENDS = {"cpsat": solve_cpsat, "milp": solve_milp, "cbc": partial(solve_milp, solver="cbc")}


# -- formulation against brute force ---------------------------------------------------------


def _placed_problem(seed: int, objective: str, memory_objective: str) -> StageProblem:
    """A random 2-group problem: group 1 slower or faster, capacities around an even split's
    peak (tight enough that the placement matters, sometimes infeasible); a budget or a
    utilization limit on some seeds."""
    rng = random.Random(seed)
    while True:
        num_layers = rng.randint(2, 6)
        graph = (random_chain if seed % 2 else random_dag)(rng, num_layers)
        config = random_config(rng, num_layers)
        if config.pp >= 2 and config.pp**num_layers * 2**config.pp <= 3000:
            break
    training = TrainingConfig(global_batch=config.global_batch)
    group_costs = [
        layer_costs(graph, config, Cluster(num_gpus=config.num_gpus, gpu_flops=flops), training)
        for flops in (989e12, rng.choice([312e12, 2e15]))
    ]
    even = [min(i * config.pp // num_layers, config.pp - 1) for i in range(num_layers)]
    peak = max(s.peak_bytes for s in stage_costs(group_costs[0], even))
    small = rng.randint(1, config.pp - 1)
    placement = Placement(
        group_costs=group_costs,
        capacity_bytes=[int(peak * rng.uniform(0.5, 1.0)), int(peak * rng.uniform(1.0, 2.0))],
        stages_per_group=[small, config.pp - small],
        names=["small", "large"],
        memory_objective=memory_objective,
    )
    problem = StageProblem(costs=group_costs[0], objective=objective, placement=placement)
    if seed % 3 == 0:  # a limit that cuts off some assignments
        reference = solve_brute_force(problem)
        if reference.has_solution:
            if objective == OBJECTIVE_MEMORY:
                _, iteration = problem.measure(
                    reference.stage_of_layer, group_of_stage=reference.group_of_stage
                )
                problem.iteration_budget_ns = iteration
            elif memory_objective == UTILIZATION:
                memory, _ = problem.measure(
                    reference.stage_of_layer, group_of_stage=reference.group_of_stage
                )
                problem.utilization_limit_ppm = memory
    return problem


@pytest.mark.parametrize("backend", ["cpsat", "milp"])
@pytest.mark.parametrize("memory_objective", [UTILIZATION, ABSOLUTE])
@pytest.mark.parametrize("objective", [OBJECTIVE_MEMORY, OBJECTIVE_TIME])
@pytest.mark.parametrize("seed", range(8))
def test_placement_matches_brute_force(seed, objective, memory_objective, backend):
    problem = _placed_problem(seed, objective, memory_objective)
    reference = solve_brute_force(problem)
    solution = BACKENDS[backend](problem, time_limit_s=20)
    assert solution.status == reference.status
    assert solution.objective == reference.objective
    if solution.has_solution:
        assert (
            problem.violation(solution.stage_of_layer, group_of_stage=solution.group_of_stage)
            is None
        )
        assert (
            problem.objective_value(solution.stage_of_layer, group_of_stage=solution.group_of_stage)
            == solution.objective
        )


def test_cbc_agrees_on_placement():
    problem = _placed_problem(5, OBJECTIVE_MEMORY, UTILIZATION)
    assert BACKENDS["cbc"](problem).objective == solve_brute_force(problem).objective


@pytest.mark.parametrize("backend", ["cpsat", "milp"])
def test_heavy_stage_goes_to_the_large_gpus(backend):
    """Two layers, one stage each, the first 3x heavier, both fit either group: utilization puts
    the heavy stage on the 4x larger GPUs (max(1/4, 1/3) < max(1, 1/12)); capacities decide
    when the heavy stage fits the large GPUs only, or none."""
    graph = graph_from_dict(
        {
            "format": "layer-graph",
            "version": 1,
            "model": "two",
            "layers": [
                {"name": "heavy", "params": 3000, "activation_bytes": 0, "output_bytes": 0},
                {"name": "light", "params": 1000, "activation_bytes": 0, "output_bytes": 0},
            ],
        }
    )
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=1)
    costs = layer_costs(graph, config, Cluster(num_gpus=2), TrainingConfig(global_batch=1))
    light, heavy = 18 * 1000, 18 * 3000  # bytes per parameter on megatron: 2 + 4 + 12
    placement = Placement(
        group_costs=[costs, costs],
        capacity_bytes=[heavy, 4 * heavy],
        stages_per_group=[1, 1],
        names=["small", "large"],
    )
    problem = StageProblem(costs=costs, placement=placement)
    solution = BACKENDS[backend](problem)
    assert solution.group_of_stage == [1, 0]
    assert solution.objective == utilization_ppm(light, heavy) == 333_334
    placement.memory_objective = ABSOLUTE
    assert BACKENDS[backend](problem).objective == heavy
    placement.capacity_bytes = [heavy - 1, heavy]  # the heavy stage fits the large GPUs only
    assert BACKENDS[backend](problem).group_of_stage == [1, 0]
    placement.capacity_bytes = [heavy - 1, heavy - 1]
    assert BACKENDS[backend](problem).status == INFEASIBLE


# -- planning ----------------------------------------------------------------------------------


def _graph(seed: int = 3, num_layers: int = 6):
    return random_chain(random.Random(seed), num_layers)


def _peak_of_homogeneous(graph, num_gpus: int, gpus_per_node: int, training) -> int:
    result = plan(
        graph,
        Cluster(num_gpus=num_gpus, gpus_per_node=gpus_per_node, gpu_memory_bytes=2**50),
        training,
    )
    return result.peak_bytes


@pytest.mark.parametrize("memory_objective", [UTILIZATION, ABSOLUTE])
def test_plan_respects_group_capacities_and_gpu_counts(memory_objective):
    graph = _graph()
    training = TrainingConfig(global_batch=8, max_slowdown=None, memory_objective=memory_objective)
    peak = _peak_of_homogeneous(graph, 8, 2, training)
    cluster = cluster_of(
        cluster_group("small", int(peak * 0.9), nodes=2), cluster_group("large", 2 * peak, nodes=2)
    )
    result = plan(graph, cluster, training)
    evaluation = result.evaluation
    assert check_plan(result) == []
    assert evaluation.fits
    config = result.config
    for k, group in enumerate(cluster.groups):
        hosted = evaluation.group_of_stage.count(k)
        assert hosted * config.tp * config.dp == group.num_gpus
    for stage, k in zip(result.stages, evaluation.group_of_stage, strict=True):
        assert stage.peak_bytes <= cluster.groups[k].gpu_memory_bytes
    document = plan_to_dict(result)
    for stage, k, ppm in zip(
        document["stages"], evaluation.group_of_stage, evaluation.utilization_ppm, strict=True
    ):
        assert stage["group"] == cluster.groups[k].name
        assert stage["capacity_bytes"] == cluster.groups[k].gpu_memory_bytes
        assert stage["utilization"] == ppm / 1e6
    unit = "ppm" if memory_objective == UTILIZATION else "bytes"
    assert document["solver"]["objective_unit"] == unit


@pytest.mark.parametrize("memory_objective", [UTILIZATION, ABSOLUTE])
def test_plan_equals_brute_force_over_every_config(memory_objective):
    graph = _graph(seed=8, num_layers=5)
    training = TrainingConfig(
        global_batch=4,
        micro_batch_sizes=(1, 2),
        max_slowdown=None,
        memory_objective=memory_objective,
    )
    peak = _peak_of_homogeneous(graph, 4, 2, training)
    cluster = cluster_of(
        cluster_group("small", int(peak * 0.8)), cluster_group("large", int(peak * 1.6))
    )
    result = plan(graph, cluster, training)
    best = None
    for entry in build_entries(graph, cluster, training):
        problem = StageProblem(costs=entry.costs, placement=entry.placement)
        solution = solve_brute_force(problem)
        if solution.status != INFEASIBLE and (best is None or solution.objective < best):
            best = solution.objective
    assert best is not None
    assert result.solver.status == OPTIMAL
    assert result.solver.objective == best


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("memory_objective", [UTILIZATION, ABSOLUTE])
def test_mixed_cluster_never_worse_than_all_small(seed, memory_objective):
    """Mixed small/large GPUs against the same GPU count, all small (pp pinned so that both
    search the same configs; same FLOP/s, no throughput constraint)."""
    graph = _graph(seed=seed + 20, num_layers=6)
    training = TrainingConfig(
        global_batch=8, pp=2, max_slowdown=None, memory_objective=memory_objective
    )
    peak = _peak_of_homogeneous(graph, 8, 4, training)
    for share in (0.9, 1.05):
        small = int(peak * share)
        all_small = Cluster(num_gpus=8, gpus_per_node=4, gpu_memory_bytes=small)
        mixed = cluster_of(
            cluster_group("small", small, gpus=4), cluster_group("large", 2 * small, gpus=4)
        )
        result = plan(graph, mixed, training)
        assert check_plan(result) == []
        try:
            reference = plan(graph, all_small, training)
        except InfeasibleError:
            continue  # nothing fits on the small GPUs alone: the mix is strictly better
        assert result.peak_bytes <= reference.peak_bytes or memory_objective == UTILIZATION
        assert max(result.evaluation.utilization_ppm) <= utilization_ppm(
            reference.peak_bytes, small
        )


def test_chain_backend_refuses_a_heterogeneous_cluster():
    cluster = cluster_of(cluster_group("a", "40GiB"), cluster_group("b", "80GiB"))
    with pytest.raises(InputError, match="node groups"):
        plan(_graph(), cluster, TrainingConfig(global_batch=4), backend="chain")


def test_configs_use_every_gpu_and_fit_every_group():
    cluster = cluster_of(
        cluster_group("a", "40GiB", nodes=1, gpus=4), cluster_group("b", "80GiB", gpus=4, nodes=2)
    )
    training = TrainingConfig(global_batch=24, micro_batch_sizes=(1,))
    for entry in build_entries(_graph(num_layers=12), cluster, training):
        config = entry.costs.config
        assert config.num_gpus == 12
        assert 4 % config.tp == 0 and 4 % (config.tp * config.dp) == 0
        assert sum(entry.placement.stages_per_group) == config.pp


# -- cluster files and CLIs ------------------------------------------------------------------


def test_homogeneous_cluster_file_gives_the_flags_plan(write_json, tmp_path, run_cli):
    graph = _graph(num_layers=8)
    graph_path = tmp_path / "graph.json"
    graph.save(graph_path)
    cluster = {
        "format": "cluster",
        "version": 1,
        "groups": [
            {
                "name": "h100",
                "num_nodes": 2,
                "gpus_per_node": 4,
                "gpu_memory": "2MiB",
                "gpu_tflops": 500,
                "flops_efficiency": 0.4,
                "intra_node_gb_per_s": 300,
                "inter_node_gb_per_s": 20,
            }
        ],
    }
    assert not load_cluster(write_json("c.json", cluster)).is_heterogeneous
    common = [str(graph_path), "--global-batch", "8", "--quiet", "--reserve", "0"]
    flags = [
        "--gpus",
        "8",
        "--gpus-per-node",
        "4",
        "--gpu-memory",
        "2MiB",
        "--gpu-tflops",
        "500",
        "--flops-efficiency",
        "0.4",
        "--intra-node-gbps",
        "300",
        "--inter-node-gbps",
        "20",
    ]
    documents = []
    for options, out in (
        (flags, "flags.json"),
        (["--cluster", str(tmp_path / "c.json")], "f.json"),
    ):
        code, _, err = run_cli(plan_main, *common, *options, "--json", str(tmp_path / out))
        assert code == 0, err
        document = json.loads((tmp_path / out).read_text())
        document["solver"].pop("wall_s")
        for search in document["solver"]["searches"]:  # timings differ from run to run
            search.pop("wall_s"), search.pop("incumbent_s")
        documents.append(document)
    assert documents[0] == documents[1]


GOOD_GROUP = cluster_group("a", "40GiB")


@pytest.mark.parametrize(
    "document, message",
    [
        ("{", "not valid JSON"),
        ({"format": "cluster", "version": 1}, "'groups' is a required property"),
        ({"format": "graph", "version": 1, "groups": [GOOD_GROUP]}, "$.format"),
        ({"format": "cluster", "version": 1, "groups": []}, "$.groups"),
        (
            {"format": "cluster", "version": 1, "groups": [GOOD_GROUP | {"gpus": 3}]},
            "allowed keys",
        ),
        (
            {"format": "cluster", "version": 1, "groups": [GOOD_GROUP | {"gpu_memory": "40 GiBs"}]},
            "$.groups[0].gpu_memory",
        ),
        (
            {"format": "cluster", "version": 1, "groups": [GOOD_GROUP | {"num_nodes": 0}]},
            "$.groups[0].num_nodes",
        ),
        ({"format": "cluster", "version": 1, "groups": [GOOD_GROUP, GOOD_GROUP]}, "used twice"),
    ],
)
def test_bad_cluster_files_are_one_line_input_errors(write_json, run_cli, document, message):
    path = write_json("cluster.json", document)
    code, out, err = run_cli(plan_main, GPT_1_3B, "--cluster", path, "--global-batch", "8")
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and path in err and message in err


def test_missing_cluster_file_and_conflicting_flags(write_json, tmp_path, run_cli):
    code, _, err = run_cli(
        plan_main, GPT_1_3B, "--cluster", str(tmp_path / "no.json"), "--global-batch", "8"
    )
    assert code == 2 and "cluster file not found" in err and err.count("\n") == 1
    path = write_json("c.json", {"format": "cluster", "version": 1, "groups": [GOOD_GROUP]})
    for extra in (["--gpus", "2"], ["--gpu-memory", "40GiB"]):
        code, _, err = run_cli(
            plan_main, GPT_1_3B, "--cluster", path, "--global-batch", "8", *extra
        )
        assert code == 2 and extra[0] in err and err.count("\n") == 1
    code, _, err = run_cli(plan_main, GPT_1_3B, "--global-batch", "8")
    assert code == 2 and "--gpus N or --cluster FILE" in err


def test_evaluate_with_stage_groups(write_json, tmp_path, run_cli):
    path = write_json(
        "c.json",
        {
            "format": "cluster",
            "version": 1,
            "groups": [cluster_group("s", "40GiB"), cluster_group("l", "80GiB")],
        },
    )
    common = [
        GPT_1_3B,
        "--cluster",
        path,
        "--pp",
        "2",
        "--tp",
        "2",
        "--global-batch",
        "8",
        "--split",
        "even",
    ]
    out_path = tmp_path / "e.json"
    code, out, err = run_cli(
        evaluate_main, *common, "--stage-groups", "l,s", "--json", str(out_path)
    )
    assert code == 0, err
    document = json.loads(out_path.read_text())
    assert [s["group"] for s in document["stages"]] == ["l", "s"]
    assert [s["capacity_bytes"] for s in document["stages"]] == [80 * 2**30, 40 * 2**30]
    assert "util" in out
    code, _, err = run_cli(evaluate_main, *common, "--stage-groups", "s,s")
    assert code == 2 and "group s" in err and err.count("\n") == 1
    code, _, err = run_cli(evaluate_main, *common)
    assert code == 2 and "--stage-groups" in err


def test_example_cluster_file_loads():
    cluster = load_cluster(MIXED_CLUSTER)
    assert cluster.is_heterogeneous
    assert [g.gpu_memory_bytes for g in cluster.groups] == [40 * 2**30, 80 * 2**30]
    assert cluster.num_gpus == 32


@pytest.mark.slow
def test_recompute_on_a_heterogeneous_cluster(write_json, tmp_path, run_cli):
    """selective is accepted there, and auto is none or full where one fits, like on a
    homogeneous cluster (tests/test_placement_selective.py checks the plans)."""
    groups = [cluster_group("s", "40GiB"), cluster_group("l", "80GiB")]
    path = write_json("c.json", {"format": "cluster", "version": 1, "groups": groups})
    common = [GPT_1_3B, "--cluster", path, "--global-batch", "16", "--time-limit", "30"]
    for mode in ("auto", "selective"):
        out = tmp_path / f"{mode}.json"
        code, _, err = run_cli(plan_main, *common, "--recompute", mode, "--json", str(out))
        assert code == 0, err
        document = json.loads(out.read_text())
        expected = ("none", "full") if mode == "auto" else ("selective",)
        assert document["config"]["recompute"] in expected
        assert all("group" in stage for stage in document["stages"])
