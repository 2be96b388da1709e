"""The loss of an hf: model computed outside it, as a ``torch.distributed.pipelining`` user does.

``pipeline(module, mb_args=...)`` traces a module whose forward returns a tensor, and the
schedule applies ``loss_fn(output, target)`` on the last stage. ``loss_outside_of`` gives the
pieces for that split of a ``hf_spec`` model (``models.LossOutside``):

- ``module``: the built model's very submodules and parameters (same names, e.g.
  ``transformer.h.3``, so a plan's layer names cut it) behind a forward that returns the logits;
- ``model_inputs(x)`` / ``target(x)``: the spec's example inputs ``x = (inputs..., labels)``
  split into that forward's arguments and the labels; an encoder-decoder gets
  ``decoder_input_ids`` from the model's own ``prepare_decoder_input_ids_from_labels`` (T5:
  ``_shift_right(labels)``), as its forward does when given only labels;
- ``loss_fn(output, target)``: the loss the training forward computes from those logits: the
  model's ``loss_function`` when its forward calls it (``ForCausalLMLoss(logits, labels,
  vocab_size)``, which shifts the labels and upcasts the logits to fp32), else the
  ``CrossEntropyLoss`` over flattened logits it applies inline (T5, BART, BERT's masked LM).

So ``loss_fn(module(*model_inputs(x)), target(x))`` equals ``build()(*x)`` with the same
parameters and random state (``tests/test_hf.py``). A forward whose loss is neither (a
regression head, a custom loss) gives None: no loss-outside split.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import torch
from torch import nn

from models.registry import LossOutside


def loss_outside_of(
    model_class: type[nn.Module], kind: str, output_inputs: tuple[str, ...], config
) -> Callable[[nn.Module], LossOutside] | None:
    """A ``ModelSpec.loss_outside`` for a ``model_class`` trained as ``kind``
    (``profiling.hf.models``'s
    tasks: text, seq2seq, image, classification), or None when its loss is not one of ours."""
    names = inspect.unwrap(model_class.forward).__code__.co_names
    own_function = "loss_function" in names
    if not own_function and "CrossEntropyLoss" not in names:
        return None
    if not own_function and kind == "classification" and config.num_labels == 1:
        return None  # inline regression (MSELoss), not cross-entropy
    if kind == "seq2seq" and not hasattr(model_class, "prepare_decoder_input_ids_from_labels"):
        return None

    def logits_forward(self, *inputs):
        """forward(*model_inputs) -> logits."""
        arguments = dict(zip(output_inputs, inputs, strict=True))
        return model_class.forward(self, **arguments).logits

    Logits = type(model_class.__name__, (model_class,), {"forward": logits_forward})

    def split(model: nn.Module) -> LossOutside:
        def model_inputs(example: tuple) -> tuple:
            if kind == "seq2seq":
                labels = example[-1]
                return example[0], model.prepare_decoder_input_ids_from_labels(labels=labels)
            return tuple(example[:-1])  # a vision-language model's input_ids, pixel_values

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            if not own_function:
                return nn.functional.cross_entropy(
                    output.view(-1, output.size(-1)), target.view(-1)
                )
            if kind in ("image", "classification"):
                return model.loss_function(target, output, model.config)
            return model.loss_function(
                logits=output, labels=target, vocab_size=model.config.get_text_config().vocab_size
            )

        return LossOutside(
            module=shared_view(model, Logits),
            model_inputs=model_inputs,
            target=lambda example: example[-1],
            loss_fn=loss_fn,
        )

    return split


def shared_view(model: nn.Module, cls: type[nn.Module]) -> nn.Module:
    """A second module object of class ``cls`` holding ``model``'s very submodules, parameters
    and buffers (same objects, same names) in its own containers, so that adding or removing a
    submodule or hook on one leaves the other as it was."""
    view = copy.copy(model)
    for key, value in model.__dict__.items():
        if isinstance(value, dict | set | list):
            view.__dict__[key] = copy.copy(value)
    view.__class__ = cls
    return view
