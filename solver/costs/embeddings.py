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

With p = 1 the owner and its users share one table, and autograd sums their gradients of it
(the profile holds none of them in its per-sample transients: ``profiling.trace.param_grads``).
B = w n' is one gradient of the table (w bytes per parameter, n' its elements per GPU, split over
TP as the vocabulary is), U the users of owner o, u* the last (a chain's LM head):

  G_u += B            a user's partial gradient of the table, made in its backward; where a
                      later user's is held, + B more: autograd sums the two (T5's decoder
                      embedding with the head's partial held)
  T_l, G_l += B       o < l < u*: the partial sum is held through the backward of every layer
                      between them (from u*'s backward until the owner's)
  T_o += B, G_o += 2B the owner holds it through its backward; at its weight gradient its own
                      partial and the held one are live beside the sum (the weight-gradient
                      temporary gtemp_o, which becomes ``.grad`` or is added to it)

These are batch-independent: a torch run holds one of each whatever the micro-batch (measured
on the zoo's GPT-2 small, tied, fp32, one micro-batch of 4: the profile's per-sample figures had
charged 4 of each, +14.1%). Forward moments of the layers in between take B too (a small
over-count where a layer's forward transient is its peak).

The charge assumes the layer and its owner are on different stages, which a chain with the
embedding first and the head last always has at p > 1; where a plan puts them on one stage (a
DAG such as T5), the copy is charged though not held (and covers the partial gradients then
held): an over-prediction, never an under-one. With p = 1 no copy is held.
docs/cost-model.md, "Tied parameters".
"""

from __future__ import annotations

import numpy as np

from solver.costs.graph_inputs import graph_columns
from solver.costs.times import pipeline_links
from solver.costs.vocab import split_tied_copies
from solver.graph import LayerGraph
from solver.specs import Cluster, ParallelConfig, TrainingConfig


def tied_columns(graph: LayerGraph) -> tuple[np.ndarray, np.ndarray]:
    """(n_l, the sum of the n of the layers tied to l as owner) per layer, elements."""
    cols = graph_columns(graph)
    return cols["tied_used"], cols["tied_owned"]


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


def tied_gradient_bytes(
    cols: dict[str, np.ndarray], graph: LayerGraph, config: ParallelConfig, training: TrainingConfig
) -> tuple[np.ndarray, np.ndarray]:
    """(anytime, at the weight gradients) bytes per GPU each layer's moments hold of a tied
    table's partial gradients with p = 1 (module docstring: T_l, G_l), zeros at p > 1 (each
    stage keeps its own copy, whose gradient is the copy's weight-gradient temporary).
    ``cols``: after ``vocab.with_vocab_split``."""
    count = graph.num_layers
    anytime = np.zeros(count, dtype=np.int64)
    at_grad = np.zeros(count, dtype=np.int64)
    used, _ = tied_columns(graph)
    if config.pp > 1 or not used.any():
        return anytime, at_grad
    split, copy = split_tied_copies(cols["vocab_rows"], used, config, training.runtime)
    table = training.weight_bytes_per_param * np.where(split, -(-copy // config.tp), copy)
    ties = graph_columns(graph)
    users: dict[int, list[int]] = {}
    for user, owner in zip(ties["tie_user"].tolist(), ties["tie_owner"].tolist(), strict=True):
        users.setdefault(owner, []).append(user)
    for owner, using in users.items():
        size = int(table[using].max())
        last = max(using)
        anytime[owner + 1 : last] += size  # the partial sum held from u*'s backward on
        at_grad[owner + 1 : last] += size
        for user in using:
            at_grad[user] += size * (1 if user == last else 2)
        anytime[owner] += size
        at_grad[owner] += 2 * size
    return anytime, at_grad


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
    ties = graph_columns(graph)
    user, count = ties["tie_user"], ties["tie_elements"]
    share = -(-per_gpu[user] * count // np.maximum(used[user], 1))
    owned_per_gpu = np.zeros_like(owned)
    np.add.at(owned_per_gpu, ties["tie_owner"], share)
    bytes_per_ns = pipeline_links(config, cluster)[(0, config.pp - 1)]
    grad_bytes = training.grad_bytes_per_param * (per_gpu + owned_per_gpu)
    return np.ceil(grad_bytes / bytes_per_ns).astype(np.int64)
