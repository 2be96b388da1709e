"""The attention ``hf:`` models are profiled with: what flash attention keeps, as engines train.

Megatron/TransformerEngine and flash attention (the kernels users train HF architectures with)
keep, per attention call, q, k, v, the output and the fp32 log-sum-exp for the backward, never
the ``s x s`` scores or probabilities; a sliding window, logit soft-capping and attention sinks
change what the kernel computes, not what it keeps (``flash_attn_func(..., window_size=,
softcap=)``: the same saved tensors). transformers' own paths do not run that way for every
architecture: a sliding window goes to SDPA as an explicit ``b x 1 x s x s`` mask (which also
makes grouped-query models widen K and V to every head: +10% activations per Mistral block at
4k tokens, +14% at 8k), and models that soft-cap their logits (Gemma 2) refuse SDPA altogether,
leaving eager attention (+76% on a planned peak: the scores and softmax kept).

:func:`choose_attention` picks the implementation a model is built with, in this order:

1. ``--set attn_implementation=...``: the user's choice, as given.
2. The model calls attention through transformers' ``AttentionInterface``
   (``_supports_attention_backend``; Llama, Mistral, Gemma 1-3, Qwen, DeepSeek, BERT, ViT, ...):
   :data:`FUSED`, registered here, :func:`fused_attention_forward`: the flash contract through
   ``F.scaled_dot_product_attention`` (``profiling.trace.cuda_attention``), with the FLOP
   count of a sliding window scaled to the pairs it attends (``window_flop_fraction``).
3. Otherwise, SDPA where the class takes it (Falcon, T5, StableLM, ...), as before.
4. Otherwise, a model with attention modules (BLOOM, MPT: ALiBi in transformers' eager code
   only) is refused (InputError, exit 2): ``--set attn_implementation=eager`` profiles the
   explicit attention on purpose. A model without attention (Mamba) is built eagerly.

**Values.** The profile measures memory and time, not the loss: the window, the soft-cap and
sinks are not applied to the values (the attention computed is full causal attention; on a real
CPU or GPU run its time is that of full attention). Attention dropout is not applied either
(``cuda_attention``). A learned position bias (``position_bias``) or a mask the model builds
itself (a 4-d tensor) cannot run on flash; those calls go to transformers' SDPA path, as before.
A 2-d padding mask is dropped (flash unpads; the profile's inputs hold no padding).
"""

from __future__ import annotations

import sys
from typing import Any

from solver.errors import InputError

FUSED = "fused_attention"
"""The ``attn_implementation`` name of :func:`fused_attention_forward` (without "flash":
transformers would take it for a flash-attention package to import)."""


def choose_attention(config, model_class, overrides: dict[str, Any], *, source: str) -> str:
    """Set ``config``'s attention implementation by the rules of the module docstring and return
    it; InputError for an architecture whose attention only runs in eager code."""
    if "attn_implementation" in overrides:
        return str(overrides["attn_implementation"])
    if getattr(model_class, "_supports_attention_backend", False):
        register()
        chosen = FUSED
    elif getattr(model_class, "_supports_sdpa", False):
        chosen = "sdpa"
    elif _attention_classes(model_class):
        raise InputError(
            f"{source}: {model_class.__name__} runs its attention ("
            f"{', '.join(_attention_classes(model_class)[:2])}) only in transformers' eager code, "
            "which keeps the s x s scores that flash-attention engines never keep; "
            "--set attn_implementation=eager profiles it anyway (an over-estimate)"
        )
    else:
        chosen = "eager"  # no attention at all (state-space models)
    config._attn_implementation = chosen  # the setter sets the sub-configs too
    return chosen


def _attention_classes(model_class) -> list[str]:
    """Names of the ``nn.Module`` classes in the model's module whose name says Attention."""
    import torch

    module = sys.modules.get(model_class.__module__)
    return sorted(
        name
        for name, value in vars(module or {}).items()
        if "Attention" in name
        and isinstance(value, type)
        and issubclass(value, torch.nn.Module)
        and value.__module__ == model_class.__module__
    )


def register() -> None:
    """Register :data:`FUSED` with transformers' attention and mask interfaces (the mask is
    flash attention's: None when nothing is padded)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(FUSED, fused_attention_forward)
    AttentionMaskInterface.register(FUSED, flash_attention_mask)


def fused_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """An ``AttentionInterface`` function with flash attention's memory contract (module
    docstring). query (b, a, s, d), key and value (b, kv, s, d) -> ((b, s, a, d), None)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from profiling.trace.cuda_attention import attention_flop_fraction, window_flop_fraction

    has_bias = kwargs.get("position_bias") is not None
    if has_bias or (attention_mask is not None and attention_mask.dim() == 4):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    q_length, kv_length = query.shape[2], key.shape[2]
    causal = q_length > 1 and (is_causal if is_causal is not None else module.is_causal)
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    if value_dim < head_dim:  # MLA: flash takes one head dim; value padded, output cropped
        value = F.pad(value, [0, head_dim - value_dim])
    fraction = window_flop_fraction(q_length, kv_length, sliding_window) if causal else 1.0
    with attention_flop_fraction(fraction):
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=dropout if module.training else 0.0,
            is_causal=causal,
            scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1],
        )
    return out[..., :value_dim].transpose(1, 2).contiguous(), None
