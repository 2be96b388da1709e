"""GPT / Llama-style decoder-only transformer, buildable at any size from ``GPTConfig``.

Module paths (the default layer granularity): ``embed``, ``layers.0`` ... ``layers.{N-1}``,
``head`` (final norm + LM head + loss). ``forward(ids, targets)`` returns the scalar loss.

With the GPT-2/3 options (layernorm, gelu, biases, learned positions, ffn_hidden = 4h) the
parameter counts are those of ``scripts/make_examples.py``:

    embed   V h + s h            token table + learned position table
    block   12 h^2 + 13 h        qkv 3h^2 + 3h, proj h^2 + h, fc1 4h^2 + 4h, fc2 4h^2 + h, 2 x LN 2h
    head    h V + 2 h            final LayerNorm + untied LM head (2 h when tied)

Llama-2 (rmsnorm, swiglu, no biases, rotary, GQA): block 2 h^2 + 2 h kv_heads d + 3 h ffn + 2 h,
embed V h, head h V + h: 6,738,415,616 parameters for 7B and 68,976,648,192 for 70B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.common import (
    ATTENTIONS,
    MLP,
    MLPS,
    NORMS,
    Attention,
    Dropout,
    LMHead,
    check_config,
    check_positive,
    make_norm,
)
from models.moe import MoE


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 50257
    """Vocabulary size V (GPT-2/3 BPE: 50257; Llama-2: 32000)."""
    seq_len: int = 2048
    """Default sequence length; with learned positions also the size of the position table."""
    layers: int = 12
    """Number of transformer blocks N."""
    hidden: int = 768
    """Model width h."""
    heads: int = 12
    """Attention (query) heads a; head_dim = hidden / heads."""
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None = heads (multi-head attention)."""
    ffn_hidden: int | None = None
    """MLP width; None = 4 h."""
    norm: str = "layernorm"
    """Norm kind: "layernorm" (GPT) or "rmsnorm" (Llama)."""
    norm_eps: float = 1e-5
    """Epsilon of every norm."""
    mlp: str = "gelu"
    """MLP kind: "gelu" (GPT: fc1, GeLU, fc2), "swiglu" (Llama: silu(gate) * up) or "relu"."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms (GPT: yes; Llama: no)."""
    qkv_bias: bool | None = None
    """Biases on the fused q/k/v projection alone (Qwen2; Megatron's ``add_qkv_bias``); None:
    ``bias``."""
    positions: str = "learned"
    """Positions: "learned" (GPT: a seq_len x h table in the embedding) or "rotary" (Llama)."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    dropout: float = 0.1
    """Dropout on the embedding, attention probabilities and both residual branches."""
    attention: str = "explicit"
    """Attention kernel: "explicit" (q k^T, mask, softmax, dropout, @ v; Korthikanti's saved
    tensors) or "sdpa" (F.scaled_dot_product_attention)."""
    tied_embeddings: bool = False
    """The LM head reuses the token embedding weight (one Parameter; GPT-2 does this)."""
    num_experts: int = 0
    """Routed experts per MoE block (Mixtral 8, DeepSeek-MoE 64); 0: every block has the dense
    MLP. The experts are MLPs of kind ``mlp`` and width ``expert_ffn_width``."""
    top_k: int = 2
    """Experts each token is routed to (Mixtral 2, DeepSeek-MoE 6)."""
    expert_ffn_hidden: int | None = None
    """Width of one routed (and shared) expert; None = ``ffn_width``."""
    shared_experts: int = 0
    """Always-active shared experts per MoE block (DeepSeek-MoE 2), each ``expert_ffn_width``
    wide, next to the routed ones."""
    dense_layers: int = 0
    """The first ``dense_layers`` blocks keep the dense MLP of width ``ffn_width`` (DeepSeek-MoE
    1); the rest are MoE blocks when ``num_experts`` > 0."""
    capacity_factor: float = 1.0
    """Each expert takes at most ceil(capacity_factor * tokens * top_k / num_experts) tokens of
    a micro-batch (GShard/Switch capacity; Megatron's ``--moe-expert-capacity-factor`` with
    ``--moe-pad-expert-input-to-capacity``): tokens over it are dropped, and the expert inputs
    are padded to it, so the shapes (and the memory) do not depend on the routing."""
    router_pre_softmax: bool = False
    """Routing weights (``models.moe.route``): False (Megatron's default; Mixtral) takes the
    top-k logits and a softmax over those k (weights sum to 1); True (Megatron's
    ``--moe-router-pre-softmax``; DeepSeek-MoE) a softmax over all experts, then the top k,
    not renormalised."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_config(
            self,
            positive=(
                "vocab_size",
                "seq_len",
                "layers",
                "hidden",
                "heads",
                "kv_heads",
                "ffn_hidden",
            ),
            choices={
                "norm": NORMS,
                "mlp": MLPS,
                "positions": ("learned", "rotary"),
                "attention": ATTENTIONS,
            },
        )
        if self.num_experts:
            check_positive(name, num_experts=self.num_experts, top_k=self.top_k)
            check_positive(name, expert_ffn_hidden=self.expert_ffn_hidden)
            if self.top_k > self.num_experts:
                raise ValueError(f"{name}: top_k ({self.top_k}) > num_experts ({self.num_experts})")
            if not self.capacity_factor > 0:
                raise ValueError(f"{name}.capacity_factor = {self.capacity_factor!r}; expected > 0")
        if not 0 <= self.num_experts or not 0 <= self.shared_experts or not 0 <= self.dense_layers:
            raise ValueError(
                f"{name}: num_experts ({self.num_experts}), shared_experts "
                f"({self.shared_experts}) and dense_layers ({self.dense_layers}) must be >= 0"
            )
        if self.hidden % self.heads:
            raise ValueError(f"{name}: hidden ({self.hidden}) % heads ({self.heads}) != 0")
        if self.heads % self.num_kv_heads:
            raise ValueError(f"{name}: heads ({self.heads}) % kv_heads ({self.kv_heads}) != 0")
        if self.positions == "rotary" and (self.hidden // self.heads) % 2:
            raise ValueError(
                f"{name}: rotary needs an even head_dim, got {self.hidden // self.heads}"
            )

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_width(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def expert_ffn_width(self) -> int:
        return self.expert_ffn_hidden or self.ffn_width

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has the mixture-of-experts MLP."""
        return self.num_experts > 0 and index >= self.dense_layers


class Embedding(nn.Module):
    """Token embedding (+ learned positions) + dropout: ids (b, s) -> hidden states (b, s, h)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.hidden)
        nn.init.normal_(
            self.tok.weight, std=0.02
        )  # GPT-2 / BERT init; N(0, 1) inflates tied logits
        self.pos = (
            nn.Embedding(config.seq_len, config.hidden) if config.positions == "learned" else None
        )
        self.dropout = Dropout(config.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        if self.pos is not None:
            x = x + self.pos(torch.arange(ids.size(1), device=ids.device))
        return self.dropout(x)


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm1(x)), then x + mlp(norm2(x)). Block ``index`` of a
    MoE config (``config.is_moe_block(index)``) has ``models.moe.MoE`` as its ``mlp``."""

    def __init__(self, config: GPTConfig, index: int = 0):
        super().__init__()
        norm = dict(eps=config.norm_eps, bias=config.bias)
        self.norm1 = make_norm(config.norm, config.hidden, **norm)
        self.attn = Attention(
            hidden=config.hidden,
            heads=config.heads,
            kv_heads=config.num_kv_heads,
            bias=config.bias,
            qkv_bias=config.qkv_bias,
            dropout=config.dropout,
            causal=True,
            rotary=config.positions == "rotary",
            rope_theta=config.rope_theta,
            impl=config.attention,
        )
        self.norm2 = make_norm(config.norm, config.hidden, **norm)
        if config.is_moe_block(index):
            self.mlp = MoE(config)
        else:
            self.mlp = MLP(
                hidden=config.hidden,
                ffn_hidden=config.ffn_width,
                kind=config.mlp,
                bias=config.bias,
                dropout=config.dropout,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """embed -> layers -> head; ``forward(ids, targets)`` -> mean cross-entropy (fp32 scalar)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.layers))
        self.head = LMHead(
            hidden=config.hidden,
            vocab_size=config.vocab_size,
            norm=config.norm,
            eps=config.norm_eps,
            bias=config.bias,
        )
        if config.tied_embeddings:
            self.head.lm_head.weight = self.embed.tok.weight

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x, targets)


def layer_paths(config: GPTConfig) -> list[str]:
    return ["embed", *(f"layers.{i}" for i in range(config.layers)), "head"]


def example_inputs(config: GPTConfig, batch: int, seq: int | None = None) -> tuple:
    """(ids, targets): int64 (batch, seq) token ids on the current default device."""
    seq = seq or config.seq_len
    if config.positions == "learned" and seq > config.seq_len:
        raise ValueError(
            f"seq {seq} > seq_len {config.seq_len} (the learned position table); "
            f"override seq_len={seq}"
        )
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
