"""Tied parameters held twice under pipeline parallelism: an LM head sharing its weight with the
input embedding (HF ``tie_word_embeddings``, GPT-2, Gemma, small Qwen2) on another stage.

A layer's ``tied_params`` (graph field: {"<owner layer>": elements}) are parameters the graph
counts once, in the owner's ``params``. With pp > 1 the stage of the layer using them keeps its
own copy: Megatron-core's ``share_embeddings_and_output_weights`` makes the last stage allocate
the output layer's weight (with its gradient and optimizer state) and, after the backward,
all-reduces the two copies' gradients over the embedding group (first and last pipeline ranks,
``finalize_model_grads`` -> ``_allreduce_word_embedding_grads``); torch pipelining keeps the
tied module on both stages (../shared/reference/runtime-memory-facts.md). So with p > 1:

  P_l += n_l          the copy's n_l elements join layer l's parameters, and with them its
                      weights, gradients and optimizer state (ZeRO as the rest): split over TP
                      like the vocabulary it copies (``vocab``: on megatron a head with
                      ``vocab_rows`` holds k n_l / t, k = V_pad / V, Megatron's output layer is
                      vocabulary-parallel), else replicated (torch: a tied table is replicated)
  largest_l = max(largest_l, n_l)   the copy's weight-gradient temporary on that stage (of the
                      split parameters when split: k n_l / t)
  tail_l, tail_o += ceil(g n_l' / B(0, p-1))   the gradient all-reduce of the two copies (two
                      ranks: a ring moves 2 (2-1)/2 = 1 x the g n_l' gradient bytes per GPU,
                      n_l' the elements per GPU, unsharded: Megatron all-reduces ``main_grad``
                      after the data-parallel sync) over the link between the first and the last
                      pipeline ranks, charged to the using layer and to its owner (both ranks wait
                      for it before their optimizer step)

  G_o -> G_o - d n_o   on megatron, the owner o's weight-gradient transient without the tie's
                      accumulation: a single-device profile makes o's own gradient of the table
                      (n_o elements in the profile's dtype, d bytes: ``meta.dtype``) and sums it
                      with the using layer's into ``.grad``, so that gradient is live beside the
                      sum when the weight gradient is made; with Megatron's separate copy it is
                      o's gradient itself (measured: qwen2 at pp 2, +3.2% on the first stage
                      before). Only where the table is o's one parameter tensor (params_o =
                      n_o: the moment is the table's) and the dtype is known; at least 0.
                      On torch (torch pipelining's copies, :mod:`profiling.executors.tied`)
                      for every owner, kept at least d (params_o - n_o) (its other parameters'
                      gradients) where it was more. The anytime transients T_o of the owner and
                      T_l, G_l of the using layer can hold a table-sized gradient too (the zoo's
                      GPT head: its gradient of the table, which it does not own in the
                      profile), but not always (HF's lm_head: not), and the columns do not say
                      which part it is: they stay (an over-prediction, never an under-one)

The charge assumes the layer and its owner are on different stages, which a chain with the
embedding first and the head last always has at p > 1; where a plan puts them on one stage (a
DAG such as T5), the copy is charged though not held: an over-prediction, never an under-one.
With p = 1 nothing changes. docs/cost-model.md, "Tied parameters".
"""

from __future__ import annotations

import numpy as np

from solver.costs.times import pipeline_links
from solver.costs.vocab import split_tied_copies
from solver.graph import LayerGraph
from solver.specs import Cluster, ParallelConfig, TrainingConfig


def tied_columns(graph: LayerGraph) -> tuple[np.ndarray, np.ndarray]:
    """(n_l, the sum of the n of the layers tied to l as owner) per layer, elements."""
    position = graph.index()
    used = np.zeros(graph.num_layers, dtype=np.int64)
    owned = np.zeros(graph.num_layers, dtype=np.int64)
    for i, layer in enumerate(graph.layers):
        for owner, count in (layer.tied_params or {}).items():
            used[i] += count
            owned[position[owner]] += count
    return used, owned


def with_tied_copies(
    cols: dict[str, np.ndarray], graph: LayerGraph, config: ParallelConfig, runtime: str
) -> dict[str, np.ndarray]:
    """The columns with each tied copy among its layer's parameters when p > 1, split over TP
    as ``runtime`` splits the layer's vocabulary (module docstring: P_l and largest_l);
    ``cols`` itself when no copy is held."""
    used, _ = tied_columns(graph)
    if config.pp == 1 or not used.any():
        return cols
    split, copy = split_tied_copies(cols["vocab_rows"], used, config, runtime)
    held = dict(cols)
    held["params"] = cols["params"] + copy
    held["tp_params"] = cols["tp_params"] + np.where(split, copy, 0)
    held["largest_param"] = np.maximum(cols["largest_param"], np.where(split, 0, copy))
    held["largest_tp_param"] = np.maximum(cols["largest_tp_param"], np.where(split, copy, 0))
    return held


PROFILE_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of a gradient in the profile, by the graph's ``meta.dtype``."""


def without_tied_accumulation(
    cols: dict[str, np.ndarray], graph: LayerGraph, config: ParallelConfig, runtime: str
) -> dict[str, np.ndarray]:
    """The columns with each tie owner's weight-gradient transient less the accumulation of the
    copies' gradients a single-device profile makes (module docstring, G_o), at p > 1 on
    megatron and torch (where each stage keeps its own copy); ``cols`` itself elsewhere or when
    no owner qualifies."""
    if runtime not in ("megatron", "torch") or config.pp == 1:
        return cols
    _, owned = tied_columns(graph)
    size = PROFILE_DTYPE_BYTES.get(graph.meta.get("dtype"))
    if size is None or not owned.any():
        return cols
    # megatron: where the table is the owner's one tensor; torch: any owner, kept at least its
    # other parameters' gradient bytes (what its other weight-gradient moments can hold)
    owners = (owned > 0) & ((cols["params"] == owned) | (runtime == "torch"))
    rest = size * (cols["params"] - owned)
    out = dict(cols)
    for key in ("weight_grad_transient_bytes", "fixed_weight_grad_transient_bytes"):
        out[key] = _less(cols[key], owners, size * owned, floor=rest)
    return out


def _less(
    column: np.ndarray, rows: np.ndarray, amount: np.ndarray, floor: np.ndarray | int = 0
) -> np.ndarray:
    """``column`` less ``amount`` on ``rows`` where measured (-1: not measured), at least
    ``floor`` (and 0) unless the column was below it already."""
    less = np.maximum(column - amount, np.minimum(column, np.maximum(floor, 0)))
    return np.where(rows & (column >= 0), less, column)


def tied_sync_ns(
    graph: LayerGraph,
    cols: dict[str, np.ndarray],
    config: ParallelConfig,
    cluster: Cluster,
    training: TrainingConfig,
) -> np.ndarray:
    """The tied copies' gradient all-reduce per layer, ns per iteration (module docstring,
    tail_l; a copy split over TP moves each rank's share): zeros with p = 1 or no tied
    parameter."""
    used, owned = tied_columns(graph)
    if config.pp == 1 or not used.any():
        return np.zeros(graph.num_layers, dtype=np.int64)
    split, copy = split_tied_copies(cols["vocab_rows"], used, config, training.runtime)
    per_gpu = np.where(split, -(-copy // config.tp), copy)
    # the owner moves what its users do: the same share of the same table
    position = graph.index()
    owned_per_gpu = np.zeros_like(owned)
    for i, layer in enumerate(graph.layers):
        for owner, count in (layer.tied_params or {}).items():
            owned_per_gpu[position[owner]] += -(-per_gpu[i] * count // max(used[i], 1))
    bytes_per_ns = pipeline_links(config, cluster)[(0, config.pp - 1)]
    grad_bytes = training.grad_bytes_per_param * (per_gpu + owned_per_gpu)
    return np.ceil(grad_bytes / bytes_per_ns).astype(np.int64)
