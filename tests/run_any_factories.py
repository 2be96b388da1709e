"""Model factories for the traced-run tests (``tests/test_run_any.py``) and the HF rows of
``scripts/bench_accuracy.py``, as a user's ``package.module:factory`` would be written.

``t5_untied``: HF T5 (``hf:t5-base`` with its ``loss_outside``) with untied embeddings and head;
``zoo_loss_inside``: a factory without ``loss_outside`` (its ``build()`` forward takes
``(ids, targets)`` and returns the loss); ``failing``: a factory that raises.
"""

from __future__ import annotations

from torch import nn

import models
from profiling.hf import hf_spec


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


def zoo_loss_inside(**overrides) -> models.ModelSpec:
    """The zoo's gpt-tiny as a user factory: ``forward(ids, targets)`` returns the loss."""
    spec = models.get("gpt-tiny", **overrides)
    spec.name = "factory-gpt-tiny"
    return spec


def failing(**overrides) -> models.ModelSpec:
    """A factory that raises (the run must fail with one line, exit 2)."""
    raise RuntimeError("cannot reach the model store")
