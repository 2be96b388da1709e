"""Assemble the layer graph from a traced run: per-sample fields, parameter owners, edges, meta.

    graph = build_graph(selection, tracer, split, run_params, batch=8, timings=None, ...)

The inputs are what ``profile.py`` collected: the ``Tracer`` records per layer (``dataflow.py``),
the tensor-parallel split (``tensor_parallel.py``) and, in real mode, the per-layer times
(``timing.py``). Batch totals become per-sample values here (bytes rounded up); the fields and
rules are described in ``profile.py``'s docstring.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from profiling.trace.dataflow import PENDING, Tracer
from profiling.trace.experts import ExpertTracker, is_expert_path
from profiling.trace.layers import layer_kinds
from profiling.trace.own_grads import backward_grad_moments
from profiling.trace.tensor_parallel import TensorParallelSplit, is_linear
from solver.errors import InputError
from solver.graph import LayerGraph, graph_from_dict


def _ceil_div(total: int, batch: int) -> int:
    return -(-int(total) // batch)


def _graph_order(selection, tracer: Tracer) -> list[int]:
    """Execution order; a layer that never ran follows the layer listed before it."""
    called = sorted(
        (i for i in range(len(selection)) if tracer.layers[i].first_call is not None),
        key=lambda i: tracer.layers[i].first_call,
    )
    order = list(called)
    for i in range(len(selection)):
        if tracer.layers[i].first_call is None:
            before = [j for j in range(i) if j in order]
            order.insert(order.index(before[-1]) + 1 if before else 0, i)
    return order


@dataclass(kw_only=True)
class _ParamCounts:
    """Parameters per layer (by position in ``selection``), each counted once: in the first layer
    (graph order) that owns it, or else the layer that first used it."""

    params: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Elements per layer."""
    tp_params: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Elements per layer that tensor parallelism splits."""
    expert_params: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Elements per layer of routed experts (not split by TP)."""
    largest: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Elements of the layer's largest replicated parameter tensor."""
    largest_tp: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Elements of the layer's largest TP-split parameter tensor."""
    tensors: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Parameter tensors per layer (``param_tensors``: Adam's step count per tensor)."""
    shared: list[dict[str, Any]] = field(default_factory=list)
    """Parameters owned by several layers (meta ``shared_params``)."""
    vocab: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Elements per layer of vocabulary tables (``vocab_params``)."""
    tied: dict[int, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    """Layer -> {owner layer name: elements} of the parameters it shares with the layer that
    counts them (the layer field ``tied_params``)."""
    unused: list[str] = field(default_factory=list)
    """Parameters no layer owns or used (meta ``unused_params``)."""
    by_tensor: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """``id`` of the tensor the run used -> (the layer counting it, elements, TP-split
    elements): the owners of the gradients (``own_grads``)."""


def build_graph(
    selection: list[tuple[str, nn.Module]],
    tracer: Tracer,
    split: TensorParallelSplit,
    run_params: list[tuple[str, nn.Parameter, torch.Tensor]],
    *,
    batch: int,
    timings: tuple[list[float], list[float]] | None,
    model_name: str,
    meta: dict,
    experts: ExpertTracker | None = None,
    blocks: set[str] | None = None,
) -> LayerGraph:
    """The validated graph. ``run_params`` holds (first name, original parameter, the tensor the run
    used) per distinct parameter; ``timings`` is (forward ms, backward ms) per layer per batch;
    ``blocks`` the layers that are the model's repeated blocks (``layers.block_paths``), which
    give every layer its ``kind`` (``layers.layer_kinds``)."""
    names = [path for path, _ in selection]
    if PENDING in tracer.layers and tracer.first_layer is not None:
        tracer.layers[tracer.first_layer].absorb(tracer.layers.pop(PENDING))
    order = _graph_order(selection, tracer)
    position = {i: k for k, i in enumerate(order)}
    counts = _count_params(selection, tracer, split, run_params, order, names)
    items = _layer_items(
        selection,
        tracer,
        split,
        counts,
        order,
        names,
        batch=batch,
        timings=timings,
        experts=experts,
    )
    kinds = layer_kinds([item["name"] for item in items], blocks or set())
    for item, kind in zip(items, kinds or [], strict=False):
        item["kind"] = kind
    edges = _edges(tracer, order, position, names, batch, model_name)
    chain = [
        {"src": a["name"], "dst": b["name"], "bytes": a["output_bytes"]}
        for a, b in zip(items, items[1:], strict=False)
    ]
    extra = _graph_meta(tracer, split, counts, order, names, batch=batch, experts=experts)
    document: dict[str, Any] = {
        "format": "layer-graph",
        "version": 1,
        "model": model_name,
        "meta": extra | meta,
        "layers": items,
    }
    # a chain whose tensors each need grad and are counted by their consumer is the implied
    # chain: the cost model treats its edges as those of a graph without the fields
    plain = all(edge.get("charged") and set(edge) <= _PLAIN_KEYS for edge in edges)
    if not plain or sorted(map(_edge_key, edges)) != sorted(map(_edge_key, chain)):
        document["edges"] = edges
    return graph_from_dict(document, origin=f"profile of {model_name}")


def _count_params(
    selection: list[tuple[str, nn.Module]],
    tracer: Tracer,
    split: TensorParallelSplit,
    run_params: list[tuple[str, nn.Parameter, torch.Tensor]],
    order: list[int],
    names: list[str],
) -> _ParamCounts:
    """Parameters: each counted once, in the first layer (graph order) that owns it."""
    owners: dict[int, list[int]] = defaultdict(list)
    for i in order:
        for param in selection[i][1].parameters():
            owners[id(param)].append(i)
    counts = _ParamCounts()
    params, tp_params, expert_params = counts.params, counts.tp_params, counts.expert_params
    largest, largest_tp = counts.largest, counts.largest_tp  # one tensor's elements, per layer
    shared, unused = counts.shared, counts.unused
    used_by = {
        id(original): tracer.resolve(record.first_user)
        for _, original, tensor in run_params
        if (record := tracer.record_of(tensor)) is not None and record.first_user is not None
    }
    for name, original, tensor in run_params:
        layers = owners.get(id(original)) or (
            [used_by[id(original)]] if id(original) in used_by else []
        )
        if not layers:
            unused.append(name)
            continue
        # a container the forward never calls (T5's `shared`, whose weight its encoder's
        # embed_tokens uses) holds no copy of its own: the first called one owns the parameter
        layers = [j for j in layers if getattr(tracer.layers.get(j), "calls", 0)] or layers[:1]
        params[layers[0]] += original.numel()
        counts.tensors[layers[0]] += 1
        if is_expert_path(name) and id(original) not in split.split_params:
            expert_params[layers[0]] += original.numel()
        if id(original) in split.vocab_params:
            counts.vocab[layers[0]] += original.numel()
        split_numel = original.numel() if id(original) in split.split_params else 0
        counts.by_tensor[id(tensor)] = (layers[0], original.numel(), split_numel)
        if id(original) in split.split_params:
            tp_params[layers[0]] += original.numel()
            largest_tp[layers[0]] = max(largest_tp[layers[0]], original.numel())
        else:
            largest[layers[0]] = max(largest[layers[0]], original.numel())
        for j in layers[1:]:
            owner = names[layers[0]]
            counts.tied[j][owner] = counts.tied[j].get(owner, 0) + original.numel()
        if len(layers) > 1:
            shared.append(
                {
                    "param": name,
                    "numel": original.numel(),
                    "counted_in": names[layers[0]],
                    "shared_with": [names[j] for j in layers[1:]],
                }
            )
    return counts


def _split_backward_items(
    tracer: Tracer, counts: _ParamCounts, order: list[int], batch: int
) -> dict[int, dict[str, Any]]:
    """Per layer, its split-backward fields (``weight_step``), per sample: the dY its input
    step keeps (``weight_op_grad_bytes``, ``weight_op_output_grad_bytes``), its weight step's
    points and end, and its input step's transient; {} where the tracer recorded none."""
    weight_steps = {
        tracer.resolve(owner): value
        for owner, value in getattr(tracer, "weight_step_bytes", {}).items()
    }
    weight_moments = {}
    if getattr(tracer, "weight_step_moments", None) is not None:
        steps, excluded_here = tracer.weight_step_moments
        weight_moments = {
            tracer.resolve(owner): value
            for owner, value in steps.moments(excluded_here, counts.by_tensor).items()
        }
    if not (weight_steps or weight_moments):
        return {}
    inputs = getattr(tracer, "input_step_peaks", {})
    items: dict[int, dict[str, Any]] = {}
    for i in order:
        item: dict[str, Any] = {}
        if i in weight_steps:  # a split backward's dY
            own, output = weight_steps[i]
            item["weight_op_grad_bytes"] = _ceil_div(own, batch)
            item["weight_op_output_grad_bytes"] = _ceil_div(output, batch)
        points, end = weight_moments.get(i, ([], (0, 0, 0)))  # the W step
        item["weight_step_moments"] = [
            [params, tp_params, _ceil_div(nbytes, batch)] for params, tp_params, nbytes in points
        ]
        item["weight_step_end"] = [end[0], end[1], _ceil_div(end[2], batch)]
        item["input_step_transient_bytes"] = _ceil_div(
            sum(v for owner, v in inputs.items() if tracer.resolve(owner) == i), batch
        )
        items[i] = item
    return items


def _layer_items(
    selection: list[tuple[str, nn.Module]],
    tracer: Tracer,
    split: TensorParallelSplit,
    counts: _ParamCounts,
    order: list[int],
    names: list[str],
    *,
    batch: int,
    timings: tuple[list[float], list[float]] | None,
    experts: ExpertTracker | None,
) -> list[dict[str, Any]]:
    """The graph's ``layers`` entries in graph order, per-sample (bytes rounded up)."""
    params, tp_params, expert_params = counts.params, counts.tp_params, counts.expert_params
    largest, largest_tp = counts.largest, counts.largest_tp
    transients = tracer.transient_peaks
    kv_reads: dict[int, int] = defaultdict(int)  # owner -> k + v bytes its attention read
    for owner, nbytes in getattr(tracer, "attention_kv_bytes", {}).items():
        kv_reads[tracer.resolve(owner)] += nbytes
    scores: dict[int, int] = defaultdict(int)  # owner -> its explicit attention's score bytes
    for owner, nbytes in getattr(tracer, "attention_score_bytes", {}).items():
        scores[tracer.resolve(owner)] += nbytes
    weight_grad_transients = tracer.weight_grad_transient_peaks
    split_backward = _split_backward_items(tracer, counts, order, batch)
    moments = {}
    if getattr(tracer, "gradient_moments", None) is not None:
        excluded, grad_params = tracer.gradient_moments
        moments = backward_grad_moments(tracer, excluded, grad_params, counts.by_tensor, batch)
    input_reads = getattr(tracer, "model_input_bytes", {})
    gradients = getattr(tracer, "param_gradients", None)  # a bias's beside its weight's
    partners = gradients.partner_elements(counts.by_tensor) if gradients is not None else {}
    items = []
    for i in order:
        record = tracer.layers[i]
        saved_total = record.saved_bytes
        split_total = sum(n for n, taint in record.saved if split.is_split(taint))
        # under sequence parallelism eager torch keeps whole what the gathered sequence feeds:
        # the column-parallel inputs, and what a Linear left replicated computes from them
        replicated_total = sum(
            n for n, taint in record.saved if taint and not split.is_split(taint)
        )
        item: dict[str, Any] = {
            "name": names[i],
            "params": params[i],
            "activation_bytes": _ceil_div(saved_total, batch),
            "output_bytes": _ceil_div(record.output_bytes, batch),
            "tp_params": tp_params[i],
            "tp_activation_bytes": _ceil_div(split_total, batch),
            "fwd_flops": record.fwd_flops / batch,
            "bwd_flops": record.bwd_flops / batch,
            "tp_comm_bytes": _ceil_div(split.comm_bytes.get(i, 0), batch),
            # at most what the layer saves: a gathered input the layer does not save for
            # backward (a frozen Linear, a tensor another layer already saved) costs nothing
            "sp_gathered_bytes": _ceil_div(
                min(split.gathered_bytes.get(i, 0) + replicated_total, saved_total), batch
            ),
            "transient_bytes": _ceil_div(transients.get(i, 0), batch),
            "weight_grad_transient_bytes": _ceil_div(weight_grad_transients.get(i, 0), batch),
            "largest_param": largest[i],
            "largest_tp_param": largest_tp[i],
            "param_tensors": counts.tensors[i],
            "grad_partner_params": partners.get(i, 0),  # gradients beside its node's largest
        }
        if input_reads.get(i):  # the batch a pipeline's step() holds
            item["model_input_bytes"] = _ceil_div(input_reads[i], batch)
        item |= split_backward.get(i, {})
        if i in moments:  # the own gradients beside its backward's transient (``own_grads``)
            item["backward_grad_moments"] = [list(point) for point in moments[i]]
        if kv_reads.get(i):
            item["attention_kv_bytes"] = _ceil_div(kv_reads[i], batch)
        if scores.get(i):
            item["attention_score_bytes"] = _ceil_div(scores[i], batch)
            # Megatron's attention backward differs from the zoo's (solver.costs.
            # megatron_attention): its moment is the backward's peak, not the forward's
            backward = getattr(tracer, "backward_transient_peaks", {}).get(i, 0)
            item["attention_backward_transient_bytes"] = _ceil_div(backward, batch)
        expert_saved = sum(n for n, taint in record.expert_saved if not split.is_split(taint))
        ep_comm = experts.comm_bytes.get(i, 0) if experts is not None else 0
        if expert_params[i] or expert_saved or ep_comm:
            item["expert_params"] = expert_params[i]
            item["expert_activation_bytes"] = _ceil_div(expert_saved, batch)
            item["ep_comm_bytes"] = _ceil_div(ep_comm, batch)
        if counts.tied.get(i):
            item["tied_params"] = dict(counts.tied[i])
        if i in split.vocab_layers:
            item |= _vocab_fields(tracer, split, record, i, counts.vocab[i], batch)
        kind = _kind(selection[i][1], split)
        if kind:
            item["kind"] = kind
        if timings is not None:
            item["fwd_ms"] = timings[0][i] / batch
            item["bwd_ms"] = timings[1][i] / batch
        items.append(item)
    return items


def _vocab_fields(
    tracer: Tracer, split: TensorParallelSplit, record, i: int, params: int, batch: int
) -> dict[str, int]:
    """The vocabulary fields of layer ``i`` (``tensor_parallel.py``), per sample (rounded up)."""
    saved = sum(n for n, tag in record.vocab_saved if tag in split.vocab_tags)
    fields = {
        "vocab_rows": split.vocab_layers[i],
        "vocab_params": params,
        "vocab_activation_bytes": _ceil_div(saved, batch),
    }
    for peaks, prefix in (
        (getattr(tracer, "vocab_transient_peaks", {}), ""),
        (getattr(tracer, "vocab_weight_grad_peaks", {}), "weight_grad_"),
    ):
        fixed, vocab = peaks.get(i, (0, 0))
        fields[f"vocab_{prefix}transient_bytes"] = _ceil_div(max(vocab, 0), batch)
        fields[f"fixed_{prefix}transient_bytes"] = _ceil_div(max(fixed, 0), batch)
    return fields


def _graph_meta(
    tracer: Tracer,
    split: TensorParallelSplit,
    counts: _ParamCounts,
    order: list[int],
    names: list[str],
    *,
    batch: int,
    experts: ExpertTracker | None,
) -> dict[str, Any]:
    """What the trace adds to the graph's ``meta`` (before the caller's ``meta``)."""
    shared, unused = counts.shared, counts.unused
    extra: dict[str, Any] = {}
    glue = {names[i]: _ceil_div(r.glue_saved_bytes, batch) for i, r in tracer.layers.items()}
    if any(glue.values()):
        extra["glue_activation_bytes"] = {k: v for k, v in glue.items() if v}
    if shared:
        extra["shared_params"] = shared
    if unused:
        extra["unused_params"] = unused
    # the model's output, when a pipeline's loss_fn computes the loss from it, stays alive for
    # every in-flight micro-batch; what no op saved is not in any layer's activation_bytes
    extra["unsaved_output_bytes"] = _ceil_div(tracer.unsaved_output_bytes(order[-1]), batch)
    uncalled = [names[i] for i in order if tracer.layers[i].first_call is None]
    if uncalled:
        extra["uncalled_layers"] = uncalled
    if split.roles:
        extra["tp_roles"] = dict(sorted(split.roles.items()))
    if experts is not None and experts.moe is not None:
        extra["moe"] = experts.moe
    return extra


def _edges(
    tracer: Tracer,
    order: list[int],
    position: dict[int, int],
    names: list[str],
    batch: int,
    model_name: str,
) -> list[dict[str, Any]]:
    """One edge per (producer, consumer, tensor) of the dataflow (``LayerRecord.in_edges``),
    per-sample bytes. A tensor on several edges, or one of several between a pair, is named
    ``"<producer>:<index>"`` (the producer's tensors numbered in consumer order), so the cost
    model counts it once per stage. Each edge also says whether the tensor requires grad when
    sent (``requires_grad``, written when False), whether ``dst`` saves it for backward
    (``saved``) and whether ``dst``'s ``activation_bytes`` already count its storage
    (``charged``: dst saved it first, written when True) or ``src``'s do (``src_charged``);
    ``costs.direct_boundary_bytes``
    uses them for the torch runtime's buffers."""
    found: list[tuple[int, int, int, int]] = []  # (src, dst, uid, bytes)
    for dst in order:
        merged: dict[tuple[int, int], int] = defaultdict(int)
        for (src, uid), nbytes in tracer.layers[dst].in_edges.items():
            src = tracer.resolve(src)
            if src != dst:
                merged[(src, uid)] += nbytes
        for (src, uid), nbytes in sorted(merged.items(), key=lambda e: position[e[0][0]]):
            if position[src] > position[dst]:
                raise InputError(
                    f"{model_name}: layer {names[dst]!r} reads the output of {names[src]!r}, "
                    "which first runs after it (a layer called more than once); select modules "
                    "that each run once"
                )
            found.append((src, dst, uid, nbytes))
    index: dict[tuple[int, int], int] = {}
    edges_of: dict[int, int] = defaultdict(int)
    tensors_of: dict[tuple[int, int], int] = defaultdict(int)
    for src, dst, uid, _ in found:
        index.setdefault((src, uid), sum(1 for key in index if key[0] == src))
        edges_of[uid] += 1
        tensors_of[(src, dst)] += 1
    edges = []
    for src, dst, uid, nbytes in found:
        edge: dict[str, Any] = {
            "src": names[src],
            "dst": names[dst],
            "bytes": _ceil_div(nbytes, batch),
        }
        if edges_of[uid] > 1 or tensors_of[(src, dst)] > 1:
            edge["tensor"] = f"{names[src]}:{index[(src, uid)]}"
        if uid not in tracer.grad_storages:
            edge["requires_grad"] = False
        edge["saved"] = dst in {tracer.resolve(owner) for owner in tracer.savers.get(uid, ())}
        first_saver = tracer.saved_owner.get(uid)
        first_saver = None if first_saver is None else tracer.resolve(first_saver)
        if edge["saved"] and first_saver == dst:
            edge["charged"] = True
        if first_saver == src:
            edge["src_charged"] = True
        edges.append(edge)
    return edges


_PLAIN_KEYS = {"src", "dst", "bytes", "tensor", "saved", "charged"}


def _edge_key(edge: dict) -> tuple:
    return (edge["src"], edge["dst"], edge["bytes"])


def _kind(layer: nn.Module, split: TensorParallelSplit) -> str | None:
    """``embedding`` for embedding-only layers, ``head`` for the vocab-parallel head's layer;
    None leaves it to the name rule of the format. Used when the model has no block list
    (``layers.layer_kinds`` gives None); otherwise the position around the blocks decides."""
    modules = list(layer.modules())
    if any(id(m) in split.heads for m in modules):
        return "head"
    if any(isinstance(m, nn.Embedding) for m in modules) and not any(is_linear(m) for m in modules):
        return "embedding"
    return None
