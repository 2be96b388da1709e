"""Building blocks shared by the transformer models: norms, attention, MLP, rotary, LM head.

Plain PyTorch, no parallelism (torchtitan keeps model code apart from the code that shards it).
The module names follow Megatron-LM's tensor-parallel roles, so a profiler can split a layer by
name alone:

    column-parallel (output split over TP ranks):  attn.qkv, attn.q, attn.kv, mlp.fc1
    row-parallel (input split, all-reduce after):  attn.proj, mlp.fc2
    vocabulary-parallel:                           embed.tok, head.lm_head (and BERT head.decoder)
    replicated:                                    norms, position tables, row-parallel biases

Attention is written out by default ("explicit": q @ k^T, scale, causal masked_fill, softmax,
dropout, @ v), so the tensors autograd saves are those counted by Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4.1: Q and K (saved by
the score matmul), the softmax output, the dropout mask and output, V. One extra, batch-independent
tensor is saved per attention layer: the (s, s) bool causal mask that masked_fill keeps for its
backward (s^2 bytes, shared by the whole batch, so zero per sample in the limit). The "sdpa" option
calls F.scaled_dot_product_attention instead (flash / memory-efficient kernels where available;
on CPU PyTorch falls back to a math kernel that saves fp32 copies of the scores).

Dropout masks are bool (one byte per element) on every device: see ``dropout``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu", "relu")
ATTENTIONS = ("explicit", "sdpa")


def check_choice(owner: str, field: str, value: str, choices: tuple[str, ...]) -> None:
    """ValueError naming the field and its valid values when ``value`` is not one of them."""
    if value not in choices:
        raise ValueError(f"{owner}.{field} = {value!r}; valid: {', '.join(choices)}")


def check_positive(owner: str, **values: int | None) -> None:
    """ValueError for any integer field that is set and below 1."""
    for field, value in values.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{owner}.{field} = {value!r}; expected an integer >= 1")


def check_dropout(owner: str, dropout: float) -> None:
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"{owner}.dropout = {dropout!r}; expected 0 <= dropout < 1")


def check_config(
    config: Any,
    *,
    positive: tuple[str, ...],
    choices: dict[str, tuple[str, ...]],
    divisible: tuple[tuple[str, str], ...] = (),
) -> None:
    """The checks every model family's config runs in ``__post_init__``, in this order, each a
    ValueError naming the config class and the field: the ``positive`` integer fields (None
    allowed: a default), each field of ``choices`` among its valid values, the dropout
    probability, and each ``(a, b)`` of ``divisible`` with ``a % b == 0``."""
    owner = type(config).__name__
    check_positive(owner, **{field: getattr(config, field) for field in positive})
    for field, valid in choices.items():
        check_choice(owner, field, getattr(config, field), valid)
    check_dropout(owner, config.dropout)
    for a, b in divisible:
        if getattr(config, a) % getattr(config, b):
            raise ValueError(
                f"{owner}: {a} ({getattr(config, a)}) % {b} ({getattr(config, b)}) != 0"
            )


def dropout(x: torch.Tensor, p: float, *, training: bool = True) -> torch.Tensor:
    """Inverted dropout that keeps a one-byte bool mask for backward on every device.

    CUDA's fused kernel (aten.native_dropout) saves a bool mask, as Korthikanti et al. count (one
    byte per element); the CPU path of F.dropout multiplies by a noise tensor of the input's dtype
    and saves that (two bytes in bf16, four in fp32). Writing it out makes the saved bytes the
    same on CPU, under fake tensors and on CUDA. ``x * mask`` saves only the mask; the scale is a
    Python float and saves nothing.
    """
    if not training or p == 0.0:
        return x
    mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
    return x * mask * (1.0 / (1.0 - p))


class Dropout(nn.Module):
    """Module form of ``dropout`` (drop-in for nn.Dropout)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, training=self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def make_norm(kind: str, hidden: int, *, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """LayerNorm (weight + optional bias: 2h or h params) or RMSNorm (weight only: h params)."""
    if kind == "layernorm":
        return nn.LayerNorm(hidden, eps=eps, bias=bias)
    return nn.RMSNorm(hidden, eps=eps)


def rotary_tables(
    seq: int, head_dim: int, *, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, shape (seq, head_dim), for the rotate-half convention (GPT-NeoX, HF Llama).

    Built on every call from ``arange``: no buffer, so the model builds the same way on the meta
    device, under fake tensors and for real. The tables do not require grad and do not depend on
    the batch; autograd saves them (2 x seq x head_dim elements per call, batch-independent;
    :class:`Attention` makes them for q and for k, as megatron-core does).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (b, heads, s, d) by position: x cos + rotate_half(x) sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, dropout_p: float
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) [causal mask]) v with dropout on the probabilities, written out.

    Shapes (b, heads, s, d) for q and (b, heads, t, d) for k and v (KV heads already repeated).
    """
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    if causal:
        s, t = q.size(-2), k.size(-2)
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).triu(1 + t - s)
        scores = scores.masked_fill(mask, float("-inf"))
    probs = F.softmax(scores, dim=-1)
    probs = dropout(probs, dropout_p)
    return probs @ v


class Attention(nn.Module):
    """Multi-head self- or cross-attention with grouped-query heads and optional rotary positions.

    Self-attention uses one fused projection ``qkv``: Linear(h, (heads + 2 kv_heads) head_dim),
    Linear(h, 3h) for plain multi-head attention, with a bias when ``qkv_bias`` (None:
    ``bias``). Cross-attention (``cross=True``) projects the
    queries from x with ``q`` and keys and values from the memory (the encoder output) with ``kv``.
    ``proj`` maps heads x head_dim back to h and is followed by dropout (Korthikanti's sh mask).
    """

    def __init__(
        self,
        *,
        hidden: int,
        heads: int,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        qkv_bias: bool | None = None,
        dropout: float = 0.0,
        causal: bool = True,
        rotary: bool = False,
        rope_theta: float = 10000.0,
        impl: str = "explicit",
        cross: bool = False,
    ):
        super().__init__()
        self.heads = heads
        self.kv_heads = kv_heads or heads
        self.head_dim = head_dim or hidden // heads
        self.dropout_p = dropout
        self.causal = causal
        self.rotary = rotary
        self.rope_theta = rope_theta
        self.impl = impl
        self.cross = cross
        q_width, kv_width = heads * self.head_dim, self.kv_heads * self.head_dim
        if cross:
            self.q = nn.Linear(hidden, q_width, bias=bias)
            self.kv = nn.Linear(hidden, 2 * kv_width, bias=bias)
        else:
            qkv_bias = bias if qkv_bias is None else qkv_bias
            self.qkv = nn.Linear(hidden, q_width + 2 * kv_width, bias=qkv_bias)
        self.proj = nn.Linear(q_width, hidden, bias=bias)
        self.dropout = Dropout(dropout)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        """(b, s, count * d) -> (b, count, s, d)."""
        b, s, _ = x.shape
        return x.view(b, s, count, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        kv_width = self.kv_heads * self.head_dim
        if self.cross:
            assert memory is not None, "cross-attention needs the encoder output"
            q = self.q(x)
            k, v = self.kv(memory).split(kv_width, dim=-1)
        else:
            q, k, v = self.qkv(x).split([self.heads * self.head_dim, kv_width, kv_width], dim=-1)
        q = self._heads(q, self.heads)
        k, v = self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
        if self.rotary:  # tables made per call, as megatron-core's apply_rotary_pos_emb does
            # (its cos and sin of q and of k are saved apart: 4 s d elements per layer)
            tables = dict(theta=self.rope_theta, device=x.device, dtype=q.dtype)
            q = apply_rotary(q, *rotary_tables(x.size(1), self.head_dim, **tables))
            k = apply_rotary(k, *rotary_tables(x.size(1), self.head_dim, **tables))
        dropout_p = self.dropout_p if self.training else 0.0
        if self.impl == "sdpa":
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_p=dropout_p,
                is_causal=self.causal,
                enable_gqa=self.kv_heads != self.heads,
            )
        else:
            if self.kv_heads != self.heads:  # GQA: every KV head serves heads / kv_heads queries
                repeat = self.heads // self.kv_heads
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            out = explicit_attention(q, k, v, causal=self.causal, dropout_p=dropout_p)
        b, _, s, _ = out.shape
        out = out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.dropout(self.proj(out))


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of the fused [gate, up] projection, keeping only that input for the
    backward and recomputing silu there: Megatron-LM's fused bias-SwiGLU (``SwiGLUFunction``,
    on by default with ``--swiglu``), whose memory the zoo's Llama therefore has."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        # megatron-core's swiglu_back, term for term (so its temporaries): its gradient of
        # silu(gate) and of up, made and concatenated as the fused function's are
        return torch.cat(
            (
                grad * torch.sigmoid(gate) * (1 + gate * (1 - torch.sigmoid(gate))) * up,
                grad * F.silu(gate),
            ),
            -1,
        )


class MLP(nn.Module):
    """fc1 -> activation -> fc2 -> dropout.

    gelu / relu: fc1 Linear(h, ffn), 2 h ffn weights. swiglu: fc1 is the fused gate and up
    projection Linear(h, 2 ffn) (Megatron-LM's gated linear unit layout), silu(gate) * up
    (:class:`_SwiGLU`, Megatron-LM's fused kernel: only fc1's output is kept), then fc2
    Linear(ffn, h): 3 h ffn weights, as Llama's w1, w3 and w2.
    """

    def __init__(
        self, *, hidden: int, ffn_hidden: int, kind: str, bias: bool = True, dropout: float = 0.0
    ):
        super().__init__()
        self.kind = kind
        width = 2 * ffn_hidden if kind == "swiglu" else ffn_hidden
        self.fc1 = nn.Linear(hidden, width, bias=bias)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        if self.kind == "swiglu":
            x = _SwiGLU.apply(x)
        elif self.kind == "relu":
            x = F.relu(x)
        else:
            x = F.gelu(x)
        return self.dropout(self.fc2(x))


class _CrossEntropy(torch.autograd.Function):
    """Megatron-core's cross-entropy (``tensor_parallel.vocab_parallel_cross_entropy`` on one
    tensor-parallel rank) with its memory behaviour: the logits' fp32 copy (the logits themselves
    when they are fp32) becomes the softmax in place and is the only tensor saved; the backward
    turns it into the gradient in place. Per-token losses, (b, s) -> fp32."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float()  # a copy for bf16 logits, the same tensor for fp32 ones
        logits -= logits.max(dim=-1, keepdim=True)[0]
        predicted = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        torch.exp(logits, out=logits)
        sum_exp = logits.sum(dim=-1)
        loss = torch.log(sum_exp) - predicted
        logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(logits, targets)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, targets = ctx.saved_tensors
        grad = softmax  # in place, as Megatron
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad.new_full((*targets.shape, 1), -1.0))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (b, s, V) logits, computed in fp32 as Megatron-core does
    (:class:`_CrossEntropy`). Sharded (vocabulary-parallel DTensor) logits go through
    ``F.cross_entropy``, which torch's ``loss_parallel`` computes without gathering them."""
    if isinstance(logits, DTensor):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return _CrossEntropy.apply(logits, targets).mean()


class LMHead(nn.Module):
    """Final norm + LM head (no bias) + cross-entropy, the loss computed in fp32.

    The loss upcasts a bf16 model's logits to fp32 (Megatron-LM does the same) and keeps only
    their softmax for the backward (:func:`language_model_loss`), so the loss and its gradient
    are fp32. Tying (the LM head reusing the token embedding weight)
    is done by the owning model, which replaces ``lm_head.weight`` with the embedding's Parameter.
    """

    def __init__(self, *, hidden: int, vocab_size: int, norm: str, eps: float, bias: bool):
        super().__init__()
        self.norm = make_norm(norm, hidden, eps=eps, bias=bias)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(x))
        return language_model_loss(logits, targets)
