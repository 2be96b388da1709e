"""The running layer's own gradients at a first backward's moment (``LayerCosts.own_grad_bytes``).

Under the gradient lifetime "step", on a stage whose forwards all precede its first backward
(``LayerCosts.first_backward_peak`` with ``grads_late``), layer l's moment ``during(l)`` holds
the gradients of the layers after l and those of l's own parameters its backward has made by
then: a block's MLP and output projection before its attention's backward peaks (measured, T5
pp 3 GPipe fp32: 82,176 B of encoder.block.1's gradients beside its transient). The profile
gives the moments of l's backward as points (P_i, T_i, e_i) (``Layer.backward_grad_moments``,
``profiling.trace.own_grads``): P_i of its parameters have a gradient, T_i of them TP-split, and
its extra live bytes are e_i per sample (negative once it has released more of its
saved storages than it holds beside them). At that moment the layer holds, beside the stored
bytes and grads(> l) of ``during(l)``, G(P_i, T_i) + B(e_i) per GPU, with G(P, T) the gradient
bytes of P parameters of which T split (``states.model_state_bytes``'s rule: tp, ZeRO, dtype;
a gradient counts from its allocation, the weight-gradient temporary included) and
B(e) = ceil(b e / c). The moment adds own_l to l's transient trans_l (``layers``, the kept
state, the smaller):

    own_l = min(G_l, max(0, max_i (G(P_i, T_i) + B(e_i)) - trans_l))

so that own_l + trans_l is at least every measured moment of l's backward, exact at its
largest: where the largest is a weight-gradient moment whose gradient is the one
``trans_l``'s temporary gtemp_l counts (an LM head's), own_l is 0. The points count l's own
parameters as the graph's ``params`` do: a tied copy a stage keeps of another layer's table
(``embeddings.with_tied_copies``) has its gradient in G_l and not in them, so its gradient,
G_l - G(params_l, tp_params_l) where positive, is added at every point (it may be made at any
moment of l's backward). Parameters a runtime splits more than the points say (routed experts,
Megatron's vocabulary split under 16384 rows) count whole: over, within G_l. A layer without
the field takes G_l: every gradient of l (over by those it has not made yet at its peak). The
points scale e_i by the batch whole: the batch-independent parts of the transients
(``unbatched``) are not in them.
"""

from __future__ import annotations

import numpy as np

from solver.costs.states import ParamShares, model_state_bytes
from solver.costs.units import as_int, ceil_div
from solver.graph import LayerGraph
from solver.specs import ParallelConfig, TrainingConfig


def own_gradient_bytes(
    graph: LayerGraph,
    config: ParallelConfig,
    training: TrainingConfig,
    grads: np.ndarray,
    transient: tuple[np.ndarray, np.ndarray],
    scaled,
) -> np.ndarray:
    """own_l of every layer (module docstring), bytes per GPU; ``grads``: G_l, the bound;
    ``transient``: trans_l kept and recomputed (the smaller is taken); ``scaled``:
    ``layers._calibrated``'s function (gradients and transients)."""
    own = scaled(grads, "grads").copy()
    transient = scaled(np.minimum(*transient), "transient")
    exact = [i for i, layer in enumerate(graph.layers) if layer.backward_grad_moments]
    if not exact:
        return own
    points = [(i, point) for i in exact for point in graph.layers[i].backward_grad_moments]
    index = np.array([i for i, _ in points], dtype=np.int64)
    made, split, extra = (as_int([point[k] for _, point in points]) for k in range(3))
    whole = (  # every parameter the graph gives l, per point's layer: the tied copies' rest
        as_int([graph.layers[i].params for i in index]),
        as_int([graph.layers[i].tp_params for i in index]),
    )
    made_grads, whole_grads = (
        gradient_bytes(params, tp_params, config, training, scaled)
        for params, tp_params in ((made, split), whole)
    )
    copies = np.maximum(own[index] - whole_grads, 0)
    moment = scaled(ceil_div(config.micro_batch * extra, config.cp), "transient")
    largest = np.full(len(graph.layers), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(largest, index, made_grads + copies + moment)
    beside = np.maximum(largest[exact] - as_int(transient)[exact], 0)
    own[exact] = np.minimum(own[exact], beside)
    return own


def gradient_bytes(
    params: np.ndarray, tp_params: np.ndarray, config: ParallelConfig, training, scaled
) -> np.ndarray:
    """G(P, T) per GPU of each entry (module docstring): P parameters, T of them TP-split, as
    ``states.model_state_bytes`` gives the gradients (the rest replicated, no experts)."""
    t = config.tp
    shares = ParamShares(
        dense_times_t=(params - tp_params) * t + tp_params,
        expert=np.zeros_like(params),
        tp=t,
        ep=config.ep,
    )
    return scaled(model_state_bytes(shares, config, training)[1], "grads")
