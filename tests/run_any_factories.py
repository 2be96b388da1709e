"""Model factories for the traced-run tests (``tests/test_run_any.py``) and the HF rows of
``scripts/bench_accuracy.py``, as a user's ``package.module:factory`` would be written.

``t5_untied``: HF T5 (``hf:t5-base`` with its ``loss_outside``) with untied embeddings and head;
``loss_inside``: a factory without ``loss_outside`` (its ``build()`` forward takes
``(x, target)`` and returns the loss); ``failing``: a factory that raises.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import models
from profiling.hf.models import hf_spec

TINY_HF_MODELS = {
    "gpt2": (
        "hf:gpt2",
        {
            "n_layer": 4,
            "n_embd": 64,
            "n_head": 4,
            "vocab_size": 512,
            "tie_word_embeddings": False,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    ),
    "llama-gqa": (
        "hf:llama-2-7b",
        {
            "num_hidden_layers": 4,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "tie_word_embeddings": False,
        },
    ),
    "t5": (
        "tests.run_any_factories:t5_untied",
        {
            "num_layers": 2,
            "num_decoder_layers": 2,
            "d_model": 64,
            "d_ff": 128,
            "num_heads": 4,
            "d_kv": 16,
            "vocab_size": 512,
            "dropout_rate": 0.0,
        },
    ),
}
"""Tiny HF configs, dropout 0, by key: (model name, --set overrides). GPT-2 and Llama (GQA)
through ``hf:`` (the loss outside the model, in the schedule's ``loss_fn``), T5 through
:func:`t5_untied` (transformers 5 ties T5's encoder and decoder embeddings and head, which a split
over stages cannot share)."""


def t5_untied(**overrides) -> models.ModelSpec:
    """HF T5 whose decoder embedding and LM head get their own copies of the shared embedding
    (transformers 5 always ties all three; a user splitting T5 over stages unties them so)."""
    spec = hf_spec("t5-base", overrides)  # its loss_outside: models.LossOutside
    build = spec.build

    def untied() -> nn.Module:
        model = build()
        for module in (model.decoder.embed_tokens, model.lm_head):
            module.weight = nn.Parameter(model.shared.weight.detach().clone())
        return model

    spec.build = untied
    spec.name = "t5-untied"
    return spec


class RegressionChain(nn.Module):
    """Four tanh Linear layers whose forward returns its own loss (MSE against ``target``)."""

    def __init__(self, width: int = 16, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, target)


def loss_inside(width: int = 16, depth: int = 4) -> models.ModelSpec:
    """A factory without ``loss_outside``: ``build()(x, target)`` returns the loss."""
    return models.ModelSpec(
        name="regression-chain",
        config=None,
        build=lambda: RegressionChain(width, depth),
        example_inputs=lambda batch, seq: (torch.randn(batch, width), torch.randn(batch, width)),
        layers=[f"layers.{i}" for i in range(depth)],
        seq_len=None,
    )


def failing(**overrides) -> models.ModelSpec:
    """A factory that raises (the run must fail with one line, exit 2)."""
    raise RuntimeError("cannot reach the model store")
