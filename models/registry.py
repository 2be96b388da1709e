"""Named presets and ``get(name, **overrides) -> ModelSpec``.

    spec = models.get("gpt3-175b", layers=4)
    with torch.device("meta"):          # no memory: shapes only
        model = spec.build()
    ids, targets = spec.example_inputs(1, None)

Shapes come from the papers: GPT-2 (Radford et al. 2019; seq 1024, tied embeddings), GPT-3
(Brown et al. 2020, table 2.1; seq 2048, vocabulary 50257), Llama 2 (Touvron et al. 2023; seq
4096, vocabulary 32000, 70B with 8 KV heads), BERT (Devlin et al. 2019), T5 (Raffel et al. 2020),
ViT (Dosovitskiy et al. 2021), ResNet (He et al. 2016). The ``*-tiny`` presets run a real CPU
forward and backward in milliseconds, for tests.

**Attention and dropout as trained.** The LLM presets (``gpt2-*``, ``gpt3-*``, ``llama2-*``) run
``attention="sdpa"``: ``F.scaled_dot_product_attention``, which a GPU runs on the flash kernel (no
``s x s`` tensor is kept; ``profiling/trace/cuda_attention.py`` lists what it saves), as Megatron-LM
(``--attention-backend auto``), torchtitan and HuggingFace train them today. ``--set
attention=explicit`` (``get(name, attention="explicit")``) keeps the written-out attention whose
saved tensors Korthikanti et al. 2022 count (scores, softmax, dropout mask). Dropout follows each
model's published training setup: GPT-2 0.1 (OpenAI's released config,
``profiling/hf/configs/gpt2.json``: ``attn_pdrop``, ``embd_pdrop``, ``resid_pdrop`` 0.1); GPT-3
0.1 (the paper gives none; Megatron-LM's GPT-3 175B recipe,
``examples/gpt3/train_gpt3_175b_distributed.sh``, keeps Megatron's defaults, attention and hidden
dropout 0.1); Llama 2 0 (Meta's reference model has no dropout layer). BERT, T5 and ViT keep the
written-out attention.

The tiny presets keep ``attention="explicit"`` (``llama-tiny`` too, though the full-size Llama
presets take SDPA): they exist for real CPU runs of the executor (``profiling.run``,
``profiling.validate``, ``scripts/bench_accuracy.py``, the megatron engine's tests), whose recorded
rows and expected figures were measured with it, and at their sizes (s 16, h 32) the explicit
attention's ``5 a s^2`` bytes are over a fifth of a block's activations, which keeps the
attention's memory visible to those checks. ``--set attention=sdpa`` profiles them as the LLM
presets are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from models import bert, gpt, resnet, t5, vit


@dataclass(kw_only=True)
class LossOutside:
    """A model split as ``torch.distributed.pipelining`` trains it: a module returning the output
    tensor (what ``pipeline()`` traces) and the loss applied to it on the last stage.

    For example inputs ``x`` of the spec, ``loss_fn(module(*model_inputs(x)), target(x))`` equals
    the spec's ``build()(*x)``: same value, same gradients.
    """

    module: nn.Module
    """Shares the built model's parameters and submodule names; ``forward(*model_inputs)``
    returns the output tensor (e.g. logits, batch x seq x vocabulary)."""
    model_inputs: Callable[[tuple], tuple]
    """Example inputs -> ``module``'s forward arguments (T5: input_ids and the decoder inputs
    shifted from the labels)."""
    target: Callable[[tuple], torch.Tensor]
    """Example inputs -> the target ``loss_fn`` takes (the labels)."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss_fn(output, target)`` -> scalar loss, the one the built model's forward returns."""


@dataclass(kw_only=True)
class ModelSpec:
    name: str
    """Preset name."""
    config: Any
    """The model's config dataclass, overrides applied."""
    build: Callable[[], nn.Module]
    """Builds the model on the current default device (``with torch.device("meta"):`` for shapes
    only)."""
    example_inputs: Callable[[int, int | None], tuple]
    """``example_inputs(batch, seq=None)`` -> forward arguments on the current default device:
    int64 token ids / float images, plus targets. ``seq=None`` takes ``seq_len``; image models
    take no sequence length (ValueError)."""
    layers: list[str] | None
    """Default layer granularity: module paths in execution order (embedding, blocks, head; for
    T5 the DAG's parts in a valid topological order). None: ``profiling.trace.layers`` picks
    them."""
    seq_len: int | None
    """Default sequence length (None for image models)."""
    loss_outside: Callable[[nn.Module], LossOutside] | None = None
    """``loss_outside(built_model)`` -> the model split into output module and loss (for
    ``torch.distributed.pipelining``); None: only the loss-returning ``build()`` (zoo presets)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Recorded in the profiled graph's ``meta`` (hf: source, class, training settings)."""


@dataclass(frozen=True)
class _Family:
    config: type
    model: type[nn.Module]
    layer_paths: Callable[[Any], list[str]]
    example_inputs: Callable[..., tuple]


_FAMILIES = {
    "gpt": _Family(gpt.GPTConfig, gpt.GPT, gpt.layer_paths, gpt.example_inputs),
    "bert": _Family(bert.BERTConfig, bert.BERT, bert.layer_paths, bert.example_inputs),
    "t5": _Family(t5.T5Config, t5.T5, t5.layer_paths, t5.example_inputs),
    "vit": _Family(vit.ViTConfig, vit.ViT, vit.layer_paths, vit.example_inputs),
    "resnet": _Family(
        resnet.ResNetConfig, resnet.ResNet, resnet.layer_paths, resnet.example_inputs
    ),
}


_AS_TRAINED = dict(attention="sdpa")
"""What every LLM preset trains with (module docstring): fused attention."""


def _gpt2(layers: int, hidden: int, heads: int) -> tuple[str, dict[str, Any]]:
    shape = dict(layers=layers, hidden=hidden, heads=heads, seq_len=1024, tied_embeddings=True)
    return "gpt", {**_AS_TRAINED, "dropout": 0.1, **shape}


def _gpt3(layers: int, hidden: int, heads: int) -> tuple[str, dict[str, Any]]:
    shape = dict(layers=layers, hidden=hidden, heads=heads, seq_len=2048)
    return "gpt", {**_AS_TRAINED, "dropout": 0.1, **shape}


_LLAMA = dict(
    vocab_size=32000,
    seq_len=4096,
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    positions="rotary",
    dropout=0.0,
)


def _llama(
    layers: int, hidden: int, heads: int, ffn: int, kv_heads: int | None = None
) -> tuple[str, dict[str, Any]]:
    shape = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn)
    return "gpt", {**_LLAMA, **_AS_TRAINED, **shape}


_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2-small": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
    "gpt3-xl": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    # Table 2.1 prints d_model 5140 with 40 heads of 128; 5140 is not a multiple of 40, and
    # 40 x 128 = 5120 is what reimplementations (Megatron-LM, OPT-13B) use.
    "gpt3-13b": _gpt3(40, 5120, 40),
    "gpt3-175b": _gpt3(96, 12288, 96),
    "llama2-7b": _llama(32, 4096, 32, 11008),
    "llama2-13b": _llama(40, 5120, 40, 13824),
    "llama2-70b": _llama(80, 8192, 64, 28672, kv_heads=8),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts"; HF mistralai/Mixtral-8x7B-v0.1):
    # Mistral-7B's shape with 8 SwiGLU experts of width 14336 per block, top-2; 46,702,792,704
    # parameters. seq 4096 for planning (the model was trained at 32k).
    "mixtral-8x7b": (
        "gpt",
        {
            **_LLAMA,
            **dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336),
            **dict(rope_theta=1e6, num_experts=8, top_k=2),
        },
    ),
    # DeepSeekMoE 16B (Dai et al. 2024, table 1; HF deepseek-ai/deepseek-moe-16b-base): block 0
    # dense (width 10944), then 64 routed experts of width 1408 + 2 shared, top-6, softmax before
    # the top-k and no renormalisation; 16,375,728,128 parameters.
    "deepseek-moe-16b": (
        "gpt",
        {
            **_LLAMA,
            **dict(vocab_size=102400, layers=28, hidden=2048, heads=16, ffn_hidden=10944),
            **dict(norm_eps=1e-6, num_experts=64, top_k=6, expert_ffn_hidden=1408),
            **dict(shared_experts=2, dense_layers=1, router_pre_softmax=True),
        },
    ),
    "bert-base": ("bert", dict(layers=12, hidden=768, heads=12)),
    "bert-large": ("bert", dict(layers=24, hidden=1024, heads=16)),
    "t5-base": ("t5", dict(layers=12, hidden=768, heads=12, ffn_hidden=3072)),
    "t5-11b": ("t5", dict(layers=24, hidden=1024, heads=128, head_dim=128, ffn_hidden=65536)),
    "vit-b16": ("vit", dict(patch_size=16, layers=12, hidden=768, heads=12)),
    "vit-h14": ("vit", dict(patch_size=14, layers=32, hidden=1280, heads=16)),
    "resnet-50": ("resnet", dict(blocks=(3, 4, 6, 3))),
    "resnet-152": ("resnet", dict(blocks=(3, 8, 36, 3))),
    # Tiny presets: a real CPU forward + backward in milliseconds; explicit attention (module
    # docstring).
    "gpt-tiny": (
        "gpt",
        dict(vocab_size=96, seq_len=16, layers=2, hidden=32, heads=4, attention="explicit"),
    ),
    "llama-tiny": (
        "gpt",
        {
            **_LLAMA,
            **dict(vocab_size=96, seq_len=16, layers=2, hidden=32, heads=4, kv_heads=2),
            "attention": "explicit",
        },
    ),
    "moe-tiny": (
        "gpt",
        {
            **_LLAMA,
            **dict(vocab_size=96, seq_len=16, layers=2, hidden=32, heads=4, kv_heads=2),
            **dict(ffn_hidden=64, num_experts=4, top_k=2),
        },
    ),
    "bert-tiny": ("bert", dict(vocab_size=96, seq_len=16, layers=2, hidden=32, heads=4)),
    "t5-tiny": (
        "t5",
        dict(
            vocab_size=96, seq_len=16, layers=2, decoder_layers=2, hidden=32, heads=4, ffn_hidden=64
        ),
    ),
    "vit-tiny": (
        "vit",
        dict(image_size=32, patch_size=8, layers=2, hidden=32, heads=4, num_classes=10),
    ),
    "resnet-tiny": ("resnet", dict(blocks=(1, 1, 1, 1), width=8, image_size=64, num_classes=10)),
}


def presets() -> list[str]:
    """Every preset name, in the registry's order (families, then sizes, then tiny ones)."""
    return list(_PRESETS)


def get(name: str, **overrides: Any) -> ModelSpec:
    """The preset ``name`` with any config field overridden, e.g. ``get("gpt3-175b", layers=4)``.

    Raises ValueError for an unknown preset or field (the message lists the valid ones) and for
    invalid values (the config's own checks, with the numbers).
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(_PRESETS)}")
    family_name, preset = _PRESETS[name]
    family = _FAMILIES[family_name]
    valid = [field.name for field in dataclasses.fields(family.config)]
    unknown = [key for key in overrides if key not in valid]
    if unknown:
        raise ValueError(
            f"unknown config field(s) for {name} ({family.config.__name__}): "
            f"{', '.join(unknown)}; valid fields: {', '.join(valid)}"
        )
    config = family.config(**{**preset, **overrides})
    return ModelSpec(
        name=name,
        config=config,
        build=functools.partial(family.model, config),
        example_inputs=functools.partial(family.example_inputs, config),
        layers=family.layer_paths(config),
        seq_len=getattr(config, "seq_len", None),
    )
