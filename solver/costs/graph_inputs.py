"""Everything the cost model reads from a layer graph, in one place: the per-layer fields as
arrays (``graph_columns``), their sums for the range check (``graph_totals``), the edges' tensors,
what the profile measured of the runtime (``profiled_ns``, ``optimizer_step_ns_per_param``), the
model output no op saves (``unsaved_output_bytes``), the bytes glue code saves
(``glue_saved_bytes``) and which layers a runtime recomputes
(``recomputable_layers``). The router (``meta.moe``) is ``solver.costs.moe``'s; the empirical
statistics are ``empirical``'s. ``solver.graph`` stays the format alone. Arrays are cached on the
graph object.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from solver.errors import InputError
from solver.graph import INTEGER_FIELDS, LayerGraph, timing_of
from solver.graph_fields import UNBATCHED_FIELDS, VOCAB_TRANSIENT_PAIRS


def graph_columns(graph: LayerGraph) -> dict[str, np.ndarray]:
    """The graph's per-layer fields as numpy arrays (cached on the graph object)."""
    cached = getattr(graph, "_columns", None)
    if cached is not None:
        return cached
    layers = graph.layers
    ints = lambda key: np.array([getattr(x, key) for x in layers], dtype=np.int64)  # noqa: E731
    measured = np.array([x.fwd_ms is not None and x.bwd_ms is not None for x in layers])
    position = graph.index()
    cols = {key: ints(key) for key in INTEGER_FIELDS}
    for key in ("weight_grad_transient_bytes", "attention_backward_transient_bytes"):
        # a part of the transient, measured at some moments: the whole transient where absent
        cols[key] = np.array(
            [x.transient_bytes if getattr(x, key) is None else getattr(x, key) for x in layers],
            dtype=np.int64,
        )
    for key, figure in UNBATCHED_FIELDS.items():
        # the batch-independent parts (``unbatched``), 0 where absent; a moment's figure taken
        # as the whole transient takes the transient's part too
        cols[key] = np.array(
            [
                (x.unbatched_transient_bytes if getattr(x, figure) is None else getattr(x, key))
                or 0
                for x in layers
            ],
            dtype=np.int64,
        )
    for key in (key for pair in VOCAB_TRANSIENT_PAIRS for key in pair):
        # -1: not measured (``vocab.with_vocab_split`` keeps the whole transient there)
        cols[key] = np.array(
            [-1 if getattr(x, key) is None else getattr(x, key) for x in layers], dtype=np.int64
        )
    # Adam's step counts and the model inputs a layer reads first: 0 where not measured (a
    # hand-made or older graph: a few bytes per tensor, far below its closed-form error; see
    # states.step_count_bytes)
    cols["param_tensors"] = np.array([x.param_tensors or 0 for x in layers], dtype=np.int64)
    cols["model_input_bytes"] = np.array([x.model_input_bytes or 0 for x in layers], dtype=np.int64)
    cols.update(
        measured=measured,
        fwd_ms=np.array([x.fwd_ms or 0.0 for x in layers]),
        bwd_ms=np.array([x.bwd_ms or 0.0 for x in layers]),
        fwd_flops=np.array([x.fwd_flops for x in layers], dtype=float),
        bwd_flops=np.array(
            [2 * x.fwd_flops if x.bwd_flops is None else x.bwd_flops for x in layers], dtype=float
        ),
        edge_src=np.array([position[e.src] for e in graph.edges], dtype=np.int64),
        edge_dst=np.array([position[e.dst] for e in graph.edges], dtype=np.int64),
        edge_bytes=np.array([e.bytes for e in graph.edges], dtype=np.int64),
        edge_tensor=_edge_tensors(graph),
        edge_requires_grad=np.array([e.requires_grad for e in graph.edges], dtype=bool),
        edge_saved=np.array(
            [-1 if e.saved is None else int(e.saved) for e in graph.edges], dtype=np.int64
        ),
        edge_charged=np.array([e.charged for e in graph.edges], dtype=bool),
        edge_src_charged=np.array([e.src_charged for e in graph.edges], dtype=bool),
        glue_activation_bytes=glue_saved_bytes(graph),
    )
    cols.update(_tie_columns(graph, position))
    graph._columns = cols
    return cols


def _tie_columns(graph: LayerGraph, position: dict[str, int]) -> dict[str, np.ndarray]:
    """The graph's ``tied_params`` as arrays, one entry per (user, owner) pair in layer order:
    ``tie_user``, ``tie_owner`` (layer positions) and ``tie_elements``; and per layer
    ``tied_used`` (the elements l holds of others' tables) and ``tied_owned`` (of l's tables,
    the elements others hold), for ``embeddings`` and ``states``."""
    pairs = [
        (i, position[owner], count)
        for i, layer in enumerate(graph.layers)
        for owner, count in (layer.tied_params or {}).items()
    ]
    user, owner, elements = np.array(pairs, dtype=np.int64).reshape(-1, 3).T.copy()
    used = np.zeros(graph.num_layers, dtype=np.int64)
    owned = np.zeros(graph.num_layers, dtype=np.int64)
    np.add.at(used, user, elements)
    np.add.at(owned, owner, elements)
    return {
        "tie_user": user,
        "tie_owner": owner,
        "tie_elements": elements,
        "tied_used": used,
        "tied_owned": owned,
    }


def _edge_tensors(graph: LayerGraph) -> np.ndarray:
    """An index per edge: edges naming one tensor (``Edge.tensor``) share it, others get their
    own."""
    index: dict[str, int] = {}
    tensors = []
    for position, edge in enumerate(graph.edges):
        key = f"#{position}" if edge.tensor is None else edge.tensor
        tensors.append(index.setdefault(key, len(index)))
    return np.array(tensors, dtype=np.int64)


def graph_totals(graph: LayerGraph) -> dict[str, float]:
    """Sums and maxima of a graph's fields (floats: no overflow) for ``check_exact_range``
    (cached on the graph object)."""
    cached = getattr(graph, "_totals", None)
    if cached is not None:
        return cached
    layers = graph.layers
    fields = (
        "params",
        "activation_bytes",
        "output_bytes",
        "tp_comm_bytes",
        "attention_kv_bytes",
        "expert_activation_bytes",
        "ep_comm_bytes",
    )
    totals = {key: float(sum(getattr(layer, key) for layer in layers)) for key in fields}
    # a tied parameter is held again by a stage without its owner (``embeddings``)
    totals["params"] += float(sum(sum((x.tied_params or {}).values()) for x in layers))
    totals["edges"] = float(sum(edge.bytes for edge in graph.edges))
    totals["largest"] = float(
        max(
            max(
                layer.params,
                layer.activation_bytes + layer.transient_bytes,
                layer.output_bytes,
                layer.largest_param,
                layer.largest_tp_param,
            )
            for layer in layers
        )
    )
    totals["largest"] = max([totals["largest"], *(float(edge.bytes) for edge in graph.edges)])
    totals["empirical"] = float(
        sum((layer.mem_isolated or 0) + (layer.mem_added or 0) for layer in layers)
    )
    # per sample, with a recomputed forward: measured ms, and FLOPs (divided by the rate later)
    totals["ms"] = float(sum(2 * (layer.fwd_ms or 0.0) + (layer.bwd_ms or 0.0) for layer in layers))
    totals["flops"] = float(
        sum(
            2 * layer.fwd_flops
            + (2 * layer.fwd_flops if layer.bwd_flops is None else layer.bwd_flops)
            for layer in layers
        )
    )
    graph._totals = totals
    return totals


def unsaved_output_bytes(graph: LayerGraph) -> int:
    """Bytes per sample of the model's output (its last layer's) that no op saves for backward:
    the graph's ``meta["unsaved_output_bytes"]`` (``profiling.export`` writes it; 0 when absent,
    as in graphs written before it). HuggingFace's ``lm_head`` returns the logits, which the
    linear does not save: all of them; the zoo's head returns the loss: 4 bytes."""
    value = graph.meta.get("unsaved_output_bytes", 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**50:
        raise InputError(
            f"{graph.source}: $.meta.unsaved_output_bytes: {value!r} is not a byte count in "
            "0..2^50; give the per-sample bytes of the last layer's output no op saves, or "
            "remove the field"
        )
    return value


def glue_saved_bytes(graph: LayerGraph) -> np.ndarray:
    """Bytes per sample, per layer, that glue code the layer owns (outside its module: a loss
    after the LM head) saves for backward: the graph's ``meta["glue_activation_bytes"]`` ({layer
    name: bytes}; ``profiling.export`` writes it, part of the layer's ``activation_bytes``; all
    0 when absent, as in older graphs). A checkpoint of the layer's module does not recompute
    them: the torch runtime keeps them under recomputation (``layers``)."""
    cached = getattr(graph, "_glue", None)
    if cached is not None:
        return cached.copy()
    value = graph.meta.get("glue_activation_bytes", {})
    where = f"{graph.source}: $.meta.glue_activation_bytes"
    if not isinstance(value, dict):
        raise InputError(
            f"{where}: {type(value).__name__} is not an object; give {{layer name: bytes per "
            "sample}} or remove the field"
        )
    position = graph.index()
    glue = np.zeros(len(graph.layers), dtype=np.int64)
    for name, nbytes in value.items():
        if name not in position:
            raise InputError(
                f"{where}: {name!r} is not a layer of the graph; name a layer or remove the entry"
            )
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= 2**50:
            raise InputError(
                f"{where}.{name}: {nbytes!r} is not a byte count in 0..2^50; give the per-sample "
                "bytes the layer's glue saves, or remove the entry"
            )
        glue[position[name]] = nbytes
    graph._glue = glue
    return glue.copy()


def layer_roles(graph: LayerGraph) -> list[str]:
    """Every layer's ``Layer.role`` (embedding, block, head, other), cached on the graph object
    (a role read from a name takes a few string searches: seconds over 10^6 layers)."""
    cached = getattr(graph, "_roles", None)
    if cached is None:
        cached = graph._roles = [layer.role for layer in graph.layers]
    return cached


def recomputable_layers(graph: LayerGraph, runtime: str) -> np.ndarray:
    """Which layers ``runtime`` recomputes under recomputation: megatron the transformer blocks
    (``Layer.role == "block"``), torch every layer."""
    if runtime == "torch":
        return np.ones(len(graph.layers), dtype=bool)
    cached = getattr(graph, "_blocks", None)
    if cached is None:
        cached = graph._blocks = np.array(layer_roles(graph), dtype=object) == "block"
    return cached.copy()


def profiled_ns(graph: LayerGraph, name: str) -> int:
    """A runtime term the graph's profile measured (``meta.timing``'s ``microbatch_overhead_ns``
    or ``step_overhead_ns``), ns rounded up, else 0."""
    timing = timing_of(graph)
    measured = None if timing is None else timing.get(name)
    return 0 if measured is None else math.ceil(float(measured))


class ProfiledTimes(NamedTuple):
    """The runtime terms a real profile measured (``meta.timing``, ``solver.graph.timing_of``;
    ``profiling.trace.time_terms``)."""

    optimizer_step_ns_per_param: float | None
    """One optimizer step, ns per parameter element; None: not measured (the model then takes
    the bytes a step moves over the memory bandwidth, ``times.layer_optimizer_step_ns``)."""
    microbatch_overhead_ns: int
    """The runtime's own time per micro-batch and (virtual) stage, ns (0: not measured)."""
    step_overhead_ns: int
    """The runtime's own time per step and rank, ns (0: not measured)."""


def profiled_times(graph: LayerGraph) -> ProfiledTimes:
    """The runtime terms of the graph's profile (``ProfiledTimes``)."""
    timing = timing_of(graph)
    return ProfiledTimes(
        optimizer_step_ns_per_param=(
            None if timing is None else timing.get("optimizer_step_ns_per_param")
        ),
        microbatch_overhead_ns=profiled_ns(graph, "microbatch_overhead_ns"),
        step_overhead_ns=profiled_ns(graph, "step_overhead_ns"),
    )
