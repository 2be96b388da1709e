"""The batch-independent part of each layer's memory figures, from a second trace at batch 2.

    fields = unbatched_fields(graph, totals_at_two)     # {layer: {"unbatched_...": F}}
    graph = with_unbatched(graph, fields)

The profile divides each batch total by the batch, and the cost model multiplies the per-sample
figure by the micro-batch b. A tensor the whole batch shares (a causal mask, a position index,
rotary cos/sin tables, a position embedding's gradient, summed over the batch) is then counted b
times. A memory-only trace of the same module at batch 2 (``profile.profile_module`` runs it
when it profiles at batch 1) gives each figure X a second point; the line through both,

    X(n) = n (X - F) + F,    F = 2 X(1) - X(2),

is exact at batch 1 and 2. F > 0 is the shared part; F < 0 where batch 2 holds more than twice
batch 1 (a copy batch 1 skips because its tensor is already contiguous), so that b (X - F) + F
>= b X for every b >= 1 there. The figures (``solver.graph_fields.UNBATCHED_FIELDS``): the saved
bytes and the working-memory peaks (the layer's transient, at its weight gradients, in its
attention's backward); a field is written where F != 0. docs/layer-graph.md,
docs/cost-model.md ("Batch-independent bytes").
"""

from __future__ import annotations

from typing import Any

import torch

from solver.graph import LayerGraph, graph_from_dict
from solver.graph_fields import UNBATCHED_FIELDS


def doubled_inputs(example_inputs: Any, batch: int) -> Any:
    """The example inputs at twice the batch: every tensor whose leading dimension is the batch
    concatenated with itself (under the caller's fake mode, if any); other leaves unchanged."""

    def double(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.dim() and value.shape[0] == batch:
                return torch.cat([value, value], dim=0)
            return value
        if isinstance(value, tuple):
            return tuple(double(v) for v in value)
        if isinstance(value, list):
            return [double(v) for v in value]
        if isinstance(value, dict):
            return {k: double(v) for k, v in value.items()}
        return value

    return double(example_inputs)


def unbatched_fields(at_one: LayerGraph, totals_at_two: LayerGraph) -> dict[str, dict[str, int]]:
    """{layer name: {field: F}} with F = 2 X(1) - X(2) for each figure of
    ``UNBATCHED_FIELDS`` measured in both (``totals_at_two``: the batch-2 trace built with
    batch 1, so its figures are the batch's totals), F != 0 only. A layer the batch-2 trace
    lacks gets none; F is at most X(1) (``X(2) >= X(1)``: a shared tensor is not halved)."""
    twos = {layer.name: layer for layer in totals_at_two.layers}
    fields: dict[str, dict[str, int]] = {}
    for layer in at_one.layers:
        two = twos.get(layer.name)
        if two is None:
            continue
        found = {}
        for key, figure in UNBATCHED_FIELDS.items():
            x1, x2 = getattr(layer, figure), getattr(two, figure)
            if x1 is None or x2 is None:
                continue
            fixed = min(2 * x1 - x2, x1)
            if fixed:
                found[key] = fixed
        if found:
            fields[layer.name] = found
    return fields


def with_unbatched(graph: LayerGraph, fields: dict[str, dict[str, int]]) -> LayerGraph:
    """``graph`` with the layers' ``unbatched_*`` fields set (validated again)."""
    if not fields:
        return graph
    document = graph.to_dict()
    for item in document["layers"]:
        item.update(fields.get(item["name"], {}))
    return graph_from_dict(document, origin=f"profile of {graph.model}")

