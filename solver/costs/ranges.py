"""The range in which the cost model's integers are exact: a config whose memory or iteration
could leave it is refused before any coefficient is computed (``check_exact_range``;
docs/layer-graph.md, "Limits")."""

from __future__ import annotations

from fractions import Fraction

from solver.costs.experts import routing_factor
from solver.costs.graph_inputs import graph_totals, profiled_times
from solver.costs.units import NS_PER_MS
from solver.errors import InputError
from solver.graph import LayerGraph
from solver.specs import Cluster, ParallelConfig, TrainingConfig

MAX_EXACT_BYTES = 2**62
"""Largest stage memory the cost model computes: int64 holds 2^63 - 1, and the chain backend adds
its "no value" 2^62 to sums of layer costs (``solver.backends.chain.INF``); CP-SAT needs every
expression inside int64 too (``solver.backends.cpsat.MAX_CP_SAT_VALUE``)."""


MAX_ITERATION_NS = 2**52
"""Longest iteration the cost model computes, ns (52 days): a budget of up to
``specs.MAX_SLOWDOWN`` (1000) times it stays below 2^62, and every float time it rounds is exact
to the nanosecond."""


def check_exact_range(
    graph: LayerGraph,
    config: ParallelConfig,
    cluster: Cluster,
    training: TrainingConfig,
    held: int,
    receive_copies: list[int],
    send_copies: list[int],
    *,
    factor: Fraction | None = None,
) -> None:
    """InputError unless every int64 product and sum of ``layer_costs`` and ``stage_costs`` for
    this config stays exact: upper bounds (every layer on one stage, every micro-batch in flight
    that the schedule holds, ``held``) of a layer's intermediate products and of a stage's memory
    at most :data:`MAX_EXACT_BYTES`, and of the iteration at most :data:`MAX_ITERATION_NS`.
    Computed in floats from the graph's totals, O(1) per config; the limits have a factor 2 of
    headroom over int64, far more than the floats' rounding. Real models are orders of magnitude
    below both (GPT-3 175B: stage peaks near 2^36 bytes, iterations near 2^44 ns). ``factor``:
    the routing factor when the caller has it (``experts.routing_factor``, computed otherwise)."""
    totals = graph_totals(graph)
    t, b, m, p, v = (
        config.tp,
        config.micro_batch,
        config.num_microbatches,
        config.pp,
        config.virtual_stages,
    )
    w, g, o = (
        training.weight_bytes_per_param,
        training.grad_bytes_per_param,
        training.optimizer_bytes_per_param,
    )
    calibration = training.calibration
    scale = max(1.0, *calibration.scales.values()) if calibration else 1.0
    constant = abs(calibration.constant_bytes) if calibration else 0
    layers = graph.num_layers
    if factor is None:
        factor = routing_factor(graph, config, training)
    factor = float(factor)
    # a layer's largest intermediate: t P w before the division by t d, b t (A + T), ...
    largest_product = totals["largest"] * t * max(b, w, g, o, 1) * 2
    memory = (
        scale
        * (
            (2 * w + 2 * g + o + training.optimizer_step_bytes_per_param) * totals["params"]
            # + DDP's buckets and the optimizer step's temporary
            + held * b * (totals["activation_bytes"] + totals["output_bytes"] + totals["edges"])
            + held * b * factor * totals["expert_activation_bytes"]
            + (max(receive_copies) + max(send_copies)) * v * b * totals["edges"]
            + b * totals["largest"] * 2
            + 2 * b * totals["attention_kv_bytes"]  # ring attention: max(c, 4) chunks <= 2 b kv
            + (g + 2 * w) * totals["largest"]
            + 8 * layers
        )
        + constant
        + totals["empirical"]
    )
    rate_per_ms = cluster.gpu_flops * cluster.flops_efficiency / 1e3
    slowest_link = min(cluster.intra_node_gb_per_s, cluster.inter_node_gb_per_s)
    stage_ns = (
        b * (totals["ms"] + totals["flops"] / rate_per_ms) * NS_PER_MS / t
        + 2 * b * totals["tp_comm_bytes"] / cluster.intra_node_gb_per_s
        + 2 * b * factor * totals["ep_comm_bytes"] / slowest_link
        + 4 * b * totals["attention_kv_bytes"] / slowest_link  # ring passes, at most 4 per layer
        + layers
    )
    sync_ns = 3 * g * totals["params"] / slowest_link + layers
    iteration = (m + p) * stage_ns + sync_ns
    # the runtime terms a profile measured (meta.timing) and the optimizer step of every
    # parameter, checked after the layers' (whose message stays as it was for them alone)
    profiled = profiled_times(graph)
    step_per_param = profiled.optimizer_step_ns_per_param or (
        (2 * o + g + w) / cluster.memory_gb_per_s
    )
    runtime_ns = (
        (m + p) * v * profiled.microbatch_overhead_ns
        + profiled.step_overhead_ns
        + step_per_param * totals["params"]
    )
    where = f"{graph.source}: {config.label()}"
    if max(largest_product, memory) > MAX_EXACT_BYTES:
        raise InputError(
            f"{where}: a stage's memory could reach {max(largest_product, memory):.3g} bytes, "
            "beyond the 2^62 the cost model computes exactly; the graph's sizes (parameters, "
            "bytes per sample), the batch and the bytes per parameter are implausible together "
            '(docs/layer-graph.md, "Limits")'
        )
    for total in (iteration, iteration + runtime_ns):
        if not total <= MAX_ITERATION_NS:
            raise InputError(
                f"{where}: an iteration could take {total:.3g} ns ({total / 864e11:.3g} "
                "days), beyond the 2^52 ns (52 days) the cost model computes; check the graph's "
                "FLOPs and times and the cluster's TFLOP/s and bandwidths (docs/layer-graph.md, "
                '"Limits")'
            )
