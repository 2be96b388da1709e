"""The fast paths of ``plan()`` return what the full paths return.

- tie-breaking skips the re-solve of a tie whose split already reaches its config's lower bound
  on the secondary objective (every split of a config that takes no time), and keeps the split
  found unless the re-solve is strictly better: the same plan as re-solving every tie;
- it still picks the fastest of configs tied on the peak (brute force over every split);
- statistics without times get no throughput budget (every plan takes 0 ns);
- the graph's schema is checked by fastjsonschema first: it accepts exactly what jsonschema does;
- ``Plan.exports`` / ``Plan.baselines`` are built when first read, as they were eagerly.
"""

from __future__ import annotations

import copy
import itertools
import pickle
import random

import jsonschema
import pytest

import solver.search.planner as planner
import solver.search.ties as ties
from solver import Cluster, TrainingConfig, plan
from solver.costs import iteration_bound_ns, layer_costs, stage_costs
from solver.errors import InputError
from solver.evaluation import evaluate_assignment, prepare_training
from solver.exports import build_exports
from solver.graph import _check_schema, _fast_check, graph_from_dict, schema
from solver.report.baselines import BASELINES
from solver.search.config_search import build_entries

HUGE = 2**50


def statistics_document(rng: random.Random, num_layers: int, *, timed: bool) -> dict:
    """A chain with CAPSlog's statistics; with ``timed`` also per-layer FLOPs (so the time
    model tells splits apart)."""
    layers = []
    for i in range(num_layers):
        added = rng.randint(1, 20) * 10**6
        layer = {
            "name": f"l{i}",
            "params": 1,
            "activation_bytes": 1,
            "output_bytes": 1,
            "mem_isolated": added + rng.choice([0, rng.randint(0, 20) * 10**6]),
            "mem_added": added,
        }
        if timed:
            layer["fwd_flops"] = rng.randint(1, 9) * 10**9
        layers.append(layer)
    return {"format": "layer-graph", "version": 1, "model": "stats", "layers": layers}


def pinned(stages: int, **options) -> TrainingConfig:
    return TrainingConfig(
        global_batch=stages,
        micro_batch_sizes=(1,),
        pp=stages,
        tp=1,
        dp=1,
        memory_model="empirical",
        **options,
    )


def plan_summary(result) -> tuple:
    return (
        result.config.label(),
        tuple(result.stage_of_layer),
        result.peak_bytes,
        result.evaluation.iteration_ns,
        result.required_throughput,
        result.fastest_throughput,
        result.solver.status,
        result.solver.objective,
    )


@pytest.mark.parametrize("timed", [False, True])
def test_fast_tie_break_returns_what_re_solving_every_tie_returns(monkeypatch, timed):
    rng = random.Random(17 + timed)
    cases = []
    for _ in range(6):
        stages = rng.choice([2, 3, 4])
        document = statistics_document(rng, rng.randint(stages + 2, 14), timed=timed)
        cases.append((document, stages))
    fast = [
        plan(graph_from_dict(d), Cluster(num_gpus=p, gpu_memory_bytes=HUGE), pinned(p))
        for d, p in cases
    ]
    resolved = []
    real_refine = ties.refine

    def counting_refine(*args, **kwargs):
        resolved.append(1)
        return real_refine(*args, **kwargs)

    monkeypatch.setattr(ties, "_secondary_bound", lambda call, entry: -1)  # never settled
    monkeypatch.setattr(ties, "refine", counting_refine)
    full = [
        plan(graph_from_dict(d), Cluster(num_gpus=p, gpu_memory_bytes=HUGE), pinned(p))
        for d, p in cases
    ]
    assert len(resolved) == len(cases)  # the full path did re-solve every tie
    assert [plan_summary(r) for r in fast] == [plan_summary(r) for r in full]


def test_statistics_without_times_skip_the_fastest_plan_search(monkeypatch):
    rng = random.Random(5)
    document = statistics_document(rng, 12, timed=False)
    cluster = Cluster(num_gpus=4, gpu_memory_bytes=HUGE)
    searched = []
    real_best = planner._PlanningCall.best

    def spy(self, objective, **kwargs):
        searched.append(objective)
        return real_best(self, objective, **kwargs)

    monkeypatch.setattr(planner._PlanningCall, "best", spy)
    fast = plan(graph_from_dict(document), cluster, pinned(4))
    assert searched == ["memory"]
    # the same answer as with no slowdown constraint at all, and the same peak as the full path
    unconstrained = plan(graph_from_dict(document), cluster, pinned(4, max_slowdown=None))
    assert plan_summary(fast) == plan_summary(unconstrained)
    monkeypatch.setattr(planner, "_time_invariant", lambda costs: False)
    monkeypatch.setattr(ties, "_time_invariant", lambda costs: False)
    full = plan(graph_from_dict(document), cluster, pinned(4))
    assert full.peak_bytes == fast.peak_bytes
    assert full.evaluation.iteration_ns == fast.evaluation.iteration_ns == 0
    assert full.required_throughput is fast.required_throughput is None


def brute_force_choice(graph, cluster, training) -> tuple[int, int, int]:
    """(peak, iteration ns, config order) of the plan the planner must pick: the smallest peak
    over every config and contiguous split, then the fastest such split, then the earliest
    config; from the cost model over every split."""
    prepared = prepare_training(graph, cluster, training)
    best = None
    for entry in build_entries(graph, cluster, prepared):
        costs = entry.costs
        layers, stages = costs.num_layers, costs.num_stages
        for cuts in itertools.combinations(range(1, layers), stages - 1):
            bounds = [0, *cuts, layers]
            split = [s for s in range(stages) for _ in range(bounds[s], bounds[s + 1])]
            evaluated = stage_costs(costs, split)
            key = (
                max(stage.peak_bytes for stage in evaluated),
                iteration_bound_ns(costs, evaluated),
                entry.order,
            )
            best = key if best is None or key < best else best
    return best


def test_tie_breaking_picks_the_faster_of_two_tied_configs():
    """Layers without parameters whose activations TP does not split (no SP): on 4 GPUs with pp
    2, tp 1 x dp 2 (4 micro-batches) and tp 2 x dp 1 (8) hold the same activations, so their
    optimal peaks tie, while tp 2 halves each layer's time. The plan must be the brute-force
    fastest split at the optimal peak, over both configs: the later one in candidate order."""
    layers = [
        {
            "name": f"l{i}",
            "params": 0,
            "activation_bytes": 1000 * (1 + i % 3),
            "output_bytes": 0,
            "fwd_flops": (1 + i % 4) * 10**12,
        }
        for i in range(8)
    ]
    graph = graph_from_dict({"format": "layer-graph", "version": 1, "model": "m", "layers": layers})
    cluster = Cluster(num_gpus=4, gpu_memory_bytes=HUGE)
    training = TrainingConfig(
        global_batch=8, micro_batch_sizes=(1,), pp=2, max_slowdown=None, sequence_parallel="off"
    )
    result = plan(graph, cluster, training)
    peak, iteration, order = brute_force_choice(graph, cluster, training)
    assert (result.peak_bytes, result.evaluation.iteration_ns) == (peak, iteration)
    entries = build_entries(graph, cluster, prepare_training(graph, cluster, training))
    assert result.config == entries[order].costs.config
    assert [e.costs.config.tp for e in entries] == [1, 2]
    # both configs reach the optimal peak; the first in order is the slower one there
    assert order == 1
    assert brute_force_choice_of(entries[0], peak) > iteration


def brute_force_choice_of(entry, peak: int) -> int:
    """Fastest iteration (ns) of the entry's splits whose peak is ``peak`` (or less)."""
    costs = entry.costs
    layers, stages = costs.num_layers, costs.num_stages
    fastest = None
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = [0, *cuts, layers]
        split = [s for s in range(stages) for _ in range(bounds[s], bounds[s + 1])]
        evaluated = stage_costs(costs, split)
        if max(stage.peak_bytes for stage in evaluated) <= peak:
            time_ns = iteration_bound_ns(costs, evaluated)
            fastest = time_ns if fastest is None else min(fastest, time_ns)
    return fastest


def test_tie_breaking_moves_to_a_faster_split_at_the_same_peak():
    """One config, many splits at the optimal peak, FLOPs that make them differ: the plan is
    the fastest of them by the iteration bound (the re-solve runs where the time model tells
    them apart)."""
    rng = random.Random(3)
    for _ in range(5):
        document = statistics_document(rng, 10, timed=True)
        graph = graph_from_dict(document)
        cluster = Cluster(num_gpus=3, gpu_memory_bytes=HUGE)
        training = pinned(3, max_slowdown=None)
        result = plan(graph, cluster, training)
        peak, iteration, _ = brute_force_choice(graph, cluster, training)
        costs = layer_costs(graph, result.config, cluster, result.evaluation.training)
        bound = iteration_bound_ns(costs, result.stages)  # ties go to the least bound
        assert (result.peak_bytes, bound) == (peak, iteration)


def mutations(document: dict):
    """Documents around a valid one, each changed in one place (valid or not)."""
    yield document
    for key, value in [
        ("params", -1),
        ("params", 1.5),
        ("params", 2.0),
        ("params", True),
        ("params", "1"),
        ("name", ""),
        ("name", 3),
        ("kind", "block"),
        ("kind", "blocks"),
        ("fwd_flops", 1.5),
        ("fwd_flops", -0.5),
        ("mem_added", None),
        ("surprise", 1),
    ]:
        changed = copy.deepcopy(document)
        changed["layers"][1][key] = value
        yield changed
    for key in ("format", "version", "model", "layers"):
        changed = copy.deepcopy(document)
        del changed[key]
        yield changed
    for key, value in [
        ("version", 2),
        ("format", "graph"),
        ("model", ""),
        ("layers", []),
        ("layers", {}),
        ("meta", []),
        ("edges", [{"src": "l0", "dst": "l1", "bytes": -1}]),
        ("edges", [{"src": "l0", "dst": "l1", "bytes": 4}]),
        ("extra", 1),
    ]:
        changed = copy.deepcopy(document)
        changed[key] = value
        yield changed
    changed = copy.deepcopy(document)
    del changed["layers"][0]["output_bytes"]
    yield changed
    yield []
    yield "layer-graph"


def test_compiled_schema_check_accepts_exactly_what_jsonschema_accepts():
    fast = _fast_check()
    assert fast is not None  # the bundled schema uses draft-7 keywords only
    validator = jsonschema.Draft202012Validator(schema())
    document = statistics_document(random.Random(1), 4, timed=True)
    for changed in mutations(document):
        try:
            fast(changed)
            accepted = True
        except Exception:  # noqa: BLE001
            accepted = False
        assert accepted == validator.is_valid(changed), changed


def test_rejected_documents_still_get_jsonschema_s_message():
    document = statistics_document(random.Random(1), 4, timed=False)
    document["layers"][2]["params"] = -3
    with pytest.raises(InputError, match=r"^g.json: \$\.layers\[2\]\.params: .*docs/layer-graph"):
        _check_schema(document, "g.json")


def test_exports_and_baselines_are_built_when_read_as_they_were_eagerly():
    rng = random.Random(2)
    graph = graph_from_dict(statistics_document(rng, 10, timed=True))
    cluster = Cluster(num_gpus=3, gpu_memory_bytes=HUGE)
    training = pinned(3)
    result = plan(graph, cluster, training)
    copied = pickle.loads(pickle.dumps(result))  # picklable before the lazy parts are built
    evaluation = result.evaluation
    assert result.exports == build_exports(
        graph,
        evaluation.config,
        evaluation.virtual_stage_layer_names(),
        recomputed=evaluation.virtual_stage_recomputed_names(),
        moe_capacity_factor=training.moe_capacity_factor,
    )
    assert copied.exports == result.exports
    prepared = result.evaluation.training
    costs = build_entries(graph, cluster, prepared)[0].costs
    for name, split_of in BASELINES.items():
        expected = evaluate_assignment(
            graph, costs, split_of(graph, 3), cluster=cluster, training=prepared
        )
        assert result.baselines[name].stage_of_layer == expected.stage_of_layer
        assert result.baselines[name].peak_bytes == expected.peak_bytes
        assert result.baselines[name].iteration_ns == expected.iteration_ns


def bench_capslog(monkeypatch):
    """scripts/bench_capslog.py as a module (scripts/ on the path for its ``tables`` import)."""
    import importlib.util
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    monkeypatch.syspath_prepend(str(scripts))
    spec = importlib.util.spec_from_file_location("bench_capslog", scripts / "bench_capslog.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_capslog_oracle_is_the_brute_force_optimum_and_the_plan_s_peak(monkeypatch):
    bench = bench_capslog(monkeypatch)
    rng = random.Random(9)
    for _ in range(8):
        stages = rng.randint(1, 4)
        isolated, added = bench.draw_statistics(rng.randint(stages, 9), rng)
        layers = len(isolated)
        brute = min(
            bench.split_peak(isolated, added, [b - a for a, b in itertools.pairwise(cuts)])
            for middle in itertools.combinations(range(1, layers), stages - 1)
            for cuts in [(0, *middle, layers)]
        )
        assert bench.optimum(isolated, added, stages) == brute
        counts, peak, _, _ = bench.run_ours(bench.layer_graph_document(isolated, added), stages)
        assert peak == brute == bench.split_peak(isolated, added, counts)


def test_bench_capslog_runs_capslog_s_own_code_when_its_snapshot_is_here(monkeypatch, tmp_path):
    bench = bench_capslog(monkeypatch)
    if not bench.CAPSLOG_GIT.exists():
        pytest.skip(f"no CAPSlog snapshot at {bench.CAPSLOG_GIT}")
    capslog = bench.load_capslog(bench.extract_capslog(bench.CAPSLOG_GIT, tmp_path))
    isolated, added = bench.draw_statistics(12, random.Random(4))
    row = bench.measure_case(capslog, isolated, added, 4, repeats=1)
    assert row["exact"] is True
    assert row["capslog_over_optimum_pct"] >= 0 and row["bs_over_optimum_pct"] >= 0


@pytest.mark.parametrize("seed", range(12))
def test_banded_peak_dp_still_matches_brute_force_where_the_dense_dp_now_runs(monkeypatch, seed):
    """Chains of <= DENSE_DP_MAX_LAYERS layers solve their peak problems with the dense DP; the
    banded DP (longer chains) keeps its brute-force check on the same small chains, and both
    give the same optimum."""
    import solver.backends.chain as chain
    from tests.random_graphs import random_chain, random_problem
    from tests.test_chain import assert_same_optimum, limit_variants

    rng = random.Random(seed)
    problem = random_problem(rng, random_chain(rng, rng.randint(2, 6)))
    dense = [chain.solve_chain(variant) for variant in limit_variants(problem)]
    monkeypatch.setattr(chain, "DENSE_DP_MAX_LAYERS", 0)
    for variant, first in zip(limit_variants(problem), dense, strict=True):
        assert_same_optimum(variant)
        banded = chain.solve_chain(variant)
        assert (banded.status, banded.objective) == (first.status, first.objective)


def test_a_solution_s_stage_costs_are_reused_only_for_its_own_split():
    from solver.backends.chain import solve_chain
    from solver.backends.problem import StageProblem

    graph = graph_from_dict(statistics_document(random.Random(8), 9, timed=True))
    cluster = Cluster(num_gpus=3, gpu_memory_bytes=HUGE)
    entry = build_entries(graph, cluster, prepare_training(graph, cluster, pinned(3)))[0]
    solution = solve_chain(StageProblem(costs=entry.costs))
    own = ties._matching_stages(entry, solution.stage_of_layer, solution.stages)
    assert own is solution.stages
    assert [s.peak_bytes for s in own] == [
        s.peak_bytes for s in stage_costs(entry.costs, solution.stage_of_layer)
    ]
    layers = len(solution.stage_of_layer)
    other = next(  # another split of the same config
        split
        for split in ([0, 1] + [2] * (layers - 2), [0, 0, 1] + [2] * (layers - 3))
        if split != solution.stage_of_layer
    )
    assert other != solution.stage_of_layer
    assert ties._matching_stages(entry, other, solution.stages) is None
