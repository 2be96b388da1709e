"""Expert parallelism in the solver: the cost model's expert terms counted by hand on a 3-layer
mixture-of-experts graph, the routing factor, the candidates, the backends against brute force,
the CLIs' flags and errors, the plan JSON and the Megatron export."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction

import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, StageProblem
from solver.costs import expert_all_to_all_ns, layer_costs, routing_factor
from solver.errors import InputError
from solver.graph import graph_from_dict
from solver.search.candidates import (
    candidate_configs,
    expert_parallel_degrees,
    memory_lower_bound,
    time_lower_bound,
)
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import (
    GPT_1_3B,
    assert_backends_match_brute_force,
    costs_of,
    solve_everywhere,
)

MOE_BLOCK = {
    "name": "moe0",
    "params": 10_000,  # 400 replicated (norms, router) + 1,600 TP-split (attention) + 8,000 experts
    "tp_params": 1_600,
    "expert_params": 8_000,
    "activation_bytes": 6_000,  # 1,000 replicated + 1,000 TP-split + 4,000 routed experts
    "tp_activation_bytes": 1_000,
    "expert_activation_bytes": 4_000,
    "ep_comm_bytes": 800,  # 4 all-to-alls of the 200-byte routed hidden states
    "output_bytes": 50,
}


def moe_graph(*, blocks: int = 1, num_experts: int = 8, top_k: int = 2, meta: bool = True):
    """embed, ``blocks`` MoE blocks (MOE_BLOCK), head; no FLOPs (times are communication only)."""
    layers = [
        {"name": "embed", "kind": "embedding", "params": 1_000, "activation_bytes": 100,
         "output_bytes": 50},
        *({**MOE_BLOCK, "name": f"moe{i}"} for i in range(blocks)),
        {"name": "head", "params": 1_000, "activation_bytes": 200, "output_bytes": 4},
    ]  # fmt: skip
    document = {"format": "layer-graph", "version": 1, "model": "moe-toy", "layers": layers}
    if meta:
        document["meta"] = {"moe": {"num_experts": num_experts, "top_k": top_k}}
    return graph_from_dict(document)


def dense_graph():
    layer = {"name": "a", "params": 1, "activation_bytes": 1, "output_bytes": 1}
    return graph_from_dict({"format": "layer-graph", "version": 1, "model": "d", "layers": [layer]})


def config_of(**changes) -> ParallelConfig:
    base = dict(pp=1, tp=2, dp=4, ep=2, micro_batch=2, num_microbatches=1, zero=1)
    return ParallelConfig(**(base | changes))


def training_of(config: ParallelConfig, **changes) -> TrainingConfig:
    return TrainingConfig(global_batch=config.global_batch, **changes)


CLUSTER = Cluster(num_gpus=8, gpus_per_node=8, intra_node_gb_per_s=100.0, inter_node_gb_per_s=10.0)


def moe_costs(config, cluster=CLUSTER, graph=None, **training):
    """``costs_of`` the MoE toy (or ``graph``) on ``cluster``."""
    return costs_of(graph or moe_graph(), config, cluster=cluster, **training)


# -- the cost model by hand ------------------------------------------------------------------


def test_expert_states_by_hand():
    """P' of the MoE block at t 2, ep 2: 400 + 1,600 / 2 + 8,000 / (2 x 2) = 3,200 parameters.
    bf16-mixed megatron (2, 4, 12 bytes), ZeRO-1 over d 4: the dense optimizer state over the 4
    data-parallel ranks (1,200 x 12 / 4), the experts' over the 4 / 2 = 2 expert-data-parallel
    ranks (2,000 x 12 / 2)."""
    costs = moe_costs(config_of())
    moe = 1
    assert costs.weight_bytes[moe] == 2 * 3_200
    assert costs.grad_bytes[moe] == 4 * 3_200
    assert costs.optimizer_bytes[moe] == 1_200 * 12 // 4 + 2_000 * 12 // 2 == 15_600
    # ep 1: the experts whole on every GPU (split over t only), their states over all 4 ranks
    dense = moe_costs(config_of(ep=1))
    assert dense.weight_bytes[moe] == 2 * (1_200 + 4_000)
    assert dense.optimizer_bytes[moe] == 1_200 * 12 // 4 + 4_000 * 12 // 4
    # ZeRO-1's expert optimizer state is the same at any ep: t ep (d / ep) = t d shards
    assert dense.optimizer_bytes[moe] == costs.optimizer_bytes[moe]
    # ZeRO-3 shards the weights alike and gathers 2 P' (dense whole, experts / (t ep))
    zero3 = moe_costs(config_of(zero=3))
    assert zero3.weight_bytes[moe] == 2 * 1_200 // 4 + 2 * 2_000 // 2
    # (+ megatron's all-to-all received tokens at ep 2: b R = 2 x 200, test below)
    assert zero3.transient_bytes[moe] == 2 * 2 * 3_200 + 400


def test_expert_activations_by_hand():
    """Saved bytes of the MoE block per micro-batch (b 2, t 2): dense (1,000 replicated + 1,000
    / 2) x 2 = 3,000; experts: R = 800 / 4 = 200 routed hidden-state bytes stay whole on every
    TP rank, the other 3,800 split: 2 x (200 + 3,800 / 2) = 4,200 at a balanced routing; the
    same at every ep."""
    moe = 1
    for ep in (1, 2, 4):
        assert moe_costs(config_of(ep=ep)).stored_bytes[moe] == 3_000 + 4_200
    # capacity factor 1.25: ceil(1.25 x 4,200) = 5,250
    assert moe_costs(config_of(), moe_capacity_factor=1.25).stored_bytes[moe] == 3_000 + 5_250
    # dropless at ep 2 (E 8, k 2): f = 2 min(2, 4) / 2 = 2; at ep 4: 4 min(2, 2) / 2 = 4
    dropless = {"moe_capacity_factor": "dropless"}
    assert moe_costs(config_of(), **dropless).stored_bytes[moe] == 3_000 + 2 * 4_200
    assert moe_costs(config_of(ep=4), **dropless).stored_bytes[moe] == 3_000 + 4 * 4_200
    # sequence parallelism splits the dense part (2,000 / 2 per sample); the gathered routed
    # tokens stay whole
    sp = moe_costs(config_of(sp=True))
    assert sp.stored_bytes[moe] == 2 * 1_000 + 4_200
    # a recomputed block re-materialises all of it while it runs, beside its output's
    # gradient (b x 50)
    full = moe_costs(config_of(recompute="full"))
    assert full.stored_bytes[moe] == 2 * 50
    assert full.transient_bytes[moe] == 3_000 + 4_200 + 2 * 50 + 400


def test_megatron_all_to_all_receives_the_routed_tokens_beside_the_sent_ones():
    """At ep > 1 megatron-core's dispatcher holds the all-to-all's received tokens, f b R (R =
    800 / 4 = 200 bytes per sample), beside the permuted ones: b f R more in the MoE layer's
    transient; nothing at ep 1, on the torch runtime or on a dense layer."""
    moe = 1
    base = moe_costs(config_of(ep=1)).transient_bytes
    assert list(moe_costs(config_of(ep=2)).transient_bytes - base) == [0, 2 * 200, 0]
    assert list(moe_costs(config_of(ep=4)).transient_bytes - base) == [0, 2 * 200, 0]
    padded = moe_costs(config_of(ep=2), moe_capacity_factor=1.25).transient_bytes
    assert padded[moe] - moe_costs(config_of(ep=1), moe_capacity_factor=1.25).transient_bytes[
        moe
    ] == 500  # ceil(1.25 x 2 x 200)
    torch_base = moe_costs(config_of(ep=1), runtime="torch").transient_bytes
    assert list(moe_costs(config_of(ep=2), runtime="torch").transient_bytes) == list(torch_base)


def test_expert_all_to_all_by_hand():
    """b ep_comm f (ep-1)/ep: 2 x 800 x 1/2 = 800 bytes at ep 2, over 100 GB/s (t ep = 4 fits
    the 8-GPU node): 8 ns; 2 x 800 x 3/4 = 1,200 bytes at ep 4: 12 ns; across nodes (2 GPUs per
    node) at 10 GB/s: 80 ns; dropless ep 2 (f 2): 16 ns. The layer has no FLOPs, so its time is
    the all-to-all; a recomputed forward sends its half again (x 1.5)."""
    moe = 1
    assert moe_costs(config_of(ep=1)).time_ns[moe] == 0
    assert moe_costs(config_of()).time_ns[moe] == 8
    assert moe_costs(config_of(ep=4)).time_ns[moe] == 12
    small_nodes = dataclasses.replace(CLUSTER, gpus_per_node=2)
    assert moe_costs(config_of(), cluster=small_nodes).time_ns[moe] == 80
    assert moe_costs(config_of(), moe_capacity_factor="dropless").time_ns[moe] == 16
    assert moe_costs(config_of(recompute="full")).time_ns[moe] == 12
    # sequence parallelism: each TP rank dispatches its s / t tokens
    assert moe_costs(config_of(sp=True)).time_ns[moe] == 4


def test_expert_gradient_sync_by_hand():
    """Megatron-style sync: the dense gradients over d 4 (2 x 3/4 x 1,200 x 4 bytes), the
    experts' over d / ep = 2 ranks (2 x 1/2 x 2,000 x 4), at 100 GB/s (t d = 8 fits a node):
    (7,200 + 8,000) / 100 = 152 ns; at ep 1 the experts' 4,000 over 4 ranks: 312 ns."""
    moe = 1
    assert moe_costs(config_of()).dp_sync_ns[moe] == 152
    assert moe_costs(config_of(ep=1)).dp_sync_ns[moe] == (7_200 + 2 * 3 / 4 * 4_000 * 4) / 100
    # ep = dp: every expert on one rank, no expert gradient to sync
    assert moe_costs(config_of(ep=4)).dp_sync_ns[moe] == 72


def test_routing_factor():
    graph = moe_graph()
    config = config_of(ep=4)
    assert routing_factor(graph, config, training_of(config)) == 1
    assert routing_factor(graph, config, training_of(config, moe_capacity_factor=1.1)) == (
        Fraction(11, 10)
    )
    dropless = training_of(config, moe_capacity_factor="dropless")
    assert routing_factor(graph, config, dropless) == 4
    assert routing_factor(graph, config_of(ep=1), dropless) == 1
    # Mixtral (E 8, k 2) at ep 8: each token reaches at most 1 of a GPU's 1 expert, f = 8 / 2
    eight = ParallelConfig(pp=1, tp=1, dp=8, ep=8, micro_batch=1, num_microbatches=1)
    assert routing_factor(moe_graph(), eight, dropless) == 4
    # a dense graph: always 1
    dense = dense_graph()
    assert routing_factor(dense, config_of(ep=1), dropless) == 1


def test_dense_graph_costs_unchanged_by_the_expert_terms():
    """A graph without expert fields costs what it did: P', states and times at ep 1 equal the
    dense formulas (the expert terms are all zero)."""
    graph = moe_graph()
    keep = ("name", "params", "tp_params", "activation_bytes", "output_bytes")
    layers = [{k: getattr(layer, k) for k in keep} for layer in graph.layers]
    dense = graph_from_dict({"format": "layer-graph", "version": 1, "model": "d", "layers": layers})
    costs = moe_costs(config_of(ep=1), graph=dense)
    assert costs.weight_bytes.tolist() == [2_000, 2 * (8_400 + 800), 2_000]


def test_all_to_all_zero_without_expert_parallelism():
    graph = moe_graph()
    from solver.costs import graph_columns as _graph_columns

    assert not expert_all_to_all_ns(_graph_columns(graph), config_of(ep=1), CLUSTER, 1).any()


# -- bad input ---------------------------------------------------------------------------------


def test_expert_degree_errors():
    config = config_of(ep=2)
    dense = dense_graph()
    with pytest.raises(InputError, match="no routed experts .expert_params 0 on every layer.; "):
        layer_costs(dense, config, CLUSTER, training_of(config))
    with pytest.raises(InputError, match="--ep 3: does not divide the 8 routed experts"):
        six = ParallelConfig(pp=1, tp=1, dp=6, ep=3, micro_batch=1, num_microbatches=1)
        layer_costs(moe_graph(), six, Cluster(num_gpus=6), training_of(six))
    with pytest.raises(InputError, match=r"ep\(4\) does not divide dp\(2\)"):
        ParallelConfig(pp=1, tp=1, dp=2, ep=4, micro_batch=1, num_microbatches=1)
    with pytest.raises(InputError, match=r"\$.meta.moe: missing"):
        layer_costs(moe_graph(meta=False), config, CLUSTER, training_of(config))
    with pytest.raises(InputError, match="moe_capacity_factor must be a number in 1..1024"):
        TrainingConfig(global_batch=1, moe_capacity_factor=0.5)
    with pytest.raises(InputError, match="ep must be None"):
        TrainingConfig(global_batch=1, ep=(0,))


# -- candidates and search ---------------------------------------------------------------------


def test_expert_parallel_degrees():
    auto = TrainingConfig(global_batch=8)
    assert expert_parallel_degrees(auto, 8, None) == [1]
    assert expert_parallel_degrees(auto, 8, 8) == [1, 2, 4, 8]
    assert expert_parallel_degrees(auto, 12, 8) == [1, 2, 4]
    assert expert_parallel_degrees(auto, 6, 64) == [1, 2]
    given = dataclasses.replace(auto, ep=(4, 1, 2))
    assert expert_parallel_degrees(given, 2, 8) == [1, 2]


def test_candidates_carry_ep():
    cluster = Cluster(num_gpus=8)
    training = TrainingConfig(global_batch=8, micro_batch_sizes=(1,))
    configs = candidate_configs(3, cluster, training, num_experts=8)
    pairs = {(c.pp, c.tp, c.dp, c.ep) for c in configs}
    assert (1, 1, 8, 8) in pairs and (1, 2, 4, 4) in pairs and (3, 1, 8, 8) not in pairs
    assert all(c.dp % c.ep == 0 for c in configs)
    assert {c.ep for c in candidate_configs(3, cluster, training)} == {1}


@pytest.mark.parametrize("seed", range(3))
def test_backends_agree_with_brute_force_on_moe(seed):
    """CP-SAT, the MILP and the chain algorithm prove brute force's optimum on a 5-layer MoE
    chain, for memory (capacity factor and dropless) and for time, and the search's lower
    bounds stay below it."""
    graph = moe_graph(blocks=3)
    config = ParallelConfig(
        pp=2 + seed % 2, tp=2, dp=4, ep=(2, 4, 1)[seed], micro_batch=1, num_microbatches=4,
        recompute="full" if seed == 1 else "none",
    )  # fmt: skip
    factor = (1.25, "dropless", 1.0)[seed]
    costs = layer_costs(
        graph,
        config,
        CLUSTER,
        training_of(config, moe_capacity_factor=factor, recompute=config.recompute),
    )
    for objective in (OBJECTIVE_MEMORY, OBJECTIVE_TIME):
        problem = StageProblem(costs=costs, objective=objective)
        assert_backends_match_brute_force(problem)
        optimum = solve_brute_force(problem).objective
        assert solve_everywhere(problem, chain=True) == {optimum}
        bound = (memory_lower_bound if objective == OBJECTIVE_MEMORY else time_lower_bound)(costs)
        assert bound <= optimum


def test_plan_api_picks_expert_parallelism():
    """With dp 8 pinned the memory-optimal plan shards the experts over all 8 ranks (auto
    searches ep 1, 2, 4, 8); pinned --ep 1 holds every expert: 2 x 8,000 more parameters of 18
    bytes per MoE block (7,000 more per GPU at ep 8) on the one stage."""
    from solver.search.planner import plan

    graph = moe_graph(blocks=2)
    cluster = Cluster(num_gpus=8, gpu_memory_bytes=2**30)
    training = TrainingConfig(global_batch=8, micro_batch_sizes=(1,), pp=1, tp=1, dp=8)
    result = plan(graph, cluster, training)
    assert result.config.ep == 8
    pinned = plan(graph, cluster, dataclasses.replace(training, ep=(1,)))
    assert pinned.config.ep == 1
    assert pinned.evaluation.peak_bytes - result.evaluation.peak_bytes == 2 * 7_000 * (2 + 4 + 12)


# -- CLIs -------------------------------------------------------------------------------------


def write_graph(tmp_path, graph) -> str:
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(graph.to_dict()))
    return str(path)


def test_plan_cli_ep_and_json(tmp_path, run_cli):
    from solver.cli.plan import plan_main as main

    path = write_graph(tmp_path, moe_graph(blocks=2))
    out = tmp_path / "plan.json"
    common = (path, "--gpus", "8", "--global-batch", "8", "--micro-batch", "1")
    code, stdout, stderr = run_cli(
        main, *common, "--ep", "2,4", "--moe-capacity-factor", "dropless", "--json", str(out),
        "--sequence-parallel", "auto",
    )  # fmt: skip
    assert code == 0, stderr
    document = json.loads(out.read_text())
    assert document["config"]["ep"] in (2, 4)
    assert document["training"]["ep"] == [2, 4]
    assert document["training"]["moe_capacity_factor"] == "dropless"
    assert f"ep{document['config']['ep']}" in stdout
    assert "routing factor" in stdout
    megatron = document["exports"]["megatron"]["args"]
    assert "--expert-model-parallel-size" in megatron and "--num-experts" in megatron
    # the plan re-checks
    from solver.cli.evaluate import evaluate_main as evaluate

    code, _, stderr = run_cli(evaluate, "--plan", str(out))
    assert code == 0, stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--ep", "3"), "--ep 3: does not divide the 8 routed experts"),
        (
            ("--ep", "2", "--dp", "1", "--pp", "1", "--tp", "8"),
            "--ep 2 does not divide the pinned dp(1)",
        ),
        (("--moe-capacity-factor", "0.5"), "--moe-capacity-factor: must be a number in [1, 1024]"),
        (("--ep", "x"), "--ep: expected comma-separated integers"),
    ],
)
def test_plan_cli_bad_expert_input(tmp_path, run_cli, args, message):
    from solver.cli.plan import plan_main as main

    path = write_graph(tmp_path, moe_graph(blocks=2))
    code, _, stderr = run_cli(main, path, "--gpus", "8", "--global-batch", "8", *args)
    assert code == 2
    assert message in stderr and len(stderr.strip().splitlines()) == 1


def test_ep_on_a_dense_graph_is_an_error(run_cli):
    from solver.cli.plan import plan_main as main

    code, _, stderr = run_cli(main, GPT_1_3B, "--gpus", "8", "--global-batch", "8", "--ep", "2")
    assert code == 2
    assert "the graph has no routed experts (expert_params 0 on every layer); re-export it or " \
        "drop --ep" in stderr  # fmt: skip


def test_evaluate_cli_ep(tmp_path, run_cli):
    from solver.cli.evaluate import evaluate_main as main

    path = write_graph(tmp_path, moe_graph(blocks=2))
    common = (path, "--pp", "2", "--tp", "1", "--dp", "4", "--global-batch", "8")
    code, stdout, stderr = run_cli(main, *common, "--ep", "4", "--split", "2,2")
    assert code == 0, stderr
    assert "ep4" in stdout
    code, _, stderr = run_cli(main, *common, "--ep", "8", "--split", "2,2")
    assert code == 2 and "--ep 8 does not divide --dp 4" in stderr


def test_sweep_rows_carry_ep(tmp_path, run_cli):
    """The sweep's CSV has the ep column (pinned --ep 2 on 4 and 8 GPUs) and reads back."""
    from solver.cli.sweep import sweep_main
    from solver.sweep import read_rows

    path = write_graph(tmp_path, moe_graph(blocks=2))
    out = tmp_path / "sweep.csv"
    code, _, stderr = run_cli(
        sweep_main, path, "--gpus", "4,8", "--global-batch", "8", "--ep", "2", "--pp", "1",
        "--tp", "1", "--workers", "1", "--quiet", "--out", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    rows = read_rows(out)
    assert [(row["gpus"], row["ep"], row["status"]) for row in rows] == [
        (4, 2, "OPTIMAL"),
        (8, 2, "OPTIMAL"),
    ]


def test_profiled_capacity_factor_and_extra_meta_keys():
    """A graph profiled with drop-and-pad at capacity 1.25 (``meta.moe.capacity_factor``, as
    profiling.export writes it, with a description key the planner ignores) holds 1.25 times the
    balanced experts' bytes: planning it at 1.25 counts them once (f = 1), balanced at 1 / 1.25."""
    graph = moe_graph()
    graph.meta["moe"] |= {"capacity_factor": 1.25, "expert_fields": "at a balanced routing"}
    config = config_of()
    assert routing_factor(graph, config, training_of(config, moe_capacity_factor=1.25)) == 1
    assert routing_factor(graph, config, training_of(config)) == Fraction(4, 5)
    graph = moe_graph()
    graph.meta["moe"]["capacity_factor"] = 0.5
    with pytest.raises(InputError, match=r"\$.meta.moe.capacity_factor: 0.5 is not a number"):
        routing_factor(graph, config, training_of(config))


@pytest.mark.parametrize(
    ("factor", "extra", "warned"),
    [
        (1.0, [], True),
        (1.5, ["--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"], False),
        ("dropless", [], False),
    ],
)
def test_megatron_export_expert_flags(factor, extra, warned):
    from solver.exports.megatron import megatron_export

    graph = moe_graph(blocks=2)
    config = ParallelConfig(pp=2, tp=1, dp=4, ep=4, micro_batch=1, num_microbatches=2)
    stages = [["embed", "moe0"], ["moe1", "head"]]
    export = megatron_export(graph, config, stages, moe_capacity_factor=factor)
    args = export["args"]
    start = args.index("--num-experts")
    assert args[start : start + 8 + len(extra)] == [
        "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "4",
        "--moe-token-dispatcher-type", "alltoall", *extra,
    ]  # fmt: skip
    assert warned == any(w.startswith("moe:") for w in export["warnings"])
    # megatron-core refuses MoE layers with tp > 1 without sequence parallelism
    no_sp = megatron_export(graph, dataclasses.replace(config, tp=2), stages)
    assert "--num-experts" not in no_sp["args"]
    assert any("--sequence-parallel auto" in w for w in no_sp["warnings"])
    dense = megatron_export(dense_graph(), dataclasses.replace(config, pp=1, ep=1), [["a"]])
    assert "--num-experts" not in dense["args"]


def test_expert_terms_under_context_parallelism():
    """cp 2 x dp 2 x ep 2 (t 2, 8 GPUs): ZeRO-1 shards the dense optimizer state over d c = 4
    ranks and the experts' over d c / ep = 2 (Megatron's expert-data-parallel group of
    world / (pp tp ep) ranks); each GPU routes its s / c tokens: the expert activations
    (4,200 at cp 1) and the all-to-all (8 ns at cp 1) halve."""
    document = moe_graph().to_dict()
    document["meta"]["seq_len"] = 64
    document["layers"][1]["attention_kv_bytes"] = 0
    document["layers"][0]["attention_kv_bytes"] = 2  # cp needs the field on some layer
    graph = graph_from_dict(document)
    config = config_of(cp=2, dp=2)
    costs = moe_costs(config, graph=graph)
    moe = 1
    assert costs.optimizer_bytes[moe] == 1_200 * 12 // 4 + 2_000 * 12 // 2
    assert costs.stored_bytes[moe] == 3_000 // 2 + 4_200 // 2
    assert costs.time_ns[moe] == 4
    # expert gradients over d c / ep = 2 ranks, dense over 4: as at dp 4 (test above)
    assert costs.dp_sync_ns[moe] == 152


def test_expert_weight_gradient_temporary():
    """A largest_param above the layer's 400 dense replicated parameters is a grouped expert
    weight (profiling.export marks Mixtral's (E, h, 2f) fc1 so): its gradient temporary holds
    the GPU's share, 4,000 / (t ep) = 1,000 elements at t 2, ep 2 (2 bytes each); a smaller one
    is a dense tensor and stays whole."""
    moe = 1

    def transient(largest: int, **changes) -> int:
        document = moe_graph().to_dict()
        document["layers"][moe]["largest_param"] = largest
        return moe_costs(config_of(**changes), graph=graph_from_dict(document)).transient_bytes[moe]

    assert transient(4_000) == 2 * 1_000
    assert transient(4_000, ep=1) == 2 * 2_000
    assert transient(300) == 2 * 300
