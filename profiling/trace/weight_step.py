"""What a split backward's input step keeps for its weight step, per layer.

torch 2.13's zero-bubble schedules split a stage's backward in two
(``torch.distributed.pipelining._backward``): ``stage_backward_input`` (I) runs
``autograd.grad(..., retain_graph=True)`` for the stage's input gradients with a pre-hook on
every *intermediate*, the autograd node on the input-to-output path that a parameter's
subgraph feeds (``get_param_groups``: a Linear's ``AddmmBackward``, a LayerNorm's
``NativeLayerNormBackward``), and keeps the gradients those nodes receive, the gradients at the
outputs of the weight ops (dY), in ``param_groups``; ``stage_backward_weight`` (W) later feeds
them back to get the weights' gradients. Between the two, the micro-batch keeps them besides
its saved activations.

:class:`WeightStepGradients` finds the same intermediates in the profiled backward (the same
closures as torch's ``construct_reverse_graph``, ``reverse_closure`` and ``get_param_groups``,
with every layer's output as a stage input) and records each gradient they receive, by storage
(``Tracer`` records): per layer (the owner of the intermediate)

- ``own``: the storages the layer's own backward made, less those saved for backward (an
  in-place gradient, such as a cross-entropy that turns its saved softmax into the logits'
  gradient) and those of parameters: ``weight_op_grad_bytes``;
- ``output``: the gradient of the layer's own output when a weight op's output is the layer's
  output (a block's last projection through the residual add): made by the layer's consumers,
  so a new storage where a consumer runs in the same pipeline stage, and the stage's received
  gradient otherwise: ``weight_op_output_grad_bytes``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import torch

from profiling.trace.dataflow import Tracer


class WeightStepGradients:
    """The gradients a split backward keeps per layer between its I and W steps (module
    docstring): ``install`` after the forward, before ``loss.backward()``; ``remove`` after;
    then ``bytes_by_layer``."""

    def __init__(self, tracer: Tracer, params: list[torch.Tensor]) -> None:
        self.tracer = tracer
        self.param_ids = {id(p) for p in params if p.requires_grad}
        self.outputs: dict[int, list[tuple[Any, int]]] = defaultdict(list)
        """Layer -> (grad_fn, output_nr) of each of its outputs (``note_outputs``)."""
        self.captured: dict[int, dict[int, int]] = defaultdict(dict)
        """Layer -> {storage uid: bytes} of the gradients its intermediates received."""
        self.output_grads: dict[int, set[int]] = defaultdict(set)
        """Layer -> storage uids of the gradients of its outputs."""
        self._handles: list[Any] = []

    def note_outputs(self, layer: int, outputs: list[torch.Tensor]) -> None:
        """Remember the autograd nodes of a layer's outputs (not the tensors: holding them
        would change what the profile sees live)."""
        for tensor in outputs:
            if tensor.grad_fn is not None:
                self.outputs[layer].append((tensor.grad_fn, tensor.output_nr))

    def install(self, loss: torch.Tensor) -> None:
        """Hook the intermediates of ``loss``'s graph and every layer's output nodes."""
        if loss.grad_fn is None:
            return
        reverse: dict[Any, list[Any]] = defaultdict(list)  # node -> nodes that read its output
        accumulators = []
        stack, seen = [loss.grad_fn], {loss.grad_fn}
        while stack:
            node = stack.pop()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                reverse[child].append(node)
                if getattr(child, "variable", None) is not None:
                    if id(child.variable) in self.param_ids and child not in seen:
                        accumulators.append(child)
                        seen.add(child)
                    continue
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
        roots = [node for nodes in self.outputs.values() for node, _ in nodes]
        inputs_closure = _closure(roots, set(), reverse)[0]
        intermediates: set[Any] = set()
        for accumulator in accumulators:
            intermediates |= _closure([accumulator], inputs_closure, reverse)[1]
        for node in intermediates:
            owner = self.tracer.node_owner.get(node)
            if owner is None:
                continue
            hook = functools.partial(self._record, self.tracer.resolve(owner))
            self._handles.append(node.register_prehook(hook))
        for layer, nodes in self.outputs.items():
            for node, number in nodes:
                hook = functools.partial(self._record_output, layer, number)
                self._handles.append(node.register_prehook(hook))

    def _record(self, layer: int, grad_outputs: tuple) -> None:
        for grad in grad_outputs:
            if isinstance(grad, torch.Tensor):
                record = self.tracer.record_of(grad)
                if record is not None and record.kind == "activation":
                    self.captured[layer][record.uid] = record.nbytes

    def _record_output(self, layer: int, number: int, grad_outputs: tuple) -> None:
        grad = grad_outputs[number] if number < len(grad_outputs) else None
        if isinstance(grad, torch.Tensor):
            record = self.tracer.record_of(grad)
            if record is not None:
                self.output_grads[layer].add(record.uid)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def bytes_by_layer(self, excluded: set[int]) -> dict[int, tuple[int, int]]:
        """Layer -> (own, output) bytes of the whole profiled batch (module docstring);
        ``excluded``: storage uids saved for backward or gradients of parameters."""
        result = {}
        for layer, storages in self.captured.items():
            own = output = 0
            for uid, nbytes in storages.items():
                if uid in excluded:
                    continue
                if uid in self.output_grads[layer]:
                    output += nbytes
                else:
                    own += nbytes
            result[layer] = (own, output)
        return result


def _closure(roots: list[Any], targets: set[Any], reverse: dict[Any, list[Any]]):
    """(nodes reached from ``roots`` along ``reverse`` edges without passing a target, the
    targets reached): torch's ``reverse_closure``."""
    closure: set[Any] = set()
    reached: set[Any] = set()
    queue = []
    for node in roots:
        if node is not None and node not in closure:
            closure.add(node)
            queue.append(node)
    while queue:
        node = queue.pop()
        for parent in reverse.get(node, ()):
            if parent in closure:
                continue
            if parent in targets:
                reached.add(parent)
                continue
            closure.add(parent)
            queue.append(parent)
    return closure, reached
