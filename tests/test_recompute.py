"""Selective recomputation: the recomputed layers are a decision taken jointly with the split.

Oracle: brute force over every split and every recompute set (small random chains and DAGs);
"none" and "full" are the all-off and all-on sets of the same model, so the selective optimum is
never worse than either.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import replace

import numpy as np
import pytest

from solver.backends import resolve_backend
from solver.backends.brute_force import solve_brute_force
from solver.backends.chain import solve_chain
from solver.backends.cpsat import solve_cpsat
from solver.backends.milp import solve_milp
from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, OPTIMAL, StageProblem
from solver.cli import plan_main
from solver.costs import layer_costs, stage_costs
from solver.errors import InfeasibleError, InputError
from solver.evaluation import evaluate
from solver.exports import build_exports
from solver.files.plan_file import load_plan
from solver.graph import LayerGraph
from solver.plan_check import check_plan
from solver.report.plan_report import format_plan, plan_to_dict
from solver.search.config_search import Deadline, uniform_recompute_hint
from solver.search.planner import SELECTIVE_NOTE, plan
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from solver.sweep import PointOptions, solve_point
from tests.conftest import activation_heavy_chain, gpt_chain
from tests.random_graphs import random_chain, random_config, random_dag

BACKENDS = {"cpsat": solve_cpsat, "milp": solve_milp}
MAX_CASES = 4096
"""Brute force tries p**L splits x 2**L recompute sets; keep that small."""


def _costs(graph: LayerGraph, config: ParallelConfig):
    return layer_costs(graph, config, Cluster(num_gpus=config.num_gpus), _training(config))


def _training(config: ParallelConfig) -> TrainingConfig:
    return TrainingConfig(global_batch=config.global_batch)


def _random_selective(seed: int) -> tuple[LayerGraph, ParallelConfig]:
    """Odd seeds chains, even seeds DAGs, p >= 2, small enough for brute force."""
    rng = random.Random(seed)
    while True:
        num_layers = rng.randint(3, 5)
        graph = (random_chain if seed % 2 else random_dag)(rng, num_layers)
        config = dataclasses.replace(random_config(rng, num_layers), recompute="selective")
        if config.pp >= 2 and config.pp**num_layers * 2**num_layers <= MAX_CASES:
            return graph, config


@pytest.mark.parametrize("seed", range(6))
def test_selective_costs_hold_both_states(seed):
    """The all-off set costs exactly what "none" costs, the all-on set what "full" costs."""
    graph, config = _random_selective(seed)
    costs = _costs(graph, config)
    none = _costs(graph, dataclasses.replace(config, recompute="none"))
    full = _costs(graph, dataclasses.replace(config, recompute="full"))
    assert np.array_equal(costs.stored_bytes, none.stored_bytes)
    assert np.array_equal(costs.recompute_stored_bytes, full.stored_bytes)
    assert np.array_equal(costs.recompute_transient_bytes, full.transient_bytes)
    assert np.array_equal(costs.recompute_time_ns, full.time_ns)
    split = sorted(random.Random(seed).choices(range(config.pp), k=graph.num_layers))
    split[: config.pp] = range(config.pp)  # no empty stage
    split.sort()
    n = graph.num_layers
    assert stage_costs(costs, split, [False] * n) == stage_costs(none, split)
    on = stage_costs(costs, split, [True] * n)
    for selective, everything in zip(on, stage_costs(full, split), strict=True):
        assert selective == everything
        assert selective.recomputed == selective.layers


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("seed", range(8))
def test_selective_optimum_equals_brute_force(backend, seed):
    """Memory objective free, then under a throughput budget between the fastest split and the
    fastest with everything recomputed; the solution's own costs recompute from stage_costs."""
    graph, config = _random_selective(seed)
    costs = _costs(graph, config)
    fastest = solve_brute_force(StageProblem(costs=costs, objective=OBJECTIVE_TIME)).objective
    slowest = int(fastest * (costs.recompute_time_ns.sum() / costs.time_ns.sum()))
    budget = random.Random(seed).randint(fastest, max(fastest, slowest))
    for problem in (
        StageProblem(costs=costs),
        StageProblem(costs=costs, iteration_budget_ns=budget),
        StageProblem(costs=costs, objective=OBJECTIVE_TIME, capacity_bytes=None),
    ):
        expected = solve_brute_force(problem)
        solution = BACKENDS[backend](problem, time_limit_s=30)
        assert solution.status == expected.status == OPTIMAL
        assert solution.objective == expected.objective
        assert len(solution.recomputed) == graph.num_layers
        assert problem.violation(solution.stage_of_layer, solution.recomputed) is None
        stages = stage_costs(costs, solution.stage_of_layer, solution.recomputed)
        peak = max(stage.peak_bytes for stage in stages)
        if problem.objective == OBJECTIVE_MEMORY:
            assert peak == solution.objective
        flagged = [layer for layer, flag in enumerate(solution.recomputed) if flag]
        assert sorted(layer for stage in stages for layer in stage.recomputed) == flagged


@pytest.mark.parametrize("seed", range(6))
def test_selective_and_auto_never_worse_than_none_and_full(seed):
    """Planner level, same cluster and absolute throughput floor: recompute selective and auto
    (none and full, selective when neither fits) reach a peak no larger than the best plan with
    no recomputation or with all of it; auto's is exactly the better of the two."""
    rng = random.Random(100 + seed)
    graph = (random_chain if seed % 2 else random_dag)(rng, rng.randint(4, 6))
    cluster = Cluster(num_gpus=4, gpus_per_node=2, gpu_memory_bytes=10**9)
    base = TrainingConfig(global_batch=8, micro_batch_sizes=(1, 2), max_slowdown=None)
    fastest = plan(graph, cluster, dataclasses.replace(base, objective="throughput")).throughput
    for floor in (None, fastest / 1.15):
        training = dataclasses.replace(base, min_throughput=floor)
        peaks = {}
        for mode in ("none", "full", "selective", "auto"):
            try:
                result = plan(graph, cluster, dataclasses.replace(training, recompute=mode))
            except InfeasibleError:  # full recomputation may miss the floor
                continue
            assert result.solver.status == OPTIMAL
            assert check_plan(result) == []
            peaks[mode] = result.peak_bytes
        assert "none" in peaks and "auto" in peaks  # the fastest plan recomputes nothing
        assert peaks["selective"] <= min(peaks["none"], peaks.get("full", np.inf))
        assert peaks["auto"] == min(peaks["none"], peaks.get("full", np.inf))


def test_tight_budget_recomputes_only_early_layers():
    """Uniform 8-layer chain, 4 stages, 1F1B: stage s holds p - s micro-batches, so under a
    budget that pays for only some recomputation the fastest split at the optimal peak
    recomputes some layers, more on earlier stages, and none on the last one."""
    costs = _costs(
        activation_heavy_chain(8),
        ParallelConfig(pp=4, tp=1, dp=1, micro_batch=1, num_microbatches=8, recompute="selective"),
    )
    fastest = solve_cpsat(StageProblem(costs=costs, objective=OBJECTIVE_TIME)).objective
    results = {}
    for factor in (1.0, 1.2, 1.5):
        budget = int(fastest * factor)
        lean = solve_cpsat(StageProblem(costs=costs, iteration_budget_ns=budget))
        # the secondary objective of the planner: fastest split at that peak (no needless
        # recomputation)
        best = solve_cpsat(
            StageProblem(
                costs=costs,
                objective=OBJECTIVE_TIME,
                capacity_bytes=lean.objective,
                iteration_budget_ns=budget,
            )
        )
        stages = stage_costs(costs, best.stage_of_layer, best.recomputed)
        assert max(stage.peak_bytes for stage in stages) == lean.objective
        results[factor] = (lean.objective, [len(stage.recomputed) for stage in stages])
    (none_peak, none_counts), (some_peak, some_counts), (all_peak, all_counts) = results.values()
    # the loosest budget recomputes everything the peak needs: the last stage (k = 1) peaks in
    # its own layers' moments (costs.layer_moments) below the others with one layer kept
    assert none_counts == [0, 0, 0, 0] and all_counts[:3] == [2, 2, 2] and all_counts[3] >= 1
    assert all_peak < some_peak < none_peak
    assert 0 < sum(some_counts) < 8 and some_counts[-1] == 0
    assert some_counts == sorted(some_counts, reverse=True)


def test_chain_backend_routes_selective_to_cpsat():
    graph, config = _random_selective(1)
    assert graph.is_chain
    assert resolve_backend("auto", True, selective=True) == "cpsat"
    assert resolve_backend("auto", True) == "chain"
    with pytest.raises(InputError, match="does not choose recomputed layers"):
        resolve_backend("chain", True, selective=True)
    with pytest.raises(InputError, match="does not choose recomputed layers"):
        solve_chain(StageProblem(costs=_costs(graph, config)))


def test_recompute_flags_need_selective():
    graph = activation_heavy_chain(4)
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=2)
    with pytest.raises(InputError, match="recompute='none'"):
        evaluate(graph, config, [2, 2], recomputed=[True, False, False, False])
    problem = StageProblem(costs=_costs(graph, config))
    assert "recompute='none'" in problem.violation([0, 0, 1, 1], [True, False, False, False])
    selective = dataclasses.replace(config, recompute="selective")
    evaluation = evaluate(graph, selective, [2, 2], recomputed=[True, False, False, True])
    assert [stage.recomputed for stage in evaluation.stages] == [[0], [3]]


def test_megatron_block_recompute_or_explicit_list():
    graph = gpt_chain(4)  # embed, b0..b3, head
    config = ParallelConfig(
        pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4, recompute="selective"
    )
    stages = [["embed", "b0", "b1"], ["b2", "b3", "head"]]
    uniform = build_exports(graph, config, stages, recomputed=[["b0"], ["b2"]])
    args = uniform["megatron"]["args"]
    assert args[args.index("--recompute-method") + 1] == "block"
    assert args[args.index("--recompute-num-layers") + 1] == "1"
    assert uniform["torch_pipelining"]["checkpoint_modules"] == ["b0", "b2"]
    assert uniform["megatron"]["recompute"]["exact"] is True
    # b1 is not stage 0's first block: Megatron's block method runs N = 1 (b0 and b2), the
    # export says so in a field and one warning
    uneven = build_exports(graph, config, stages, recomputed=[["b1"], ["b2"]])["megatron"]
    args = uneven["args"]
    assert args[args.index("--recompute-method") + 1] == "block"
    assert args[args.index("--recompute-num-layers") + 1] == "1"
    assert uneven["recompute"] == {
        "exact": False,
        "method": "block",
        "num_layers": 1,
        "planned_per_stage": [["b1"], ["b2"]],
        "exported_per_stage": [["b0"], ["b2"]],
    }
    (warning,) = [w for w in uneven["warnings"] if w.startswith("recompute:")]
    assert "N = 1" in warning and "stage 0: 1 instead of ['b1']" in warning
    # stage 0 recomputes both its blocks, stage 1 one: N = 2 recomputes both on each
    more = build_exports(graph, config, stages, recomputed=[["b0", "b1"], ["b2"]])["megatron"]
    assert more["recompute"]["exported_per_stage"] == [["b0", "b1"], ["b2", "b3"]]
    assert more["recompute"]["exact"] is False
    nothing = build_exports(graph, config, stages, recomputed=[[], []])
    assert "--recompute-method" not in nothing["megatron"]["args"]
    assert nothing["megatron"]["recompute"] is None
    assert nothing["torch_pipelining"]["checkpoint_modules"] == []
    with pytest.raises(InputError, match="not on stage 0"):
        build_exports(graph, config, stages, recomputed=[["b2"], []])


def test_plan_cli_lists_recomputed_layers(capsys, tmp_path):
    """A memory-tight uniform chain under a throughput floor: the plan recomputes some layers,
    the table has a 'recomputed' column, the JSON lists them per stage, the exports carry them,
    and solver.evaluate with the same flags reproduces the peak."""
    graph_path = tmp_path / "uniform.json"
    activation_heavy_chain(8).save(graph_path)
    costs = _costs(
        activation_heavy_chain(8),
        ParallelConfig(pp=4, tp=1, dp=1, micro_batch=1, num_microbatches=8, recompute="selective"),
    )
    fastest = solve_cpsat(StageProblem(costs=costs, objective=OBJECTIVE_TIME)).objective
    floor = 8 * 1e9 / (1.2 * fastest)
    out = tmp_path / "plan.json"
    argv = [str(graph_path), "--gpus", "4", "--global-batch", "8", "--micro-batch", "1"]
    argv += ["--pp", "4", "--recompute", "selective", "--min-throughput", f"{floor:.9g}"]
    code = plan_main([*argv, "--json", str(out)])
    text, err = capsys.readouterr()
    assert code == 0, err
    assert "recomputed" in text.splitlines()[2] and "selective-recompute" in text
    document = json.loads(out.read_text())
    recomputed = [stage["recomputed"] for stage in document["stages"]]
    assert 0 < sum(map(len, recomputed)) < 8
    for stage in document["stages"]:
        assert set(stage["recomputed"]) <= set(stage["layers"])
    flat = [name for names in recomputed for name in names]
    assert document["exports"]["torch_pipelining"]["checkpoint_modules"] == flat
    names = [f"layers.{i}" for i in range(8)]
    config = ParallelConfig(**document["config"])
    evaluation = evaluate(
        activation_heavy_chain(8),
        config,
        document["stage_of_layer"],
        recomputed=[name in flat for name in names],
    )
    assert evaluation.peak_bytes == document["peak_bytes"]


@pytest.mark.parametrize("seed", [1, 3, 5, 7])
def test_uniform_hint_is_the_better_of_none_and_full(seed):
    """The start the search gives a selective chain solve: the exact chain optimum of all-off or
    all-on, whichever is lower, with the matching flags; the selective optimum is no worse."""
    graph, config = _random_selective(seed)
    costs = _costs(graph, config)
    problem = StageProblem(costs=costs)
    split, flags = uniform_recompute_hint(problem, Deadline.after(None))
    variants = [
        solve_chain(StageProblem(costs=_costs(graph, dataclasses.replace(config, recompute=mode))))
        for mode in ("none", "full")
    ]
    best = min(solution.objective for solution in variants)
    assert problem.objective_value(split, flags) == best
    assert len(set(flags)) == 1
    assert solve_cpsat(problem).objective <= best


# -- baselines compare like with like ----------------------------------------------------------


def test_pp1_selective_plan_equals_its_baselines(gpt_graph):
    """One stage: every split is the same split, so with the plan's recomputed layers the
    baselines have its peak and throughput, and the report says 0% (it said -25.2%: the
    baselines had no recomputation)."""
    cap = 80 * 2**30
    cluster = Cluster(num_gpus=1, gpu_memory_bytes=cap)
    training = TrainingConfig(global_batch=64, recompute="selective")
    result = plan(gpt_graph, cluster, training)
    assert result.config.pp == 1 and 0 < sum(result.evaluation.recomputed) < gpt_graph.num_layers
    for baseline in result.baselines.values():
        assert baseline.recomputed == result.evaluation.recomputed
        assert baseline.peak_bytes == result.peak_bytes
        assert baseline.throughput == result.throughput
    chosen = sum(result.evaluation.recomputed)
    lines = [line for line in format_plan(result).splitlines() if " split (" in line]
    assert len(lines) == 2
    for line in lines:
        assert f"same config and recomputed layers ({chosen} of 26)" in line
        assert line.endswith("this plan: +0.0% peak")
    row, _ = solve_point(PointOptions(graph=gpt_graph, training=training, cluster=cluster), 1, cap)
    assert row["even_peak_bytes"] == row["parameters_peak_bytes"] == row["peak_bytes"]


def test_pp4_selective_baselines_are_exact_evaluations_with_the_plans_recompute_set(gpt_graph):
    """pp4: the even split differs from the plan's; its peak is what solver.evaluation.evaluate
    gives for that split with the plan's recomputed layers, and the JSON carries that set."""
    cluster = Cluster(num_gpus=4, gpu_memory_bytes=8 * 2**30)
    training = TrainingConfig(global_batch=16, recompute="selective", pp=4, max_slowdown=None)
    result = plan(gpt_graph, cluster, training)
    flags = result.evaluation.recomputed
    assert any(flags)
    for name in ("even", "parameters"):
        expected = evaluate(
            gpt_graph, result.config, name, cluster=cluster, training=training, recomputed=flags
        )
        baseline = result.baselines[name]
        assert baseline.stage_of_layer == expected.stage_of_layer
        assert baseline.peak_bytes == expected.peak_bytes
        assert baseline.throughput == expected.throughput
    even = result.baselines["even"]
    assert even.stage_of_layer != result.stage_of_layer and even.peak_bytes > result.peak_bytes
    bare = evaluate(gpt_graph, result.config, "even", cluster=cluster, training=training)
    assert bare.peak_bytes != even.peak_bytes  # what it was compared with before
    document = plan_to_dict(result)  # checked against the schema and load_plan on the way
    load_plan(document)
    chosen = [name for name, flag in zip(gpt_graph.names, flags, strict=True) if flag]
    for baseline in document["baselines"].values():
        assert baseline["recomputed"] == chosen


def test_full_recompute_and_zero_baselines_keep_the_config(gpt_graph):
    """ZeRO and full recomputation live in the config, which the baselines share."""
    cluster = Cluster(num_gpus=4, gpu_memory_bytes=80 * 2**30)
    training = TrainingConfig(
        global_batch=16, recompute="full", zero_stages=(3,), dp=2, max_slowdown=None
    )
    result = plan(gpt_graph, cluster, training)
    expected = evaluate(gpt_graph, result.config, "even", cluster=cluster, training=training)
    assert result.baselines["even"].config == result.config
    assert result.baselines["even"].peak_bytes == expected.peak_bytes
    recomputed = plan_to_dict(result)["baselines"]["even"]["recomputed"]
    # full on the megatron runtime: every transformer block (Megatron never recomputes the
    # embedding or the head)
    assert recomputed == [layer.name for layer in gpt_graph.layers if layer.role == "block"]


def test_megatron_recomputes_only_transformer_blocks(gpt_graph):
    """Under full recomputation the megatron runtime keeps the embedding's and the head's
    activations (Megatron checkpoints only its TransformerBlock layers); torch recomputes every
    layer. The blocks' coefficients are the same on both runtimes."""
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4, recompute="full")
    cluster = Cluster(num_gpus=2, gpu_memory_bytes=80 * 2**30)
    costs = {
        runtime: layer_costs(
            gpt_graph,
            config,
            cluster,
            TrainingConfig(global_batch=4, runtime=runtime, grad_bytes_per_param=2),
        )
        for runtime in ("megatron", "torch")
    }
    blocks = np.array([layer.role == "block" for layer in gpt_graph.layers])
    assert 0 < blocks.sum() < len(blocks)
    megatron, torch_runtime = costs["megatron"], costs["torch"]
    assert np.array_equal(megatron.recompute_mask(None), blocks)
    assert torch_runtime.recompute_mask(None).all()
    kept = layer_costs(
        gpt_graph,
        dataclasses.replace(config, recompute="none"),
        cluster,
        TrainingConfig(global_batch=4, grad_bytes_per_param=2),
    )
    # not recomputed: the kept coefficients; recomputed: only the output is stored
    assert np.array_equal(megatron.stored_bytes[~blocks], kept.stored_bytes[~blocks])
    assert np.array_equal(megatron.stored_bytes[blocks], torch_runtime.stored_bytes[blocks])
    outputs = [config.micro_batch * layer.output_bytes for layer in gpt_graph.layers]
    assert np.array_equal(torch_runtime.stored_bytes, outputs)
    assert np.array_equal(megatron.time_ns[~blocks], kept.time_ns[~blocks])


def test_auto_falls_back_to_selective_when_neither_fits(run_cli, tmp_path):
    """--recompute auto searches none and full by the exact algorithms; where neither fits (here
    none over the memory, full under the throughput floor) it searches selective, says so, and
    finds the selective plan."""
    graph = activation_heavy_chain(8)
    costs = _costs(
        graph,
        ParallelConfig(pp=4, tp=1, dp=1, micro_batch=1, num_microbatches=8, recompute="selective"),
    )
    fastest = solve_cpsat(StageProblem(costs=costs, objective=OBJECTIVE_TIME)).objective
    floor = 8 * 1e9 / (1.2 * fastest)
    base = TrainingConfig(global_batch=8, micro_batch_sizes=(1,), pp=4, min_throughput=floor)
    selective = plan(
        graph, Cluster(num_gpus=4, gpu_memory_bytes=10**9), replace(base, recompute="selective")
    )
    tight = Cluster(num_gpus=4, gpu_memory_bytes=selective.peak_bytes)
    for mode in ("none", "full"):
        with pytest.raises(InfeasibleError):
            plan(graph, tight, replace(base, recompute=mode))
    auto = plan(graph, tight, replace(base, recompute="auto"))
    assert auto.config.recompute == "selective"
    assert auto.peak_bytes == selective.peak_bytes
    assert auto.solver.notes[0] == SELECTIVE_NOTE
    # the CLI's default is auto: the same plan, and the note in its text
    path = tmp_path / "uniform.json"
    graph.save(path)
    argv = [str(path), "--gpus", "4", "--global-batch", "8", "--micro-batch", "1", "--pp", "4"]
    argv += ["--gpu-memory", f"{selective.peak_bytes}B", "--reserve", "0"]
    code, out, err = run_cli(plan_main, *argv, "--min-throughput", f"{floor:.9g}")
    assert (code, err) == (0, "")
    assert f"note: {SELECTIVE_NOTE}" in out and "selective-recompute" in out
    # below the selective peak nothing fits: exit 3, the exact search's explanation, one line
    argv[argv.index("--gpu-memory") + 1] = f"{selective.peak_bytes - 1}B"
    code, out, err = run_cli(plan_main, *argv, "--min-throughput", f"{floor:.9g}")
    assert (code, out) == (3, "") and err.count("\n") == 1 and err.startswith("error: ")
    assert err.startswith("error: with no, full or per-layer selective recomputation: ")
