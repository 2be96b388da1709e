"""BERT-style encoder with a masked-language-model head (Devlin et al. 2019), from ``BERTConfig``.

Module paths: ``embed`` (token + position + token-type tables, LayerNorm, dropout),
``layers.0`` ... ``layers.{N-1}`` (post-norm blocks), ``head`` (MLM transform: dense, GeLU,
LayerNorm; decoder to the vocabulary, its weight tied to the token table by default; loss).
``forward(ids, labels, token_type_ids=None)`` returns the mean cross-entropy over positions
whose label is not -100.

Simplifications: no padding mask (every sequence is full length, the planning worst case), no
pooler and no next-sentence head (BertForMaskedLM has neither). bert-base comes to 109,514,298
parameters, as Hugging Face's BertForMaskedLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.common import (
    ATTENTIONS,
    MLP,
    Attention,
    Dropout,
    check_config,
)


@dataclass(kw_only=True)
class BERTConfig:
    vocab_size: int = 30522
    """Vocabulary size (BERT WordPiece: 30522)."""
    seq_len: int = 512
    """Default sequence length and size of the learned position table."""
    type_vocab_size: int = 2
    """Token-type (segment) table size."""
    layers: int = 12
    """Number of encoder blocks."""
    hidden: int = 768
    """Model width h."""
    heads: int = 12
    """Attention heads."""
    ffn_hidden: int | None = None
    """MLP width; None = 4 h."""
    norm_eps: float = 1e-12
    """LayerNorm epsilon (BERT: 1e-12)."""
    dropout: float = 0.1
    """Dropout on embeddings, attention probabilities and residual branches."""
    attention: str = "explicit"
    """Attention kernel: "explicit" (written out, bidirectional) or "sdpa"."""
    tied_embeddings: bool = True
    """The MLM decoder reuses the token embedding weight (BERT does)."""

    def __post_init__(self) -> None:
        check_config(
            self,
            positive=(
                "vocab_size",
                "seq_len",
                "type_vocab_size",
                "layers",
                "hidden",
                "heads",
                "ffn_hidden",
            ),
            choices={"attention": ATTENTIONS},
            divisible=(("hidden", "heads"),),
        )


class Embedding(nn.Module):
    """Token + position + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, config: BERTConfig):
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.hidden)
        nn.init.normal_(
            self.tok.weight, std=0.02
        )  # GPT-2 / BERT init; N(0, 1) inflates tied logits
        self.pos = nn.Embedding(config.seq_len, config.hidden)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden)
        self.norm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.dropout = Dropout(config.dropout)

    def forward(
        self, ids: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(ids)
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        return self.dropout(self.norm(x + self.token_type(token_type_ids)))


class Block(nn.Module):
    """Post-norm encoder block: norm1(x + attn(x)), then norm2(x + mlp(x))."""

    def __init__(self, config: BERTConfig):
        super().__init__()
        self.attn = Attention(
            hidden=config.hidden,
            heads=config.heads,
            dropout=config.dropout,
            causal=False,
            impl=config.attention,
        )
        self.norm1 = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.mlp = MLP(
            hidden=config.hidden,
            ffn_hidden=config.ffn_hidden or 4 * config.hidden,
            kind="gelu",
            dropout=config.dropout,
        )
        self.norm2 = nn.LayerNorm(config.hidden, eps=config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.mlp(x))


class MLMHead(nn.Module):
    """dense -> GeLU -> LayerNorm -> decoder (+ bias) -> fp32 cross-entropy (ignore_index -100)."""

    def __init__(self, config: BERTConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden, config.hidden)
        self.norm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.decoder = nn.Linear(config.hidden, config.vocab_size)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.decoder(self.norm(F.gelu(self.dense(x))))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


class BERT(nn.Module):
    def __init__(self, config: BERTConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.head = MLMHead(config)
        if config.tied_embeddings:
            self.head.decoder.weight = self.embed.tok.weight

    def forward(
        self,
        ids: torch.Tensor,
        labels: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(ids, token_type_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x, labels)


def layer_paths(config: BERTConfig) -> list[str]:
    return ["embed", *(f"layers.{i}" for i in range(config.layers)), "head"]


def example_inputs(config: BERTConfig, batch: int, seq: int | None = None) -> tuple:
    """(ids, labels): int64 (batch, seq); every position labelled (the memory worst case)."""
    seq = seq or config.seq_len
    if seq > config.seq_len:
        raise ValueError(
            f"seq {seq} > seq_len {config.seq_len} (the learned position table); "
            f"override seq_len={seq}"
        )
    return (
        torch.randint(0, config.vocab_size, (batch, seq)),
        torch.randint(0, config.vocab_size, (batch, seq)),
    )
