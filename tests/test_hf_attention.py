"""hf: models profiled as the engines run them (issue 28, part D).

Attention with flash semantics (q, k, v, output and log-sum-exp kept; no ``s x s`` tensor) for
sliding windows, soft-capping and architectures transformers refuses SDPA for; vision-language
models with their vision tower; the sequence length chosen without ``--seq`` printed and kept in
the graph's meta; Megatron's skip-connection warning only where a plan cuts such an edge.
Configs are written in the tests (no download); models are built on the meta device.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from profiling.export import export_graph, main  # noqa: E402
from profiling.hf.attention import FUSED  # noqa: E402
from profiling.trace.cuda_attention import window_flop_fraction  # noqa: E402
from solver.exports import build_exports  # noqa: E402
from solver.exports.megatron import cut_skip_edges  # noqa: E402
from solver.graph import Edge, load_graph  # noqa: E402
from solver.specs import ParallelConfig  # noqa: E402

MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1, two of its 32 layers
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "rms_norm_eps": 1e-05,
}

TINY = {
    "gemma2": {  # soft-capped logits; transformers refuses SDPA for it
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "head_dim": 16,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "query_pre_attn_scalar": 16,
        "sliding_window": 32,
        "vocab_size": 256,
    },
    "deepseek_v3": {  # MLA: query/key head dim 24, value head dim 16
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "vocab_size": 256,
    },
}

LLAVA = {  # LLaVA-1.5's layout at a small size: CLIP tower (CLS + 7 x 7 patches), Llama text
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "image_token_index": 250,
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "text_config": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "max_position_embeddings": 256,
        "vocab_size": 256,
    },
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "image_size": 56,
        "patch_size": 8,
        "projection_dim": 32,
    },
}


def _config_dir(tmp_path, name: str, config: dict) -> str:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return f"hf:{directory}"


def _layer(graph, name: str):
    return next(layer for layer in graph.layers if layer.name == name)


# -- sliding windows -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_mistral_block_keeps_what_flash_keeps_for_any_window(tmp_path):
    """Mistral 7B, seq 4096, bf16 (e = 2), per sample: s tokens, h 4096, a 32 heads, kv = 8 x 128
    K/V width, f 14336. Flash keeps the same tensors with a window of 4096 or 1024:
    2 (4sh + 4s + 2esh) (two RMSNorms) + 2esh (rotated q, attention output) + 2e s kv (k, v) +
    4as (fp32 log-sum-exp) + 4esf (SwiGLU) + 24 (flash's RNG state) = 822,640,664 bytes; no
    s x s term. SDPA with transformers' explicit window mask kept s^2 (the bool mask) + 2esh
    (K and V widened to every head) more and no RNG state: 906,526,720 (+10.2%). Attention
    FLOPs shrink to the window's pairs: 1024 (1025) / 2 + 3072 x 1024 over 4096 x 4097 / 2."""
    s, h, a, f, e = 4096, 4096, 32, 14336, 2
    kv = 8 * h // a
    flash = 2 * (4 * s * h + 4 * s + 2 * e * s * h) + 2 * e * s * h + 2 * e * s * kv
    flash += 4 * a * s + 4 * e * s * f + 24
    graphs = {}
    for window in (4096, 1024):
        name = _config_dir(tmp_path, f"w{window}", {**MISTRAL_7B, "sliding_window": window})
        graphs[window] = export_graph(name, seq=s)
        block = _layer(graphs[window], "model.layers.1")
        assert block.activation_bytes == flash == 822_640_664
        assert block.attention_kv_bytes == 2 * e * s * kv  # what ring attention passes
        assert graphs[window].meta["training_settings"]["attn_implementation"] == FUSED
    sdpa = export_graph(name, seq=s, overrides={"attn_implementation": "sdpa"})
    assert _layer(sdpa, "model.layers.1").activation_bytes == flash - 24 + s * s + 2 * e * s * h
    attention = 4 * a * s * s * (h // a)  # torch's count: every q-k pair, QK^T and PV
    full, windowed = (_layer(graphs[w], "model.layers.1").fwd_flops for w in (4096, 1024))
    fraction = (1024 * 1025 / 2 + 3072 * 1024) / (s * (s + 1) / 2)
    assert window_flop_fraction(s, s, 1024) == pytest.approx(fraction)
    assert full - windowed == pytest.approx(attention * (1 - fraction), abs=2)


def test_window_flop_fraction():
    assert window_flop_fraction(8, 8, None) == window_flop_fraction(8, 8, 8) == 1.0
    assert window_flop_fraction(4, 4, 2) == (1 + 2 + 2 + 2) / 10  # keys seen: 1, 2, 2, 2
    assert window_flop_fraction(1, 8, 2) == 1.0  # not a training forward


# -- architectures transformers refuses SDPA for, soft-capping, MLA ---------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(TINY))
def test_flash_semantics_keep_no_s_by_s_tensor(tmp_path, run_cli, arch):
    """Gemma 2 (soft-capping: SDPA refused) and DeepSeek-V3 (MLA: q and v head dims differ,
    SDPA's math kernel) export with exit 0 and blocks linear in s (a constant c0: RNG state,
    Gemma's fp32 norm weights), where the eager profile grows with s^2."""
    name = _config_dir(tmp_path, arch, TINY[arch])
    out = tmp_path / "graph.json"
    code, _, err = run_cli(main, name, "--seq", "64", "--out", str(out), "--no-progress")
    assert code == 0, err
    assert load_graph(str(out)).meta["training_settings"]["attn_implementation"] == FUSED
    blocks = {}
    for implementation in (FUSED, "eager"):
        overrides = {} if implementation == FUSED else {"attn_implementation": "eager"}
        blocks[implementation] = [
            _layer(export_graph(name, seq=s, overrides=overrides), "model.layers.1")
            for s in (64, 128, 256)
        ]
    fused = [block.activation_bytes for block in blocks[FUSED]]
    eager = [block.activation_bytes for block in blocks["eager"]]
    assert fused[2] - fused[1] == 2 * (fused[1] - fused[0])  # a s + c0
    assert eager[2] - eager[1] > 2 * (eager[1] - eager[0])  # + b s^2
    assert all(f < g for f, g in zip(fused, eager, strict=True))


@pytest.mark.slow
def test_eager_only_attention_is_refused_in_one_line(tmp_path, run_cli):
    bloom = {"model_type": "bloom", "n_layer": 2, "hidden_size": 32, "n_head": 4}
    code, out, err = run_cli(main, _config_dir(tmp_path, "bloom", bloom), "--no-progress")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "BloomForCausalLM runs its attention (BloomAttention) only in transformers' eager" in err
    assert "--set attn_implementation=eager profiles it anyway" in err


def test_a_model_without_attention_is_built_eagerly():
    from profiling.hf.attention import choose_attention

    class Config:
        _attn_implementation = None

    class Mamba:  # no attention interface, no SDPA, no *Attention module class
        __module__ = __name__

    config = Config()
    assert choose_attention(config, Mamba, {}, source="x") == "eager"
    assert config._attn_implementation == "eager"


# -- vision-language models ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_llava_profiles_its_vision_tower_first(tmp_path, run_cli):
    """One 56 x 56 image per sample: 7 x 7 patches of 8 px (the CLS feature dropped by the
    "default" strategy) make 49 image tokens; the tower runs before the language blocks, with
    activations and FLOPs."""
    name = _config_dir(tmp_path, "llava", LLAVA)
    out = tmp_path / "graph.json"
    code, _, err = run_cli(main, name, "--seq", "96", "--out", str(out), "--no-progress")
    assert code == 0, err
    graph = load_graph(str(out))
    names = graph.names
    tower = _layer(graph, "model.vision_tower")
    assert names.index("model.vision_tower") < names.index("model.language_model.layers.0")
    assert tower.activation_bytes > 0 and tower.fwd_flops > 0 and tower.params > 0
    from profiling.hf.models import hf_spec

    ids, pixels, labels = hf_spec(name[3:]).example_inputs(2, 96)
    assert tuple(pixels.shape) == (2, 3, 56, 56)
    assert (ids == 250).sum(dim=1).tolist() == [49, 49]
    assert (labels == -100).sum().item() == 2 * 49
    code, _, err = run_cli(main, name, "--seq", "49", "--no-progress")
    assert code == 2 and "--seq 49 holds no text after the 49 image tokens" in err


@pytest.mark.slow
def test_a_vlm_whose_images_need_more_than_pixels_is_refused(tmp_path, run_cli):
    qwen2_vl = {
        "model_type": "qwen2_vl",
        "text_config": {
            "model_type": "qwen2_vl_text",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "vocab_size": 256,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        },
        "vision_config": {"depth": 1, "embed_dim": 32, "num_heads": 2, "hidden_size": 64},
    }
    code, out, err = run_cli(main, _config_dir(tmp_path, "qwen2_vl", qwen2_vl), "--no-progress")
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "Qwen2VLForConditionalGeneration: a vision-language model without " in err
    assert "vision_config.image_size is not supported" in err  # its tower takes patch rows
    assert "profile its language model alone from text_config" in err


# -- the sequence length chosen --------------------------------------------------------------------


@pytest.mark.slow
def test_the_sequence_length_chosen_is_printed_and_kept(tmp_path, run_cli):
    out = tmp_path / "graph.json"
    argv = ["hf:gpt2", "--set", "n_layer=1", "--set", "n_embd=32", "--set", "n_head=2"]
    code, _, err = run_cli(main, *argv, "--out", str(out), "--no-progress")
    assert code == 0
    assert err == "seq 1024 (min(max_position_embeddings 1024, 2048)); pass --seq to change\n"
    meta = load_graph(str(out)).meta
    assert meta["seq_len"] == 1024
    assert meta["seq_len_source"] == "min(max_position_embeddings 1024, 2048)"
    code, _, err = run_cli(main, *argv, "--seq", "64", "--out", str(out), "--no-progress")
    assert code == 0 and err == ""
    meta = load_graph(str(out)).meta
    assert (meta["seq_len"], meta["seq_len_source"]) == (64, "--seq")


# -- Megatron's skip-connection warning ------------------------------------------------------------


def _skip_warnings(graph, stages) -> list[str]:
    config = ParallelConfig(pp=len(stages), tp=1, dp=1, micro_batch=1, num_microbatches=4)
    warnings = build_exports(graph, config, stages)["megatron"].get("warnings", [])
    return [w for w in warnings if "skip connection" in w or "not a chain" in w]


@pytest.mark.slow
def test_rotary_tables_give_no_skip_warning(tmp_path):
    """hf:llama-2-7b (4 of its blocks): the rotary cos/sin go from the embedding to every block
    (the graph is not a chain) but need no gradient: no warning at pp 1 or pp 2. A gradient
    skip edge cut by the stages is warned about, one not cut is not."""
    graph = export_graph("hf:llama-2-7b", seq=128, overrides={"num_hidden_layers": 4})
    names = graph.names
    assert not graph.is_chain
    assert _skip_warnings(graph, [names]) == []
    assert _skip_warnings(graph, [names[:3], names[3:]]) == []
    graph.edges.append(Edge(src=names[1], dst=names[4], bytes=8))
    assert cut_skip_edges(graph, [names]) == []
    assert _skip_warnings(graph, [names[:5], names[5:]]) == []
    warning = _skip_warnings(graph, [names[:3], names[3:]])
    assert warning == [
        f"1 skip connection(s) needing gradients cross stages ({names[1]} -> {names[4]}): "
        "Megatron's GPT model passes one hidden state between stages, so they need model "
        "changes."
    ]
