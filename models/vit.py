"""Vision Transformer (Dosovitskiy et al. 2021), from ``ViTConfig``.

Module paths: ``embed`` (patch conv, class token, learned positions, dropout), ``layers.0`` ...
``layers.{N-1}`` (pre-norm blocks: LayerNorm, bidirectional attention, GeLU MLP, biases),
``head`` (final LayerNorm over all tokens, the class token's features, linear classifier,
cross-entropy). ``forward(images, labels)`` returns the loss. The sequence is the
(image_size / patch_size)^2 patches plus the class token: 197 for ViT-B/16 and ViT-H/14 at 224.

Parameters: embed 3 p^2 h + h (conv) + h (class token) + (n + 1) h (positions); block
12 h^2 + 13 h when mlp_hidden = 4 h; head 2 h + h C + C. vit-b16 comes to 86,567,656 (timm).
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
class ViTConfig:
    image_size: int = 224
    """Side of the square input image, pixels."""
    patch_size: int = 16
    """Side of a square patch; image_size must be a multiple."""
    channels: int = 3
    """Input image channels."""
    layers: int = 12
    """Transformer blocks."""
    hidden: int = 768
    """Model width h."""
    heads: int = 12
    """Attention heads."""
    mlp_hidden: int | None = None
    """MLP width; None = 4 h."""
    num_classes: int = 1000
    """Classifier outputs."""
    norm_eps: float = 1e-6
    """LayerNorm epsilon."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches (ViT: 0 at scale)."""
    attention: str = "explicit"
    """Attention kernel: "explicit" (written out) or "sdpa"."""

    def __post_init__(self) -> None:
        check_config(
            self,
            positive=(
                "image_size",
                "patch_size",
                "channels",
                "layers",
                "hidden",
                "heads",
                "mlp_hidden",
                "num_classes",
            ),
            choices={"attention": ATTENTIONS},
            divisible=(("image_size", "patch_size"), ("hidden", "heads")),
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class Embedding(nn.Module):
    """Patchify with a stride-p conv, prepend the class token, add learned positions."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.patch = nn.Conv2d(
            config.channels, config.hidden, config.patch_size, stride=config.patch_size
        )
        self.cls = nn.Parameter(torch.zeros(1, 1, config.hidden))
        self.pos = nn.Parameter(torch.empty(1, config.num_patches + 1, config.hidden))
        nn.init.normal_(self.pos, std=0.02)
        self.dropout = Dropout(config.dropout)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)  # (b, n, h)
        x = torch.cat((self.cls.expand(x.size(0), -1, -1), x), dim=1)
        return self.dropout(x + self.pos)


class Block(nn.Module):
    """Pre-norm encoder block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.attn = Attention(
            hidden=config.hidden,
            heads=config.heads,
            dropout=config.dropout,
            causal=False,
            impl=config.attention,
        )
        self.norm2 = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.mlp = MLP(
            hidden=config.hidden,
            ffn_hidden=config.mlp_hidden or 4 * config.hidden,
            kind="gelu",
            dropout=config.dropout,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """LayerNorm, class-token features, linear classifier, fp32 cross-entropy."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.fc = nn.Linear(config.hidden, config.num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.fc(self.norm(x)[:, 0])
        return F.cross_entropy(logits.float(), labels)


class ViT(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.head = Head(config)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)
        for layer in self.layers:
            x = layer(x)
        return self.head(x, labels)


def layer_paths(config: ViTConfig) -> list[str]:
    return ["embed", *(f"layers.{i}" for i in range(config.layers)), "head"]


def example_inputs(config: ViTConfig, batch: int, seq: int | None = None) -> tuple:
    """(images, labels): float (batch, channels, image_size, image_size), int64 (batch,)."""
    if seq is not None:
        raise ValueError(
            f"an image model takes no sequence length (got seq={seq}); "
            f"override image_size (now {config.image_size}) or patch_size instead"
        )
    size = config.image_size
    return (
        torch.randn(batch, config.channels, size, size),
        torch.randint(0, config.num_classes, (batch,)),
    )
