"""Context parallelism (``ParallelConfig.cp``): the cost model's terms against hand counts, the
search over ``TrainingConfig.cp`` on every backend, the CLI flag and its bad inputs, the plan
file and the engine exports, and the profiler's ``attention_kv_bytes``.

torch's ``context_parallel`` does not run on CPU here (docs/running.md), so the formulas are
checked against hand-counted cases of a small graph."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from solver import Cluster, TrainingConfig, graph_from_dict, load_plan, plan
from solver.cli.evaluate import evaluate_main
from solver.cli.plan import plan_main
from solver.costs import (
    NS_PER_MS,
    ring_attention_bytes,
)
from solver.errors import InputError
from solver.files.plan_file import evaluate_plan
from solver.parallel import check_context_parallel
from solver.search.candidates import candidate_configs, stages_per_group
from solver.specs import ParallelConfig
from solver.sweep.rows import ROW_KEYS, read_rows
from tests.conftest import cluster_group, cluster_of, costs_of

SEQ_LEN = 16
KV = 128
"""attention_kv_bytes of each block, per sample."""


def cp_graph(*, kv: int = KV, seq_len: int | None = SEQ_LEN, blocks: int = 4) -> dict:
    """embed, b0..b{n-1}, head: blocks with TP-split parameters and activations, a transient
    and attention K/V; the document (``graph_from_dict`` makes the graph)."""
    block = {
        "params": 4000,
        "tp_params": 3000,
        "activation_bytes": 1000,
        "tp_activation_bytes": 600,
        "output_bytes": 64,
        "transient_bytes": 200,
        "fwd_flops": 1e9,
        "attention_kv_bytes": kv,
    }
    layers = [
        {"name": "embed", "kind": "embedding", "params": 1000, "activation_bytes": 64,
         "output_bytes": 64},
        *({"name": f"b{i}", **block} for i in range(blocks)),
        {"name": "head", "kind": "head", "params": 1000, "activation_bytes": 64,
         "output_bytes": 4},
    ]  # fmt: skip
    meta = {} if seq_len is None else {"seq_len": seq_len}
    return {"format": "layer-graph", "version": 1, "model": "cp-toy", "layers": layers,
            "meta": meta}  # fmt: skip


def config(**kw) -> ParallelConfig:
    base = dict(pp=1, tp=1, cp=1, dp=1, micro_batch=2, num_microbatches=1, zero=0)
    return ParallelConfig(**(base | kw))


# -- cost model: hand counts -------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_activations_edges_and_ring_buffers_are_hand_counted(cp):
    """b = 2, t = 1: a block stores ceil(2 * 1000 / c), sends ceil(2 * 64 / c), and its
    transient is ceil(2 * 200 / c) plus max(c, 4) K/V chunks of ceil(2 * 128 / c) (none at
    c = 1)."""
    costs = costs_of(cp_graph(), config(cp=cp))
    block = 1  # b0
    assert costs.stored_bytes[block] == math.ceil(2000 / cp)
    assert costs.edge_bytes[block] == math.ceil(128 / cp)
    ring = {1: 0, 2: 4 * 128, 4: 4 * 64, 8: 8 * 32}[cp]
    assert costs.transient_bytes[block] == math.ceil(400 / cp) + ring
    # the embedding has no attention: no ring buffers
    assert costs.transient_bytes[0] == 0
    assert costs.stored_bytes[0] == math.ceil(128 / cp)


def test_ring_chunk_is_split_over_tensor_and_context_ranks():
    """tp 2 cp 2: a chunk holds the s/2 tokens of h_kv/2 heads, ceil(2 * 128 / 4) = 64 bytes;
    the backward's 4 chunks are the largest: 256."""
    cfg = config(tp=2, cp=2)
    assert ring_attention_bytes(np.array([KV, 0]), cfg).tolist() == [256, 0]
    costs = costs_of(cp_graph(), cfg)
    # A' = (1000 - 600) + 600 / 2 = 700 per sample: ceil(2 * 700 / 2)
    assert costs.stored_bytes[1] == 700
    assert costs.transient_bytes[1] == 200 + 256


def test_recomputed_block_keeps_its_output_over_c_and_rematerialises_over_c():
    costs = costs_of(cp_graph(), config(cp=2, recompute="full"))
    assert costs.stored_bytes[1] == 64  # ceil(2 * 64 / 2)
    # ceil(2 (200 + 1000) / 2) + 4 chunks of 128 + its output's gradient, ceil(2 * 64 / 2)
    assert costs.transient_bytes[1] == 1200 + 512 + 64


def test_sequence_parallel_and_cp_split_the_sent_tensor_over_t_c():
    costs = costs_of(cp_graph(), config(tp=2, cp=2, sp=True))
    assert costs.edge_bytes[1] == 32  # ceil(2 * 64 / 4)
    assert costs.stored_bytes[1] == 500  # ceil(2 * 1000 / 4): SP splits all of A


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_are_replicated_over_cp_and_sharded_over_dp_x_cp(zero):
    """cp 2 dp 2 shards like dp 4 (Megatron's data-parallel group with context parallelism),
    and the parameters are not split by cp: the same states as pp1 tp1 dp4."""
    with_cp = costs_of(cp_graph(), config(cp=2, dp=2, zero=zero))
    dp4 = costs_of(cp_graph(), config(dp=4, zero=zero))
    for field in ("weight_bytes", "grad_bytes", "optimizer_bytes"):
        assert getattr(with_cp, field).tolist() == getattr(dp4, field).tolist()
    assert with_cp.dp_sync_ns.tolist() == dp4.dp_sync_ns.tolist()
    # zero 1: Adam's 12 bytes of b0's 4000 parameters over d c = 4 ranks
    if zero == 1:
        assert with_cp.optimizer_bytes[1] == 12 * 4000 // 4


def test_time_is_compute_over_t_c_plus_three_ring_passes():
    """b0 at cp 2: b (1e9 + 2e9) FLOPs / (rate c) + 3 passes of (c-1)/c b kv bytes, intra-node
    (t c = 2 divides 8 GPUs per node); with cp 16 > 8 GPUs per node the ring crosses nodes."""
    cluster = Cluster(num_gpus=2, intra_node_gb_per_s=100.0, inter_node_gb_per_s=10.0)
    rate_per_ms = cluster.gpu_flops * cluster.flops_efficiency / 1e3
    costs = costs_of(cp_graph(), config(cp=2), cluster=cluster)
    compute_ns = 2 * 3e9 / rate_per_ms / 2 * NS_PER_MS
    pass_ns = 2 * KV * (1 / 2) / 100.0
    assert costs.time_ns[1] == math.ceil(compute_ns + 3 * pass_ns)
    recomputed = 2 * 4e9 / rate_per_ms / 2 * NS_PER_MS + 4 * pass_ns
    assert costs.recompute_time_ns[1] == math.ceil(recomputed)
    far = Cluster(num_gpus=16, intra_node_gb_per_s=100.0, inter_node_gb_per_s=10.0)
    costs = costs_of(cp_graph(), config(cp=16), cluster=far)
    compute_ns = 2 * 3e9 / rate_per_ms / 16 * NS_PER_MS
    assert costs.time_ns[1] == math.ceil(compute_ns + 3 * 2 * KV * (15 / 16) / 10.0)


def test_tensor_parallel_all_reduces_carry_s_over_c_tokens():
    """tp 2 cp 2, b0 without attention: the ring all-reduce of b tp_comm_bytes / c moves
    2 (t-1)/t of it; no ring pass."""
    doc = cp_graph()
    for layer in doc["layers"]:
        layer["tp_comm_bytes"] = 1000
    doc["layers"][1]["attention_kv_bytes"] = 0
    cluster = Cluster(num_gpus=4, intra_node_gb_per_s=100.0)
    costs = costs_of(doc, config(tp=2, cp=2), cluster=cluster)
    rate_per_ms = cluster.gpu_flops * cluster.flops_efficiency / 1e3
    compute_ns = 2 * 3e9 / rate_per_ms / 4 * NS_PER_MS
    all_reduce_ns = 2 * 1000 / 2 * (2 * 1 / 2) / 100.0
    assert costs.time_ns[1] == math.ceil(compute_ns + all_reduce_ns)


def test_cp_one_is_the_model_without_context_parallelism():
    """A graph with attention_kv_bytes plans at cp 1 exactly as one without."""
    plain = costs_of(cp_graph(kv=0), config())
    with_kv = costs_of(cp_graph(), config())
    for field in ("stored_bytes", "transient_bytes", "time_ns", "edge_bytes", "optimizer_bytes"):
        assert getattr(plain, field).tolist() == getattr(with_kv, field).tolist()


# -- bad input -----------------------------------------------------------------------------------


def test_bad_inputs_name_the_fix():
    graph = graph_from_dict(cp_graph(seq_len=12))
    with pytest.raises(InputError, match=r"cp\(8\) does not divide the sequence length 12"):
        check_context_parallel(graph, 8)
    check_context_parallel(graph, 4)
    old = graph_from_dict(cp_graph(kv=0))
    with pytest.raises(InputError, match="re-export the graph"):
        check_context_parallel(old, 2)
    with pytest.raises(InputError, match="--cp 1 or --memory-model analytic"):
        check_context_parallel(graph, 2, "empirical")
    with pytest.raises(InputError, match=r"cp must be integers"):
        TrainingConfig(global_batch=4, cp=(0,))


@pytest.mark.parametrize(
    ("document", "flags", "message"),
    [
        (cp_graph(seq_len=6), ["--cp", "4"], "sequence length (6) divisible by 2 cp (8)"),
        (cp_graph(kv=0), ["--cp", "1,2"], "re-export the graph with this version"),
        (cp_graph(), ["--cp", "2", "--memory-model", "empirical"], "empirical memory model"),
        (cp_graph(), ["--cp", "3"], "pinned cp(3) = 3 does not divide gpus(4)"),
    ],
)
def test_plan_cli_bad_cp_exits_2_with_one_line(run_cli, write_json, document, flags, message):
    path = write_json("g.json", document)
    code, out, err = run_cli(
        plan_main, path, "--gpus", "4", "--global-batch", "8", "--time-limit", "20", *flags
    )
    assert code == 2, err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


# -- search --------------------------------------------------------------------------------------


def test_candidates_hold_every_pp_tp_cp_dp_product():
    cluster = Cluster(num_gpus=8, gpus_per_node=4)
    training = TrainingConfig(global_batch=8, cp=(1, 2, 4))
    configs = candidate_configs(6, cluster, training)
    layouts = {(c.pp, c.tp, c.cp, c.dp) for c in configs}
    assert all(pp * tp * cp * dp == 8 for pp, tp, cp, dp in layouts)
    assert {(1, 1, 2, 4), (1, 2, 4, 1), (2, 1, 4, 1), (1, 4, 2, 1)} <= layouts
    assert {c.cp for c in configs} == {1, 2, 4}
    # ZeRO shards over dp x cp: with dp = 1 and cp = 2 ZeRO 1 is not collapsed to 0 (as at
    # dp x cp = 1), and as it dominates ZeRO 0 there, ZeRO 0 is left out of the search
    zero = TrainingConfig(global_batch=8, cp=(2,), zero_stages=(0, 1), dp=1, tp=1)
    assert {c.zero for c in candidate_configs(6, cluster, zero)} == {1}
    pinned = TrainingConfig(global_batch=8, cp=(2,), zero_stages=(0,), dp=1, tp=1)
    assert {c.zero for c in candidate_configs(6, cluster, pinned)} == {0}


@pytest.mark.parametrize("backend", ["chain", "cpsat", "milp"])
def test_every_backend_finds_the_same_cp_plan(backend):
    """Activation-heavy blocks on 4 GPUs: splitting each sequence over 2 GPUs beats giving them
    another pipeline stage or data-parallel rank, and every backend proves the same peak."""
    graph = heavy_graph()
    training = TrainingConfig(
        global_batch=8, cp=(1, 2, 4), max_slowdown=None, zero_stages=(0, 1), reserve=None
    )
    result = plan(graph, Cluster(num_gpus=4), training, backend=backend, time_limit_s=30)
    reference = plan(graph, Cluster(num_gpus=4), training, backend="chain", time_limit_s=30)
    assert result.config.cp > 1
    assert result.peak_bytes == reference.peak_bytes
    assert result.solver.status == "OPTIMAL"


def heavy_graph():
    """cp_graph with 2 MB of replicated activations per block: context parallelism pays (the
    tests plan it without sequence parallelism, which would split them over tp as well)."""
    doc = cp_graph(blocks=6)
    for layer in doc["layers"][1:-1]:
        layer["activation_bytes"] = 2_000_000
        layer["tp_activation_bytes"] = 0
    return graph_from_dict(doc)


def test_pareto_front_and_heterogeneous_clusters_take_cp():
    from solver.search.pareto import pareto_front, pareto_to_dict

    training = TrainingConfig(
        global_batch=8, cp=(1, 2, 4), max_slowdown=None, sequence_parallel="off"
    )
    front = pareto_front(heavy_graph(), Cluster(num_gpus=4), training, time_limit_s=30)
    configs = [point["config"] for point in pareto_to_dict(front)["points"]]
    assert configs[0]["cp"] == 4  # the smallest peak splits every sequence over 4 GPUs
    assert any(config["cp"] == 1 for config in configs)
    mixed = cluster_of(cluster_group("small", "40GiB", gpus=2), cluster_group("big", "80GiB"))
    result = plan(heavy_graph(), mixed, dataclasses.replace(training, cp=(2,)), time_limit_s=30)
    assert (result.config.pp, result.config.cp) == (2, 2)
    assert stages_per_group(mixed, result.config) == [1, 1]


def test_plan_json_records_cp_and_rechecks(tmp_path, run_cli, write_json):
    path = write_json("g.json", cp_graph())
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli(
        plan_main, path, "--gpus", "4", "--global-batch", "8", "--cp", "2", "--pp", "2",
        "--json", str(out), "--time-limit", "20",
    )  # fmt: skip
    assert code == 0, err
    assert " cp2 " in stdout
    document = json.loads(out.read_text())
    assert document["config"]["cp"] == 2
    assert document["training"]["cp"] == [2]
    megatron = document["exports"]["megatron"]["args"]
    assert megatron[megatron.index("--context-parallel-size") + 1] == "2"
    torch_cp = document["exports"]["torch_pipelining"]["context_parallel"]
    assert torch_cp["mesh_shape"] == [2, 1, 2, 1]
    assert "context_parallel(mesh['cp']" in torch_cp["snippet"]
    loaded = load_plan(str(out))
    assert evaluate_plan(loaded).peak_bytes == document["peak_bytes"]
    code, stdout, err = run_cli(evaluate_main, "--plan", str(out))
    assert code == 0, err


def test_evaluate_cli_takes_one_cp(run_cli, write_json):
    path = write_json("g.json", cp_graph())
    args = (path, "--pp", "1", "--tp", "1", "--dp", "2", "--global-batch", "4", "--split", "even")
    args += ("--cp",)
    code, out, err = run_cli(evaluate_main, *args, "2")
    assert code == 0, err
    assert "pp1 tp1 cp2 dp2" in out
    code, out, err = run_cli(evaluate_main, *args, "1,2")
    assert code == 2 and "evaluate takes one value" in err


def test_sweep_rows_have_a_cp_column(tmp_path):
    from solver.sweep.runner import PointOptions, solve_point

    assert ROW_KEYS.index("cp") == ROW_KEYS.index("tp") + 1
    options = PointOptions(
        graph=heavy_graph(),
        training=TrainingConfig(
            global_batch=8, cp=(1, 2), max_slowdown=None, sequence_parallel="off"
        ),
        cluster=Cluster(num_gpus=4),
        time_limit_s=30,
    )
    row, _ = solve_point(options, 4, 80 * 2**30)
    assert row["cp"] == 2 and " cp2 " in row["config"]
    old = tmp_path / "old.csv"  # a sweep written before the column existed
    keys = [key for key in ROW_KEYS if key not in ("cp", "reserve_bytes", "usable_bytes")]
    old.write_text(",".join(keys) + "\n" + ",".join("1" if k == "tp" else "" for k in keys) + "\n")
    assert read_rows(old)[0]["cp"] is None


# -- profiler ------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
@pytest.mark.parametrize(("preset", "kv_heads"), [("gpt-tiny", 4), ("llama-tiny", 2)])
def test_profiled_attention_kv_bytes_of_a_zoo_block(preset, kv_heads, attention):
    """gpt-tiny / llama-tiny: s 16, 4 heads of 8 (llama: 2 KV heads, GQA), bf16: k + v hold
    2 * 16 * kv_heads * 8 * 2 bytes per sample; the explicit path's repeated GQA heads count
    once, and only the blocks attend."""
    from profiling.export import export_graph

    graph = export_graph(preset, batch=2, overrides={"attention": attention})
    expected = 2 * 16 * kv_heads * 8 * 2
    assert [layer.attention_kv_bytes for layer in graph.layers] == [0, expected, expected, 0]


@pytest.mark.slow
@pytest.mark.parametrize("native_gqa", [True, False])
def test_profiled_attention_kv_bytes_of_an_hf_llama_with_gqa(monkeypatch, native_gqa):
    """HF Llama, 4 heads of 16 and 2 KV heads, bf16, s 32: 2 * 32 * 2 * 16 * 2 bytes per
    sample in each decoder layer, whether SDPA takes the KV heads (enable_gqa) or transformers
    widens them first with repeat_kv (as it does when a mask is passed)."""
    import transformers.integrations.sdpa_attention as sdpa_attention

    from profiling.export import export_graph
    from tests.run_any_factories import TINY_HF_MODELS

    if not native_gqa:
        monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", lambda *args, **kwargs: False)

    name, overrides = TINY_HF_MODELS["llama-gqa"]
    # transformers' own SDPA path (hf: models get the flash-semantics attention by default)
    overrides = {**overrides, "attn_implementation": "sdpa"}
    graph = export_graph(name, batch=2, seq=32, overrides=overrides)
    kv = {layer.name: layer.attention_kv_bytes for layer in graph.layers}
    assert [kv[f"model.layers.{i}"] for i in range(4)] == [2 * 32 * 2 * 16 * 2] * 4
    assert kv["model.embed_tokens"] == kv["lm_head"] == 0
