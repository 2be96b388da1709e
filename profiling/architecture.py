"""The architecture facts of a model's config for the graph's ``meta.architecture``: attention
heads, key/value heads, vocabulary, hidden size, routed experts and layers, what the engines'
rules (``solver.engine_rules``) read. One reader for the zoo presets' dataclass configs and
HuggingFace configs, whose families name the same fact differently; a fact no name gives is left
out (the rules that need it are then skipped)."""

from __future__ import annotations

from typing import Any

HEADS = (
    "num_attention_heads",
    "n_head",
    "num_heads",
    "n_heads",
    "heads",
    "encoder_attention_heads",
)
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", "kv_heads")
VOCAB = ("vocab_size", "padded_vocab_size")
HIDDEN = ("hidden_size", "n_embd", "d_model", "hidden", "dim")
EXPERTS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "layers")
"""The config fields of each fact, first found wins (Llama/Mistral/Qwen, GPT-2/BigCode, T5,
Falcon, ChatGLM, BART, the zoo's GPTConfig; DeepSeek, Mixtral/GPT-OSS, Qwen-MoE/OLMoE)."""


def architecture_meta(config: Any) -> dict[str, Any]:
    """``{"architecture": {...}}`` for the graph's meta, or {} when the config gives no fact.
    A vision-language config's text model is read (``get_text_config``)."""
    facts = architecture_of(config)
    return {"architecture": facts} if facts else {}


def architecture_of(config: Any) -> dict[str, int]:
    """The facts ``config`` gives: attention_heads, kv_heads, vocab_size, hidden_size,
    num_experts, layers (positive ints only)."""
    text = getattr(config, "get_text_config", None)
    if callable(text):
        try:
            config = text() or config
        except (TypeError, ValueError):  # a config that refuses (no text model): read it as is
            pass
    heads = _first(config, HEADS)
    facts = {
        "attention_heads": heads,
        "kv_heads": _kv_heads(config, heads),
        "vocab_size": _first(config, VOCAB),
        "hidden_size": _first(config, HIDDEN),
        "num_experts": _first(config, EXPERTS),
        "layers": _first(config, LAYERS),
    }
    return {name: value for name, value in facts.items() if value is not None}


def _kv_heads(config: Any, heads: int | None) -> int | None:
    """Key/value heads: Falcon's new decoder architecture reads ``num_kv_heads``, a multi-query
    model (Falcon-7B, GPT-BigCode) has one, ChatGLM's ``multi_query_group_num`` counts only with
    ``multi_query_attention``; else the first KV field, else the heads (no GQA)."""
    if getattr(config, "new_decoder_architecture", False):
        return _first(config, ("num_kv_heads",)) or heads
    if getattr(config, "multi_query", False) is True:
        return 1
    names = tuple(
        name
        for name in KV_HEADS
        if name != "multi_query_group_num" or getattr(config, "multi_query_attention", False)
    )
    return _first(config, names) or heads


def _first(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
