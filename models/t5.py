"""T5-style encoder-decoder (Raffel et al. 2020), a DAG of layers, from ``T5Config``.

Module paths, in a valid topological (and execution) order:

    encoder.embed, encoder.layers.0 ... encoder.layers.{N-1}, encoder.final_norm,
    decoder.embed, decoder.layers.0 ... decoder.layers.{M-1}, head

Every decoder block takes the encoder output (``encoder.final_norm``'s output) as a tensor
argument, ``block(x, memory)``, for its cross-attention keys and values: a dataflow tracer sees
an edge from ``encoder.final_norm`` to each decoder block. ``head`` is the decoder's final norm,
the LM head and the loss. ``forward(input_ids, decoder_input_ids, targets)`` returns the loss.

As T5 (v1.0): pre-norm RMSNorm blocks, no biases, ReLU MLP of width ffn_hidden, heads x head_dim
need not equal hidden (T5-11B: 128 heads x 128 = 16384 with hidden 1024), one token table shared
by encoder, decoder and (tied, the default) the LM head.

Simplifications, documented: (1) no relative position bias. T5 keeps a 32-bucket x heads table per
stack, computed in its first block and added to every layer's scores; leaving it out removes
2 x 32 x heads parameters (768 for t5-base) and one broadcast add per layer, and keeps every layer
a function of its hidden state (plus the encoder output). Counts are therefore T5's minus
2 x 32 x heads: t5-base 222,902,784 (Hugging Face: 222,903,552). (2) Attention scores are scaled by
1/sqrt(head_dim) (T5 folds the scale into its initialisation) and the tied LM head input is not
rescaled by hidden^-0.5; neither changes sizes or saved tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.common import (
    ATTENTIONS,
    MLP,
    MLPS,
    Attention,
    Dropout,
    LMHead,
    check_config,
)


@dataclass(kw_only=True)
class T5Config:
    vocab_size: int = 32128
    """Vocabulary size (T5 SentencePiece, padded: 32128)."""
    seq_len: int = 512
    """Default length of both the encoder input and the decoder input."""
    layers: int = 12
    """Encoder blocks."""
    decoder_layers: int | None = None
    """Decoder blocks; None = layers."""
    hidden: int = 768
    """Model width (d_model)."""
    heads: int = 12
    """Attention heads."""
    head_dim: int | None = None
    """Width of one head (d_kv); None = hidden / heads."""
    ffn_hidden: int = 3072
    """MLP width (d_ff)."""
    mlp: str = "relu"
    """MLP kind: "relu" (T5 v1.0), "gelu" or "swiglu"."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    dropout: float = 0.1
    """Dropout on embeddings, attention probabilities, residual branches, encoder output."""
    attention: str = "explicit"
    """Attention kernel: "explicit" (written out) or "sdpa"."""
    tied_embeddings: bool = True
    """The LM head reuses the shared token table (T5 v1.0; v1.1 unties it)."""

    def __post_init__(self) -> None:
        check_config(
            self,
            positive=(
                "vocab_size",
                "seq_len",
                "layers",
                "decoder_layers",
                "hidden",
                "heads",
                "head_dim",
                "ffn_hidden",
            ),
            choices={"mlp": MLPS, "attention": ATTENTIONS},
            # an explicit head_dim (d_kv) frees the width from the head count
            divisible=(("hidden", "heads"),) if self.head_dim is None else (),
        )

    @property
    def num_decoder_layers(self) -> int:
        return self.decoder_layers or self.layers


def _attention(config: T5Config, *, causal: bool, cross: bool = False) -> Attention:
    return Attention(
        hidden=config.hidden,
        heads=config.heads,
        head_dim=config.head_dim,
        bias=False,
        dropout=config.dropout,
        causal=causal,
        impl=config.attention,
        cross=cross,
    )


def _mlp(config: T5Config) -> MLP:
    return MLP(
        hidden=config.hidden,
        ffn_hidden=config.ffn_hidden,
        kind=config.mlp,
        bias=False,
        dropout=config.dropout,
    )


class Embedding(nn.Module):
    """Token lookup + dropout (positions come from attention biases in T5; omitted here)."""

    def __init__(self, config: T5Config):
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.hidden)
        nn.init.normal_(
            self.tok.weight, std=0.02
        )  # GPT-2 / BERT init; N(0, 1) inflates tied logits
        self.dropout = Dropout(config.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.tok(ids))


class EncoderBlock(nn.Module):
    """x + attn(norm1(x)) (bidirectional), then x + mlp(norm2(x))."""

    def __init__(self, config: T5Config):
        super().__init__()
        self.norm1 = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.attn = _attention(config, causal=False)
        self.norm2 = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.mlp = _mlp(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention over ``memory`` (the encoder output), MLP."""

    def __init__(self, config: T5Config):
        super().__init__()
        self.norm1 = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.self_attn = _attention(config, causal=True)
        self.norm2 = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.cross_attn = _attention(config, causal=False, cross=True)
        self.norm3 = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.mlp = _mlp(config)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x))
        x = x + self.cross_attn(self.norm2(x), memory)
        return x + self.mlp(self.norm3(x))


class FinalNorm(nn.Module):
    """The encoder's closing RMSNorm + dropout; its output is the decoder's memory."""

    def __init__(self, config: T5Config):
        super().__init__()
        self.norm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.norm(x))


class Encoder(nn.Module):
    def __init__(self, config: T5Config):
        super().__init__()
        self.embed = Embedding(config)
        self.layers = nn.ModuleList(EncoderBlock(config) for _ in range(config.layers))
        self.final_norm = FinalNorm(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)


class Decoder(nn.Module):
    def __init__(self, config: T5Config):
        super().__init__()
        self.embed = Embedding(config)
        self.layers = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_decoder_layers))

    def forward(self, ids: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, memory)
        return x


class T5(nn.Module):
    def __init__(self, config: T5Config):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.decoder.embed.tok.weight = self.encoder.embed.tok.weight  # one shared table
        self.head = LMHead(
            hidden=config.hidden,
            vocab_size=config.vocab_size,
            norm="rmsnorm",
            eps=config.norm_eps,
            bias=False,
        )
        if config.tied_embeddings:
            self.head.lm_head.weight = self.encoder.embed.tok.weight

    def forward(
        self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        memory = self.encoder(input_ids)
        return self.head(self.decoder(decoder_input_ids, memory), targets)


def layer_paths(config: T5Config) -> list[str]:
    return [
        "encoder.embed",
        *(f"encoder.layers.{i}" for i in range(config.layers)),
        "encoder.final_norm",
        "decoder.embed",
        *(f"decoder.layers.{i}" for i in range(config.num_decoder_layers)),
        "head",
    ]


def example_inputs(config: T5Config, batch: int, seq: int | None = None) -> tuple:
    """(input_ids, decoder_input_ids, targets): int64 (batch, seq) each."""
    seq = seq or config.seq_len
    return tuple(torch.randint(0, config.vocab_size, (batch, seq)) for _ in range(3))
