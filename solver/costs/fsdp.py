"""The buffers FSDP2 (``fully_shard``, the torch runtime's ZeRO 2 and 3, one unit per layer)
holds around a layer beyond its model states, per GPU, bytes per micro-batch moment.

Read from torch 2.13's ``torch/distributed/fsdp/_fully_shard`` and measured by tagging the live
storages at each rank's peak (``profiling.run``, gpt-tiny, dp 2 x pp 2):

- ``unshard`` all-gathers a layer's weights into one flat buffer (w P'_l) that lives until the
  layer's ``wait_for_unshard`` copies it out into the unsharded parameters (w P'_l). In the
  backward, layer l's pre-backward prefetches layer l-1: its flat buffer is live through l's
  whole backward, beside l's own unsharded weights. With ZeRO 3 both are transients of the
  layer; with ZeRO 2 the unsharded weights stay (``states``: full + sharded) and only a
  re-gathered layer's flat buffer is.
- the layer's weight gradients are made whole and unsharded, in the weights' dtype (w P'_l),
  before ``post_backward`` reduce-scatters them: they replace the one-tensor weight-gradient
  temporary of plain autograd.
- ``post_backward`` copies them into a flat reduce-scatter input in the reduce dtype (g P'_l)
  and reduce-scatters it into a new shard (g P'_l / d, accumulated into ``.grad``); the input is
  kept (``reduce_scatter_states``, ``reduce_scatter_max_input_buffers`` 1) until the next
  layer's ``post_backward``: layer l's backward runs beside layer l+1's reduce-scatter input.

All of this is pp 1. Under pipelining (p > 1) torch's ``PipelineStage`` reduce-scatters once per
step (``states.reduces_per_step``): the unsharded gradients are model states there, and so are
ZeRO 2's unsharded weights; ZeRO 3 reshards a layer after each forward and its backward gathers
it again and keeps it, so its unsharded weights live at layer l's moment for the stage's layers
after l only (``backward_weight_bytes``), beside l's own and a gather's flat buffer
(``gathered_bytes``); ``forward_gather_bytes`` and ``_step_reduce_bytes`` are the rest.

Layers l-1 and l+1 are the neighbours in the graph's order; a neighbour on another stage is
counted too (over, never under). With d = 1 there is no FSDP (``profiling.run`` runs the stage
unwrapped): nothing is added.

Where this errs over: the stage's moments (``stages.layer_moments``) charge layer l's buffers
beside micro-batch j's stored bytes up to l only, so the next layer's held input is counted once,
beside the saved tensors its finished backward has left. The gradients are charged whole
(w P'_l) at every weight-gradient moment of l: a layer's large weight gradients come early in its
backward (fc2's, while most of its saved tensors are live), and the profile's weight-gradient
transient already credits the saved tensors freed before each of them
(``weight_grad_transient_bytes``), so nothing more is subtracted; over by the gradients the
layer has not made yet at its peak moment (its attention's, when the MLP's peak). Subtracting
the layer's freed saved bytes once more (exact only if every gradient came at the end of its
backward) under-predicted by 1.4%. Measured on gpt-tiny at pp 1 (4 blocks of 12,704 parameters,
fp32; parameters outweigh its activations, so these are large shares): +10.2% (ZeRO 2, dp 2; +7.5%
with the subtraction) and +3.3% (ZeRO 3, tp 2 x dp 2) per rank, never under
(``tests/test_run.py``, FSDP2_BOUNDS).
"""

from __future__ import annotations

import numpy as np

from solver.costs.states import ParamShares, reduces_per_step, uses_fsdp2
from solver.specs import ParallelConfig, TrainingConfig


def _previous(values: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], values[:-1])).astype(values.dtype)


def _next(values: np.ndarray) -> np.ndarray:
    return np.concatenate((values[1:], [0])).astype(values.dtype)


def gathered_bytes(
    params: ParamShares, config: ParallelConfig, training: TrainingConfig
) -> np.ndarray:
    """Every layer's gathered-weights transient per GPU, bytes, live at any moment of it. On
    FSDP2 (``uses_fsdp2``) with ZeRO 3: the prefetched neighbour's flat buffer w max(P'_l,
    P'_{l-1}), its own unsharded weights w P'_l, and through its backward the next layer's
    reduce-scatter input g P'_{l+1}; with ZeRO 2, whose unsharded weights stay
    from the forward to the backward, the larger of the flat buffer (forward) and the held
    input. Under pipelining (``reduces_per_step``) with ZeRO 3: its own unsharded weights
    w P'_l and the flat buffer its pre-backward prefetches for the layer before it,
    w P'_{l-1} (``LayerCosts.gather_bytes``); with ZeRO 2 none (states). Other runtimes with
    ZeRO 3: 2 w P'_l (the running layer's weights and the next one's). Else 0."""
    full = params.bytes_per_gpu(training.weight_bytes_per_param, 1, 1)
    if not uses_fsdp2(config, training.runtime):
        return 2 * full if config.zero >= 3 else np.zeros_like(full)
    flat_buffer = np.maximum(full, _previous(full))
    if reduces_per_step(config, training.runtime):
        # ZeRO 3: l's own unsharded weights (out of the states: ``backward_weight_bytes``) and
        # the flat buffer of the gather it runs beside; ZeRO 2: ``forward_gather_bytes``
        return full + _previous(full) if _resharded(config, training) else np.zeros_like(full)
    held_input = _next(params.bytes_per_gpu(training.grad_bytes_per_param, 1, 1))
    if config.zero >= 3:
        return full + flat_buffer + held_input
    # ZeRO 2 gathers only in the forward (a layer resharded by its last backward); the
    # backward finds its weights unsharded and holds the next layer's input
    return np.maximum(flat_buffer, held_input)


def weight_gradient_bytes(
    params: ParamShares,
    config: ParallelConfig,
    training: TrainingConfig,
    temporary: np.ndarray,
) -> np.ndarray:
    """Every layer's weight-gradient transient per GPU, bytes, added to what is live when its
    weight gradients are made (``gathered_bytes`` included): ``temporary`` (one tensor's, plain
    autograd) unless FSDP2 runs the layer. Then its whole unsharded gradients w P'_l (the saved
    tensors freed before each weight gradient are credited by the profile's weight-gradient
    transient, which this term joins: module docstring), and at its ``post_backward``
    the reduce-scatter input g P'_l where its own weights (ZeRO 3) and the next layer's held
    input g P'_{l+1} are freed (and the new shard g P'_l / d once the gradients are copied
    in and freed); never less than ``temporary``."""
    if not uses_fsdp2(config, training.runtime):
        return temporary
    if reduces_per_step(config, training.runtime):
        return np.maximum(temporary, _step_reduce_bytes(params, config, training))
    w, g = training.weight_bytes_per_param, training.grad_bytes_per_param
    unsharded = params.bytes_per_gpu(w, 1, 1)
    reduce_input = params.bytes_per_gpu(g, 1, 1)
    own_weights = unsharded if config.zero >= 3 else 0
    # post_backward frees the layer's weights, then the held input, allocates its own input,
    # copies the gradients in and frees them, then allocates the new shard
    freed_first = own_weights + _next(reduce_input)
    at_reduce = np.maximum(
        reduce_input - freed_first,
        reduce_input + params.sharded(g, config, True) - freed_first - unsharded,
    )
    gradients = unsharded + np.maximum(at_reduce, 0)
    return np.maximum(temporary, gradients)


def _step_reduce_bytes(
    params: ParamShares, config: ParallelConfig, training: TrainingConfig
) -> np.ndarray:
    """Every layer's gradient transient per GPU, bytes, when FSDP2 reduces once per step under
    pipelining (``states.reduces_per_step``): the unsharded gradients are states, so a
    micro-batch's backward adds plain autograd's one-tensor temporary (accumulated in place),
    unless the weights' dtype differs from the reduce dtype: then its whole gradients
    w P'_l, made before ``post_backward`` adds them to the accumulated ones. At the step's
    reduce (``perform_reduce_grad``, no activation left) each layer frees its unsharded
    weights, then makes its reduce-scatter input g P'_l and new shard g P'_l / d while its
    unsharded gradients are still referenced: g P'_l + g P'_l / d - w P'_l."""
    w, g = training.weight_bytes_per_param, training.grad_bytes_per_param
    unsharded = params.bytes_per_gpu(w, 1, 1)
    reduce_input = params.bytes_per_gpu(g, 1, 1)
    at_reduce = reduce_input + params.sharded(g, config, True) - unsharded
    made_whole = unsharded if w != g else np.zeros_like(unsharded)
    return np.maximum(np.maximum(at_reduce, made_whole), 0)


def forward_gather_bytes(
    params: ParamShares, config: ParallelConfig, training: TrainingConfig
) -> np.ndarray:
    """Every layer's gather transient per GPU, bytes, live only at its forward's start, before
    anything of its own is (the layer's transient is the larger of this and the rest), when
    FSDP2 reduces once per step under pipelining (``states.reduces_per_step``); else 0. The flat
    all-gather buffer is live beside the unsharded weights it is copied into
    (``foreach_all_gather_copy_out``). ZeRO 2 ("never" reshards after forward; its unsharded
    weights are states) gathers only in the step's first forward, before any gradient: its
    buffer w P'_l less its own gradients g P'_l, counted but not yet made. ZeRO 3 ("always")
    gathers again in a forward that follows a forward, with no other layer's unsharded weights
    live (they are out of the states: ``backward_weight_bytes``): its own and the buffer,
    2 w P'_l."""
    full = params.bytes_per_gpu(training.weight_bytes_per_param, 1, 1)
    if not reduces_per_step(config, training.runtime):
        return np.zeros_like(full)
    if _resharded(config, training):
        return 2 * full  # a forward after a forward: its own and the flat buffer, alone
    if config.zero >= 3:
        return full  # interleaved: every unsharded weight a state, the flat buffer beside
    own_grads = params.bytes_per_gpu(training.grad_bytes_per_param, 1, 1)
    return np.maximum(full - own_grads, 0)


def backward_weight_bytes(
    params: ParamShares, config: ParallelConfig, training: TrainingConfig
) -> np.ndarray | None:
    """Every layer's unsharded weights w P'_l per GPU, bytes, where FSDP2 with ZeRO 3 runs under
    pipelining without interleaving (``states.reduces_per_step``, reshard after forward
    "always", no reshard after backward); else None (interleaved ranks keep them as states).
    Part of the weights (``states.model_state_bytes``) but live only from the layer's backward
    (its pre-backward gathers it, or its later neighbour's prefetches it) to its next forward
    (which reshards it) or the step's end: while layer l of a micro-batch
    runs, the stage holds those of its layers after l (their backward, when l's is running, or
    the previous micro-batch's, when l's forward follows it), l's own and the flat buffer of
    the gather beside it (``gathered_bytes``), and no other (each forward since resharded them).
    After a backward that no forward follows (1F1B's last backwards, GPipe) every one of them
    is live: the moment after, with k - 1 micro-batches held (``LayerCosts.first_backward_peak``).
    Measured (gpt-tiny, dp 2 x pp 2, m 4, tagged storages): the first stage peaks at its last
    block's pre-backward with that block's unsharded weights and the prefetched flat buffer of
    the block before, every other block's resharded. The model is +0.0% to +1.9% over on
    gpt-tiny, dp 2, pp 2-4, 1F1B m 2-8 and GPipe m 4 (+9.7%/+10.0% with every one a state)."""
    if not _resharded(config, training):
        return None
    return params.bytes_per_gpu(training.weight_bytes_per_param, 1, 1)


def _resharded(config: ParallelConfig, training: TrainingConfig) -> bool:
    """FSDP2 ZeRO 3 under pipelining without interleaving, by 1F1B or GPipe:
    ``backward_weight_bytes`` applies. Interleaved ranks and the split-backward schedules keep
    every unsharded weight a state (an upper bound), a gather's flat buffer in its layer's
    transient."""
    return (
        reduces_per_step(config, training.runtime)
        and config.zero >= 3
        and config.virtual_stages == 1
        and config.schedule in ("1f1b", "gpipe")
    )
