"""Per-layer coefficients of one config: :func:`layer_costs` reads the graph's columns
(``graph_inputs``) and builds the :class:`~solver.costs.coefficients.LayerCosts` every backend
uses, from the model states (``states``), the activations below, the time terms (``times``) and
the MoE and CP terms (``experts``, ``context_parallel``).

Notation: config (p, t, d), micro-batch b, m micro-batches per step, bytes per parameter (w, g,
o), ZeRO stage z.

  A'_l = (activation_bytes - expert_activation_bytes - tp_activation_bytes) + tp_act / t
         + X'_l / b                                                  saved bytes per sample per GPU
         (X'_l the routed experts' part, ``experts.expert_stored_bytes``)
  A'_l = activation_bytes / t  with sequence parallelism (config.sp; Korthikanti et al. 2022,
         sbh(34/t + 5as/(ht)) against sbh(10 + 24/t + 5as/(ht))): the parts TP leaves replicated
         (norm inputs, dropout masks, residuals) are split along the sequence over the t ranks too;
         so are the tensors sent between stages, [s/t, b, h]: an edge carries ceil(b bytes / t) per
         micro-batch, and a recomputed layer keeps ceil(b output_bytes / t);
         + (t-1)/t sp_gathered_bytes on the torch runtime, whose eager autograd saves the
         gathered input of each column-parallel Linear where Megatron saves its shard
  P'_l, A'_l, trans_l with the vocabulary split over t as the runtime splits it (``vocab``:
         Megatron always, padded to a multiple of 128 t, the logits transient / t too; torch
         from 16384 rows)
  P'_l, largest_l with the tied copy a stage keeps at p > 1 (``embeddings``: an LM head's own
         copy of the tied embedding, split like its vocabulary; its gradient all-reduce in the
         layer's tail); at p = 1 the tied table's partial gradients autograd holds and sums,
         tie_l (anytime) and tieg_l (at the weight gradients), batch-independent
         (``embeddings.tied_gradient_bytes``: B from the LM head's backward to the embedding's,
         2B more at the embedding's weight gradient)
  stored_l  = b A'_l, or b output_bytes_l when l is recomputed         per micro-batch, rounded up;
              every b X here is b (X - F) + F with F the figure's batch-independent part
              (``unbatched``: the graph's unbatched_* fields, 0 where absent)
  torch runtime: the last layer's stored bytes += b unsaved_output_bytes (graph meta): a
              pipeline's loss_fn keeps the model's output per in-flight micro-batch, and the
              one in backward keeps it through every layer of its stage: during(l) of each
              earlier layer of the last layer's stage + b unsaved_output_bytes
              (``LayerCosts.held_output_bytes``)
  gtemp_l   = w (max(largest_param_l, largest_tp_param_l / t) + grad_partner_params_l): a
              weight gradient is computed in the weights' dtype into a temporary and added to
              the persistent gradient (.grad, or Megatron's fp32 main_grad) while backward
              accumulates, beside the gradients its op returns with it (a linear's bias
              gradient; the most over the layer's ops, whole on every TP rank: over where
              split, or where the largest is another op's); a largest_param larger
              than the layer's dense replicated parameters is a routed-expert tensor, held
              / (t ep) (``experts.largest_local_param``)
  gather_l  = 2 w P'_l with ZeRO-3, else 0: the running layer's weights are gathered and the next
              layer's prefetched (FSDP), each freed again after use; on the torch runtime's
              FSDP2 (ZeRO 2/3, d > 1) the buffers ``fsdp`` derives from torch's code: the
              prefetched neighbour's size, and at the weight gradients the layer's whole
              unsharded gradients and the reduce-scatter input held beside them replace gtemp_l
  trans_l   = max(b transient_l + tie_l, b weight_grad_transient_l + gtemp_l + tieg_l)
              + gather_l: the
              weight-gradient temporary joins what is live when the weight gradients are made
              (weight_grad_transient_bytes), not the layer's peak, so a loss whose fp32 logits
              are freed by then does not count both (a graph without the field takes
              weight_grad_transient = transient: the sum); for a recomputed layer b A'_l
              + ceil(b output_bytes_l / t) joins both terms: the layer being recomputed
              re-materialises its saved tensors while it runs, and its backward runs beside
              its output's gradient; megatron runtime (``megatron_linear``): an LM head's
              weight_grad_transient takes its input gradient (megatron-core makes it first),
              and with SP every trans_l + the all-gather buffer b s h d each rank keeps; with
              explicit attention (``megatron_attention``) trans_l = max(b T_l, b B_l + b S_l
              / t + b O_l) (the in-place mask's backward, B_l the backward-only transient, O_l
              the output's gradient; ep > 1: + the all-to-all's received tokens) and the
              kept buffer the larger of that and the score buffer max_l b S_l / t (none on the
              layers before the first attention where that is never low)

With context parallelism every per-sample term is / c (``context_parallel``). Calibrated
(``TrainingConfig.calibration``, fitted by ``python -m profiling.calibrate``): each per-layer
coefficient is multiplied by its component's scale and rounded up (weights, grads, optimizer,
stored activations, transient; the edge bytes take the buffers scale, relays included), and the
calibration's constant is added to every stage's peak. Without one, the formulas hold exactly.
Empirical statistics replace the memory terms (``empirical``). docs/cost-model.md, "Memory of one
stage".
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import numpy as np

from solver.calibration import Calibration
from solver.costs.coefficients import LayerCosts
from solver.costs.context_parallel import (
    ring_attention_bytes,
)
from solver.costs.embeddings import (
    tied_gradient_bytes,
    tied_sync_ns,
    with_tied_copies,
)
from solver.costs.empirical import check_empirical_options, empirical_layer_costs
from solver.costs.experts import (
    all_to_all_copy_bytes,
    expert_stored_bytes,
    largest_local_param,
    routing_factor,
)
from solver.costs.fsdp import (
    backward_weight_bytes,
    forward_gather_bytes,
    gathered_bytes,
    weight_gradient_bytes,
)
from solver.costs.graph_inputs import (
    graph_columns,
    profiled_times,
    recomputable_layers,
    unsaved_output_bytes,
)
from solver.costs.megatron_attention import (
    backward_held_bytes,
    kept_buffer_bytes,
    score_buffer_bytes,
)
from solver.costs.megatron_buffers import largest_moment_copies
from solver.costs.megatron_linear import head_weight_grad_moment, sp_gather_buffer_bytes
from solver.costs.own_grads import gradient_bytes, own_gradient_bytes
from solver.costs.ranges import check_exact_range
from solver.costs.schedule import in_flight_counts, stage_boundary_copies
from solver.costs.schedule_orders import ZERO_BUBBLE_SCHEDULES
from solver.costs.split_rows import attach_split_rows, most_held
from solver.costs.states import (
    ParamShares,
    ddp_bucket_bytes,
    input_batch_bytes,
    model_state_bytes,
    optimizer_step_bytes,
    step_count_bytes,
)
from solver.costs.times import (
    dp_overlap_of,
    layer_dp_sync_ns,
    layer_forward_ns,
    layer_optimizer_step_ns,
    layer_time_ns,
    pipeline_links,
)
from solver.costs.unbatched import batch_bytes, saved_bytes_times_t, unbatched_column
from solver.costs.units import as_int, ceil_div
from solver.costs.vocab import with_vocab_split
from solver.graph import LayerGraph
from solver.parallel import check_context_parallel
from solver.specs import Cluster, ParallelConfig, TrainingConfig


def layer_costs(
    graph: LayerGraph, config: ParallelConfig, cluster: Cluster, training: TrainingConfig
) -> LayerCosts:
    """Coefficients of every layer for ``config`` (the module docstring's formulas), vectorised
    over layers; integer terms in exact integer arithmetic (ceil of a ratio of ints)."""
    in_flight, vectors, dones, running, moment_copies = in_flight_counts(config, training)
    copies = stage_boundary_copies(
        training.runtime,
        config,
        deallocate_pipeline_outputs=training.deallocate_pipeline_outputs,
        in_flight=in_flight,
    )
    if moment_copies:  # megatron with interleaving: the moments' largest, for bounds
        copies = largest_moment_copies(moment_copies, config.pp)
    factor = routing_factor(graph, config, training)
    most_held = _most_micro_batches_held(config, vectors)
    check_exact_range(graph, config, cluster, training, most_held, *copies, factor=factor)
    cols = graph_columns(graph)
    if config.cp > 1:
        check_context_parallel(graph, config.cp, training.memory_model)
    # the ties' separate copies at p > 1, the vocabulary split over tp as the runtime makes it
    cols = with_vocab_split(cols, config, training.runtime)
    held = with_tied_copies(cols, graph, config, training.runtime)
    params = ParamShares.of(held, config)
    saved, edge_bytes = _saved_and_edge_bytes(cols, config, training, factor)
    weight, grad, optimizer = model_state_bytes(params, config, training)
    optimizer = optimizer + step_count_bytes(graph, held, config, training)
    tied = tied_gradient_bytes(cols, graph, config, training)
    stored, transient = _activation_bytes(held, params, saved, config, training, tied, factor)
    stored, held_output = _with_held_output(graph, stored, config, training)
    profiled = profiled_times(graph)
    time_ns = layer_time_ns(cols, config, cluster, factor)
    forward_ns = np.minimum(layer_forward_ns(cols, config, cluster, factor), time_ns[0])
    recomputable = recomputable_layers(graph, training.runtime)
    stored, transient, time_ns = (
        (kept, np.where(recomputable, recomputed, kept))
        for kept, recomputed in (stored, transient, time_ns)
    )
    state = int(config.recompute == "full")  # the plain coefficients: kept, or recomputed
    calibration = training.calibration
    scaled = _calibrated(calibration)
    unsharded = backward_weight_bytes(params, config, training)  # FSDP2 ZeRO 3 under PP
    costs = LayerCosts(
        config=config,
        weight_bytes=scaled(weight, "weights"),
        grad_bytes=scaled(grad, "grads"),
        optimizer_bytes=scaled(optimizer, "optimizer"),
        stored_bytes=scaled(stored[state], "activations"),
        transient_bytes=scaled(transient[state], "transient"),
        time_ns=as_int(time_ns[state]),
        recompute_stored_bytes=scaled(stored[1], "activations"),
        recompute_transient_bytes=scaled(transient[1], "transient"),
        recompute_time_ns=as_int(time_ns[1]),
        forward_ns=as_int(forward_ns),
        recomputable=recomputable,
        dp_sync_ns=as_int(layer_dp_sync_ns(params, config, cluster, training)),
        edge_src=cols["edge_src"],
        edge_dst=cols["edge_dst"],
        edge_bytes=scaled(edge_bytes, "buffers"),
        edge_tensor=cols["edge_tensor"],
        edge_requires_grad=cols["edge_requires_grad"],
        edge_saved=cols["edge_saved"],
        edge_charged=cols["edge_charged"],
        edge_src_charged=cols["edge_src_charged"],
        constant_bytes=0 if calibration is None else calibration.constant_bytes,
        held_output_bytes=int(scaled(np.array([held_output], dtype=np.int64), "activations")[0]),
        in_flight=in_flight,
        in_flight_vectors=vectors,
        backwards_done=dones,
        running_chunks=running,
        moment_copies=moment_copies,
        receive_copies=copies[0],  # R_s, S_s (``stage_boundary_copies``)
        send_copies=copies[1],
        runtime=training.runtime,
        deallocate_pipeline_outputs=training.deallocate_pipeline_outputs,
        grad_lifetime=training.grad_lifetime,
        grad_buffer_bytes=ddp_bucket_bytes(config, training, scaled(grad, "grads")),
        input_batch_bytes=_scaled_or_none(input_batch_bytes(cols, config, training), scaled),
        own_grad_bytes=own_gradient_bytes(graph, config, training, grad, transient, scaled),
        backward_weight_bytes=None if unsharded is None else scaled(unsharded, "weights"),
        gather_bytes=None if unsharded is None else _gather_part(params, config, training),
        step_bytes=optimizer_step_bytes(params, config, training, scaled),
        **_weight_step_bytes(graph, config),
        **weight_step_columns(graph, config, training, scaled),
        optimizer_step_ns=_optimizer_step_ns(graph, cols, params, config, cluster, training),
        microbatch_overhead_ns=profiled.microbatch_overhead_ns,
        step_overhead_ns=profiled.step_overhead_ns,
        link_gb_per_s=pipeline_links(config, cluster),
        p2p_latency_ns=math.ceil(cluster.p2p_latency_us * 1000),
        dp_overlap=dp_overlap_of(config, training),
    )
    if not costs.has_compute_time:  # no time model: the optimizer step alone says nothing
        costs.optimizer_step_ns = np.zeros(len(costs.time_ns), dtype=np.int64)
    if config.schedule in ZERO_BUBBLE_SCHEDULES:
        attach_split_rows(costs)
    if training.memory_model == "empirical":
        check_empirical_options(config, calibration)
        return empirical_layer_costs(graph, config, costs)
    return costs


def _optimizer_step_ns(
    graph: LayerGraph,
    cols: dict[str, np.ndarray],
    params: ParamShares,
    config: ParallelConfig,
    cluster: Cluster,
    training: TrainingConfig,
) -> np.ndarray:
    """Each layer's optimizer step, ns: its parameters' update (profiled per parameter where the
    graph says) and a tied parameter's gradient sync."""
    profiled = profiled_times(graph)
    return as_int(
        layer_optimizer_step_ns(
            params, config, cluster, training, profiled.optimizer_step_ns_per_param
        )
        + tied_sync_ns(graph, cols, config, cluster, training)
    )


def weight_step_columns(
    graph: LayerGraph, config: ParallelConfig, training: TrainingConfig, scaled
) -> dict[str, np.ndarray]:
    """The W step's per-layer figures of a split-backward schedule, per GPU per micro-batch
    (``LayerCosts.weight_step_bytes``, ``weight_step_end_bytes``), where the graph gives
    ``weight_step_moments``: W_l = max_i G(P_i, T_i) + ceil(b e_i / cp) over its points and
    End_l the same of its end (G: ``own_grads.gradient_bytes`` at ZeRO 0, the unsharded weight
    gradients' bytes of P parameters, T of them TP-split: ``stage_backward_weight``'s
    ``autograd.grad`` makes a group's whole dweights before any reduce-scatter, so under ZeRO
    >= 2 a group's are not the sharded gradients kept; over where the runtime keeps them
    unsharded anyway, FSDP2 under pipelining); the same of a chunk's first W step, where no
    ``.grad`` exists yet and each group's dweights become the gradients
    (``weight_step_first_bytes``, ``weight_step_first_end_bytes``): a point's P counts the
    layer's groups so far (each group's size is its point's P less the previous group's), the
    end every group of the layer; and the input step's transient b X_l (``input_step_bytes``,
    -1 where not given); nothing on other schedules or graphs without them."""
    if config.schedule not in ZERO_BUBBLE_SCHEDULES:
        return {}
    inputs = as_int([layer.input_step_transient_bytes or 0 for layer in graph.layers])
    input_known = np.array([layer.input_step_transient_bytes is not None for layer in graph.layers])
    input_bytes = scaled(ceil_div(config.micro_batch * inputs, config.cp), "transient")
    input_columns = {"input_step_bytes": np.where(input_known, input_bytes, -1)}
    if all(layer.weight_step_moments is None for layer in graph.layers):
        return input_columns if input_known.any() else {}
    known = np.array([layer.weight_step_moments is not None for layer in graph.layers])
    points, first_points = [], []
    for i, layer in enumerate(graph.layers):
        steps = [*(layer.weight_step_moments or ()), layer.weight_step_end or (0, 0, 0)]
        group, so_far = (0, 0), (0, 0)  # the previous group's (P, T), the groups' so far
        for k, (params, tp_params, nbytes) in enumerate(steps):
            points.append((i, (params, tp_params, nbytes)))
            if k < len(steps) - 1:  # a group's moment: the previous group's and its own
                group = (params - group[0], tp_params - group[1])
                so_far = (so_far[0] + group[0], so_far[1] + group[1])
            first_points.append((i, (*so_far, nbytes)))
    columns = {}
    for name, entries in (("", points), ("first_", first_points)):
        largest, end_bytes = _step_extremes(entries, len(graph.layers), config, training, scaled)
        columns[f"weight_step_{name}bytes"] = np.where(known, largest, 0)
        columns[f"weight_step_{name}end_bytes"] = np.where(known, end_bytes, 0)
    return {**columns, "weight_step_known": known, **input_columns}


def _step_extremes(
    points: list, num_layers: int, config: ParallelConfig, training: TrainingConfig, scaled
) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the largest of its W step's points but the last and the last (its end),
    bytes per GPU per micro-batch (``weight_step_columns``): ``points`` (layer, (P, T, e)) in
    layer order, each layer's end last."""
    index = np.array([i for i, _ in points], dtype=np.int64)
    made, split, extra = (as_int([point[k] for _, point in points]) for k in range(3))
    # autograd makes a group's whole dweights before any reduce-scatter: unsharded (ZeRO 0)
    whole = replace(config, zero=0)
    value = gradient_bytes(made, split, whole, training, scaled) + scaled(
        ceil_div(config.micro_batch * extra, config.cp), "transient"
    )
    ends = np.zeros(len(points), dtype=bool)
    ends[np.r_[np.flatnonzero(np.diff(index)), len(points) - 1]] = True  # each layer's last
    largest = np.zeros(num_layers, dtype=np.int64)
    first = np.ones(num_layers, dtype=bool)
    for i, v, end in zip(index.tolist(), value.tolist(), ends.tolist(), strict=True):
        if not end:
            largest[i] = v if first[i] else max(largest[i], v)
            first[i] = False
    end_bytes = np.zeros(num_layers, dtype=np.int64)
    end_bytes[index[ends]] = value[ends]
    return largest, end_bytes


def _weight_step_bytes(graph: LayerGraph, config: ParallelConfig) -> dict[str, np.ndarray]:
    """``weight_op_grad_bytes`` and ``weight_op_output_grad_bytes`` per micro-batch (b times
    the graph's per-sample fields; -1 / 0 where a layer lacks them) of a split-backward
    schedule, where the graph gives them; nothing otherwise. Not divided over tp or cp (a
    column-parallel op's output gradient is split, a row-parallel one's is not): over."""
    if config.schedule not in ZERO_BUBBLE_SCHEDULES:
        return {}
    own = [layer.weight_op_grad_bytes for layer in graph.layers]
    if all(value is None for value in own):
        return {}
    output = [layer.weight_op_output_grad_bytes or 0 for layer in graph.layers]
    b = config.micro_batch
    return {
        "weight_op_grad_bytes": np.array(
            [-1 if value is None else b * value for value in own], dtype=np.int64
        ),
        "weight_op_output_grad_bytes": np.array([b * value for value in output], dtype=np.int64),
    }


def _most_micro_batches_held(config: ParallelConfig, vectors: list) -> int:
    """The most micro-batches a rank holds at once (its in-flight vectors' largest sum; a
    split-backward schedule's pending W steps keep dY too), for the exact-range check."""
    held = max(sum(vector) for rank in vectors for vector in rank)
    if config.schedule in ZERO_BUBBLE_SCHEDULES:
        held = max(held, most_held(config))
    return held


def _with_held_output(
    graph: LayerGraph, stored: tuple, config: ParallelConfig, training: TrainingConfig
) -> tuple[tuple, int]:
    """(stored bytes of both recompute states, the output held per micro-batch, bytes).

    torch.distributed.pipelining's loss_fn(output, target) runs outside the model: the last
    stage keeps each in-flight micro-batch's output until its backward has run through the whole
    stage, beside what the loss saves; the part no op saved is not in the graph's
    activation_bytes: b unsaved_output_bytes joins the last layer's stored bytes, and
    ``LayerCosts.moment_transient`` the earlier layers' moments of that stage (measured, small HF
    gpt2 and deepseek_v2 pp 2 --recompute full: stage 1 peaks in a block's recomputation with
    the logits still held). megatron-core computes the loss inside the last layer: nothing."""
    if training.runtime != "torch":
        return stored, 0
    held_output = config.micro_batch * unsaved_output_bytes(graph)
    stored = tuple(np.concatenate([kept[:-1], kept[-1:] + held_output]) for kept in stored)
    return stored, held_output


def _saved_and_edge_bytes(
    cols: dict[str, np.ndarray], config: ParallelConfig, training: TrainingConfig, factor: Fraction
) -> tuple[np.ndarray, np.ndarray]:
    """(b A'_l, rounded up, / c with context parallelism; the bytes each edge carries) per GPU
    and micro-batch (module docstring, A'_l), with the routed experts' part at routing factor
    ``factor`` (``experts.expert_stored_bytes``)."""
    t, b = config.tp, config.micro_batch
    # t * A'_l is an integer: ceil(b t A' / (t c)) is then exact. The routed experts' part is
    # apart (expert_stored_bytes): it scales with the routing factor
    dense_activation_bytes = cols["activation_bytes"] - cols["expert_activation_bytes"]
    saved_times_t = (dense_activation_bytes - cols["tp_activation_bytes"]) * t + cols[
        "tp_activation_bytes"
    ]
    edge_bytes = b * cols["edge_bytes"]
    if config.sp:
        # sequence parallelism splits every saved tensor along the sequence or, where TP
        # already splits it, along heads/width: A'_l = activation_bytes / t (Korthikanti et al.
        # 2022, section 4.2.2); a stage sends [s/t, b, h]
        saved_times_t = dense_activation_bytes
        if training.runtime == "torch":
            # eager torch (torch.distributed.tensor.parallel, profiling.executors.parallelize)
            # saves the all-gathered [b, s, h] input of each column-parallel Linear and LM head,
            # not its [b, s/t, h] shard: (t-1)/t of sp_gathered_bytes more per GPU, measured to
            # the byte on gpt-tiny (tests/test_torch_sp.py)
            saved_times_t = saved_times_t + (t - 1) * cols["sp_gathered_bytes"]
    # a stage sends [s/(t c), b, h] with sequence parallelism, [s/c, b, h] without
    edge_bytes = ceil_div(edge_bytes, config.dims.sequence_split)
    # the batch-independent part (a causal mask, position ids) once per micro-batch, whole on
    # every TP rank (``unbatched``)
    saved_times_t = saved_bytes_times_t(cols, saved_times_t, t, config.sp, b)
    saved = ceil_div(saved_times_t, t * config.cp) + expert_stored_bytes(cols, config, factor)
    return saved, edge_bytes


def _activation_bytes(
    cols: dict[str, np.ndarray],
    params: ParamShares,
    saved: np.ndarray,
    config: ParallelConfig,
    training: TrainingConfig,
    tied: tuple[np.ndarray, np.ndarray],
    factor: Fraction,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(stored_l, transient) bytes of every layer per micro-batch, each in both states: kept
    (index 0) and recomputed (index 1: only the output is stored, the saved tensors come back
    while the layer recomputes). ``saved``: b A'_l per GPU, bytes per micro-batch (rounded
    up; / c with context parallelism). Transient is max(b transient_bytes_l + tie_l, b
    weight_grad_transient_bytes_l + gtemp_l + tieg_l) + gather_l (module docstring; ``tied``:
    (tie_l, tieg_l), batch-independent bytes per GPU; ``factor``: the routing factor)."""
    t, b, c = config.tp, config.micro_batch, config.cp
    w = training.weight_bytes_per_param
    # the largest weight gradient, and the gradients its op returns with it (a linear's bias
    # gradient): temporaries together until accumulated; the partners are not divided by t
    grad_temporary = w * (
        np.maximum(largest_local_param(cols, config), ceil_div(cols["largest_tp_param"], t))
        + cols["grad_partner_params"]
    )
    # a recomputed layer keeps its output, the next layer's input: [s/t, b, h] with sequence
    # parallelism; context parallelism holds s/c of every sequence: every term per sample / c
    kept_output = ceil_div(b * cols["output_bytes"], config.dims.sequence_split)
    # its backward re-materialises its saved tensors beside the gradient of its output
    recomputed, remade, output_grad = kept_output, saved, kept_output
    if training.runtime == "torch" and (cols["edge_saved"] >= 0).any():
        recomputed, remade, output_grad = checkpointed_layer_bytes(cols, saved, kept_output, config)
    stored = (saved, recomputed)
    gather = gathered_bytes(params, config, training)
    grad_temporary = weight_gradient_bytes(params, config, training, grad_temporary)

    def transient(
        bytes_per_sample: np.ndarray, figure: str | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Kept, recomputed: the recomputed layer's saved tensors come back while it runs, and
        its backward runs beside the gradient of its output, [s/t, b, h] (a middle layer's:
        what the later layer's backward made; at the stage's last layer the receive buffer
        holds it too, an over-count of one output). ``figure``: the graph field whose
        batch-independent part the micro-batch holds once (``unbatched``; None: b X)."""
        fixed = 0 if figure is None else unbatched_column(cols, figure)
        kept = ceil_div(batch_bytes(bytes_per_sample, fixed, b), c)
        return (kept, kept + remade + output_grad)

    # the weight-gradient temporary joins what is live when the weight gradients are made; ring
    # attention's K/V buffers join the layer's own peak (its attention runs then)
    ring = ring_attention_bytes(cols["attention_kv_bytes"], config)
    anytime = tuple(
        peak + ring for peak in transient(cols["transient_bytes"], "transient_bytes")
    )
    beside_grad, sp_buffer, score_buffer = cols["weight_grad_transient_bytes"], 0, 0
    if training.runtime == "megatron":
        # megatron-core's linears make the input gradient before the weight gradient, and keep
        # an all-gather buffer under SP (``megatron_linear``); its own explicit attention keeps
        # a score buffer (the same "mpu" buffer: the larger) and clones the scores' gradient
        # in the in-place mask's backward (``megatron_attention``)
        beside_grad = head_weight_grad_moment(cols, config)
        sp_buffer = sp_gather_buffer_bytes(cols, config)
        score_buffer = score_buffer_bytes(cols, config)
        scores = backward_held_bytes(cols, config)
        # the zoo's batch-independent part of its attention backward is not Megatron's
        backward = transient(cols["attention_backward_transient_bytes"], None)
        anytime = tuple(
            np.where(scores > 0, np.maximum(peak, in_backward + ring + scores), peak)
            + all_to_all_copy_bytes(cols, config, factor)
            for peak, in_backward in zip(anytime, backward, strict=True)
        )
    at_weight_grad = transient(beside_grad, "weight_grad_transient_bytes")
    # FSDP2 under pipelining: a gather's flat buffer at the forward's start, alone (``fsdp``)
    starting = forward_gather_bytes(params, config, training)
    held_anytime, held_at_grad = tied
    running = tuple(
        np.maximum(peak + held_anytime, beside + grad_temporary + held_at_grad) + gather
        for peak, beside in zip(anytime, at_weight_grad, strict=True)
    )
    kept_buffer = kept_buffer_bytes(running, cols["attention_score_bytes"], sp_buffer, score_buffer)
    peaks = tuple(np.maximum(peak + kept_buffer, starting) for peak in running)
    return stored, peaks


def checkpointed_layer_bytes(
    cols: dict[str, np.ndarray], saved: np.ndarray, kept_output: np.ndarray, config: ParallelConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stored, re-materialised, output gradient) bytes per micro-batch of each layer the torch
    runtime recomputes, a graph whose edges say what each layer saves (``Edge.charged``).

    torch's non-reentrant ``checkpoint`` of a layer's module keeps the module's inputs, not its
    output, and glue code outside the module (a loss after the LM head) runs unrecomputed:

      stored_l  = in_l + glue_l        in_l = b bytes of the edges into l that l charges (it
                                       saves them first: each tensor once per stage, a received
                                       one the stage's receive buffer, ``boundaries``); a layer
                                       with no edge in keeps the model's inputs, min(b A'_l, out)
      remade_l  = b A'_l - in_l - glue_l   (its saved inputs are the kept ones, no new storage)
      grad_l    = ceil(b output_bytes_l / t), 0 at the model's last layer (its output's gradient
                                       is the loss's, made in the layer's own backward: in T_l)

    The model's output the pipeline's ``loss_fn`` keeps is added by ``layer_costs`` in both
    states. Measured (tags of the live storages at each rank's peak, small HF Llama pp 2,
    1F1B, m 8, fp32): the last stage keeps the norm's output, the logits and the loss's
    log-softmax per micro-batch, and peaks in the loss's backward with the logits' two
    gradients (T_l) beside them; output-kept counting (the megatron runtime's block rule) took
    the logits twice and the log-softmax and the norm's output again in T_l (+10.6%)."""
    b, split = config.micro_batch, config.dims.sequence_split
    edge_bytes = ceil_div(b * cols["edge_bytes"], split)
    inputs = np.zeros(len(saved), dtype=np.int64)
    charged = cols["edge_charged"]
    np.add.at(inputs, cols["edge_dst"][charged], edge_bytes[charged])
    entry = np.ones(len(saved), dtype=bool)
    entry[cols["edge_dst"]] = False
    inputs = np.minimum(np.where(entry, np.minimum(saved, kept_output), inputs), saved)
    glue = np.minimum(ceil_div(b * cols["glue_activation_bytes"], config.cp), saved - inputs)
    output_grad = kept_output.copy()
    output_grad[-1:] = 0
    return inputs + glue, saved - inputs - glue, output_grad


def _gather_part(
    params: ParamShares, config: ParallelConfig, training: TrainingConfig
) -> np.ndarray:
    """``LayerCosts.gather_bytes``: ``fsdp.gathered_bytes`` as the scaled transients hold it at
    least (rounded down under a calibration), bytes."""
    gather = gathered_bytes(params, config, training)
    calibration = training.calibration
    if calibration is None:
        return as_int(gather)
    return as_int(np.floor(np.asarray(gather, dtype=float) * calibration.scale("transient")))


def _scaled_or_none(values: np.ndarray | None, scaled) -> np.ndarray | None:
    """``values`` scaled as buffers (the model inputs a step holds), or None."""
    return None if values is None else scaled(values, "buffers")


def _calibrated(calibration: Calibration | None):
    """values, component -> int64 coefficients scaled by the calibration's factor for that
    component, each rounded up (unchanged without a calibration)."""
    if calibration is None:
        return lambda values, component: as_int(values)
    return lambda values, component: as_int(
        np.ceil(np.asarray(values, dtype=float) * calibration.scale(component))
    )
