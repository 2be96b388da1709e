"""The layer graph's optional field families and their per-layer checks: the batch-independent
parts (``unbatched_*``) and the vocabulary parts (``vocab_*``, ``fixed_*``). ``solver.graph``
loads them; each check takes a ``solver.graph.Layer`` and raises one :class:`InputError` line naming the field and the fix."""

from __future__ import annotations

from typing import Any

from solver.errors import InputError, quote

INTEGER_FIELDS = (
    "params",
    "tp_params",
    "activation_bytes",
    "tp_activation_bytes",
    "output_bytes",
    "tp_comm_bytes",
    "transient_bytes",
    "largest_param",
    "largest_tp_param",
    "grad_partner_params",
    "expert_params",
    "expert_activation_bytes",
    "ep_comm_bytes",
    "attention_kv_bytes",
    "attention_score_bytes",
    "sp_gathered_bytes",
    "vocab_rows",
    "vocab_params",
    "vocab_activation_bytes",
)
"""Layer fields that are whole numbers (parameter counts and bytes)."""

OPTIONAL_INTEGER_FIELDS = (
    "weight_grad_transient_bytes",
    "attention_backward_transient_bytes",
    "vocab_transient_bytes",
    "fixed_transient_bytes",
    "vocab_weight_grad_transient_bytes",
    "fixed_weight_grad_transient_bytes",
    "weight_op_grad_bytes",
    "weight_op_output_grad_bytes",
    "param_tensors",
    "model_input_bytes",
    "input_step_transient_bytes",
)
"""Layer fields that are whole numbers or None (not measured)."""

UNBATCHED_FIELDS = {
    "unbatched_activation_bytes": "activation_bytes",
    "unbatched_transient_bytes": "transient_bytes",
    "unbatched_weight_grad_transient_bytes": "weight_grad_transient_bytes",
    "unbatched_attention_backward_transient_bytes": "attention_backward_transient_bytes",
}
"""Optional signed field -> its figure X: F = 2 X(1) - X(2), the part that does not grow with
the batch; b samples hold b (X - F) + F (``solver.costs.unbatched``). Absent: 0."""
VOCAB_TRANSIENT_PAIRS = (
    ("vocab_transient_bytes", "fixed_transient_bytes"),
    ("vocab_weight_grad_transient_bytes", "fixed_weight_grad_transient_bytes"),
)
"""The transients' vocabulary and fixed parts, each pair given together or not at all."""

VOCAB_PARALLEL_MIN_ROWS = 16384
"""A vocabulary of at least this many rows is split over TP in a profile's ``tp_params`` and
``tp_activation_bytes``: what the torch runtime shards (``profiling.executors.parallelize``);
Megatron splits every vocabulary (``solver.costs.vocab``)."""


def check_unbatched(layer: Any, where: str) -> None:
    """A batch-independent part F is at most its figure X (absent: the transient)."""
    for key, figure in UNBATCHED_FIELDS.items():
        fixed, total = getattr(layer, key), getattr(layer, figure)
        total = layer.transient_bytes if total is None else total
        if fixed is not None and fixed > total:
            raise InputError(
                f"{where}.{key}: {fixed} exceeds {figure} ({total}) of layer {quote(layer.name)};"
                " it is the part of it that does not grow with the batch, at most the whole"
            )


def check_vocab(layer: Any, where: str) -> None:
    """The vocabulary fields describe whole rows of ``vocab_rows``, their transients in pairs,
    and a vocabulary of 16384+ rows is in the profile's TP split."""
    rows, name = layer.vocab_rows, quote(layer.name)
    if rows and layer.vocab_params % rows:
        raise InputError(
            f"{where}.vocab_params: {layer.vocab_params} is not a multiple of vocab_rows ({rows}) "
            f"of layer {name}; it counts whole rows of the vocabulary tables"
        )
    if rows >= VOCAB_PARALLEL_MIN_ROWS and layer.vocab_params > layer.tp_params:
        raise InputError(
            f"{where}.vocab_params: {layer.vocab_params} exceeds tp_params ({layer.tp_params}) of "
            f"layer {name}; a vocabulary of 16384+ rows is split over TP in the profile, so "
            "tp_params count its tables"
        )
    given = [
        key for pair in VOCAB_TRANSIENT_PAIRS for key in pair if getattr(layer, key) is not None
    ]
    if not rows and (layer.vocab_params or layer.vocab_activation_bytes or given):
        raise InputError(
            f"{where}.vocab_rows: 0 for layer {name}, which has vocabulary parts; give the "
            "vocabulary's rows or remove the vocab_* and fixed_* fields"
        )
    for pair in VOCAB_TRANSIENT_PAIRS:
        if (getattr(layer, pair[0]) is None) != (getattr(layer, pair[1]) is None):
            raise InputError(
                f"{where}: layer {name} has only one of {pair[0]}/{pair[1]}; give both parts of "
                "the transient or neither"
            )


MAX_POINT_BYTES = 2**48
"""Largest |bytes| of a ``backward_grad_moments`` point (``solver.graph.MAX_COUNT``)."""


def check_grad_moments(layer: Any, where: str) -> None:
    """Each ``backward_grad_moments`` point: at most the layer's params (tp_params of them at
    most its tp_params and the point's params) and bytes at most its transient."""
    for k, (params, tp_params, nbytes) in enumerate(layer.backward_grad_moments or ()):
        if min(params, tp_params) < 0 or abs(nbytes) > MAX_POINT_BYTES:
            raise InputError(
                f"{where}.backward_grad_moments[{k}]: [{params}, {tp_params}, {nbytes}] of layer "
                f"{quote(layer.name)}: parameter counts must be >= 0 and bytes at most 2^48"
            )
        for value, limit, what in (
            (params, layer.params, "params"),
            (tp_params, min(params, layer.tp_params), "tp_params (and the point's params)"),
            (nbytes, layer.transient_bytes, "transient_bytes"),
        ):
            if value > limit:
                raise InputError(
                    f"{where}.backward_grad_moments[{k}]: {value} exceeds the layer's {what} "
                    f"({limit}) of layer {quote(layer.name)}; a moment of its backward holds "
                    "some of its gradients and at most its peak"
                )
    steps = list(layer.weight_step_moments or ())
    if layer.weight_step_end is not None:
        steps.append(layer.weight_step_end)
    # a layer's W step makes the dweight of every parameter its ops use, some counted in
    # another layer's params: a tied weight (an LM head's W step makes the tied embedding's)
    # or a parameter the root's glue reads (a position table added beside the token embedding)
    for params, tp_params, nbytes in steps:
        if not (0 <= tp_params <= params <= MAX_POINT_BYTES) or abs(nbytes) > MAX_POINT_BYTES:
            raise InputError(
                f"{where}.weight_step_moments: [{params}, {tp_params}, {nbytes}] of layer "
                f"{quote(layer.name)}: need 0 <= tp_params <= params <= 2^48 and |bytes| at "
                "most 2^48"
            )


def check_param_tensors(layer: Any, where: str) -> None:
    """``param_tensors``: each tensor holds at least one parameter, and a layer with parameters
    has at least one tensor; ``grad_partner_params``: gradients of its parameters, at most
    ``params``."""
    if layer.grad_partner_params > layer.params:
        raise InputError(
            f"{where}.grad_partner_params: {layer.grad_partner_params} exceeds the params "
            f"({layer.params}) of layer {quote(layer.name)}; it counts gradients of its "
            "parameters"
        )
    count = layer.param_tensors
    if count is None:
        return
    if count > layer.params or (layer.params > 0 and count == 0):
        raise InputError(
            f"{where}.param_tensors: {count} tensors for {layer.params} params of layer "
            f"{quote(layer.name)}; it counts the tensors the params are in: at least 1 where "
            "params > 0, at most params"
        )
