"""The engines' rules (solver/engine_rules.py): each divisibility rule against a brute force over
degrees, ZeRO per runtime, and the rules where they are used: candidate configs, pinned flags
(exit 2, one line), solver.evaluate (flags and --plan), the exports and the plan's note."""

from __future__ import annotations

import json
import math

import pytest

from solver.cli.evaluate import evaluate_main
from solver.cli.plan import plan_main
from solver.engine_rules import (
    ModelFacts,
    broken_rules,
    engine_refusal,
    padded_vocab_size,
    runtime_refusal,
)
from solver.search.candidates import candidate_configs
from solver.specs import Cluster, TrainingConfig
from tests.conftest import GPT_1_3B

TP_DEGREES = (1, 2, 3, 4, 6, 8, 16)


def keys(degrees, facts, engine) -> set[str]:
    return {rule.key for rule, _ in broken_rules(degrees, facts, engine)}


def qwen_like(tmp_path, **architecture) -> str:
    """examples/gpt-1.3b.json with a meta.architecture (28 heads / 4 KV heads by default, as
    Qwen2.5-7B): the rules read the facts, the costs stay the example's."""
    document = json.loads(open(GPT_1_3B).read())
    document["meta"]["architecture"] = {"attention_heads": 28, "kv_heads": 4} | architecture
    path = tmp_path / "qwen-like.json"
    path.write_text(json.dumps(document))
    return str(path)


# -- the rules against a brute force over degrees ------------------------------------------------


def test_heads_and_kv_heads_rules_match_a_brute_force_over_tp():
    for heads in range(1, 49):
        for kv in [k for k in range(1, heads + 1) if heads % k == 0]:
            facts = ModelFacts(attention_heads=heads, kv_heads=kv)
            for tp in TP_DEGREES:
                megatron = keys({"tp": tp}, facts, "megatron")
                assert ("attention-heads" in megatron) == (heads % tp != 0)
                # Megatron-core: query groups a multiple or a divisor of tp
                assert ("kv-heads" in megatron) == (kv % tp != 0 and tp % kv != 0)
                for engine in ("torch", "torchtitan", "deepspeed"):
                    whole = keys({"tp": tp}, facts, engine)
                    assert ("kv-heads-whole" in whole) == (kv % tp != 0)
                    assert ("attention-heads" in whole) == (heads % tp != 0)


def test_experts_rule_matches_a_brute_force_over_ep():
    for experts in range(1, 65):
        for ep in range(1, 17):
            refused = "experts" in keys({"ep": ep}, ModelFacts(num_experts=experts), "megatron")
            assert refused == (experts % ep != 0)


def test_context_and_sequence_parallel_rules_match_a_brute_force_over_seq():
    for seq in range(1, 97):
        facts = ModelFacts(seq_len=seq)
        for cp in (1, 2, 3, 4):
            for tp in (1, 2, 4):
                megatron = keys({"cp": cp, "tp": tp, "sp": tp > 1}, facts, "megatron")
                assert ("context-parallel-chunks" in megatron) == (cp > 1 and seq % (2 * cp) != 0)
                assert ("sequence-parallel" in megatron) == (tp > 1 and seq % (cp * tp) != 0)
                titan = keys({"cp": cp, "tp": tp}, facts, "torchtitan")
                assert ("torchtitan-sequence" in titan) == (seq % (tp * 2 * cp) != 0)


def test_a_rule_whose_fact_or_degree_is_unknown_is_skipped():
    assert broken_rules({"tp": 8}, ModelFacts(), "megatron") == []
    assert keys({"tp": 8}, ModelFacts(attention_heads=28), "megatron") == {"attention-heads"}
    assert broken_rules({"zero": 3}, ModelFacts(), "megatron") == []  # pp unknown


@pytest.mark.parametrize(
    ("vocab", "tp", "megatron"),
    [(50257, 1, 50304), (151936, 8, 152576), (128256, 8, 129024), (32000, 2, 32000)],
)
def test_megatron_pads_the_vocabulary_to_a_multiple_of_128_tp(vocab, tp, megatron):
    assert padded_vocab_size(vocab, tp, "megatron") == megatron
    assert megatron % (128 * tp) == 0 and megatron - vocab < 128 * tp
    assert padded_vocab_size(vocab, tp, "torch") == vocab


def test_zero_per_runtime_and_engine():
    facts = ModelFacts()
    for zero in range(4):
        for pp in (1, 2, 4):
            degrees = {"zero": zero, "pp": pp}
            megatron = runtime_refusal(degrees, facts, "megatron")
            assert (megatron is not None) == (zero >= 2 and pp > 1)
            assert runtime_refusal(degrees, facts, "torch") is None
            assert (engine_refusal(degrees, facts, "deepspeed") is None) == (zero <= 1 or pp == 1)
    text = runtime_refusal({"zero": 3, "pp": 2}, facts, "megatron").text()
    assert "Megatron-LM's distributed optimizer is ZeRO-1" in text
    assert "DeepSpeed's PipelineEngine refuses ZeRO-3" in text


# -- candidate configs ----------------------------------------------------------------------------


def test_the_candidates_never_hold_a_config_the_runtime_refuses():
    facts = ModelFacts(attention_heads=28, kv_heads=4, seq_len=2048)
    cluster = Cluster(num_gpus=16, gpus_per_node=8)
    training = TrainingConfig(global_batch=64, zero_stages=(0, 1, 2, 3), micro_batch_sizes=(1,))
    megatron = candidate_configs(26, cluster, training, facts=facts)
    assert megatron and all(c.tp != 8 for c in megatron)
    assert {c.tp for c in megatron} == {1, 2, 4}
    assert all(c.zero <= 1 for c in megatron if c.pp > 1)
    assert any(c.zero == 3 for c in megatron if c.pp == 1)
    torch = candidate_configs(
        26,
        cluster,
        TrainingConfig(global_batch=64, zero_stages=(0, 3), runtime="torch"),
        facts=facts,
    )
    assert any(c.zero == 3 and c.pp > 1 for c in torch)


def test_the_planner_on_a_28_head_graph_never_proposes_tp_8(run_cli, tmp_path):
    graph = qwen_like(tmp_path)
    out_file = tmp_path / "plan.json"
    code, out, err = run_cli(
        plan_main, graph, "--gpus", "8", "--global-batch", "16", "--gpu-memory", "20GiB",
        "--zero", "auto", "--json", str(out_file),
    )  # fmt: skip
    assert code == 0, err
    config = json.loads(out_file.read_text())["config"]
    assert config["tp"] in (1, 2, 4) and not (config["zero"] >= 2 and config["pp"] > 1)


def test_no_surviving_candidate_names_the_rule(run_cli, tmp_path):
    """pp 1 and dp 1 on 8 GPUs leave tp 8 only, which 28 heads refuse."""
    code, out, err = run_cli(
        plan_main, qwen_like(tmp_path), "--gpus", "8", "--global-batch", "8", "--pp", "1",
        "--dp", "1",
    )  # fmt: skip
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "no candidate config passes the engines' rules on --runtime megatron" in err
    assert "attention heads (28) divisible by tp (8)" in err


# -- pinned flags ---------------------------------------------------------------------------------

PINNED = [
    (
        ["--tp", "8"],
        "error: --tp 8: on --runtime megatron, Megatron-LM and DeepSpeed: tensor parallelism "
        "splits whole heads: needs attention heads (28) divisible by tp (8); use --tp 1, 2 or 4",
    ),
    (
        ["--zero", "3", "--pp", "2"],
        "error: --zero 3 with --pp 2: on --runtime megatron, Megatron-LM's distributed optimizer "
        "is ZeRO-1; ZeRO-3 needs Megatron-FSDP, which Megatron runs at pp 1 only; DeepSpeed's "
        "PipelineEngine refuses ZeRO-3 ('ZeRO-2 and ZeRO-3 are incompatible with pipeline "
        "parallelism'; at pp 1 its plain engine runs them); use --zero 0 or 1, or --pp 1, or "
        "--runtime torch",
    ),
    (
        ["--tp", "4", "--runtime", "torch", "--sequence-parallel", "off"],
        "error: --tp 4: on --runtime torch, torch pipelining and torchtitan: needs KV heads (2) "
        "divisible by tp (4); use --tp 1 or 2, or --runtime megatron",
    ),
]


@pytest.mark.parametrize(("flags", "line"), PINNED)
def test_a_pinned_config_an_engine_refuses_exits_2_with_one_line(run_cli, tmp_path, flags, line):
    graph = qwen_like(tmp_path, kv_heads=2 if "--runtime" in flags else 4)
    code, out, err = run_cli(plan_main, graph, "--gpus", "16", "--global-batch", "32", *flags)
    assert (code, out, err) == (2, "", line + "\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen-like.json"]


def test_zero_3_with_pp_2_plans_on_the_torch_runtime(run_cli, tmp_path):
    out_file = tmp_path / "plan.json"
    code, _, err = run_cli(
        plan_main, qwen_like(tmp_path), "--gpus", "8", "--global-batch", "16", "--zero", "3",
        "--pp", "2", "--runtime", "torch", "--json", str(out_file),
    )  # fmt: skip
    assert code == 0, err
    document = json.loads(out_file.read_text())
    assert (document["config"]["zero"], document["config"]["pp"]) == (3, 2)
    exports = document["exports"]
    assert "Megatron-FSDP" in exports["megatron"]["refused"]
    assert "ZeRO-2 and ZeRO-3" in exports["deepspeed"]["refused"]
    assert "refused" not in exports["torch_pipelining"] and "refused" not in exports["torchtitan"]


# -- evaluate -------------------------------------------------------------------------------------


def test_evaluate_flags_with_a_refused_config_exit_2(run_cli, tmp_path):
    code, out, err = run_cli(
        evaluate_main, qwen_like(tmp_path), "--pp", "2", "--tp", "8", "--split", "even",
        "--global-batch", "8",
    )  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: config pp2 tp8 dp1 b1 m8 zero0 1f1b sp: on --runtime megatron")
    assert "attention heads (28) divisible by tp (8)" in err


def test_evaluate_plan_with_a_refused_config_exits_2(run_cli, tmp_path):
    """A torch-runtime plan with ZeRO-3 over 2 stages, its runtime edited to megatron."""
    plan_file = tmp_path / "plan.json"
    graph = qwen_like(tmp_path)
    code, _, err = run_cli(
        plan_main, graph, "--gpus", "8", "--global-batch", "16", "--zero", "3", "--pp", "2",
        "--runtime", "torch", "--json", str(plan_file),
    )  # fmt: skip
    assert code == 0, err
    assert run_cli(evaluate_main, "--plan", str(plan_file), "--quiet")[0] == 0
    document = json.loads(plan_file.read_text())
    document["runtime"] = "megatron"
    document["training"]["grad_lifetime"] = "persistent"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(document))
    code, out, err = run_cli(evaluate_main, "--plan", str(edited), "--quiet")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: {edited}: config pp2 ") and "zero3" in err
    assert "on --runtime megatron, Megatron-LM's distributed optimizer is ZeRO-1" in err


# -- graphs without meta.architecture -------------------------------------------------------------


def test_a_graph_without_architecture_plans_with_one_note(run_cli, tmp_path):
    out_file = tmp_path / "plan.json"
    code, out, err = run_cli(
        plan_main, GPT_1_3B, "--gpus", "8", "--global-batch", "16", "--tp", "8",
        "--json", str(out_file),
    )  # fmt: skip
    assert code == 0 and err == ""
    notes = json.loads(out_file.read_text())["solver"]["notes"]
    skipped = [note for note in notes if "engine rules not checked" in note]
    assert len(skipped) == 1 and "attention_heads, kv_heads" in skipped[0]


def test_facts_of_a_graph_take_its_routed_experts():
    from solver.graph import load_graph

    facts = ModelFacts.of_graph(load_graph(GPT_1_3B))
    assert facts == ModelFacts(seq_len=2048)
    assert math.gcd(facts.seq_len, 4) == 4


# -- the profiler writes meta.architecture -----------------------------------------------------


@pytest.mark.slow
def test_hf_configs_give_the_facts_under_each_familys_names():
    from transformers import (
        DeepseekV3Config,
        FalconConfig,
        GPTBigCodeConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        T5Config,
    )

    from profiling.architecture import architecture_of

    qwen = Qwen2Config(num_attention_heads=28, num_key_value_heads=4, hidden_size=3584)
    assert architecture_of(qwen) == {
        "attention_heads": 28, "kv_heads": 4, "vocab_size": 151936, "hidden_size": 3584,
        "layers": 32,
    }  # fmt: skip
    assert architecture_of(FalconConfig())["kv_heads"] == 1  # multi-query
    assert (
        architecture_of(FalconConfig(new_decoder_architecture=True, num_kv_heads=8))["kv_heads"]
        == 8
    )
    assert architecture_of(GPTBigCodeConfig())["kv_heads"] == 1
    assert architecture_of(MixtralConfig())["num_experts"] == 8  # num_local_experts
    assert architecture_of(DeepseekV3Config())["num_experts"] == 256  # n_routed_experts
    assert architecture_of(Qwen2MoeConfig())["num_experts"] == 60  # num_experts
    assert architecture_of(T5Config())["attention_heads"] == 8  # num_heads


@pytest.mark.slow
def test_the_export_records_meta_architecture_and_the_graph_loads(tmp_path):
    from profiling.export import export_graph
    from solver.graph import load_graph

    graph = export_graph("mixtral-8x7b", seq=64, overrides={"layers": 2})
    assert graph.meta["architecture"] == {
        "attention_heads": 32, "kv_heads": 8, "vocab_size": 32000, "hidden_size": 4096,
        "num_experts": 8, "layers": 2,
    }  # fmt: skip
    path = tmp_path / "g.json"
    path.write_text(json.dumps(graph.to_dict()))
    facts = ModelFacts.of_graph(load_graph(str(path)))  # the schema takes the new field
    assert (facts.attention_heads, facts.kv_heads, facts.num_experts) == (32, 8, 8)
    assert facts.seq_len == 64


def test_a_sweep_with_a_refused_pin_exits_2_with_one_line(run_cli, tmp_path):
    from solver.cli.sweep import sweep_main

    code, out, err = run_cli(
        sweep_main, qwen_like(tmp_path), "--gpus", "8,16", "--global-batch", "32", "--tp", "8"
    )
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: no point can be solved; first: --tp 8: on --runtime megatron")


def test_megatron_refuses_moe_with_tp_and_no_sequence_parallelism():
    """megatron-core's MoELayer.forward raises in training for tp > 1 without sequence
    parallelism: the Megatron-LM engine refuses that layout for a MoE model (DeepSpeed, the
    megatron runtime's other engine, runs it), and a dense model is not concerned."""
    from solver.engine_rules import ModelFacts, broken_rules

    moe = ModelFacts(num_experts=8, attention_heads=8, kv_heads=8, seq_len=64)
    dense = ModelFacts(attention_heads=8, kv_heads=8, seq_len=64)
    layout = {"pp": 2, "tp": 2, "cp": 1, "dp": 1, "ep": 1, "zero": 0, "sp": False}
    keys = [rule.key for rule, _ in broken_rules(layout, moe, "megatron")]
    assert keys == ["megatron-moe-sequence-parallel"]
    assert broken_rules(layout, moe, "deepspeed") == []
    assert broken_rules(layout, dense, "megatron") == []
    assert broken_rules({**layout, "sp": True}, moe, "megatron") == []
    assert broken_rules({**layout, "tp": 1}, moe, "megatron") == []
