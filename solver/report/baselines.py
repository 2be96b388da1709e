"""Baseline splits users get today, evaluated with our cost model for comparison.

Every baseline returns a stage index per layer and treats the layer list as a chain (topological
order), as those runtimes do, so its stages are contiguous runs of the list; the throughput-first
planner is the exception: it is our own solver with the time objective, so it respects the data
flow of a DAG like our plans do (contiguous on chains). The resulting split is evaluated exactly
with ``costs.stage_costs`` like any plan (``evaluation.evaluate_partitioners``).

- even: Megatron-LM's default. Transformer blocks are divided evenly over the stages; the embedding
  joins the first stage and the head the last (Megatron builds them on the first/last pipeline
  rank). When the block count does not divide, the remainder goes one block each to the last
  stages. Graphs without that shape are split into equal layer counts.
- uniform: DeepSpeed PipelineModule ``partition_method="uniform"`` (``ds_utils.partition_uniform``
  in ``deepspeed/runtime/utils.py``): every entry of the layer list counts as one item, embedding
  and head included; ``L // p`` items per part and the first ``L % p`` parts one more.
- parameters: DeepSpeed PipelineModule ``partition_method="parameters"``: contiguous parts
  balanced by parameter count (``ds_utils.partition_balanced``: minimise the largest part's
  parameter count).
- size: torchgpipe ``balance_by_size`` (Kim et al. 2020, ``torchgpipe.balance``): profile each
  layer's memory, then ``balance_cost`` splits the list into contiguous blocks of balanced cost
  (torchgpipe's ``blockpartition.solve`` is a heuristic; we solve the same min-max block
  partition exactly, which can only help the baseline). A layer's profiled memory here is what
  the cost model gives it for the config: model states plus the activations it stores for one
  micro-batch (torchgpipe measures one micro-batch and scales parameters by ``param_scale`` for
  the optimizer); in-flight micro-batches, boundary buffers and transients are not in the profile.
- throughput: the throughput-first objective of Alpa (Zheng et al., OSDI'22) and Galvatron (Miao
  et al., VLDB'23): the fastest split of the config whose every stage fits in GPU memory, memory
  being only a constraint (our exact solver with ``objective="time"``; ties to the first split
  the backend returns). When no split fits, the fastest split regardless of memory.
- capslog: the CAPSlog recommendation algorithm (Dreuning et al., PDP 2024): stage memory is
  predicted as ``mem_isolated(first layer) + sum(mem_added(other layers))``; a binary search on a
  threshold T runs a fill-first greedy (each of the first p - 1 stages takes consecutive layers
  while the prediction stays <= T, keeping one layer for every later stage; the last stage takes
  the rest) and keeps the smallest T at which every stage's prediction is <= T. CAPSlog measures
  the two statistics on real runs; without them we derive them from the cost model at the stage
  position the layer would occupy: ``mem_isolated_s(l)`` = peak of stage s holding only layer l
  (its boundary buffers and transient included), ``mem_added_s(l)`` = peak of stage s holding
  l - 1 and l minus ``mem_isolated_s(l - 1)``, the increment CAPSlog measures when l joins a
  stage after l - 1. The prediction is exact where the increments add up (constant transients,
  one edge size); the greedy itself is not exact (CAPSlog's paper: 1-15% above the optimum on
  random statistics), and its split is evaluated exactly afterwards. The tie-break variant that
  recurses around the peak GPU is not implemented.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np

from solver.backends import resolve_backend, solve
from solver.backends.problem import OBJECTIVE_TIME, StageProblem
from solver.costs import LayerCosts
from solver.costs.graph_inputs import layer_roles
from solver.errors import InputError
from solver.graph import LayerGraph


def counts_to_assignment(counts: list[int]) -> list[int]:
    """[2, 3] -> [0, 0, 1, 1, 1]."""
    return np.repeat(np.arange(len(counts)), counts).tolist()


def even_split(graph: LayerGraph, num_stages: int) -> list[int]:
    """Megatron's even split as a stage index per layer."""
    roles = layer_roles(graph)
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


def uniform_split(graph: LayerGraph, num_stages: int) -> list[int]:
    """DeepSpeed ``partition_method="uniform"``: equal layer counts, the first parts one more."""
    base, extra = divmod(graph.num_layers, num_stages)
    return counts_to_assignment([base + (1 if s < extra else 0) for s in range(num_stages)])


def parameter_balanced_split(graph: LayerGraph, num_stages: int) -> list[int]:
    """Contiguous split minimising the largest stage parameter count (every stage non-empty).

    Zero-parameter layers get weight 1 so that every stage can be made non-empty.
    """
    weights = np.array([max(layer.params, 1) for layer in graph.layers], dtype=np.int64)
    return min_max_blocks(weights, num_stages)


def size_balanced_split(costs: LayerCosts) -> list[int]:
    """torchgpipe ``balance_by_size``: contiguous blocks minimising the largest sum of per-layer
    memory (model states + stored activations of one micro-batch, bytes; at least 1)."""
    weights = np.maximum(costs.state_bytes + costs.stored_bytes, 1)
    return min_max_blocks(weights, costs.num_stages)


def min_max_blocks(weights: np.ndarray, num_stages: int) -> list[int]:
    """Contiguous split into non-empty blocks minimising the largest block sum (weights >= 1).

    Binary search on the limit with a greedy check (exact for additive, positive weights: the
    greedy packs as much as possible into each part). Each part is one search in the prefix sums,
    so a check costs O(p log L), not O(L).
    """
    prefix = [0, *np.cumsum(np.asarray(weights, dtype=np.int64)).tolist()]
    low, high = int(np.max(weights)), prefix[-1]
    while low < high:
        limit = (low + high) // 2
        if _fits_in_parts(prefix, limit, num_stages):
            high = limit
        else:
            low = limit + 1
    return _fill(prefix, low, num_stages)


def _greedy_end(prefix: list[int], start: int, limit: int) -> int:
    """One past the last layer of a part from ``start`` holding as many layers as fit under
    ``limit`` (at least one)."""
    return max(start + 1, bisect.bisect_right(prefix, prefix[start] + limit) - 1)


def _fits_in_parts(prefix: list[int], limit: int, num_parts: int) -> bool:
    """The greedy split under ``limit`` needs at most ``num_parts`` parts."""
    start, num_layers = 0, len(prefix) - 1
    for _ in range(num_parts):
        start = _greedy_end(prefix, start, limit)
        if start >= num_layers:
            return True
    return False


def _fill(prefix: list[int], limit: int, num_stages: int) -> list[int]:
    """Greedy fill under ``limit`` (per stage the most layers that fit), leaving at least one
    layer for every later stage; the last stage takes the rest."""
    num_layers = len(prefix) - 1
    counts, start = [], 0
    for stage in range(num_stages - 1):
        later = num_stages - 1 - stage  # stages after this one, each needs a layer
        end = min(_greedy_end(prefix, start, limit), max(start + 1, num_layers - later))
        counts.append(end - start)
        start = end
    counts.append(num_layers - start)
    return counts_to_assignment(counts)


def fastest_fitting_split(
    costs: LayerCosts, capacity_bytes: int | None, *, time_limit_s: float = 60.0
) -> list[int]:
    """Throughput-first: the fastest split whose stages all fit in ``capacity_bytes`` (the
    fastest split of all when none fits), solved exactly by our backend for the graph."""
    backend = resolve_backend(
        "auto",
        costs.is_chain(),
        selective=costs.selective,
        interleaved=costs.rank_rows,
    )
    for capacity in (capacity_bytes, None) if capacity_bytes is not None else (None,):
        problem = StageProblem(costs=costs, objective=OBJECTIVE_TIME, capacity_bytes=capacity)
        solution = solve(problem, backend, time_limit_s=time_limit_s)
        if solution.has_solution:
            return solution.stage_of_layer
    raise AssertionError("a split without a memory limit always exists (pp <= layers)")


def capslog_statistics(costs: LayerCosts) -> tuple[np.ndarray, np.ndarray]:
    """(mem_isolated[s, l], mem_added[s, l]) derived from the cost model, bytes.

    CAPSlog's statistics describe contiguous stages, one per GPU: not interleaved configs.

    isolated[s, l]: peak of stage s holding only layer l; added[s, l]: peak of stage s holding
    l - 1 and l, minus isolated[s, l - 1] (added[s, 0] = 0: layer 0 always starts a stage).
    Valid for chains (the layer list order); a DAG's extra edges are ignored by the prediction.
    """
    if costs.config.virtual_stages > 1:
        raise InputError(
            "CAPSlog's statistics describe one contiguous stage per GPU; no capslog split for "
            f"interleaved config {costs.config.label()}"
        )
    num_layers = costs.num_layers
    edge_in = np.zeros(num_layers, dtype=np.int64)
    edge_out = np.zeros(num_layers, dtype=np.int64)
    # bytes crossing into / out of a stage that holds a run of the list (chain edges i -> i+1)
    chain = costs.edge_dst == costs.edge_src + 1
    np.add.at(edge_in, costs.edge_dst[chain], costs.edge_bytes[chain])
    np.add.at(edge_out, costs.edge_src[chain], costs.edge_bytes[chain])
    k = np.asarray(costs.in_flight, dtype=np.int64)[:, None]
    receive = np.asarray(costs.receive_copies, dtype=np.int64)[:, None]
    send = np.asarray(costs.send_copies, dtype=np.int64)[:, None]
    body = costs.state_bytes[None, :] + k * costs.stored_bytes[None, :]
    transient = costs.transient_bytes
    isolated = (
        body + receive * edge_in[None, :] + send * edge_out[None, :] + transient[None, :]
    ) + costs.constant_bytes
    pair = np.zeros_like(isolated)  # peak of stage s holding l - 1 and l, at column l
    # costs.layer_moments: during(l - 1) holds l - 1 of the running micro-batch, during(l) both
    stored = costs.stored_bytes
    pair[:, 1:] = (
        body[:, :-1]
        + costs.state_bytes[None, 1:]
        + (k - 1) * stored[None, 1:]
        + receive * edge_in[None, :-1]
        + send * edge_out[None, 1:]
        + np.maximum(transient[:-1] + _pair_held(costs), stored[1:] + transient[1:])[None, :]
        + costs.constant_bytes
    )
    late = np.asarray(costs.first_backward_peak, dtype=bool)
    if late.any():  # step gradients: costs.layer_moments of one and two layers
        first_isolated, first_pair = _first_backward_statistics(costs, edge_in, edge_out)
        isolated = np.where(late[:, None], first_isolated, isolated)
        pair = np.where(late[:, None], first_pair, pair)
    if any(costs.after_moments):  # the moments after a backward, one and two layers
        after_isolated, after_pair = _after_statistics(costs, edge_in, edge_out)
        isolated = np.maximum(isolated, after_isolated)
        pair[:, 1:] = np.maximum(pair[:, 1:], after_pair[:, 1:])
    if costs.step_bytes is not None:  # costs.optimizer_step_moment of one and two layers
        at_step = np.array([costs.copies_at(s, 0) for s in range(costs.num_stages)])
        body = costs.state_bytes + costs.step_bytes
        step_isolated = (
            body[None, :]
            + at_step[:, :1] * edge_in[None, :]
            + at_step[:, 1:] * edge_out[None, :]
            + costs.constant_bytes
        )
        isolated = np.maximum(isolated, step_isolated)
        pair[:, 1:] = np.maximum(
            pair[:, 1:],
            (body[:-1] + body[1:])[None, :]
            + at_step[:, :1] * edge_in[None, :-1]
            + at_step[:, 1:] * edge_out[None, 1:]
            + costs.constant_bytes,
        )
    added = np.zeros_like(isolated)
    added[:, 1:] = pair[:, 1:] - isolated[:, :-1]
    return isolated, added


def _first_backward_statistics(
    costs: LayerCosts, edge_in: np.ndarray, edge_out: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Peaks of one- and two-layer stages whose gradients appear at their first backward
    (``costs.layer_moments`` on a chain: the largest of during(l) over its layers; the moments
    after a backward are ``_after_statistics``'), in the layout of ``capslog_statistics``."""
    k = np.asarray(costs.in_flight, dtype=np.int64)[:, None]
    copies = np.array([costs.copies_at(s, int(n)) for s, n in enumerate(costs.in_flight)])
    stages = range(costs.num_stages)
    state, stored = costs.state_bytes, costs.stored_bytes
    grad = np.array([costs.late_column(s) for s in stages], dtype=np.int64)  # [stage, layer]
    own = np.array([costs.late_own(s) for s in stages], dtype=np.int64)  # l's own at its moment
    transient = costs.transient_bytes

    def buffers(pairs: np.ndarray, into: np.ndarray, out_of: np.ndarray) -> np.ndarray:
        return pairs[:, :1] * into[None, :] + pairs[:, 1:] * out_of[None, :]

    fixed = state - grad  # weights and optimizer
    during = fixed + k * stored + own + transient + buffers(copies, edge_in, edge_out)
    isolated = during + costs.constant_bytes
    pair = np.zeros_like(isolated)
    a, b = slice(None, -1), slice(1, None)
    both = fixed[:, a] + fixed[:, b] + (k - 1) * (stored[a] + stored[b])
    at_k = buffers(copies, edge_in[a], edge_out[b])
    running_a = own[:, a] + transient[a] + _pair_held(costs)  # layer a's moment, own and held
    during_a = both + stored[a] + grad[:, b] + running_a + at_k
    during_b = both + stored[a] + stored[b] + own[:, b] + transient[b] + at_k
    pair[:, 1:] = np.maximum(during_a, during_b) + costs.constant_bytes
    return isolated, pair


def _after_statistics(
    costs: LayerCosts, edge_in: np.ndarray, edge_out: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Peaks of one- and two-layer stages at their moments after a backward
    (``costs.after_moments``: every gradient, h held, the largest transient less FSDP2's
    gathers, the copies then), in the layout of ``capslog_statistics``; a stage without such
    moments 0."""
    state, stored = costs.state_bytes, costs.stored_bytes
    gone = costs.after_transient(costs.transient_bytes)
    isolated = np.zeros((costs.num_stages, costs.num_layers), dtype=np.int64)
    pair = np.zeros_like(isolated)
    a, b = slice(None, -1), slice(1, None)
    for s, moments in enumerate(costs.after_moments):
        for h, done in moments:
            receive, send = costs.copies_at(s, h, done)
            one = state + h * stored + gone + receive * edge_in + send * edge_out
            isolated[s] = np.maximum(isolated[s], one + costs.constant_bytes)
            two = (
                state[a] + state[b] + h * (stored[a] + stored[b]) + np.maximum(gone[a], gone[b])
                + receive * edge_in[a] + send * edge_out[b]
            )  # fmt: skip
            pair[s, 1:] = np.maximum(pair[s, 1:], two + costs.constant_bytes)
    return isolated, pair


def _pair_held(costs: LayerCosts) -> np.ndarray:
    """Per pair (l - 1, l) of layers, what the earlier one's moment adds on the stage holding
    the model's last layer (``costs.moment_transient``): the kept output where l is the last."""
    held = np.zeros(max(costs.num_layers - 1, 0), dtype=np.int64)
    held[-1:] = costs.held_output_bytes
    return held


def capslog_split(costs: LayerCosts) -> list[int]:
    """CAPSlog's recommendation: binary search on the threshold over the fill-first greedy."""
    isolated, added = capslog_statistics(costs)
    # every stage's prediction is at most its largest isolated value plus all positive increments
    high = int(isolated.max() + np.maximum(added, 0).sum(axis=1).max())
    low = 0
    best = _capslog_greedy(isolated, added, high)
    assert best is not None, "every split is under the largest possible prediction"
    while low < high:
        threshold = (low + high) // 2
        split = _capslog_greedy(isolated, added, threshold)
        if split is None:
            low = threshold + 1
        else:
            high, best = threshold, split
    return best


def _capslog_greedy(isolated: np.ndarray, added: np.ndarray, threshold: int) -> list[int] | None:
    """Fill-first greedy under ``threshold``; None when some stage's prediction exceeds it."""
    num_stages, num_layers = isolated.shape
    starts = []
    start = 0
    for s in range(num_stages):
        starts.append(start)
        last = num_layers - (num_stages - s)  # latest end that leaves a layer per later stage
        if s == num_stages - 1:
            last = num_layers - 1
        predicted = isolated[s, start] + np.cumsum(added[s, start + 1 : last + 1])
        if isolated[s, start] > threshold:
            return None
        if s == num_stages - 1:
            if len(predicted) and predicted.max() > threshold:
                return None
            break
        over = np.flatnonzero(predicted > threshold)
        end = start + int(over[0]) if len(over) else last  # stop before the first layer over T
        start = end + 1
    lengths = np.diff(np.append(starts, num_layers))
    return np.repeat(np.arange(num_stages), lengths).tolist()


Partitioner = Callable[[LayerGraph, LayerCosts, int | None], list[int]]
"""(graph, the config's layer costs, GPU capacity in bytes or None) -> stage index per layer."""

PARTITIONERS: dict[str, Partitioner] = {
    "even": lambda graph, costs, capacity: even_split(graph, costs.num_stages),
    "uniform": lambda graph, costs, capacity: uniform_split(graph, costs.num_stages),
    "parameters": lambda graph, costs, capacity: parameter_balanced_split(graph, costs.num_stages),
    "size": lambda graph, costs, capacity: size_balanced_split(costs),
    "throughput": lambda graph, costs, capacity: fastest_fitting_split(costs, capacity),
    "capslog": lambda graph, costs, capacity: capslog_split(costs),
}
"""Every baseline partitioner, for reports and benchmarks (see the module docstring)."""

PARTITIONER_SOURCES = {
    "even": "Megatron-LM default (even blocks; embedding first, head last)",
    "uniform": 'DeepSpeed partition_method="uniform"',
    "parameters": 'DeepSpeed partition_method="parameters"',
    "size": "torchgpipe balance_by_size (exact min-max of profiled memory)",
    "throughput": "throughput-first (Alpa/Galvatron objective): fastest split that fits",
    "capslog": "CAPSlog threshold search + fill-first greedy (cost-model statistics)",
}

BASELINES = {"even": even_split, "parameters": parameter_balanced_split}
"""The splits every plan reports (``Plan.baselines``) and ``--split`` accepts by name."""
