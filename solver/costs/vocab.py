"""The vocabulary split over tensor parallelism, per runtime: a layer's word embedding and LM
head (``vocab_rows``, ``vocab_params``, ``vocab_activation_bytes`` and the transients'
vocabulary parts of the graph) as each runtime shards them.

- **megatron**: always vocabulary-parallel (``VocabParallelEmbedding``, the output layer a
  ``ColumnParallelLinear`` whose logits stay sharded through ``vocab_parallel_cross_entropy``),
  whatever the size, over the vocabulary Megatron-LM pads to a multiple of
  ``make_vocab_size_divisible_by`` (128) x t (``_vocab_size_with_padding``): each rank holds
  V_pad / t rows of the tables (weights, gradients, optimizer state) and of the logits, the
  fp32 softmax it saves and their gradients. With k = V_pad / V:

    P_l     -> P_l - P_v + k P_v              the tables padded (P_v = ``vocab_params``)
    tp_P_l  -> tp_P_l - [V >= R] P_v + k P_v  and all split over t (R = 16384: the profile's
                                              ``tp_params`` count them from R rows on)
    A_l, tp_A_l the same with ``vocab_activation_bytes`` (rounded up)
    largest_l -> min(largest_l, the replicated rest)  a replicated vocabulary table was the
                                              largest replicated tensor: the weight-gradient
                                              temporary of one split over t instead
    T_l     -> F_l + ceil(k V_l / t)          F_l, V_l: the largest fixed and vocabulary-sized
                                              parts of the layer's transient at any moment
                                              (``fixed_transient_bytes``, ``vocab_transient_
                                              bytes``; the same at the weight-gradient moments):
                                              every moment's F_m + k V_m / t is at most this;
               and at most max(T_l, F_l) when k <= t (a moment's vocabulary part, when
               positive, only shrinks; when negative, a released saved softmax, the moment
               is at most F_l)

- **torch** (``profiling.executors.parallelize``): the split the profile made, vocabularies of
  16384+ rows (``VOCAB_PARALLEL_MIN_ROWS``) by rows, unpadded (DTensor's ``Shard`` gives the
  first ranks ceil(V / t) rows), the rest replicated: parameters and saved tensors as the
  graph's ``tp_params`` and ``tp_activation_bytes`` say; the transient of a split vocabulary
  -> F_l + ceil(V_l ceil(V / t) / V) (``loss_parallel`` keeps the logits sharded).

A graph without the fields (written before them) keeps the profile's split and its whole
transients: the behaviour before. A layer with ``tied_params`` and ``vocab_rows`` (an LM head
sharing the embedding) holds its copy split the same way (``embeddings.with_tied_copies``).
docs/cost-model.md, "Vocabulary split".
"""

from __future__ import annotations

import numpy as np

from solver.costs.units import ceil_div
from solver.engine_rules import MEGATRON_VOCAB_MULTIPLE
from solver.graph_fields import VOCAB_PARALLEL_MIN_ROWS
from solver.specs import ParallelConfig


def vocab_rows_per_rank(rows: np.ndarray, config: ParallelConfig, runtime: str) -> np.ndarray:
    """Rows of each layer's vocabulary one TP rank holds (before the division by t: the padded
    rows on megatron, ceil(V / t) t on torch for a split vocabulary), V itself where the runtime
    leaves the vocabulary replicated, 0 without one."""
    t = config.tp
    if runtime == "megatron":
        multiple = MEGATRON_VOCAB_MULTIPLE * t  # ``engine_rules.padded_vocab_size``, per layer
        return ceil_div(rows, multiple) * multiple
    return np.where(rows >= VOCAB_PARALLEL_MIN_ROWS, ceil_div(rows, t) * t, rows)


def with_vocab_split(
    cols: dict[str, np.ndarray], config: ParallelConfig, runtime: str
) -> dict[str, np.ndarray]:
    """The columns with each vocabulary split as ``runtime`` splits it (module docstring);
    ``cols`` itself when no layer has a vocabulary."""
    rows = cols["vocab_rows"]
    if not rows.any():
        return cols
    held_rows = vocab_rows_per_rank(rows, config, runtime)
    # the divisor: 1 where no vocabulary (its parts are 0 there)
    safe_rows = np.maximum(rows, 1)
    out = dict(cols)
    if runtime == "megatron":
        split_in_profile = rows >= VOCAB_PARALLEL_MIN_ROWS
        for total, part, split in (
            ("params", "vocab_params", "tp_params"),
            ("activation_bytes", "vocab_activation_bytes", "tp_activation_bytes"),
        ):
            padded = ceil_div(cols[part] * held_rows, safe_rows)
            out[total] = cols[total] - cols[part] + padded
            out[split] = cols[split] - np.where(split_in_profile, cols[part], 0) + padded
        # the largest replicated tensor: no vocabulary table now, so at most the replicated rest
        rest = cols["params"] - cols["tp_params"] - cols["expert_params"]
        rest = rest - np.where(split_in_profile, 0, cols["vocab_params"])
        out["largest_param"] = np.minimum(cols["largest_param"], rest)
        out["largest_tp_param"] = np.maximum(
            cols["largest_tp_param"], ceil_div(cols["vocab_params"] * held_rows, safe_rows)
        )
    t = config.tp
    splits = rows > 0 if runtime == "megatron" else rows >= VOCAB_PARALLEL_MIN_ROWS
    changed = splits & ((held_rows != rows) | (t > 1))
    for total, vocab, fixed in (
        ("transient_bytes", "vocab_transient_bytes", "fixed_transient_bytes"),
        (
            "weight_grad_transient_bytes",
            "vocab_weight_grad_transient_bytes",
            "fixed_weight_grad_transient_bytes",
        ),
    ):
        measured = changed & (cols[vocab] >= 0)
        if not measured.any():
            continue
        bound = cols[fixed] + ceil_div(cols[vocab] * held_rows, safe_rows * t)
        # with k <= t a moment's vocabulary part shrinks: at most max(T, F) as well
        shrinks = held_rows <= rows * t
        bound = np.where(shrinks, np.minimum(bound, np.maximum(cols[total], cols[fixed])), bound)
        out[total] = np.where(measured, bound, cols[total])
    return out


def split_tied_copies(
    rows: np.ndarray, elements: np.ndarray, config: ParallelConfig, runtime: str
) -> tuple[np.ndarray, np.ndarray]:
    """(split, padded elements) of each layer's tied copy of ``elements`` vocabulary-table
    elements: split over t where the runtime splits that layer's vocabulary (megatron: every
    ``vocab_rows`` > 0 whose copy is whole rows, padded: what one rank holds x t); elsewhere not
    split and the elements as they are (the torch runtime refuses a tied vocabulary-parallel
    table, ``profiling.executors.parallelize``: below 16384 rows it is replicated)."""
    if runtime != "megatron":
        return np.zeros(len(rows), dtype=bool), elements
    split = (rows > 0) & (elements > 0) & (elements % np.maximum(rows, 1) == 0)
    held_rows = vocab_rows_per_rank(rows, config, runtime)
    padded = ceil_div(elements * held_rows, np.maximum(rows, 1))
    return split, np.where(split, padded, elements)
