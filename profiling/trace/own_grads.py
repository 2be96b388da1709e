"""The layer's own parameter gradients beside its backward transient (``backward_grad_moments``).

Under the gradient lifetime "step" (``zero_grad(set_to_none=True)``) a stage whose forwards all
precede its first backward (GPipe; 1F1B with m <= p - s) makes its gradients during that
backward: at a moment of layer l's first backward the layers after l have theirs, and l has
those of its own parameters it made so far (a block's MLP and output projection, made before its
attention's backward peaks). The profile's transients leave every parameter gradient out (it is
the parameter's size at any batch, ``param_grads.py``), so the graph gives, per layer, the
moments of its backward as points

    (params, tp_params, bytes)

``params``: elements of the layer's own parameters (those its ``params`` count) whose gradient
exists at the moment (its storage allocated, in any window: a gradient autograd adds to later
counts from its first part); ``tp_params``: how many of them tensor parallelism splits (the
layer's ``tp_params`` rule); ``bytes``: the layer's extra live bytes per sample then, as
``Tracer.transients`` counts them (saved storages and parameter gradients left out, the layer's
saved storages released so far in the window deducted: negative once it has released more
than it holds beside them), rounded up. Only the moments no other
dominates are kept (the upper-left frontier: more gradients or more bytes), in the order they
happen (gradients rising, bytes falling). The cost model takes the largest of
grads(params) + b bytes over them (``solver.costs.layers.own_gradient_bytes``), exact under any
tp, ZeRO stage, dtype and batch: one fraction of the gradients at the transient's peak could not
bound a later moment with more gradients and fewer bytes.
"""

from __future__ import annotations

from collections import defaultdict

from profiling.trace.dataflow import Tracer


def backward_grad_moments(
    tracer: Tracer,
    excluded: set[int],
    grad_params: dict[int, int],
    owned: dict[int, tuple[int, int, int]],
    batch: int,
) -> dict[int, list[tuple[int, int, int]]]:
    """Owner layer -> its frontier of (params, tp_params, bytes per sample) over the events of
    its backward windows. ``excluded``: the storages ``transients`` leaves out; ``grad_params``:
    gradient storage uid -> the parameter (run tensor id) it is a gradient of;
    ``owned``: run tensor id -> (owner layer, elements, TP-split elements)."""
    made: dict[int, set[int]] = defaultdict(set)  # layer -> its parameters with a gradient
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    best: dict[int, dict[tuple[int, int], int]] = defaultdict(dict)
    live = base = credit = 0
    current = -1
    for window, _node, uid, delta in tracer.events:
        phase, owner = tracer.windows[window]
        owner = tracer.resolve(owner)
        if window != current:
            current, base, credit = window, live, 0
        param = grad_params.get(uid)
        if delta > 0 and param is not None and param in owned:
            layer, numel, tp_numel = owned[param]
            if param not in made[layer]:
                made[layer].add(param)
                counts[layer][0] += numel
                counts[layer][1] += tp_numel
        if uid in excluded:
            saver = tracer.saved_owner.get(uid)
            if delta < 0 and phase == "bwd" and saver is not None:
                if tracer.resolve(saver) == owner:
                    credit -= delta
        else:
            live += delta
        if phase == "bwd":
            key = (counts[owner][0], counts[owner][1])
            extra = live - base - credit
            points = best[owner]
            points[key] = max(points.get(key, extra), extra)
    return {layer: _frontier(points, batch) for layer, points in best.items()}


def _frontier(points: dict[tuple[int, int], int], batch: int) -> list[tuple[int, int, int]]:
    """The points no other dominates (at least as many gradients, in both parts, and bytes),
    gradients rising; bytes per sample rounded up, negative where the layer has released more
    of its saved storages than it holds beside them (its backward's end, every gradient made:
    those bytes are gone from the moment too)."""
    ordered = sorted((key, -(-extra // batch)) for key, extra in points.items())
    kept: list[tuple[int, int, int]] = []
    for (params, tp_params), per_sample in ordered:
        dominated = any(
            p >= params and t >= tp_params and e >= per_sample
            for (p, t), e in ordered
            if (p, t) != (params, tp_params)
        )
        if not dominated:
            kept.append((params, tp_params, per_sample))
    return kept
