"""The one place the profiler reaches into ``transformers`` internals (checked on 5.24.0).

Under ``FakeTensorMode`` transformers takes every fake tensor for a traced graph
(``transformers.utils.import_utils.is_tracing``) and skips the data-dependent shortcuts of its
mask code. One of them changes what a training step holds:
``masking_utils.find_packed_sequence_indices`` returns None on a real run when each row of
``position_ids`` is one sequence (the model's own ``arange`` positions), so the causal mask is
skipped and SDPA runs with ``is_causal=True``; on fake tensors it returns the packed-sequence
ids, the mask is materialised (``b x 1 x s x s``), SDPA gets it as ``attn_mask`` and, on a
grouped-query model (Llama), ``repeat_kv`` copies K and V to every head because
``use_gqa_in_sdpa`` refuses a mask. Measured on a tiny Llama (bf16, batch 2, seq 16): 5,120
bytes per block more under fake tensors than in the real run.

:func:`real_run_masks` makes the fake run take the real run's answer; the profiler enters it for
fake runs only. The ``hf:`` example inputs never pass ``position_ids`` (the model makes its own
``arange``), so "no packed sequences" is what the real run finds; a model fed packed
``position_ids`` of its own must be profiled with real tensors (``--device cpu``). A transformers
release that moves the function only loses the fix (the fake profile then keeps the mask, as
before); ``tests/test_profile_hf.py`` compares fake and real profiles of HF models and fails then.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

CHECKED_ON = "5.24.0"
"""The transformers version the patched function was checked against."""


@contextlib.contextmanager
def real_run_masks() -> Iterator[None]:
    """Within it (a fake run), ``find_packed_sequence_indices`` answers what a real run answers for
    the model's own positions: None, one sequence per row. Nothing happens when transformers was
    not imported or has no such function. transformers' value checks
    (``torch_compilable_check``, e.g. a vision-language model's image tokens against its image
    features) are off (``TRANSFORMERS_DISABLE_TORCH_CHECK=1``, its documented switch): fake
    tensors have no values to check, and the profile's inputs pass them in a real run."""
    with _env("TRANSFORMERS_DISABLE_TORCH_CHECK", "1"):
        masking = sys.modules.get("transformers.masking_utils")
        original = getattr(masking, "find_packed_sequence_indices", None)
        if original is None:
            yield
            return
        with _patched(masking, "find_packed_sequence_indices", lambda *args, **kwargs: None):
            yield


@contextlib.contextmanager
def _env(key: str, value: str) -> Iterator[None]:
    """``os.environ[key] = value`` for the duration; the previous state comes back."""
    previous = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


@contextlib.contextmanager
def _patched(owner, name: str, replacement) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(replacement))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def traced_run_masks() -> Iterator[None]:
    """Within it (``torch.export`` tracing, as ``torch.distributed.pipelining.pipeline()`` does),
    transformers' mask code answers as in an eager run of the model's own positions: no packed
    sequences (:func:`real_run_masks`) and a causal mask that SDPA's ``is_causal=True`` replaces.
    transformers materialises the ``b x 1 x s x s`` mask whenever ``is_torchdynamo_exporting()``
    because an exported program may later run with other shapes; a pipeline stage is traced for
    one static micro-batch shape and runs only that shape, so the eager answer is exact there.
    Without it the traced stages pass that mask to every block (a boundary tensor with a receive
    buffer per micro-batch), and a grouped-query model's SDPA copies K and V for every head
    (``use_gqa_in_sdpa`` refuses a mask), which an eager run never holds."""
    masking = sys.modules.get("transformers.masking_utils")
    exporting = getattr(masking, "is_torchdynamo_exporting", None)
    with real_run_masks():
        if exporting is None:
            yield
            return
        masking.is_torchdynamo_exporting = lambda: False
        try:
            yield
        finally:
            masking.is_torchdynamo_exporting = exporting


CAPACITY_EXPERTS = "capacity"
"""The ``experts_implementation`` the ``hf:`` models are profiled with (registered by
:func:`use_capacity_experts`)."""


def capacity_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' fused experts (``@use_experts_implementation``: Mixtral, Qwen2-MoE, ...)
    through the zoo's drop-and-pad dispatch (``models.moe.capacity_experts_forward``), with the
    module's own weights and gate (``_apply_gate``: act(gate) * up, as transformers computes
    it, saving what its activation saves) at capacity factor ``self.capacity_factor`` (1.0
    unless set: a balanced routing, every expert taking T k / E tokens).

    transformers' own implementations are dropless, with shapes that depend on the routing:
    ``eager`` loops over ``nonzero()`` (refused by fake tensors), ``grouped_mm`` and
    ``batched_mm`` hold T k rows. At capacity factor 1 the capacity dispatch holds E C = T k
    rows (T k / E rounded up, per expert) too, i.e. what a balanced routing gives the dropless
    kernels; it adds the (T, E) capacity map and the int64 permutation indices. Where the
    router returns fp32 weights (Mixtral), the weighted expert outputs are fp32, as in
    transformers' own kernels.
    """
    from models.moe import capacity_experts_forward as dispatch

    if getattr(self, "has_post_expert_norm", False):
        raise NotImplementedError(
            f"{type(self).__name__}: a post-expert norm is not supported by the capacity experts"
        )
    gated = getattr(self, "has_gate", True)
    fc1 = self.gate_up_proj if gated else self.up_proj
    fc2 = self.down_proj
    fc1_bias = fc2_bias = None
    if getattr(self, "has_bias", False):
        fc1_bias = self.gate_up_proj_bias if gated else self.up_proj_bias
        fc2_bias = self.down_proj_bias
    return dispatch(
        hidden_states,
        top_k_index,
        top_k_weights,
        fc1_weight=fc1,
        fc2_weight=fc2,
        fc1_bias=fc1_bias,
        fc2_bias=fc2_bias,
        activation=self._apply_gate if gated else self.act_fn,
        capacity_factor=float(getattr(self, "capacity_factor", 1.0)),
        out_in=not getattr(self, "is_transposed", False),  # transformers' default (E, out, in)
    )


def use_capacity_experts(config, model_class) -> bool:
    """Make ``model_class`` (a transformers MoE with fused experts) run its experts through
    :func:`capacity_experts_forward`: register it as ``experts_implementation="capacity"`` and
    select it in ``config`` unless the user chose one (``--set experts_implementation=...``).
    Returns whether the config now selects it. Models without the experts interface (or a
    transformers without it) are left as they are."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    if not getattr(model_class, "_can_set_experts_implementation", lambda: False)():
        return False
    ExpertsInterface.register(CAPACITY_EXPERTS, capacity_experts_forward)
    if getattr(config, "_experts_implementation", None) is None:
        config._experts_implementation = CAPACITY_EXPERTS
    return config._experts_implementation == CAPACITY_EXPERTS
