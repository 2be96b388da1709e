"""Which storages the profiled backward makes as gradients of parameters.

A parameter's gradient does not scale with the batch: the one that becomes ``.grad``, one
autograd adds to it, and a tied parameter's partial gradient (an LM head's gradient of the
embedding table it shares, held from the head's backward until the embedding's backward adds
its own part, ``InputBuffer`` then summing both into the ``.grad``) are all the parameter's
size, whatever the batch. The profile's per-sample transients (``Tracer.transients``) must not
count them: the cost model holds them itself, per parameter (``solver.costs.layers``: the
weight-gradient temporary; ``solver.costs.embeddings``: a tie's partial gradients).

:class:`ParamGradients` finds them exactly: a post-hook on every autograd node with an edge
into a parameter's ``AccumulateGrad`` records the storage of each gradient the node sends
there (a view, such as the ``TBackward`` of ``F.linear``'s weight, is its storage, the one the
matmul made). Post-hooks see the node's outputs after the engine's shape checks (a broadcast's
``sum_to``) and change no lifetime: the engine keeps a node's input gradients until its call
returns either way, and ``AccumulateGrad`` (which hooks nothing here) still steals a gradient
it alone holds.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from profiling.trace.dataflow import Tracer


class ParamGradients:
    """Storage uids (``Tracer`` records) of every gradient sent to a parameter's
    ``AccumulateGrad`` in the backward (``install`` before it, ``remove`` after)."""

    def __init__(self, tracer: Tracer, params: Iterable[torch.Tensor]) -> None:
        self.tracer = tracer
        self.param_ids = {id(p) for p in params if p.requires_grad}
        self.uids: set[int] = set()
        self.param_of: dict[int, int] = {}
        """Gradient storage uid -> ``id`` of the parameter it is a gradient of."""
        self._handles: list[Any] = []

    def install(self, loss: torch.Tensor) -> None:
        """Hook every node of ``loss``'s graph with an edge into a parameter's accumulator."""
        stack = [loss.grad_fn] if loss.grad_fn is not None else []
        seen: set[Any] = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            edges = []
            for position, (child, _) in enumerate(node.next_functions):
                if child is None:
                    continue
                variable = getattr(child, "variable", None)
                if variable is not None:
                    if id(variable) in self.param_ids:
                        edges.append((position, id(variable)))
                elif child not in seen:
                    stack.append(child)
            if edges:
                hook = functools.partial(self._record, tuple(edges))
                self._handles.append(node.register_hook(hook))

    def _record(
        self, edges: tuple[tuple[int, int], ...], grad_inputs: tuple, _grad_outputs: tuple
    ) -> None:
        for position, param in edges:
            grad = grad_inputs[position] if position < len(grad_inputs) else None
            record = self.tracer.record_of(grad) if isinstance(grad, torch.Tensor) else None
            if record is not None:
                self.uids.add(record.uid)
                self.param_of.setdefault(record.uid, param)

    def partner_elements(self, owned: dict[int, tuple[int, ...]]) -> dict[int, int]:
        """Layer -> the most parameter-gradient elements one autograd node makes beside the
        largest it makes (a linear's ``AddmmBackward0`` makes its bias's gradient beside its
        weight's, which reaches the accumulator through a ``TBackward0`` view), over the
        layer's nodes: the graph's ``grad_partner_params``. They are live together until the
        node returns and the accumulators add them in, temporaries beside ``.grad`` from the
        second micro-batch on. ``owned``: parameter ``id`` -> (layer counting it, elements,
        ...); a node's extra goes to the layer of its largest gradient."""
        made: dict[int, dict[int, int]] = defaultdict(dict)  # node serial -> param -> numel
        for _window, node, uid, delta in self.tracer.events:
            param = self.param_of.get(uid)
            if delta > 0 and param in owned:
                made[node][param] = owned[param][1]
        partner: dict[int, int] = {}
        for group in made.values():
            if len(group) > 1:
                largest = max(group, key=group.get)
                layer = owned[largest][0]
                extra = sum(group.values()) - group[largest]
                partner[layer] = max(partner.get(layer, 0), extra)
        return partner

    def remove(self) -> None:
        """Take the hooks off (the graph may outlive the profile)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
