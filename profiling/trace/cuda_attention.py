"""Attention profiled as a GPU runs it: ``F.scaled_dot_product_attention`` on fused kernels.

On CUDA, ``scaled_dot_product_attention`` runs a fused kernel (flash, memory-efficient or cuDNN
attention: ``select_sdp_backend`` in PyTorch's ``cuda/sdp_utils.cpp``) for every dtype, with or
without dropout, grouped-query heads or an additive mask, as long as the head dims are equal and
aligned; no fused kernel keeps an ``s x s`` attention matrix.

**What the flash kernel saves for backward** (fp16/bf16, no mask, head dim a multiple of 8 and at
most 256: what a trained LLM's attention runs, GPT-3 175B and Llama-2 included). PyTorch's
``tools/autograd/derivatives.yaml`` (the copy torchgen ships, ``torchgen/packaged/autograd``)::

    - name: _scaled_dot_product_flash_attention(Tensor query, Tensor key, Tensor value,
          float dropout_p=0.0, bool is_causal=False, bool return_debug_mask=False, *,
          float? scale=None) -> (Tensor output, Tensor logsumexp, Tensor cum_seq_q,
          Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor rng_state, Tensor unused,
          Tensor debug_attn_mask)
      query, key, value: _scaled_dot_product_flash_attention_backward_symint(grad, query, key,
          value, output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
          rng_state, unused, scale)

so autograd keeps, per attention call (b batch, a query heads, s tokens, d head dim):

    query, key, value  the tensors SDPA was given (b a s d; key and value with the KV heads
                       under grouped-query attention): views of the fused qkv projection's
                       output, whose storage they keep
    output             b a s d in the inputs' dtype (a view of a b s a d buffer, so the output
                       projection's input is the same storage)
    logsumexp          b a s, fp32
    rng_state          2 x uint64 (16 bytes): the Philox seed and offset the kernel's dropout
                       regenerates its mask from in the backward
    unused             a uint64 scalar (8 bytes)
    cum_seq_q/_k       undefined for dense (non-nested) inputs: nothing

The shapes and dtypes are those of ``meta__scaled_dot_product_flash_attention`` in
``torch/_meta_registrations.py`` (``aten._scaled_dot_product_flash_attention`` in
``native_functions.yaml`` dispatches CUDA to ``_scaled_dot_product_flash_attention_cuda``);
``mha_fwd`` in ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp`` allocates
``rng_state`` and ``unused`` on the GPU on every call, with or without dropout ("[Note] BC
breaking change to flash seed/offset"), so both are saved even at dropout 0: 24 bytes per call,
independent of the batch. No dropout mask and no ``s x s`` tensor: Korthikanti et al. 2022's
``5 a s^2 b`` bytes of scores, softmax, dropout mask and dropped probabilities are gone, which is
the saving of their selective recomputation (``tests/test_korthikanti.py``).

The memory-efficient kernel (fp32, or an additive mask) saves the same q, k, v, output and
log-sum-exp (padded to a multiple of 32 rows), the mask when one is passed (its ``attn_bias``),
and a Philox seed and offset (int64 scalars; not modelled here).

On the CPU, PyTorch only runs its fused kernel (``_scaled_dot_product_flash_attention_for_cpu``)
without dropout and without a mask that needs a gradient; otherwise it takes the math fallback,
which materialises and saves the attention matrix (in fp32 for bf16 inputs: the softmax, the
dropout noise, the dropped probabilities). A CPU or fake-CPU profile of a model that trains with
attention dropout (GPT-2, GPT-3, T5) or a learned position bias (T5) would then charge each block
``O(h s^2)`` bytes that no GPU run holds. :class:`CudaLikeAttention` makes the profile follow the
GPU instead:

- where a GPU runs the flash kernel (:func:`flash_on_gpu`): :class:`_FlashAttention`, the CPU
  fused kernel with dropout 0, saving exactly the list above (rng_state and unused included);
- another fused case without a mask that needs a gradient (fp32 inputs, a constant mask): the
  CPU fused kernel with dropout 0 (``b a s`` fp32 log-sum-exp, the mask if any);
- a mask that needs a gradient (T5's relative position bias, a learned ALiBi): the CPU fused
  kernel in the forward, saving what the memory-efficient kernel saves (q, k, v, the mask, the
  output, the log-sum-exp); its backward computes q, k, v gradients with the fused CPU backward
  and the mask's gradient one head at a time into a ``b h s s`` buffer in the mask's dtype, as
  the memory-efficient backward allocates its ``grad_bias``;
- head dims a fused kernel does not take (q/k/v head dims unequal, or not a multiple of 8 for
  16-bit and 4 for fp32 inputs: ``check_head_dim_size_mem_efficient``), other devices, nested
  tensors, DTensors: unchanged (the math kernel, which a GPU runs too, or DTensor's own rules).

Values: attention dropout is not applied (the profile measures memory and time, not the loss).

**Sliding windows** (``profiling.hf.attention``): flash attention keeps the same tensors with or
without a window; only its work shrinks. Within :func:`attention_flop_fraction` the attention
kernels' FLOPs (forward, and the backward of the calls made within it) are counted times the
fraction :func:`window_flop_fraction` gives.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from profiling._torch_compat import cpu_flash_attention, cpu_flash_attention_backward
from profiling.trace.dataflow import CudaLikeDropout, attention_flop_fraction, current_flop_fraction


def window_flop_fraction(q_length: int, kv_length: int, window: int | None) -> float:
    """Causal attention pairs within a sliding window over those of causal attention: query i
    attends min(i + 1, w) keys (transformers' ``sliding_window``: w keys, itself included;
    flash's ``window_size=(w - 1, 0)``), so with s tokens the pairs are
    w (w + 1) / 2 + (s - w) w against s (s + 1) / 2. 1 without a window, with w >= s, or when
    queries and keys differ in length (not a training forward)."""
    if not window or window >= q_length or q_length != kv_length:
        return 1.0
    s, w = q_length, window
    return (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)


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


FLASH_MAX_HEAD_DIM = 256
"""Largest head dim the flash kernel takes (``check_head_dim_size_flash``: FlashAttention-2)."""


def flash_on_gpu(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> bool:
    """Whether a CUDA GPU (sm80+) runs this attention on the flash kernel: fp16/bf16 dense
    4-d tensors, no mask, equal q/k/v head dims that are a multiple of 8 and at most 256
    (``use_flash_attention`` in ``sdp_utils.cpp``); not a DTensor (its sharding rules apply)."""
    if mask is not None or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    if any(isinstance(t, DTensor) or t.dim() != 4 for t in (query, key, value)):
        return False
    head_dim = query.shape[-1]
    return fused_on_gpu(query, key, value) and head_dim <= FLASH_MAX_HEAD_DIM


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
        grouped = key.shape[-3] != query.shape[-3]
        flash = flash_on_gpu(query, key, value, mask) or (
            mask is None and current_flop_fraction() < 1
        )
        if flash and (not grouped or bound.get("enable_gqa")):
            return _FlashAttention.apply(query, key, value, is_causal, scale)
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


class _FlashAttention(torch.autograd.Function):
    """The flash kernel's contract (module docstring): the CPU fused kernel computes the output
    and log-sum-exp (dropout 0), and autograd keeps q, k, v, the output, the log-sum-exp and the
    flash kernel's ``rng_state`` (2 x uint64) and ``unused`` (uint64 scalar) tensors; the
    backward is the fused CPU backward. Grouped-query heads go in as they are (both kernels
    take key and value with fewer heads)."""

    @staticmethod
    def forward(ctx, query, key, value, is_causal, scale):
        out, logsumexp = cpu_flash_attention(query, key, value, 0.0, is_causal, scale=scale)
        # what mha_fwd allocates on every call (flash_api.cpp), whatever dropout_p is
        rng_state = torch.empty(2, dtype=torch.uint64, device=query.device)
        unused = torch.empty((), dtype=torch.uint64, device=query.device)
        ctx.save_for_backward(query, key, value, out, logsumexp, rng_state, unused)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.flop_fraction = current_flop_fraction()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, logsumexp, _rng_state, _unused = ctx.saved_tensors
        with attention_flop_fraction(ctx.flop_fraction):
            grads = _flash_backward(ctx, grad_out, query, key, value, out, logsumexp)
        return *grads, None, None


def _flash_backward(ctx, grad_out, query, key, value, out, logsumexp, mask=None):
    """The fused kernel's backward on CPU: (grad_q, grad_k, grad_v) for the saved tensors."""
    return cpu_flash_attention_backward(
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
        grad_q, grad_k, grad_v = _flash_backward(
            ctx, grad_out, query, key, value, out, logsumexp, mask=mask
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
