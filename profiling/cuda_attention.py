"""Attention profiled as a GPU runs it: ``F.scaled_dot_product_attention`` on fused kernels.

On CUDA, ``scaled_dot_product_attention`` runs a fused kernel (cuDNN, flash or memory-efficient
attention: ``select_sdp_backend`` in PyTorch's ``cuda/sdp_utils.cpp``) for every dtype, with or
without dropout, grouped-query heads or an additive mask, as long as the head dims are equal and
aligned. A fused kernel saves for backward the query, key and value it was given, its output and
the fp32 log-sum-exp per query row (``b h s`` fp32), plus the mask when one is passed (the
memory-efficient kernel saves its ``attn_bias``); no ``s x s`` attention matrix. Its dropout
regenerates the mask from the Philox seed in the backward (16 bytes of RNG state, not modelled).

On the CPU, PyTorch only runs its fused kernel (``_scaled_dot_product_flash_attention_for_cpu``)
without dropout and without a mask that needs a gradient; otherwise it takes the math fallback,
which materialises and saves the attention matrix (in fp32 for bf16 inputs: the softmax, the
dropout noise, the dropped probabilities). A CPU or fake-CPU profile of a model that trains with
attention dropout (GPT-2, T5) or a learned position bias (T5) would then charge each block
``O(h s^2)`` bytes that no GPU run holds. :class:`CudaLikeAttention` makes the profile follow the
GPU instead:

- no mask, or a mask without gradient: the CPU fused kernel with dropout 0 (the saved tensors and
  shapes of a CUDA fused kernel with dropout: ``b h s`` fp32 log-sum-exp, the mask if any);
- a mask that needs a gradient (T5's relative position bias, a learned ALiBi): the CPU fused
  kernel in the forward, saving what the memory-efficient kernel saves (q, k, v, the mask, the
  output, the log-sum-exp); its backward computes q, k, v gradients with the fused CPU backward
  and the mask's gradient one head at a time into a ``b h s s`` buffer in the mask's dtype, as
  the memory-efficient backward allocates its ``grad_bias``;
- head dims a fused kernel does not take (q/k/v head dims unequal, or not a multiple of 8 for
  16-bit and 4 for fp32 inputs: ``check_head_dim_size_mem_efficient``), other devices, nested
  tensors: unchanged (the math kernel, which a GPU runs too).

Values: attention dropout is not applied (the profile measures memory and time, not the loss).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from profiling._torch_compat import cpu_flash_attention, cpu_flash_attention_backward
from profiling.dataflow import CudaLikeDropout

_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def cuda_like_kernels(enabled: bool = True) -> contextlib.AbstractContextManager:
    """Dropout (``CudaLikeDropout``) and attention (:class:`CudaLikeAttention`) run as CUDA
    runs them; nothing when ``enabled`` is false."""
    stack = contextlib.ExitStack()
    if enabled:
        stack.enter_context(CudaLikeDropout())
        stack.enter_context(CudaLikeAttention())
    return stack


def fused_on_gpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether a CUDA GPU runs this attention on a fused kernel (memory-efficient at least):
    equal q/k/v head dims, a multiple of 8 (fp16, bf16) or 4 (fp32), dense tensors."""
    if any(t.is_nested or t.layout != torch.strided for t in (query, key, value)):
        return False
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim or value.shape[-1] != head_dim or head_dim == 0:
        return False
    alignment = 8 if query.dtype in (torch.float16, torch.bfloat16) else 4
    fused_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    return head_dim % alignment == 0 and query.dtype in fused_dtypes


_SDPA_CALLS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
"""The Python call and the aten op a ``torch.export`` trace (a ``pipeline()`` stage) calls."""


class CudaLikeAttention(TorchFunctionMode):
    """Route ``F.scaled_dot_product_attention`` on the CPU to the fused kernel a GPU would run
    (module docstring). Tensors on other devices pass through unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SDPA_CALLS:
            return func(*args, **kwargs)
        bound = dict(zip(_ARGUMENTS, args, strict=False)) | kwargs
        query, key, value = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_mask")
        if query.device.type != "cpu" or not fused_on_gpu(query, key, value):
            return func(*args, **kwargs)
        is_causal = bool(bound.get("is_causal", False))
        scale = bound.get("scale")
        if mask is not None and mask.requires_grad and torch.is_grad_enabled():
            if key.shape[-3] != query.shape[-3] or query.dim() != 4:
                return func(*args, **kwargs)  # grouped heads with a learned bias: math, as is
            return _FusedBiasAttention.apply(query, key, value, mask, is_causal, scale)
        return func(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=bool(bound.get("enable_gqa", False)),
        )


class _FusedBiasAttention(torch.autograd.Function):
    """Fused attention with an additive mask that needs a gradient (the memory-efficient
    kernel's contract: saves q, k, v, mask, output, log-sum-exp; returns the mask's gradient)."""

    @staticmethod
    def forward(ctx, query, key, value, mask, is_causal, scale):
        out, logsumexp = cpu_flash_attention(
            query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        ctx.save_for_backward(query, key, value, mask, out, logsumexp)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, mask, out, logsumexp = ctx.saved_tensors
        grad_q, grad_k, grad_v = cpu_flash_attention_backward(
            grad_out.contiguous(),
            query,
            key,
            value,
            out,
            logsumexp,
            0.0,
            ctx.is_causal,
            attn_mask=mask,
            scale=ctx.scale,
        )
        grad_mask = None
        if ctx.needs_input_grad[3]:
            grad_mask = _bias_gradient(grad_out, query, key, value, mask, out, logsumexp, ctx.scale)
        return grad_q, grad_k, grad_v, grad_mask, None, None


def _bias_gradient(grad_out, query, key, value, mask, out, logsumexp, scale):
    """d loss / d mask = P * (dO V^T - rowsum(dO * O)), one head at a time into a ``b h s s``
    buffer in the mask's dtype (what the memory-efficient backward allocates), then summed over
    the mask's broadcast dimensions. (SDPA refuses a mask with ``is_causal``.)"""
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    grad = torch.empty(batch, heads, q_len, k_len, dtype=mask.dtype, device=mask.device)
    full_mask = mask.expand(batch, heads, q_len, k_len)
    delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
    for head in range(heads):
        q, k, v = query[:, head].float(), key[:, head].float(), value[:, head].float()
        scores = q @ k.transpose(-1, -2) * scale + full_mask[:, head].float()
        probs = torch.exp(scores - logsumexp[:, head].float().unsqueeze(-1))
        d_probs = grad_out[:, head].float() @ v.transpose(-1, -2)
        grad[:, head] = probs * (d_probs - delta[:, head])
    return grad.sum_to_size(mask.shape)
