"""Model factories for the traced-run tests (``tests/test_run_any.py``), as a user's
``package.module:factory`` would be written.

``gpt2``, ``llama`` and ``t5`` return ``profiling.hf.hf_spec`` specs with a ``loss_outside``: the
HF model whose forward returns the logits, and the loss the model computes itself
(``ForCausalLMLoss``: fp32 upcast, shifted labels; T5: cross-entropy on the decoder's logits). When
``hf_spec`` gives one itself (models.registry.LossOutside), it is used unchanged; until then this
shim stands in for it with the same fields. ``zoo_loss_inside`` is a factory without one: its
``build()`` forward takes ``(ids, targets)`` and returns the loss.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

import models
from profiling.hf import hf_spec


@dataclass(kw_only=True)
class LossOutside:
    """The fields of models.registry.LossOutside (helper C's interface)."""

    module: nn.Module
    model_inputs: Callable[[tuple], tuple]
    target: Callable[[tuple], torch.Tensor]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _logits_module(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """The model itself (same submodules and parameters) with ``forward(*inputs) -> logits``."""
    hf_class = type(model).__mro__[1]  # hf_spec's TrainingLoss subclasses the HF class

    def forward(self, *inputs):
        arguments = dict(zip(names, inputs, strict=True))
        return hf_class.forward(self, **arguments, use_cache=False).logits

    module = copy.copy(model)  # shares _modules and _parameters
    module.__class__ = type(hf_class.__name__, (hf_class,), {"forward": forward})
    return module


def _causal_loss_outside(model: nn.Module) -> LossOutside:
    vocab = model.config.vocab_size
    return LossOutside(
        module=_logits_module(model, ("input_ids",)),
        model_inputs=lambda example: (example[0],),
        target=lambda example: example[1],
        loss_fn=lambda logits, labels: model.loss_function(
            logits=logits, labels=labels, vocab_size=vocab
        ),
    )


def _seq2seq_loss_outside(model: nn.Module) -> LossOutside:
    return LossOutside(
        module=_logits_module(model, ("input_ids", "decoder_input_ids")),
        model_inputs=lambda example: (example[0], model._shift_right(example[1])),
        target=lambda example: example[1],
        loss_fn=lambda logits, labels: F.cross_entropy(
            logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100
        ),
    )


def _with_loss_outside(spec: models.ModelSpec, make) -> models.ModelSpec:
    if getattr(spec, "loss_outside", None) is None:
        spec.loss_outside = make
    return spec


def gpt2(**overrides) -> models.ModelSpec:
    """HF GPT-2 (``hf:gpt2`` with ``overrides``) with its loss outside the model."""
    return _with_loss_outside(hf_spec("gpt2", overrides), _causal_loss_outside)


def llama(**overrides) -> models.ModelSpec:
    """HF Llama (``hf:llama-2-7b`` with ``overrides``, e.g. GQA sizes)."""
    return _with_loss_outside(hf_spec("llama-2-7b", overrides), _causal_loss_outside)


def t5(**overrides) -> models.ModelSpec:
    """HF T5 (``hf:t5-base`` with ``overrides``)."""
    return _with_loss_outside(hf_spec("t5-base", overrides), _seq2seq_loss_outside)


def t5_untied(**overrides) -> models.ModelSpec:
    """HF T5 whose decoder embedding and LM head get their own copies of the shared embedding
    (transformers 5 always ties all three; a user splitting T5 over stages unties them so)."""
    spec = t5(**overrides)
    build = spec.build

    def untied() -> nn.Module:
        model = build()
        for module in (model.decoder.embed_tokens, model.lm_head):
            module.weight = nn.Parameter(model.shared.weight.detach().clone())
        return model

    spec.build = untied
    spec.name = "t5-untied"
    return spec


def zoo_loss_inside(**overrides) -> models.ModelSpec:
    """The zoo's gpt-tiny as a user factory: ``forward(ids, targets)`` returns the loss."""
    spec = models.get("gpt-tiny", **overrides)
    spec.name = "factory-gpt-tiny"
    return spec


def failing(**overrides) -> models.ModelSpec:
    """A factory that raises (the run must fail with one line, exit 2)."""
    raise RuntimeError("cannot reach the model store")
