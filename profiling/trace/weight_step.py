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

The weight step itself (``stage_backward_weight``) runs the stage's *param groups* in the order
of their first parameter (``get_param_groups``: the parameters whose closures share an
intermediate), one ``autograd.grad`` each without a retained graph. While group g runs, the
previous group's ``dweights`` tuple is still bound (a new tensor where ``.grad`` already exists
and is added into), g's new ones are made, the dY of the groups before g are freed (their
``grads`` deleted, the list rebound) and so are the saved storages of the nodes they ran (a
node's saved variables are released once it has run). :meth:`WeightStepGradients.moments`
gives, per layer, those moments as points ``(params, tp_params, bytes)`` in group order:
the parameters whose weight gradients are live beside the held tensors (the previous group's
and the running group's), and the other bytes then, the frees so far (negative) per batch;
and the layer's end (its last group's parameters, every free of the layer): the
``weight_step_moments`` and ``weight_step_end`` fields. A freed storage is only credited where
it is the layer's own: a dY no later group reads that is not the layer's output gradient (the
received gradient of a chunk's last layer stays), a saved storage every node saving which has
run, that is no layer's output (a chunk's input stays).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import torch

from profiling._torch_compat import disable_current_modes
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
        self.param_order = {id(p): i for i, p in enumerate(params)}
        self.output_storages: set[int] = set()
        """Storage uids of every layer's outputs (a saved one is another layer's input)."""
        self.groups: list[tuple[int, list[int], list[Any], set[Any]]] = []
        """torch's param groups in its order: (owner layer, parameter ids, intermediates, nodes
        the group's ``autograd.grad`` runs)."""
        self.saved_by: dict[Any, set[int]] = {}
        """Node -> storage uids of the activations it saved (read before the backward)."""
        self.saved_bytes: dict[int, int] = {}
        """Storage uid -> bytes of those saved storages."""
        self.node_grads: dict[Any, dict[int, int]] = defaultdict(dict)
        """Intermediate -> {storage uid: bytes} of the gradients it received."""
        self._handles: list[Any] = []

    def note_outputs(self, layer: int, outputs: list[torch.Tensor]) -> None:
        """Remember the autograd nodes of a layer's outputs (not the tensors: holding them
        would change what the profile sees live)."""
        for tensor in outputs:
            record = self.tracer.record_of(tensor)
            if record is not None:
                self.output_storages.add(record.uid)
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
        accumulators.sort(key=lambda node: self.param_order[id(node.variable)])
        groups: dict[Any, dict[str, Any]] = {}  # torch's get_param_groups, keyed on intermediates
        for accumulator in accumulators:
            closure, reached = _closure([accumulator], inputs_closure, reverse)
            intermediates |= reached
            group = {"params": [accumulator], "intermediates": set(reached), "runs": closure}
            for node in reached:
                existing = groups.get(node)
                if existing is None:
                    groups[node] = group
                elif existing is not group:
                    existing["params"] += group["params"]
                    existing["intermediates"] |= group["intermediates"]
                    existing["runs"] |= group["runs"]
                    group = existing
        self._note_groups(groups, seen)
        for node in intermediates:
            owner = self.tracer.node_owner.get(node)
            if owner is None:
                continue
            hook = functools.partial(self._record, self.tracer.resolve(owner), node)
            self._handles.append(node.register_prehook(hook))
        for layer, nodes in self.outputs.items():
            for node, number in nodes:
                hook = functools.partial(self._record_output, layer, number)
                self._handles.append(node.register_prehook(hook))

    def _note_groups(self, groups: dict[Any, dict[str, Any]], nodes: set[Any]) -> None:
        """Keep the unique groups in torch's order with their owners, and what every node of
        the graph saved (its ``_saved_*`` attributes, read before the backward frees them)."""
        unique = list({id(group): group for group in groups.values()}.values())
        for group in unique:
            owners = [self.tracer.node_owner.get(node) for node in group["intermediates"]]
            owners = [self.tracer.resolve(owner) for owner in owners if owner is not None]
            if not owners:
                continue
            params = [id(node.variable) for node in group["params"]]
            runs = (group["runs"] | group["intermediates"]) - set(group["params"])
            self.groups.append((min(owners), params, list(group["intermediates"]), runs))
        with disable_current_modes():  # unpacking them is no read the tracer should see
            for node in nodes:
                self.saved_by[node] = self._saved_storages(node)

    def _saved_storages(self, node: Any) -> set[int]:
        uids = set()
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except Exception:  # a saved value that cannot be read (freed, not a tensor)
                continue
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor):
                    record = self.tracer.record_of(tensor)
                    if record is not None and record.kind == "activation":
                        uids.add(record.uid)
                        self.saved_bytes[record.uid] = record.nbytes
        return uids

    def _record(self, layer: int, node: Any, grad_outputs: tuple) -> None:
        for grad in grad_outputs:
            if isinstance(grad, torch.Tensor):
                record = self.tracer.record_of(grad)
                if record is not None and record.kind == "activation":
                    self.captured[layer][record.uid] = record.nbytes
                    self.node_grads[node][record.uid] = record.nbytes

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


    def moments(
        self, excluded: set[int], owned: dict[int, tuple[int, int, int]]
    ) -> dict[int, tuple[list[tuple[int, int, int]], tuple[int, int, int]]]:
        """Layer -> (its weight step's moments, its end) as (params, tp_params, bytes of the
        whole batch) (module docstring), in torch's group order; ``excluded``: saved storages
        and parameter gradients (never a freed dY); ``owned``: run tensor id -> (owner layer,
        elements, TP-split elements)."""
        savers: dict[int, int] = defaultdict(int)  # storage uid -> nodes saving it
        for uids in self.saved_by.values():
            for uid in uids:
                savers[uid] += 1
        readers: dict[int, int] = defaultdict(int)  # dY uid -> groups reading it
        for _, _, intermediates, _ in self.groups:
            for uid in {u for node in intermediates for u in self.node_grads.get(node, {})}:
                readers[uid] += 1
        released: dict[int, int] = defaultdict(int)
        result: dict[int, tuple[list[tuple[int, int, int]], tuple[int, int, int]]] = {}
        state: dict[int, list[int]] = {}  # layer -> [previous params, previous tp, freed]
        for layer, params, intermediates, runs in self.groups:
            made = [owned[p] for p in params if p in owned]
            numel, tp_numel = sum(n for _, n, _ in made), sum(t for _, _, t in made)
            previous = state.setdefault(layer, [0, 0, 0])
            points = result.setdefault(layer, ([], (0, 0, 0)))[0]
            points.append((previous[0] + numel, previous[1] + tp_numel, -previous[2]))
            grads = {u: n for node in intermediates for u, n in self.node_grads[node].items()}
            for uid, nbytes in grads.items():
                readers[uid] -= 1
                own = uid not in excluded and uid not in self.output_grads[layer]
                if own and not readers[uid]:
                    previous[2] += nbytes
            for node in runs:
                for uid in self.saved_by.get(node, ()):
                    released[uid] += 1
                    if released[uid] == savers[uid] and uid not in self.output_storages:
                        previous[2] += self._nbytes(uid)
            previous[0], previous[1] = numel, tp_numel
            result[layer] = (points, (numel, tp_numel, -previous[2]))
        return result

    def input_step_transients(self, excluded: set[int]) -> dict[int, int]:
        """Layer -> the extra live bytes (whole batch) of its part of the input step beyond the
        dY it keeps, ``input_step_transient_bytes``: the profiled backward's events replayed as
        torch's ``stage_backward_input`` runs them (the graph retained: no saved storage is
        released; no parameter gradient is made; the gradients the intermediates receive are
        kept), max over the layer's backward windows of (live - live at the window's start)
        less the dY the layer makes and keeps."""
        tracer = self.tracer
        kept = {uid for storages in self.captured.values() for uid in storages}
        made: dict[int, int] = defaultdict(int)  # layer -> kept dY made in its windows
        peaks: dict[int, int] = {}
        live = base = 0
        current = -1
        for window, _node, uid, delta in tracer.events:
            phase, owner = tracer.windows[window]
            owner = tracer.resolve(owner)
            if window != current:
                current, base = window, live
            if uid in excluded or (delta < 0 and uid in kept):
                continue
            live += delta
            if phase != "bwd":
                continue
            if delta > 0 and uid in kept:
                made[owner] += delta
            peaks[owner] = max(peaks.get(owner, 0), live - base)
        return {owner: max(0, peak - made[owner]) for owner, peak in peaks.items()}

    def _nbytes(self, uid: int) -> int:
        nbytes = self.saved_bytes.get(uid)
        return 0 if nbytes is None else nbytes


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
