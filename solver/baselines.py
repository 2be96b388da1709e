"""Baseline splits users get today, evaluated with our cost model for comparison.

- even: Megatron-LM's default. Transformer blocks are divided evenly over the stages; the embedding
  joins the first stage and the head the last (Megatron builds them on the first/last pipeline
  rank). When the block count does not divide, the remainder goes one block each to the last
  stages. Graphs without that shape are split into equal layer counts.
- parameters: DeepSpeed PipelineModule ``partition_method="parameters"``: contiguous parts
  balanced by parameter count (``ds_utils.partition_balanced``: minimise the largest part's
  parameter count).
Both treat the layer list as a chain (topological order), as those runtimes do.
"""

from __future__ import annotations

import numpy as np

from solver.graph import LayerGraph


def counts_to_assignment(counts: list[int]) -> list[int]:
    """[2, 3] -> [0, 0, 1, 1, 1]."""
    return [stage for stage, count in enumerate(counts) for _ in range(count)]


def even_split(graph: LayerGraph, num_stages: int) -> list[int]:
    """Megatron's even split as a stage index per layer."""
    roles = [layer.role for layer in graph.layers]
    lead = 1 if roles[0] == "embedding" else 0
    tail = 1 if roles[-1] == "head" and len(roles) > lead + 1 else 0
    blocks = len(roles) - lead - tail
    if blocks < num_stages:
        lead = tail = 0
        blocks = len(roles)
    base, extra = divmod(blocks, num_stages)
    counts = [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
    counts[0] += lead
    counts[-1] += tail
    return counts_to_assignment(counts)


def parameter_balanced_split(graph: LayerGraph, num_stages: int) -> list[int]:
    """Contiguous split minimising the largest stage parameter count (every stage non-empty).

    Binary search on the limit with a greedy check (exact for additive, positive weights: the
    greedy packs as much as possible into each part); zero-parameter layers get weight 1 so that
    every stage can be made non-empty.
    """
    weights = np.array([max(layer.params, 1) for layer in graph.layers], dtype=np.int64)
    low, high = int(weights.max()), int(weights.sum())
    while low < high:
        limit = (low + high) // 2
        if _parts_needed(weights, limit) <= num_stages:
            high = limit
        else:
            low = limit + 1
    return _fill(weights, low, num_stages)


def _parts_needed(weights: np.ndarray, limit: int) -> int:
    parts, load = 1, 0
    for weight in weights:
        if load + weight > limit:
            parts, load = parts + 1, 0
        load += weight
    return parts


def _fill(weights: np.ndarray, limit: int, num_stages: int) -> list[int]:
    """Greedy fill under ``limit``, leaving at least one layer for every later stage."""
    assignment, stage, load = [], 0, 0
    num_layers = len(weights)
    for i, weight in enumerate(weights):
        layers_left = num_layers - i
        stages_left = num_stages - stage - 1
        if (
            assignment
            and stage < num_stages - 1
            and (load + weight > limit or layers_left <= stages_left)
            and load > 0
        ):
            stage, load = stage + 1, 0
        assignment.append(stage)
        load += weight
    return assignment


BASELINES = {"even": even_split, "parameters": parameter_balanced_split}
