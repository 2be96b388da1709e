"""The analytic cost model: the ONLY place memory and time are computed.

Every backend (chain algorithm, CP-SAT, MILP), the baselines, validation and the reports use the
per-layer coefficients from :func:`layer_costs` and the stage aggregation of :func:`stage_costs`.

Notation: config (p, t, d), micro-batch b, global batch B, m = B / (d b) micro-batches per step,
bytes per parameter (w, g, o) (default 2, 4, 12 on the megatron runtime: bf16 weights, fp32
gradient accumulation (Megatron's ``main_grad``), fp32 Adam master + 2 moments; 2, 2, 12 on the
torch runtime: bf16 gradients; ZeRO paper; ``specs.GRAD_BYTES_PER_PARAM``), ZeRO stage z, stages
s = 0..p-1.

Memory of stage s (bytes per GPU):
  P'_l = (params - tp_params - expert_params) + tp_params / t + expert_params / (t ep)
         parameters held per GPU: the routed experts are sharded over ep ranks (Megatron's
         expert parallelism, within the data-parallel ranks) and each expert split over t
         (expert tensor parallelism = tp, Megatron's default; ``ParamShares``)
  A'_l = (activation_bytes - expert_activation_bytes - tp_activation_bytes) + tp_act / t
         + X'_l / b                                                  saved bytes per sample per GPU
  X'_l = f b (R_l + (X_l - R_l) / t) / c  the routed experts' saved bytes per micro-batch
         (``expert_stored_bytes``): X_l = expert_activation_bytes, R_l = min(X_l,
         ep_comm_bytes / 4) the dispatched tokens' hidden states, which every TP rank keeps
         whole (Megatron all-gathers them over tp before the experts); not divided by ep (each
         GPU's experts receive b s k tokens at a balanced routing whatever ep is); f the routing
         factor (``routing_factor``): the capacity factor c (``--moe-capacity-factor c``,
         Megatron's --moe-expert-capacity-factor with padding; 1 = balanced) or, dropless, the
         worst case a router can reach on one GPU, f = ep min(k, E / ep) / k
  A'_l = activation_bytes / t  with sequence parallelism (config.sp; Korthikanti et al. 2022,
         sbh(34/t + 5as/(ht)) against sbh(10 + 24/t + 5as/(ht))): the parts TP leaves replicated
         (norm inputs, dropout masks, residuals) are split along the sequence over the t ranks too;
         so are the tensors sent between stages, [s/t, b, h]: an edge carries ceil(b bytes / t) per
         micro-batch, and a recomputed layer keeps ceil(b output_bytes / t);
         + (t-1)/t sp_gathered_bytes on the torch runtime, whose eager autograd saves the
         gathered input of each column-parallel Linear where Megatron saves its shard
  states_s  = sum_l P'_l (w / d[z>=3] + g / d[z>=2] + o / d[z>=1])  each term rounded up per layer
              (the expert part of P'_l sharded over the d c / ep expert-data-parallel ranks
              instead of d c: Megatron's distributed optimizer keeps the expert parameters'
              states on ``intra_expt_dp_group``)
              (+ w P'_l / d with ZeRO-2 on the torch runtime: FSDP2 keeps the sharded parameters
              next to the gathered ones)
  k_s       = min(m, p - s) under 1F1B, m under GPipe                  micro-batches in flight
  stored_l  = b A'_l, or b output_bytes_l when l is recomputed         per micro-batch, rounded up
  relay     = b bytes of every edge u->v with stage(u) < s < stage(v)  (passed along by stage s;
              megatron runtime: p2p between neighbours only. The torch runtime sends each
              tensor straight to every consuming stage: no relay, ``direct_boundary_bytes``)
  acts_s    = k_s (sum_l stored_l + sum relay)
  buffers_s = R_s b (bytes of edges entering s) + S_s b (bytes of edges leaving s)
              (a relayed edge does both), with the copies the pipeline runtime keeps:
              megatron  R_s = 1 (s > 0), S_s = 1 (s < p - 1): the next input's and the next
                        gradient's receive buffers; sent outputs are freed at once
                        (deallocate_pipeline_outputs, as Megatron-LM sets it) and the in-flight
                        inputs are the stage's saved input, already in acts_s. Without
                        deallocate_pipeline_outputs (megatron-core's TransformerConfig default)
                        S_s = 1 + k_s: the outputs of the k_s in-flight micro-batches stay alive
                        until their backward
              torch     R_s = m - k_s (s > 0): torch.distributed.pipelining allocates a receive
                        buffer per micro-batch and keeps them for the run (the k_s in flight are
                        the saved inputs); S_s = m + k_s (s < p - 1): m gradient receive buffers
                        and the outputs of the k_s in-flight micro-batches, held until their
                        backward
  gtemp_l   = w max(largest_param_l, largest_tp_param_l / t): a weight gradient is computed in
              the weights' dtype into a temporary and added to the persistent gradient (.grad,
              or Megatron's fp32 main_grad) while backward accumulates; a largest_param larger
              than the layer's dense replicated parameters is a routed-expert tensor, held
              / (t ep) (``largest_local_param``)
  gather_l  = 2 w P'_l with ZeRO-3, else 0: the running layer's weights are gathered and the next
              layer's prefetched (FSDP), each freed again after use
  trans_s   = max_l (max(b transient_l, b weight_grad_transient_l + gtemp_l) + gather_l): the
              weight-gradient temporary joins what is live when the weight gradients are made
              (weight_grad_transient_bytes), not the layer's peak, so a loss whose fp32 logits
              are freed by then does not count both (a graph without the field takes
              weight_grad_transient = transient: the sum);  for a recomputed layer
              b A'_l joins both terms: the layer being recomputed re-materialises its saved
              tensors while it runs
  peak_s    = states_s + acts_s + buffers_s + trans_s
  edges naming one tensor (Edge.tensor) count once per stage: it crosses every boundary from its
              producer's stage to its farthest consumer's (``boundary_bytes``); on the torch
              runtime it goes from its producer's stage to each consuming stage
  torch runtime: the last layer's stored bytes += b unsaved_output_bytes (graph meta): a
              pipeline's loss_fn keeps the model's output per in-flight micro-batch
  grad lifetime "step" (``TrainingConfig.grad_lifetime``; torch's zero_grad(set_to_none=True)),
              on a stage whose forwards all precede its first backward (GPipe, 1F1B with
              m <= p - s; ``LayerCosts.first_backward_peak``), layers l in forward order:
              peak_s = weights + optimizer + max(max_l during(l), after) with
              during(l) = (k-1)(stored_s + relay_s) + relay_s + stored(<= l) + grads(> l)
                          + trans_l + buffers(k),
              after     = (k-1)(stored_s + relay_s) + grads_s + trans_s + buffers(k-1)
              (``first_backward_moments``); DDP on torch keeps its buckets beside the fresh
              .grad all step: + g P'_l per layer (``ddp_bucket_bytes``)
  optimizer step (``TrainingConfig.optimizer_impl`` foreach, torch's default on a GPU): Adam's
              ``_multi_tensor_adam`` makes sqrt(exp_avg_sq) of every parameter at once,
              step_l = ceil(P'_l u / d[z>=1]) with u the bytes of one state element
              (``solver.precision.step_temporary_bytes_per_param``: 4 fp32 states, 0 fused),
              sharded like the optimizer state; after the schedule no activation is held and
              every gradient exists:
              peak_s = max(the moments above, states_s + sum_l step_l + buffers(0 held))
              (``optimizer_step_moment``; torch: the m receive buffers of each direction)

Recomputation (``ParallelConfig.recompute``): "none" recomputes no layer, "full" every layer,
"selective" the layers a solver chooses; :class:`LayerCosts` carries both states of every layer
(``stored_bytes`` / ``recompute_stored_bytes``, and likewise transient and time) and
:func:`stage_costs` takes the chosen set. Only recomputable layers are recomputed
(``LayerCosts.recomputable``): on the megatron runtime the transformer blocks (Megatron-LM's
``--recompute-granularity full`` checkpoints the layers of its TransformerBlock, never the
embedding or the output layer and loss; measured, tests/test_megatron.py); on the torch runtime
every layer. A layer that cannot be recomputed has the same coefficients in both states.

Empirical (``TrainingConfig.memory_model = "empirical"``, mCAP/CAPSlog statistics in the graph):
a stage holding layers a..b peaks at mem_isolated(a) + sum_{l=a+1..b} mem_added(l), nothing else
(``empirical_layer_costs``); times stay analytic.

Calibrated (``TrainingConfig.calibration``, fitted by ``python -m profiling.calibrate``): each
per-layer coefficient is multiplied by its component's scale and rounded up (weights, grads,
optimizer, stored activations, transient; the edge bytes take the buffers scale, relays included),
and the calibration's constant is added to every stage's peak. Without one, the formulas above hold
exactly.

Time (integer nanoseconds, rounded up per layer so that every backend sums the same integers):
  per-sample compute of a layer: fwd_ms + bwd_ms when measured, else
      (fwd_flops + bwd_flops) / (gpu_flops * flops_efficiency), bwd_flops defaulting to 2 fwd_flops
  per micro-batch: b * compute / t  +  b * tp_comm_bytes * 2 (t-1)/t / intra-node bandwidth (ring)
      + b * forward compute / t for a recomputed layer (the forward runs twice);
      the same with sequence parallelism: each all-reduce becomes an all-gather plus a
      reduce-scatter, (t-1)/t of the buffer each, the same bytes per GPU (Korthikanti et al. 2022)
      + expert-parallel all-to-all (dispatch and combine, forward and backward;
      ``expert_all_to_all_ns``): b ep_comm_bytes f (ep-1)/ep (/ t with sequence parallelism,
      each TP rank dispatching its s / t tokens) over the intra-node bandwidth when t ep <=
      gpus_per_node, else inter-node; a recomputed layer's forward sends its half again
  T_s  = sum of its layers' micro-batch times
  AR_s = non-overlapped data-parallel gradient sync of stage s: ring all-reduce of its gradients,
         2 (d-1)/d * sum_l P'_l g bytes (z <= 2: all-reduce, or reduce-scatter + all-gather of the
         updated shards), 3 (d-1)/d with z = 3 (parameters are all-gathered again for backward);
         over the intra-node bandwidth when t d <= gpus_per_node, else inter-node; the routed
         experts' gradients over their d_e = d c / ep expert-data-parallel ranks (c = cp, below),
         2 (d_e - 1)/d_e
  forward_l = the forward's share of a layer's time (``_forward_ns``), backward_l = time_l -
         forward_l (a recomputed layer's includes its second forward)
  step_l = the optimizer step over the layer's stepped parameters (``_optimizer_step_ns``);
         X_r = AR_r + sum step_l + the profiled per-step overhead: rank r's tail
  iteration = the simulated schedule (``solver.costs.schedule_time``: each rank's forwards and
         backwards in the runtime's order, transfers, tails); throughput = B / iteration
  iteration bound = max over ranks of ``bound_terms`` (``iteration_bound_ns``): the lower bound
         on it that every backend constrains and minimises (docs/cost-model.md, "Time")

Context parallelism (``ParallelConfig.cp`` = c; Megatron-LM's ``--context-parallel-size``, ring
attention as TransformerEngine's ``AttnFuncWithCPAndKVP2P`` runs it): a stage runs on t c d GPUs;
each GPU holds s/c tokens of every sequence of its micro-batch, so
  stored_l  = ceil(b A'_l / c) (ceil(b t A'_l / (t c)) exactly), recomputed ceil(b output_l / c)
              (/ (t c) with sequence parallelism)
  edges     = ceil(b bytes / c) ([s/c, b, h]; / (t c) with sequence parallelism)
  transient = ceil(b transient_l / c) (and the recomputed layer's re-materialised A'_l / c)
              + ring_l = max(c, 4) ceil(b attention_kv_bytes_l / (t c)) for c > 1: the K/V
              chunks live while the layer's attention runs, c in the forward (TE keeps every
              received chunk until the forward ends), 4 in the backward (K/V and dK/dV, used and
              received) (``ring_attention_bytes``)
  states    parameters, gradients and optimizer state are replicated over cp; ZeRO shards them,
              and the gradient sync runs, over the d c ranks of Megatron's data-parallel group
              with context parallelism: d -> d c in states_s, step_l, AR_s (``sharding_degree``)
  time      b compute / (t c), TP all-reduces of b tp_comm_bytes / c, + 3 ring passes (4
              recomputed), one pass
              (c-1)/c b attention_kv_bytes_l / t bytes over the intra-node bandwidth when t c
              divides the GPUs per node (Megatron's rank order tp-cp-...: consecutive ranks),
              else inter-node; not overlapped (``ring_attention_pass_ns``)
A graph planned with c > 1 needs ``attention_kv_bytes`` on some layer, c | ``meta.seq_len`` and
the analytic model (``check_context_parallel``).

Heterogeneous clusters (``Cluster.groups``): stage s runs on the t c d GPUs of one node group
k(s). Memory does not depend on the GPU type (the terms above use no cluster field); T_s and
AR_s use group k(s)'s FLOP/s, efficiency and bandwidths (``placed_stage_costs``), and the
utilization of stage s is peak_s / capacity_k(s), counted in parts per million, rounded up
(``utilization_ppm``), so that every backend compares the same integers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property, lru_cache
from typing import NamedTuple

import numpy as np

from solver.calibration import Calibration
from solver.costs.moe import RoutedExperts, check_expert_degree, routed_experts
from solver.errors import InputError
from solver.graph import INTEGER_FIELDS, LayerGraph, timing_of
from solver.specs import MOE_DROPLESS, Cluster, ParallelConfig, TrainingConfig

NS_PER_MS = 1_000_000


def in_flight_microbatches(
    schedule: str, num_microbatches: int, num_stages: int, stage: int
) -> int:
    """k_s: micro-batches whose activations stage s holds at its peak (s is 0-based).

    1F1B: stage s runs p - s warm-up forwards before its first backward (Narayanan et al. 2021).
    GPipe: all m forwards run before any backward.
    """
    if schedule == "gpipe":
        return num_microbatches
    return min(num_microbatches, num_stages - stage)


def interleaved_schedule_groups(runtime: str, num_microbatches: int, num_ranks: int) -> int:
    """Micro-batches a rank forwards through one chunk before moving to its next chunk.

    megatron: ``microbatch_group_size_per_vp_stage``, default p (it must divide m then);
    torch: ``ScheduleInterleaved1F1B.microbatches_per_round`` = m // max(1, m // p)."""
    if runtime == "torch":
        return num_microbatches // max(1, num_microbatches // num_ranks)
    return num_ranks


def in_flight_vectors(
    num_microbatches: int, num_ranks: int, num_chunks: int, rank: int, group: int | None = None
) -> list[tuple[int, ...]]:
    """Micro-batches of each of rank r's v chunks whose activations are held, at every moment
    that can be the rank's activation peak, as the maximal such vectors (n_0 .. n_{v-1}).

    Interleaved 1F1B (Narayanan et al. 2021; Megatron-core ``get_schedule_table`` and
    ``get_pp_rank_microbatches``, torch ``ScheduleInterleaved1F1B``): forwards visit the chunks
    in rounds of ``group`` micro-batches (chunk 0 for micro-batches 0..g-1, chunk 1 for the same,
    ..., then chunk 0 for g..2g-1), backwards in the same order with the chunks reversed. Rank r
    runs W_r = min(m v, (v - 1) g + 2 (p - 1 - r)) warm-up forwards, then one forward and one
    backward per step, then the remaining backwards. Activations grow only with a forward, so the
    peaks are just after each forward; dominated vectors are dropped (activations are >= 0).

    With equal chunks the largest total is W_r + 1 units of one chunk: rank 0 holds
    (v - 1) g + 2 p - 1 chunk-micro-batches, i.e. p (1 + (p - 1) / (p v)) micro-batches of a
    stage with g = p (Korthikanti et al. 2022, section 4.2.3), against p without interleaving.
    """
    moments = schedule_moments(num_microbatches, num_ranks, num_chunks, rank, group)
    held = [n for n, _ in moments]  # distinct vectors
    # [i, j]: vector i >= vector j in every chunk (i != j: distinct, so then it dominates j)
    counts = np.array(held, dtype=np.int64).reshape(len(held), num_chunks)
    at_least = np.all(counts[:, None, :] >= counts[None, :, :], axis=2)
    np.fill_diagonal(at_least, False)
    dominated = at_least.any(axis=0)
    return [vector for vector, drop in zip(held, dominated.tolist(), strict=True) if not drop]


class ScheduleAction(NamedTuple):
    """One step of a pipeline rank's schedule: a forward ("F") or a full backward ("B") of
    micro-batch ``microbatch`` through the rank's chunk ``chunk`` (virtual stage chunk p + r)."""

    kind: str
    chunk: int
    microbatch: int


def forwards_before_first_backward(
    num_microbatches: int, num_ranks: int, rank: int, schedule: str
) -> int:
    """c_r: the forwards rank r runs before its first backward without interleaving
    (``schedule_actions``' order): all m with GPipe; with 1F1B its p - 1 - r warm-up forwards
    and the first steady one, at most m. It is also d_r, the backwards after its last forward:
    GPipe's m; 1F1B's last steady one and its cool-down, as many as its warm-up plus one."""
    if schedule == "gpipe":
        return num_microbatches
    return min(num_microbatches, num_ranks - rank)


@lru_cache(maxsize=512)
def schedule_actions(
    num_microbatches: int,
    num_ranks: int,
    num_chunks: int,
    rank: int,
    group: int | None = None,
    schedule: str = "1f1b",
) -> tuple[ScheduleAction, ...]:
    """Rank r's forwards and backwards in the order it runs them (idle steps left out).

    GPipe (torch ``ScheduleGPipe``): the m forwards, then the m backwards, both in micro-batch
    order. 1F1B (torch ``Schedule1F1B``, megatron-core
    ``forward_backward_pipelining_without_interleaving``): min(m, p - 1 - r) warm-up forwards,
    then one forward and one backward per step, then the remaining backwards. Interleaved 1F1B
    (v > 1; torch ``ScheduleInterleaved1F1B``, megatron-core
    ``forward_backward_pipelining_with_interleaving``): forwards visit the chunks in rounds of
    ``group`` micro-batches (default p; ``interleaved_schedule_groups``), backwards in the same
    order with the chunks reversed, after W_r = min(m v, (v - 1) g + 2 (p - 1 - r)) warm-up
    forwards (``in_flight_vectors``). Each chunk takes its micro-batches in order."""
    m, p, v = num_microbatches, num_ranks, num_chunks
    if schedule == "gpipe":
        assert v == 1, "GPipe runs one chunk per rank"
        return tuple(ScheduleAction("F", 0, i) for i in range(m)) + tuple(
            ScheduleAction("B", 0, i) for i in range(m)
        )
    g = p if group is None else group
    order = [
        chunk for start in range(0, m, g) for chunk in range(v) for _ in range(min(g, m - start))
    ]
    total = m * v
    # without interleaving (v = 1) rank r runs p - 1 - r warm-up forwards (plain 1F1B)
    ahead = (v - 1) * g + 2 * (p - 1 - rank) if v > 1 else p - 1 - rank
    warmup = min(total, ahead)
    forwards, backwards = [0] * v, [0] * v
    actions: list[ScheduleAction] = []

    def forward(step: int) -> None:
        chunk = order[step]
        actions.append(ScheduleAction("F", chunk, forwards[chunk]))
        forwards[chunk] += 1

    def backward(step: int) -> None:
        chunk = v - 1 - order[step]
        actions.append(ScheduleAction("B", chunk, backwards[chunk]))
        backwards[chunk] += 1

    for step in range(warmup):
        forward(step)
    for k in range(total - warmup):
        forward(warmup + k)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    return tuple(actions)


def schedule_moments(
    num_microbatches: int, num_ranks: int, num_chunks: int, rank: int, group: int | None = None
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every moment of rank r's schedule just after a forward or a backward, as (n, B): the
    micro-batches each chunk holds and the backwards each chunk has done (the order of
    ``schedule_actions``, replayed). B only grows, so for each distinct n only the latest
    moment is kept; largest n first."""
    v = num_chunks
    held, done = [0] * v, [0] * v
    latest: dict[tuple[int, ...], tuple[int, ...]] = {}
    for action in schedule_actions(num_microbatches, num_ranks, v, rank, group):
        if action.kind == "F":
            held[action.chunk] += 1
        else:
            held[action.chunk] -= 1
            done[action.chunk] += 1
        latest[tuple(held)] = tuple(done)
    return sorted(latest.items(), reverse=True)


def boundary_copies(
    runtime: str,
    schedule: str,
    num_microbatches: int,
    num_stages: int,
    stage: int,
    *,
    deallocate_pipeline_outputs: bool = True,
    held: int | None = None,
) -> tuple[int, int]:
    """(R_s, S_s): copies of each received and each sent boundary tensor stage s holds at its peak.

    megatron: one buffer for the next input (s > 0) and one for the next gradient (s < p - 1).
    With ``deallocate_pipeline_outputs`` (Megatron-LM's argument parsing sets it) a sent output's
    data is freed at once; without it (megatron-core's ``TransformerConfig`` default) the outputs
    of the k_s in-flight micro-batches stay alive until their backward: S_s = 1 + k_s (measured on
    megatron-core 0.16.1, ../shared/reference/runtime-memory-facts.md).
    torch: torch.distributed.pipelining allocates a receive buffer per micro-batch (activations on
    every non-first stage, gradients on every non-last one) and keeps them for the run, and a stage
    keeps the outputs of its in-flight micro-batches until their backward (measured,
    ``benchmarks/bench_accuracy.md``); ``deallocate_pipeline_outputs`` does not apply. In both, the
    in-flight inputs are what the stage's first layer saves, so they are part of the stage's
    activations. ``held``: k_s (default: the schedule's, :func:`in_flight_microbatches`; with
    interleaving the virtual stage's count at the moment).
    """
    first, last = stage == 0, stage == num_stages - 1
    k = held
    if k is None:
        k = in_flight_microbatches(schedule, num_microbatches, num_stages, stage)
    if runtime == "megatron":
        kept_outputs = 0 if deallocate_pipeline_outputs else k
        return int(not first), (0 if last else 1 + kept_outputs)
    return (0 if first else num_microbatches - k), (0 if last else num_microbatches + k)


def stage_boundary_copies(
    runtime: str,
    config: ParallelConfig,
    *,
    deallocate_pipeline_outputs: bool = True,
    in_flight: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """([R_j], [S_j]) of every (virtual) stage of ``config`` under ``runtime``; with v chunks per
    rank each of the p v virtual stages keeps its own buffers. With interleaving on the torch
    runtime, and on the megatron runtime without ``deallocate_pipeline_outputs``, the copies
    follow the schedule (``LayerCosts.copies_at``); these are their largest values (for bounds),
    from ``in_flight`` (the most micro-batches each virtual stage holds, ``LayerCosts.in_flight``;
    needed in that megatron case)."""
    num_stages = config.pp * config.virtual_stages
    m = config.num_microbatches
    if runtime == "torch" and config.virtual_stages > 1:
        # held + done <= m, so R <= 2 m and S <= 2 m
        return [0] + [2 * m] * (num_stages - 1), [2 * m] * (num_stages - 1) + [0]
    if config.virtual_stages > 1 and not deallocate_pipeline_outputs:
        assert in_flight is not None, "interleaved megatron copies without deallocation need k_j"
    copies = [
        boundary_copies(
            runtime,
            config.schedule,
            m,
            num_stages,
            j,
            deallocate_pipeline_outputs=deallocate_pipeline_outputs,
            held=None if in_flight is None else in_flight[j],
        )
        for j in range(num_stages)
    ]
    return [receive for receive, _ in copies], [send for _, send in copies]


@dataclass(kw_only=True)
class LayerCosts:
    """Per-layer integer coefficients of one config (arrays indexed by topological position)."""

    config: ParallelConfig
    weight_bytes: np.ndarray
    """Weights per GPU, bytes."""
    grad_bytes: np.ndarray
    """Gradients per GPU, bytes."""
    optimizer_bytes: np.ndarray
    """Optimizer state per GPU, bytes."""
    stored_bytes: np.ndarray
    """Activations kept per in-flight micro-batch per GPU, bytes."""
    transient_bytes: np.ndarray
    """Extra peak while the layer runs, per micro-batch per GPU, bytes."""
    time_ns: np.ndarray
    """Forward + backward (+ recompute) time per micro-batch, ns."""
    dp_sync_ns: np.ndarray
    """Data-parallel gradient synchronisation time per step, ns."""
    edge_src: np.ndarray
    """Edge source positions."""
    edge_dst: np.ndarray
    """Edge destination positions."""
    edge_bytes: np.ndarray
    """Bytes an edge carries per micro-batch per GPU (b bytes, / t with sequence parallelism)."""
    edge_tensor: np.ndarray | None = None
    """The tensor each edge carries, as an index (edges of one tensor share it: the graph's
    ``Edge.tensor``); None: a tensor per edge. A stage receives, sends and relays each tensor
    once (``boundary_bytes``, ``tensor_groups``)."""
    edge_requires_grad: np.ndarray | None = None
    """Per edge, the tensor requires grad when sent (``Edge.requires_grad``); None: all do."""
    edge_saved: np.ndarray | None = None
    """Per edge: 1 the consumer saves the tensor, 0 it does not, -1 unknown (``Edge.saved``);
    None: all unknown."""
    edge_charged: np.ndarray | None = None
    """Per edge, the consumer's stored bytes count the tensor's storage (``Edge.charged``);
    None: none."""
    edge_src_charged: np.ndarray | None = None
    """Per edge, the producer's stored bytes count the tensor's storage (``Edge.src_charged``);
    None: none."""
    in_flight: list[int]
    """k_j for each (virtual) stage j: the most micro-batches whose activations it holds at once
    (``in_flight_vectors``; k_s of the module docstring without interleaving)."""
    in_flight_vectors: list[list[tuple[int, ...]]] = field(default_factory=list)
    """For each rank r, the vectors (n_0 .. n_{v-1}) of micro-batches held per chunk at the
    moments that can be its peak (``in_flight_vectors``); [(k_r,)] without interleaving (the
    default, from ``in_flight``)."""
    backwards_done: list[list[tuple[int, ...]]] = field(default_factory=list)
    """Parallel to ``in_flight_vectors``: backwards each chunk has done at that moment (only
    the torch runtime's interleaved buffers depend on it; zeros by default)."""
    receive_copies: list[int] = field(default_factory=list)
    """R_s for each stage: copies of a received edge's bytes (``boundary_copies``; the megatron
    runtime's when not given). With interleaving on the torch runtime they depend on the
    in-flight vector (``copies_at``) and these are their largest values (for bounds)."""
    send_copies: list[int] = field(default_factory=list)
    """S_s for each stage: copies of a sent edge's bytes."""
    runtime: str = "megatron"
    """The pipeline runtime whose buffers ``copies_at`` describes; torch also sends each
    boundary tensor straight to its consumers (``direct_sends``)."""
    deallocate_pipeline_outputs: bool = True
    """megatron runtime: sent outputs are freed at once (``TrainingConfig``'s field of that
    name); False keeps those of the in-flight micro-batches (``copies_at``)."""
    constant_bytes: int = 0
    """Added to every stage's peak (a calibration's constant per GPU), bytes."""
    recompute_stored_bytes: np.ndarray | None = None
    """stored_bytes of a recomputed layer (b output_bytes); None: the same as stored_bytes."""
    recompute_transient_bytes: np.ndarray | None = None
    """transient_bytes of a recomputed layer (its saved tensors re-materialised too)."""
    recompute_time_ns: np.ndarray | None = None
    """time_ns of a recomputed layer (the forward runs twice)."""
    recomputable: np.ndarray | None = None
    """Which layers the runtime can recompute (``recomputable_layers``); None: every layer."""
    grad_lifetime: str = "persistent"
    """When the ``.grad`` gradients (``grad_bytes``) exist: persistent (all step) or step (from
    each layer's first backward of the step; ``first_backward_peak``)."""
    grad_buffer_bytes: np.ndarray | None = None
    """Gradient buffers kept for the whole run beside ``.grad``, per GPU, bytes: DDP's buckets
    when ``zero_grad(set_to_none=True)`` frees ``.grad`` (``ddp_bucket_bytes``); None: none.
    Part of ``state_bytes`` and of a stage's ``grad_bytes``."""
    step_bytes: np.ndarray | None = None
    """The optimizer step's temporary per GPU, bytes (``optimizer_step_bytes``: a foreach Adam's
    square root of ``exp_avg_sq``, sharded like the optimizer state); None: no temporary (fused,
    or an optimizer without one), and no optimizer-step moment."""
    forward_ns: np.ndarray | None = None
    """The forward's part of ``time_ns`` per micro-batch, ns, the same in both recompute states
    (``_time_ns``); the rest is the backward (``backward_ns``). None: time_ns // 3 (a backward
    of twice the forward's FLOPs, the model's default)."""
    optimizer_step_ns: np.ndarray | None = None
    """The optimizer step over each layer's parameters on one GPU (its ZeRO shard), ns per
    iteration (``_optimizer_step_ns``); None: no step time."""
    microbatch_overhead_ns: int = 0
    """The pipeline runtime's own time per micro-batch and (virtual) stage, ns (profiled:
    ``meta.timing.microbatch_overhead_ns``): charged once per forward action."""
    step_overhead_ns: int = 0
    """The runtime's own time per step and rank beside its micro-batches and optimizer step, ns
    (profiled: ``meta.timing.step_overhead_ns``): part of every rank's tail."""
    link_gb_per_s: Mapping[tuple[int, int], float] | PipelineLinks | None = None
    """Bandwidth of each directed link between pipeline ranks, GB/s == bytes/ns, looked up as
    ``links[(x, y)]`` (``pipeline_links``); None: transfers take no time."""
    p2p_latency_ns: int = 0
    """Added to every pipeline transfer between two ranks, ns (``Cluster.p2p_latency_us``)."""
    dp_overlap: str = "none"
    """When a rank's data-parallel gradient sync runs (``schedule_time.DP_OVERLAPS``,
    ``dp_overlap_of``): after its last backward ("none"), or launched during it
    ("last_backward")."""

    def __post_init__(self) -> None:
        if self.edge_tensor is None:
            self.edge_tensor = np.arange(len(self.edge_src), dtype=np.int64)
        if not self.in_flight_vectors:
            self.in_flight_vectors = [[(k,)] for k in self.in_flight]
        if not self.backwards_done:
            self.backwards_done = [
                [(0,) * len(vector) for vector in vectors] for vectors in self.in_flight_vectors
            ]
        if not self.receive_copies and not self.send_copies:
            self.receive_copies, self.send_copies = stage_boundary_copies(
                "megatron",
                self.config,
                deallocate_pipeline_outputs=self.deallocate_pipeline_outputs,
                in_flight=self.in_flight,
            )
        if self.recompute_stored_bytes is None:
            self.recompute_stored_bytes = self.stored_bytes
        if self.recompute_transient_bytes is None:
            self.recompute_transient_bytes = self.transient_bytes
        if self.recompute_time_ns is None:
            self.recompute_time_ns = self.time_ns
        if self.forward_ns is None:
            self.forward_ns = self.time_ns // 3
        if self.optimizer_step_ns is None:
            self.optimizer_step_ns = np.zeros(len(self.time_ns), dtype=np.int64)

    def copies_at(self, stage: int, held: int, done: int = 0) -> tuple[int, int]:
        """(R_j, S_j) of (virtual) stage j while it holds ``held`` micro-batches in flight and
        has done ``done`` backwards.

        Without interleaving the stage's constants (``boundary_copies`` at held = k_s).
        megatron: (1, 1) inside the pipeline, or (1, 1 + held) without
        ``deallocate_pipeline_outputs``: the sent outputs of the ``held`` in-flight micro-batches
        stay alive until their backward. torch: each PipelineStage allocates a receive buffer per
        micro-batch for the run (m on a non-first stage, of which the ``held`` in-flight ones are
        its saved inputs, already in the activations) and m gradient receive buffers plus the
        outputs of its ``held`` in-flight micro-batches (on a non-last stage): (m - held,
        m + held). With interleaving torch's runtime schedule (``_PipelineScheduleRuntime``)
        waits on its sends only at the end of the step, so every output sent and every input
        gradient sent back stays alive until then: (m - held + done, m + held + done)
        (measured, ``benchmarks/bench_accuracy.md``)."""
        if self.config.virtual_stages == 1:
            if held == self.in_flight[stage]:
                return self.receive_copies[stage], self.send_copies[stage]
            return boundary_copies(  # a later moment of the schedule (first_backward_peak)
                self.runtime,
                self.config.schedule,
                self.config.num_microbatches,
                self.num_stages,
                stage,
                deallocate_pipeline_outputs=self.deallocate_pipeline_outputs,
                held=held,
            )
        m, last = self.config.num_microbatches, self.num_stages - 1
        if self.runtime == "megatron":
            if self.deallocate_pipeline_outputs:
                return self.receive_copies[stage], self.send_copies[stage]
            return self.receive_copies[stage], (0 if stage == last else 1 + held)
        return (
            (0 if stage == 0 else m - held + done),
            (0 if stage == last else m + held + done),
        )

    @property
    def direct_sends(self) -> bool:
        """Each boundary tensor goes straight from its producer's stage to every consuming
        stage, nothing relayed (torch.distributed.pipelining; ``direct_boundary_bytes``); False:
        from neighbour to neighbour (Megatron-LM's and DeepSpeed's p2p, ``boundary_bytes``)."""
        return self.runtime == "torch"

    @cached_property
    def tensor_groups(self) -> list[tuple[list[int], int]]:
        """(edges, bytes per micro-batch) of every tensor that edges carry, in order of first
        edge; one edge each unless the graph names a tensor sent to several consumers."""
        groups: dict[int, list[int]] = {}
        for edge, tensor in enumerate(self.edge_tensor.tolist()):
            groups.setdefault(tensor, []).append(edge)
        return [(edges, int(self.edge_bytes[edges[0]])) for edges in groups.values()]

    @cached_property
    def tensor_roles(self) -> list[tuple[bool, bool, list[int]]]:
        """Parallel to ``tensor_groups``: (requires grad, whether its consumers' saving is known,
        the layers whose stored bytes count its storage) of every tensor, for the torch
        runtime's buffers (``direct_buffer_adjustments``)."""
        roles = []
        for edges, _ in self.tensor_groups:
            grad = self.edge_requires_grad is None or bool(self.edge_requires_grad[edges[0]])
            known = self.edge_saved is not None and bool((self.edge_saved[edges] >= 0).any())
            charged = set()
            if self.edge_charged is not None:
                charged = {int(self.edge_dst[e]) for e in edges if self.edge_charged[e]}
            if self.edge_src_charged is not None and self.edge_src_charged[edges[0]]:
                charged.add(int(self.edge_src[edges[0]]))
            roles.append((grad, known, sorted(charged)))
        return roles

    @cached_property
    def plain_boundaries(self) -> bool:
        """Every tensor requires grad and goes to one consumer whose stored bytes count it (or
        its saving is unknown), so each boundary takes today's R_s and S_s copies and no
        adjustment (``direct_buffer_adjustments``): what the chain methods assume."""
        return not self.direct_sends or all(
            grad
            and (
                not known
                or charged
                == [int(self.edge_dst[edges[0]])]
                == [int(self.edge_dst[e]) for e in edges]
            )
            for (edges, _), (grad, known, charged) in zip(
                self.tensor_groups, self.tensor_roles, strict=True
            )
        )

    @cached_property
    def first_backward_peak(self) -> list[bool]:
        """Per (virtual) stage: its gradients appear during its first backward and no forward
        follows it, so its peak is one of the moments of ``first_backward_moments`` rather than
        the persistent one. True where the gradient lifetime is "step" and every forward of the
        step runs before the stage's first backward: GPipe, or 1F1B with m <= p - s (k_s = m).
        Under 1F1B with m > p - s a forward follows the first backward, holding k_s micro-batches
        and every gradient: the persistent moment, exactly. Interleaved stages keep the
        persistent moment (an upper bound: fewer gradients never take memory)."""
        m = self.config.num_microbatches
        late = self.grad_lifetime == "step" and self.config.virtual_stages == 1
        return [late and k == m for k in self.in_flight]

    @cached_property
    def state_lower_bytes(self) -> np.ndarray:
        """Per layer, states a stage holding it keeps at its peak at least: the weights and
        optimizer state, plus the gradients unless some stage's peak can come before them
        (``first_backward_peak``), bytes (for lower bounds)."""
        if any(self.first_backward_peak):
            return self.state_bytes - self.grad_bytes
        return self.state_bytes

    @property
    def selective(self) -> bool:
        """Recomputation is a per-layer decision (config.recompute == "selective"): the plain
        coefficients are a layer's without recomputation, the ``recompute_*`` ones with it."""
        return self.config.recompute == "selective"

    def uniform(self, recompute: bool) -> LayerCosts:
        """These coefficients with no layer (False) or every layer (True) recomputed, as a plain
        "none" / "full" config (what the chain algorithm takes); themselves unless selective."""
        if not self.selective:
            return self
        stored, transient, time_ns = self.coefficients([recompute] * self.num_layers)
        return dataclasses.replace(
            self,
            config=dataclasses.replace(self.config, recompute="full" if recompute else "none"),
            stored_bytes=stored,
            transient_bytes=transient,
            time_ns=time_ns,
            recompute_stored_bytes=None,
            recompute_transient_bytes=None,
            recompute_time_ns=None,
        )

    def recompute_mask(self, recomputed: list[bool] | np.ndarray | None) -> np.ndarray:
        """Which layers are recomputed: every recomputable one under "full", none under "none",
        the given recomputable ones (default none) under "selective"."""
        n = self.num_layers
        recomputable = np.ones(n, dtype=bool) if self.recomputable is None else self.recomputable
        if self.config.recompute == "full":
            return recomputable.copy()
        if recomputed is None or not self.selective:
            assert recomputed is None or not np.any(recomputed), "recompute set without selective"
            return np.zeros(n, dtype=bool)
        mask = np.asarray(recomputed, dtype=bool)
        assert mask.shape == (n,), f"{mask.shape} recompute flags for {n} layers"
        return mask & recomputable

    def bounding_coefficients(self, pick=np.minimum) -> tuple[np.ndarray, ...]:
        """(stored_bytes, transient_bytes, time_ns) per layer, the smaller (``np.minimum``) or
        larger (``np.maximum``) of the two states under "selective": bounds over every
        recompute set."""
        if not self.selective:
            return self.stored_bytes, self.transient_bytes, self.time_ns
        return (
            pick(self.stored_bytes, self.recompute_stored_bytes),
            pick(self.transient_bytes, self.recompute_transient_bytes),
            pick(self.time_ns, self.recompute_time_ns),
        )

    def stage_tail_ns(self, stage: StageCost) -> int:
        """``tail_ns`` summed over a stage's layers, from its stage costs, ns."""
        sync = stage.dp_sync_ns if self.dp_overlap == "none" else 0
        return sync + stage.optimizer_step_ns

    @property
    def has_compute_time(self) -> bool:
        """Some layer has a compute, recompute or data-parallel sync time, or the runtime a
        per-micro-batch overhead. Without any (statistics without FLOPs or times) the time
        model has nothing to say: an iteration takes 0 ns, optimizer step and transfers
        included."""
        return bool(
            self.time_ns.any()
            or self.dp_sync_ns.any()
            or self.microbatch_overhead_ns
            or (self.recompute_time_ns is not None and self.recompute_time_ns.any())
        )

    @property
    def tail_ns(self) -> np.ndarray:
        """What each layer surely adds to its rank's work after the rank's last backward, ns per
        iteration: its optimizer step, and its data-parallel gradient sync unless that overlaps
        the last backward (``dp_overlap``)."""
        if self.dp_overlap == "none":
            return self.dp_sync_ns + self.optimizer_step_ns
        return self.optimizer_step_ns

    @property
    def backward_ns(self) -> np.ndarray:
        """The backward of each layer per micro-batch, ns: time_ns - forward_ns, so that
        forward_ns + backward_ns == time_ns exactly (the forward's rounding is in here)."""
        return self.time_ns - self.forward_ns

    @property
    def recompute_backward_ns(self) -> np.ndarray:
        """The backward of a recomputed layer per micro-batch, ns: its forward runs again right
        before it, recompute_time_ns - forward_ns."""
        return self.recompute_time_ns - self.forward_ns

    def forward_backward_ns(
        self, recomputed: list[bool] | np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) ns per layer and micro-batch with the given layers recomputed
        (``recompute_mask``): a recomputed layer's backward includes its second forward. They
        sum to ``coefficients``' time_ns."""
        mask = self.recompute_mask(recomputed)
        return self.forward_ns, np.where(mask, self.recompute_backward_ns, self.backward_ns)

    def coefficients(self, recomputed: list[bool] | np.ndarray | None) -> tuple[np.ndarray, ...]:
        """(stored_bytes, transient_bytes, time_ns) per layer with the given layers recomputed."""
        if not self.selective:
            return self.stored_bytes, self.transient_bytes, self.time_ns
        mask = self.recompute_mask(recomputed)
        return (
            np.where(mask, self.recompute_stored_bytes, self.stored_bytes),
            np.where(mask, self.recompute_transient_bytes, self.transient_bytes),
            np.where(mask, self.recompute_time_ns, self.time_ns),
        )

    @property
    def num_layers(self) -> int:
        return len(self.weight_bytes)

    @property
    def num_stages(self) -> int:
        """Stages a layer can be assigned to: p v virtual stages (p without interleaving)."""
        return self.config.pp * self.config.virtual_stages

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks p (GPUs along the pipeline); virtual stage j runs on rank j mod p."""
        return self.config.pp

    def stages_of_rank(self, rank: int) -> list[int]:
        """Virtual stages of rank r, chunk order: r, r + p, ..., r + (v - 1) p."""
        return list(range(rank, self.num_stages, self.num_ranks))

    @property
    def least_held(self) -> int:
        """A count every rank holds of each of its chunks at one of its peaks: max over its
        vectors of the smallest entry, minimised over ranks (k_min without interleaving)."""
        return min(max(min(vector) for vector in vectors) for vectors in self.in_flight_vectors)

    @cached_property
    def state_bytes(self) -> np.ndarray:
        """Weights + gradients (+ gradient buffers) + optimizer per GPU, bytes."""
        states = self.weight_bytes + self.grad_bytes + self.optimizer_bytes
        return states if self.grad_buffer_bytes is None else states + self.grad_buffer_bytes

    def is_chain(self) -> bool:
        """Layer i feeds layer i + 1 only, each boundary with the plain copies
        (``plain_boundaries``): the chain methods (``backends.chain``, ``capslog_statistics``)
        apply."""
        n = self.num_layers
        return (
            self.plain_boundaries
            and len(self.edge_src) == n - 1
            and bool(
                np.all(self.edge_src == np.arange(n - 1))
                and np.all(self.edge_dst == np.arange(1, n))
            )
        )


def layer_costs(
    graph: LayerGraph, config: ParallelConfig, cluster: Cluster, training: TrainingConfig
) -> LayerCosts:
    """Coefficients of every layer for ``config`` (see the module docstring for the formulas).

    Vectorised over layers; integer terms use exact integer arithmetic (ceil of a ratio of ints).
    """
    in_flight, vectors, dones = _in_flight(config, training)
    receive_copies, send_copies = stage_boundary_copies(
        training.runtime,
        config,
        deallocate_pipeline_outputs=training.deallocate_pipeline_outputs,
        in_flight=in_flight,
    )
    held = max(sum(vector) for rank in vectors for vector in rank)
    check_exact_range(graph, config, cluster, training, held, receive_copies, send_copies)
    t, b = config.tp, config.micro_batch
    cols = _graph_columns(graph)
    if config.cp > 1:
        check_context_parallel(graph, config.cp, training.memory_model)
    factor = routing_factor(graph, config, training)
    params = ParamShares.of(cols, config)
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
            # saves the
            # all-gathered [b, s, h] input of each column-parallel Linear and LM head, not its
            # [b, s/t, h] shard: (t-1)/t of sp_gathered_bytes more per GPU, measured to the byte
            # on gpt-tiny (tests/test_torch_sp.py)
            saved_times_t = saved_times_t + (t - 1) * cols["sp_gathered_bytes"]
    # a stage sends [s/(t c), b, h] with sequence parallelism, [s/c, b, h] without
    edge_bytes = _ceil_div(edge_bytes, sequence_split(config))
    saved = _ceil_div(b * saved_times_t, t * config.cp) + expert_stored_bytes(cols, config, factor)
    weight, grad, optimizer = _model_state_bytes(params, config, training)
    stored, transient = _activation_bytes(cols, params, saved, config, training)
    if training.runtime == "torch":
        # torch.distributed.pipelining's loss_fn(output, target) runs outside the model: the
        # last stage keeps each in-flight micro-batch's output until its backward, beside what
        # the loss saves; the part no op saved is not in the graph's activation_bytes
        held_output = b * unsaved_output_bytes(graph)
        stored = tuple(np.concatenate([kept[:-1], kept[-1:] + held_output]) for kept in stored)
    time_ns = _time_ns(cols, config, cluster, factor)
    forward_ns = np.minimum(_forward_ns(cols, config, cluster, factor), time_ns[0])
    recomputable = recomputable_layers(graph, training.runtime)
    stored, transient, time_ns = (
        (kept, np.where(recomputable, recomputed, kept))
        for kept, recomputed in (stored, transient, time_ns)
    )
    # "none" and "selective" take the kept state as the plain coefficients, "full" the other
    state = int(config.recompute == "full")
    calibration = training.calibration
    scaled = _calibrated(calibration)
    costs = LayerCosts(
        config=config,
        weight_bytes=scaled(weight, "weights"),
        grad_bytes=scaled(grad, "grads"),
        optimizer_bytes=scaled(optimizer, "optimizer"),
        stored_bytes=scaled(stored[state], "activations"),
        transient_bytes=scaled(transient[state], "transient"),
        time_ns=_as_int(time_ns[state]),
        recompute_stored_bytes=scaled(stored[1], "activations"),
        recompute_transient_bytes=scaled(transient[1], "transient"),
        recompute_time_ns=_as_int(time_ns[1]),
        forward_ns=_as_int(forward_ns),
        recomputable=recomputable,
        dp_sync_ns=_as_int(_dp_sync_ns(params, config, cluster, training)),
        edge_src=cols["edge_src"],
        edge_dst=cols["edge_dst"],
        edge_bytes=scaled(edge_bytes, "buffers"),
        edge_tensor=cols["edge_tensor"],
        edge_requires_grad=cols["edge_requires_grad"],
        edge_saved=cols["edge_saved"],
        edge_charged=cols["edge_charged"],
        edge_src_charged=cols["edge_src_charged"],
        constant_bytes=0 if calibration is None else calibration.constant_bytes,
        in_flight=in_flight,
        in_flight_vectors=vectors,
        backwards_done=dones,
        receive_copies=receive_copies,
        send_copies=send_copies,
        runtime=training.runtime,
        deallocate_pipeline_outputs=training.deallocate_pipeline_outputs,
        grad_lifetime=training.grad_lifetime,
        grad_buffer_bytes=ddp_bucket_bytes(config, training, scaled(grad, "grads")),
        step_bytes=optimizer_step_bytes(params, config, training, scaled),
        optimizer_step_ns=_as_int(
            _optimizer_step_ns(params, config, cluster, training, timing_of(graph))
        ),
        microbatch_overhead_ns=_profiled_ns(graph, "microbatch_overhead_ns"),
        step_overhead_ns=_profiled_ns(graph, "step_overhead_ns"),
        link_gb_per_s=pipeline_links(config, cluster),
        p2p_latency_ns=math.ceil(cluster.p2p_latency_us * 1000),
        dp_overlap=dp_overlap_of(config, training),
    )
    if not costs.has_compute_time:  # no time model: the optimizer step alone says nothing
        costs.optimizer_step_ns = np.zeros(len(costs.time_ns), dtype=np.int64)
    if training.memory_model == "empirical":
        _check_empirical_options(config, calibration)
        return empirical_layer_costs(graph, config, costs)
    return costs


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


def ddp_bucket_bytes(
    config: ParallelConfig, training: TrainingConfig, grad: np.ndarray
) -> np.ndarray | None:
    """DDP's gradient buckets beside ``.grad`` (per layer, bytes), or None. On the torch runtime
    DDP (dp > 1, ZeRO 0 or 1; ``profiling.run`` builds it with ``gradient_as_bucket_view``)
    allocates its buckets when it is built and keeps them; ``.grad`` is a view of them only
    until ``zero_grad(set_to_none=True)`` frees it: the next backward makes fresh gradients,
    which live beside the buckets until the step ends (torch's DDP docs: "the bucket view alias
    is destroyed every iteration"; measured: +1 gradient copy, -15% under-predicted without
    it). So with the step lifetime the buckets are a persistent second copy; with persistent
    gradients ``.grad`` stays the bucket view."""
    if training.runtime == "torch" and training.grad_lifetime == "step":
        if config.dp * config.cp > 1 and config.zero <= 1:
            return grad.copy()
    return None


def dp_overlap_of(config: ParallelConfig, training: TrainingConfig) -> str:
    """When the runtime syncs a rank's gradients: torch DDP (the torch runtime at dp > 1 and
    ZeRO 0 or 1, what ``profiling.run`` builds) launches its bucket all-reduces during the last
    micro-batch's backward (``PipelineStage.backward_maybe_with_nosync``): "last_backward";
    FSDP under pipelining reduces after the schedule (``perform_reduce_grad``), and megatron-core
    without ``--overlap-grad-reduce`` (its default) in ``finalize_model_grads`` after it:
    "none"."""
    if training.runtime == "torch" and config.zero <= 1:
        return "last_backward"
    return "none"


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
) -> None:
    """InputError unless every int64 product and sum of ``layer_costs`` and ``stage_costs`` for
    this config stays exact: upper bounds (every layer on one stage, every micro-batch in flight
    that the schedule holds, ``held``) of a layer's intermediate products and of a stage's memory
    at most :data:`MAX_EXACT_BYTES`, and of the iteration at most :data:`MAX_ITERATION_NS`.
    Computed in floats from the graph's totals, O(1) per config; the limits have a factor 2 of
    headroom over int64, far more than the floats' rounding. Real models are orders of magnitude
    below both (GPT-3 175B: stage peaks near 2^36 bytes, iterations near 2^44 ns)."""
    totals = _graph_totals(graph)
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
    factor = float(routing_factor(graph, config, training))
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
    where = f"{graph.source}: {config.label()}"
    if max(largest_product, memory) > MAX_EXACT_BYTES:
        raise InputError(
            f"{where}: a stage's memory could reach {max(largest_product, memory):.3g} bytes, "
            "beyond the 2^62 the cost model computes exactly; the graph's sizes (parameters, "
            "bytes per sample), the batch and the bytes per parameter are implausible together "
            '(docs/layer-graph.md, "Limits")'
        )
    if not iteration <= MAX_ITERATION_NS:
        raise InputError(
            f"{where}: an iteration could take {iteration:.3g} ns ({iteration / 864e11:.3g} "
            "days), beyond the 2^52 ns (52 days) the cost model computes; check the graph's "
            "FLOPs and times and the cluster's TFLOP/s and bandwidths (docs/layer-graph.md, "
            '"Limits")'
        )


def _graph_totals(graph: LayerGraph) -> dict[str, float]:
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


@dataclass(frozen=True)
class ParamShares:
    """A layer's parameters per GPU in two parts that shard differently (module docstring,
    P'_l): the dense ones, P'_dense = (params - tp_params - expert_params) + tp_params / t,
    held as ``dense_times_t`` = t P'_dense (an integer); and the routed experts',
    expert_params / (t ep): Megatron shards the experts over ep ranks and splits each expert
    over the expert tensor-parallel group, whose size is tp by default
    (``ModelParallelConfig.expert_tensor_parallel_size`` None -> tensor_model_parallel_size)."""

    dense_times_t: np.ndarray
    """t P'_dense of every layer (parameters)."""
    expert: np.ndarray
    """expert_params of every layer, before the division by t ep (parameters)."""
    tp: int
    ep: int

    @classmethod
    def of(cls, cols: dict[str, np.ndarray], config: ParallelConfig) -> ParamShares:
        t = config.tp
        dense = cols["params"] - cols["tp_params"] - cols["expert_params"]
        return cls(
            dense_times_t=dense * t + cols["tp_params"],
            expert=cols["expert_params"],
            tp=t,
            ep=config.ep,
        )

    def bytes_per_gpu(self, per_param: int, dense_shards: int, expert_shards: int) -> np.ndarray:
        """ceil(P'_dense x / n_dense) + ceil(P'_expert x / n_expert) of every layer: ``per_param``
        bytes of each parameter, the dense part sharded over ``dense_shards`` ranks and the
        experts' over ``expert_shards`` (each term rounded up)."""
        dense = _ceil_div(self.dense_times_t * per_param, self.tp * dense_shards)
        return dense + _ceil_div(self.expert * per_param, self.tp * self.ep * expert_shards)

    def sharded(self, per_param: int, config: ParallelConfig, sharded: bool) -> np.ndarray:
        """``bytes_per_gpu`` with the dense part over the d c data-parallel ranks
        (``sharding_degree``) and the experts over the d c / ep expert-data-parallel ranks when
        ``sharded`` (ZeRO / Megatron's distributed optimizer: ``_get_param_groups_and_buffers``
        builds the expert parameters' optimizer over ``intra_expt_dp_group``, world / (pp tp
        ep) ranks), else unsharded."""
        if not sharded:
            return self.bytes_per_gpu(per_param, 1, 1)
        shards = sharding_degree(config)
        return self.bytes_per_gpu(per_param, shards, shards // config.ep)


def _model_state_bytes(
    params: ParamShares, config: ParallelConfig, training: TrainingConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weights, gradients and optimizer state per GPU of every layer (the terms of states_s in
    the module docstring): tp splits the tp parameters, t ep the routed experts'; ZeRO stage z
    shards the optimizer state (z >= 1), gradients (z >= 2) and weights (z = 3) over dp x cp
    (``sharding_degree``; the experts' over dp x cp / ep)."""
    d, z = sharding_degree(config), config.zero
    w, g, o = (
        training.weight_bytes_per_param,
        training.grad_bytes_per_param,
        training.optimizer_bytes_per_param,
    )
    weight = params.sharded(w, config, z >= 3)
    if z == 2 and d > 1 and training.runtime == "torch":
        # FSDP2 keeps the sharded parameters next to the gathered ones
        weight = weight + params.sharded(w, config, True)
    grad = params.sharded(g, config, z >= 2)
    optimizer = params.sharded(o, config, z >= 1)
    return weight, grad, optimizer


def optimizer_step_bytes(
    params: ParamShares, config: ParallelConfig, training: TrainingConfig, scaled
) -> np.ndarray | None:
    """The optimizer step's temporary of every layer per GPU, bytes, or None without one:
    ceil(P'_l u / d[z>=1]) with u = ``TrainingConfig.optimizer_step_bytes_per_param`` (a foreach
    Adam's square root of ``exp_avg_sq``, one state element per parameter). It is made from the
    optimizer's own states, so it is split like them: over tp, and over dp from ZeRO 1 (each
    rank steps its shard: ``ZeroRedundancyOptimizer``'s local optimizer, FSDP2's DTensor
    shards; over dp x cp with context parallelism, ``sharding_degree``; the routed experts'
    over dp x cp / ep). ``scaled``: ``_calibrated``'s function (a calibration scales it with
    the transients)."""
    per_param = training.optimizer_step_bytes_per_param
    if not per_param:
        return None
    return scaled(params.sharded(per_param, config, config.zero >= 1), "transient")


def recomputable_layers(graph: LayerGraph, runtime: str) -> np.ndarray:
    """Which layers ``runtime`` recomputes under recomputation: megatron the transformer blocks
    (``Layer.role == "block"``), torch every layer."""
    if runtime == "torch":
        return np.ones(len(graph.layers), dtype=bool)
    return np.array([layer.role == "block" for layer in graph.layers], dtype=bool)


def _activation_bytes(
    cols: dict[str, np.ndarray],
    params: ParamShares,
    saved: np.ndarray,
    config: ParallelConfig,
    training: TrainingConfig,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(stored_l, transient) bytes of every layer per micro-batch, each in both states: kept
    (index 0) and recomputed (index 1: only the output is stored, the saved tensors come back
    while the layer recomputes). ``saved``: b A'_l per GPU, bytes per micro-batch (rounded
    up; / c with context parallelism). Transient is max(b transient_bytes_l, b
    weight_grad_transient_bytes_l + gtemp_l) + gather_l (module docstring)."""
    t, b, c = config.tp, config.micro_batch, config.cp
    w = training.weight_bytes_per_param
    grad_temporary = w * np.maximum(
        largest_local_param(cols, config), _ceil_div(cols["largest_tp_param"], t)
    )
    # a recomputed layer keeps its output, the next layer's input: [s/t, b, h] with sequence
    # parallelism; context parallelism holds s/c of every sequence: every term per sample / c
    kept_output = _ceil_div(b * cols["output_bytes"], sequence_split(config))
    stored = (saved, kept_output)
    gather = 2 * params.bytes_per_gpu(w, 1, 1) if config.zero >= 3 else 0

    def transient(bytes_per_sample: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Kept, recomputed (the recomputed layer's saved tensors come back while it runs)."""
        kept = _ceil_div(b * bytes_per_sample, c)
        return (kept, kept + saved)

    # the weight-gradient temporary joins what is live when the weight gradients are made; ring
    # attention's K/V buffers join the layer's own peak (its attention runs then)
    ring = ring_attention_bytes(cols["attention_kv_bytes"], config)
    anytime = tuple(peak + ring for peak in transient(cols["transient_bytes"]))
    at_weight_grad = transient(cols["weight_grad_transient_bytes"])
    peaks = tuple(
        np.maximum(peak, beside + grad_temporary) + gather
        for peak, beside in zip(anytime, at_weight_grad, strict=True)
    )
    return stored, peaks


def largest_local_param(cols: dict[str, np.ndarray], config: ParallelConfig) -> np.ndarray:
    """Elements per GPU of every layer's largest parameter tensor that TP does not split
    (``largest_param``), as its weight-gradient temporary sees it. A tensor larger than all of
    the layer's dense replicated parameters (params - tp_params - expert_params) can only be a
    routed-expert tensor (a grouped (E, h, f) expert weight, never split by the TP rule):
    Megatron holds E / ep experts of width / t of it, largest_param / (t ep) (``ParamShares``);
    any other stays whole."""
    dense_replicated = cols["params"] - cols["tp_params"] - cols["expert_params"]
    largest = cols["largest_param"]
    in_experts = (cols["expert_params"] > 0) & (largest > dense_replicated)
    return np.where(in_experts, _ceil_div(largest, config.tp * config.ep), largest)


def routing_factor(graph: LayerGraph, config: ParallelConfig, training: TrainingConfig) -> Fraction:
    """f: how many times its balanced share of routed tokens one GPU's experts may hold
    (``TrainingConfig.moe_capacity_factor``); 1 on a dense graph. InputError when ``config.ep``
    does not fit the graph (``moe.check_expert_degree``).

    - a capacity factor c: Megatron's ``--moe-expert-capacity-factor c`` with
      ``--moe-pad-expert-input-to-capacity`` pads every expert to capacity = c x its balanced
      share (``moe_utils.get_capacity``), so the GPU holds exactly c times the balanced tokens:
      f = c (taken to 1/1000; c = 1 is the balanced routing);
    - dropless: no capacity, so the worst a router can do to one GPU is to send every token of
      the ep GPUs of its expert-parallel group as many of its k choices as that GPU has experts:
      each token reaches at most min(k, E / ep) of the GPU's E / ep experts, from ep GPUs, against
      k / ep x ep = k on average, f = ep min(k, E / ep) / k (ep = 1: f = 1; Mixtral E 8, k 2 at
      ep 8: f = 8 x 1 / 2 = 4).

    Both relative to the capacity the graph was profiled at (``meta.moe.capacity_factor``,
    default 1: balanced): a graph profiled with padding to 1.25 has f = 1 / 1.25 at a balanced
    routing."""
    check_expert_degree(graph, config.ep)
    experts = routed_experts(graph)
    return _routing_factor(experts, config.ep, training.moe_capacity_factor)


def _routing_factor(
    experts: RoutedExperts | None, ep: int, capacity_factor: float | str
) -> Fraction:
    if experts is None:
        return Fraction(1)
    # the graph's expert fields were profiled at this capacity (meta.moe.capacity_factor)
    profiled = Fraction(experts.profiled_capacity_factor).limit_denominator(1000)
    if capacity_factor == MOE_DROPLESS:
        k, local = experts.top_k, experts.num_experts // ep
        return Fraction(ep * min(k, local), k) / profiled
    return Fraction(capacity_factor).limit_denominator(1000) / profiled


def expert_stored_bytes(
    cols: dict[str, np.ndarray], config: ParallelConfig, factor: Fraction
) -> np.ndarray:
    """The routed experts' saved bytes per GPU per micro-batch of every layer (module docstring,
    X'_l): f b (R_l + (X_l - R_l) / t), rounded up, with X_l = expert_activation_bytes and
    R_l = min(X_l, ep_comm_bytes_l / 4) the routed tokens' hidden states (one of the four equal
    all-to-alls ep_comm_bytes counts: dispatch and combine, forward and backward). Megatron's
    expert tensor parallelism splits the experts' width (fc1 column-, fc2 row-parallel) but
    all-gathers the dispatched tokens over the TP ranks first
    (``MoEAlltoAllTokenDispatcher.dispatch_postprocess``: ``gather_from_sequence_parallel_region``
    over ``tp_group``), so every TP rank keeps the whole [b s k, h] input fc1 saves: R stays
    replicated; the rest (fc1's output, the activation's input, fc2's input: width ffn / t) is
    split. Not divided by ep: each GPU's experts receive b s k tokens at a balanced routing
    whatever ep is; divided by c with context parallelism (each GPU routes its s / c tokens)."""
    t, b, c = config.tp, config.micro_batch, config.cp
    expert = cols["expert_activation_bytes"]
    replicated = np.minimum(expert, cols["ep_comm_bytes"] // 4)
    times_t = replicated * t + (expert - replicated)
    return -(-(b * factor.numerator * times_t) // (factor.denominator * t * c))


def _time_ns(
    cols: dict[str, np.ndarray], config: ParallelConfig, cluster: Cluster, factor: Fraction
) -> tuple[np.ndarray, np.ndarray]:
    """Time of every layer per micro-batch (module docstring, "per micro-batch"), kept (index 0)
    and recomputed (index 1: the forward runs twice, its dispatch and combine too)."""
    t, b, c = config.tp, config.micro_batch, config.cp
    rate_per_ms = cluster.gpu_flops * cluster.flops_efficiency / 1e3
    fwd_ms = np.where(cols["measured"], cols["fwd_ms"], cols["fwd_flops"] / rate_per_ms)
    total_ms = np.where(
        cols["measured"],
        cols["fwd_ms"] + cols["bwd_ms"],
        (cols["fwd_flops"] + cols["bwd_flops"]) / rate_per_ms,
    )
    # GB/s == bytes/ns; ring all-reduce moves 2 (t-1)/t of the buffer per GPU.
    # with context parallelism the all-reduced activations hold s/c tokens
    tp_comm_ns = b * cols["tp_comm_bytes"] * 2 * (t - 1) / (t * c) / cluster.intra_node_gb_per_s
    # ring attention: (c-1)/c of the K/V per pass, three passes (forward K/V; backward K/V and
    # dK/dV), a fourth for a recomputed layer's second forward
    ring_pass_ns = ring_attention_pass_ns(cols["attention_kv_bytes"], config, cluster)
    # expert-parallel all-to-alls: a recomputed forward dispatches and combines again (x 1.5)
    all_to_all_ns = expert_all_to_all_ns(cols, config, cluster, factor)
    return tuple(
        np.ceil(
            b * (total_ms + extra) / (t * c) * NS_PER_MS
            + tp_comm_ns
            + passes * ring_pass_ns
            + a2a * all_to_all_ns
        )
        for extra, passes, a2a in ((0.0, 3, 1.0), (fwd_ms, 4, 1.5))
    )


def _forward_ns(
    cols: dict[str, np.ndarray], config: ParallelConfig, cluster: Cluster, factor: Fraction
) -> np.ndarray:
    """The forward's part of every layer's kept time per micro-batch (``_time_ns`` index 0),
    rounded up: its compute (fwd_ms measured, else fwd_flops), half of the TP all-reduce bytes
    (tp_comm_bytes counts forward plus backward: Megatron's row-parallel layers all-reduce their
    outputs in the forward, the column-parallel ones their input gradients in the backward, as
    many), one of the three ring-attention passes and half of the all-to-alls (dispatch and
    combine once each way). ``LayerCosts.backward_ns`` is the rest."""
    t, b, c = config.tp, config.micro_batch, config.cp
    rate_per_ms = cluster.gpu_flops * cluster.flops_efficiency / 1e3
    fwd_ms = np.where(cols["measured"], cols["fwd_ms"], cols["fwd_flops"] / rate_per_ms)
    tp_comm_ns = b * cols["tp_comm_bytes"] * 2 * (t - 1) / (t * c) / cluster.intra_node_gb_per_s
    ring_pass_ns = ring_attention_pass_ns(cols["attention_kv_bytes"], config, cluster)
    all_to_all_ns = expert_all_to_all_ns(cols, config, cluster, factor)
    return np.ceil(
        b * fwd_ms / (t * c) * NS_PER_MS + tp_comm_ns / 2 + ring_pass_ns + all_to_all_ns / 2
    )


def expert_all_to_all_ns(
    cols: dict[str, np.ndarray], config: ParallelConfig, cluster: Cluster, factor: Fraction
) -> np.ndarray:
    """Expert-parallel all-to-all time of every layer per micro-batch, ns (module docstring):
    b ep_comm_bytes f (ep - 1) / ep bytes leave each GPU (the (ep-1)/ep of its tokens routed to
    other ranks), / t with sequence parallelism (each TP rank dispatches its s / t tokens) and
    / c with context parallelism (s / c tokens per GPU), over the intra-node bandwidth when the
    t ep GPUs of an expert-parallel group fit in a node, else inter-node. 0 at ep 1."""
    t, e, b = config.tp, config.ep, config.micro_batch
    if e == 1:
        return np.zeros(len(cols["ep_comm_bytes"]))
    bytes_per_ns = (
        cluster.intra_node_gb_per_s
        if t * e <= cluster.gpus_per_node
        else cluster.inter_node_gb_per_s
    )
    sent = b * cols["ep_comm_bytes"] * float(factor) * (e - 1) / e
    return sent / sequence_split(config) / bytes_per_ns


def _dp_sync_ns(
    params: ParamShares, config: ParallelConfig, cluster: Cluster, training: TrainingConfig
) -> np.ndarray:
    """Each layer's share of AR_s, the data-parallel gradient sync (module docstring): 2 (d-1)/d
    of its dense gradient bytes per GPU and 2 (d_e-1)/d_e of its expert gradient bytes over the
    d_e = d c / ep expert-data-parallel ranks, 3 rounds with ZeRO-3, intra-node when t d fits in a
    node (the expert-data-parallel group spans the same GPUs); with context parallelism the
    group is dp x cp (d -> d c: the cp ranks hold the same parameters and their gradients are
    summed too, Megatron's ``with_context_parallel`` data parallel group; the experts' d c / ep,
    Megatron's expert-data-parallel group of world / (pp tp ep) ranks)."""
    t, d, e = config.tp, sharding_degree(config), config.ep
    d_expert = d // e
    sync_bytes_per_ns = (
        cluster.intra_node_gb_per_s
        if t * d <= cluster.gpus_per_node
        else cluster.inter_node_gb_per_s
    )
    sync_rounds = 3 if config.zero >= 3 else 2
    g = training.grad_bytes_per_param
    dense = sync_rounds * (d - 1) * params.dense_times_t * g / (d * t * sync_bytes_per_ns)
    expert = (
        sync_rounds * (d_expert - 1) * params.expert * g / (d_expert * t * e * sync_bytes_per_ns)
    )
    return np.ceil(dense + expert)


def _optimizer_step_ns(
    params: ParamShares,
    config: ParallelConfig,
    cluster: Cluster,
    training: TrainingConfig,
    timing: dict | None,
) -> np.ndarray:
    """The optimizer step over each layer's parameters on one GPU, ns per iteration: the
    parameters it steps (its ZeRO shard from stage 1, ``ParamShares.sharded``) times the
    profiled ``meta.timing.optimizer_step_ns_per_param`` when the graph has it, else times the
    bytes an element-wise step moves per parameter over the GPU's memory bandwidth: it reads
    and writes the optimizer state (master weights and moments, 2 o), reads the gradient (g)
    and writes the weight (w) (``Cluster.memory_gb_per_s``; a memory-bound kernel)."""
    stepped = params.sharded(1, config, config.zero >= 1)
    measured = None if timing is None else timing.get("optimizer_step_ns_per_param")
    if measured is not None:
        return np.ceil(stepped * float(measured))
    moved = (
        2 * training.optimizer_bytes_per_param
        + training.grad_bytes_per_param
        + training.weight_bytes_per_param
    )
    return np.ceil(stepped * moved / cluster.memory_gb_per_s)


def _profiled_ns(graph: LayerGraph, name: str) -> int:
    """A runtime term the graph's profile measured (``meta.timing``'s ``microbatch_overhead_ns``
    or ``step_overhead_ns``), ns rounded up, else 0."""
    timing = timing_of(graph)
    measured = None if timing is None else timing.get(name)
    return 0 if measured is None else math.ceil(float(measured))


@dataclass(frozen=True)
class PipelineLinks:
    """Bandwidth (GB/s == bytes/ns) of the directed link between two pipeline ranks, looked up
    as ``links[(x, y)]``: Megatron's rank order tp-cp-ep-dp-pp puts rank x's GPUs at global
    ranks x w + (0 .. w - 1), w = t c d, and a GPU sends to the GPU w ranks further; intra-node
    when both blocks are in one node of ``gpus_per_node`` (each block inside a node: w divides
    into it without straddling), else inter-node. O(1) per lookup: configs are built by the
    thousand, links are read only when a schedule is simulated."""

    width: int
    gpus_per_node: int
    intra_node_gb_per_s: float
    inter_node_gb_per_s: float

    def same_node(self, x: int, y: int) -> bool:
        w, node = self.width, self.gpus_per_node
        if w >= node:  # distinct blocks are at least a node apart
            return False
        first, last = x * w, x * w + w - 1
        other = y * w
        return first // node == last // node == other // node == (other + w - 1) // node

    def __getitem__(self, link: tuple[int, int]) -> float:
        x, y = link
        if self.same_node(x, y):
            return self.intra_node_gb_per_s
        return self.inter_node_gb_per_s


def pipeline_links(config: ParallelConfig, cluster: Cluster) -> PipelineLinks:
    """The links between the pipeline ranks of ``config`` on ``cluster`` (``PipelineLinks``)."""
    return PipelineLinks(
        width=config.tp * config.cp * config.dp,
        gpus_per_node=cluster.gpus_per_node,
        intra_node_gb_per_s=cluster.intra_node_gb_per_s,
        inter_node_gb_per_s=cluster.inter_node_gb_per_s,
    )


def pipeline_link_gb_per_s(
    config: ParallelConfig, cluster: Cluster
) -> dict[tuple[int, int], float]:
    """Every directed link between pipeline ranks and its bandwidth, GB/s (``PipelineLinks``)."""
    links = pipeline_links(config, cluster)
    p = config.pp
    return {(x, y): links[(x, y)] for x in range(p) for y in range(p) if x != y}


def _as_int(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _calibrated(calibration: Calibration | None):
    """values, component -> int64 coefficients scaled by the calibration's factor for that
    component, each rounded up (unchanged without a calibration)."""
    if calibration is None:
        return lambda values, component: _as_int(values)
    return lambda values, component: _as_int(
        np.ceil(np.asarray(values, dtype=float) * calibration.scale(component))
    )


def _check_empirical_options(config: ParallelConfig, calibration: Calibration | None) -> None:
    if config.recompute == "selective":
        raise InputError(
            "memory model empirical: the statistics are measured for one recompute setting; "
            "selective recomputation needs the analytic model"
        )
    if calibration is not None:
        raise InputError(
            "memory model empirical: a calibration scales the analytic model; give one or the other"
        )


def _in_flight(config: ParallelConfig, training: TrainingConfig):
    """(k_j per virtual stage, in-flight vectors per rank, backwards done at each) of
    ``config``: on the torch runtime with interleaving every moment of the schedule (its
    buffers grow with the backwards done, and shrink with the held inputs), else the maximal
    vectors."""
    p, v, m = config.pp, config.virtual_stages, config.num_microbatches
    if v == 1:
        in_flight = [in_flight_microbatches(config.schedule, m, p, s) for s in range(p)]
        return in_flight, [[(k,)] for k in in_flight], [[(0,)] for _ in in_flight]
    if training.memory_model != "analytic":
        raise InputError(
            "memory model empirical: the statistics describe contiguous stages; interleaved "
            "stages (--virtual-stages > 1) need the analytic model"
        )
    group = interleaved_schedule_groups(training.runtime, m, p)
    if training.runtime == "torch":
        moments = [_undominated_moments(schedule_moments(m, p, v, r, group)) for r in range(p)]
        vectors = [[n for n, _ in rank] for rank in moments]
        dones = [[done for _, done in rank] for rank in moments]
    else:
        vectors = [in_flight_vectors(m, p, v, r, group) for r in range(p)]
        dones = [[(0,) * v for _ in rank] for rank in vectors]
    in_flight = [max(vector[j // p] for vector in vectors[j % p]) for j in range(p * v)]
    return in_flight, vectors, dones


def _undominated_moments(moments):
    """Drop a moment (n, B) when another has, for every chunk, n' >= n, B' - n' >= B - n and
    B' + n' >= B + n: the coefficients of a chunk's kept, received and sent bytes on the torch
    runtime with interleaving (n, m - n + B, m + n + B, ``LayerCosts.copies_at``) are then all
    at least as large, so its memory is too, whatever the split."""
    held = np.array([n for n, _ in moments], dtype=np.int64)
    done = np.array([b for _, b in moments], dtype=np.int64)
    keys = np.concatenate([held, done - held, done + held], axis=1)
    at_least = np.all(keys[:, None, :] >= keys[None, :, :], axis=2)  # [j, i]: j >= i everywhere
    differs = np.any(keys[:, None, :] != keys[None, :, :], axis=2)
    dominated = np.any(at_least & differs, axis=0)
    return [moment for moment, drop in zip(moments, dominated.tolist(), strict=True) if not drop]


def empirical_layer_costs(
    graph: LayerGraph, config: ParallelConfig, costs: LayerCosts
) -> LayerCosts:
    """The empirical (mCAP/CAPSlog) memory model in the cost model's terms; times from ``costs``.

    A stage holding layers a..b peaks at mem_isolated(a) + sum mem_added(a+1..b). On a chain that
    is: weight_bytes[l] = mem_added(l) (mem_isolated for layer 0, always a first layer), and the
    edge l-1 -> l carries mem_isolated(l) - mem_added(l), received once (R_s = 1) by the stage it
    starts; nothing else. Every backend then solves the empirical model exactly.
    """
    layers = graph.layers
    missing = [layer.name for layer in layers if layer.mem_isolated is None]
    if missing:
        raise InputError(
            f"memory model empirical: layers {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''} have no mem_isolated/mem_added; profile them "
            "or plan with the analytic model"
        )
    if not graph.is_chain:
        raise InputError(
            "memory model empirical: the graph is not a chain; the statistics (first layer of a "
            "stage + the layers it adds) describe contiguous stages of a chain"
        )
    if config.tp * config.dp > 1:
        raise InputError(
            f"memory model empirical: config {config.label()} has tp or dp > 1; the statistics "
            "describe one pipeline (pin --tp 1 --dp 1)"
        )
    added = np.array([layer.mem_added for layer in layers], dtype=np.int64)
    isolated = np.array([layer.mem_isolated for layer in layers], dtype=np.int64)
    weight = added.copy()
    weight[0] = isolated[0]
    zeros = np.zeros(len(layers), dtype=np.int64)
    return LayerCosts(
        config=config,
        weight_bytes=weight,
        grad_bytes=zeros,
        optimizer_bytes=zeros,
        stored_bytes=zeros,
        transient_bytes=zeros,
        time_ns=costs.time_ns,
        forward_ns=costs.forward_ns,
        dp_sync_ns=costs.dp_sync_ns,
        edge_src=np.arange(len(layers) - 1, dtype=np.int64),
        edge_dst=np.arange(1, len(layers), dtype=np.int64),
        edge_bytes=(isolated - added)[1:],
        in_flight=costs.in_flight,
        receive_copies=[0] + [1] * (config.pp - 1),
        send_copies=[0] * config.pp,
    )


# -- context parallelism (config.cp = c) ------------------------------------------------------

RING_BACKWARD_CHUNKS = 4
"""K/V chunks (each b * attention_kv_bytes / (t c)) a GPU holds while ring attention's backward
runs: TransformerEngine's ``AttnFuncWithCPAndKVP2P.backward`` (Megatron-LM's CP attention,
``cp_comm_type="p2p"``, context_parallel.py at TE d0067d0) allocates ``p2p_comm_buffers`` as
two tensors of shape (2, *kv.shape): the K/V being used and its dK/dV, and the K/V and dK/dV
being received."""


def sequence_split(config: ParallelConfig) -> int:
    """Parts a tensor laid out [s, b, h] is split into along the sequence: c (context
    parallelism), times t with sequence parallelism."""
    return config.cp * (config.tp if config.sp else 1)


def sharding_degree(config: ParallelConfig) -> int:
    """GPUs that hold the same parameters of a stage and sum their gradients: d c. The cp ranks
    keep full copies (context parallelism splits activations only), and Megatron-LM syncs
    gradients and shards its distributed optimizer over the data-parallel group *with* context
    parallelism (``parallel_state.get_data_parallel_group(with_context_parallel=True)``), so
    ZeRO stages and the gradient sync span d c ranks."""
    return config.dp * config.cp


def ring_attention_bytes(attention_kv_bytes: np.ndarray, config: ParallelConfig) -> np.ndarray:
    """Bytes per micro-batch per GPU of ring attention's K/V exchange buffers while a layer's
    attention runs (0 without context parallelism or attention).

    One chunk is the K and V of the GPU's s/c tokens and h_kv/t heads,
    chunk_l = ceil(b attention_kv_bytes_l / (t c)). TransformerEngine's
    ``AttnFuncWithCPAndKVP2P`` (what Megatron-LM runs) keeps, in the forward, every chunk it
    received in ``p2p_comm_buffers`` until the forward ends (a copy of its own, ``torch.cat`` of
    k and v, and c - 1 received: c chunks), and in the backward :data:`RING_BACKWARD_CHUNKS` (K/V
    and dK/dV, in use and being received). The layer's transient takes the larger,
    max(c, 4) chunk_l: ring_l = max(c, 4) ceil(b kv_l / (t c)) for c > 1, else 0. An upper bound
    where the layer's own transient peak comes at another moment than its attention."""
    c = config.cp
    if c == 1:
        return np.zeros_like(attention_kv_bytes)
    chunk = _ceil_div(config.micro_batch * attention_kv_bytes, config.tp * c)
    return max(c, RING_BACKWARD_CHUNKS) * chunk


def ring_bytes_per_ns(config: ParallelConfig, cluster: Cluster) -> float:
    """Bandwidth of ring attention's point-to-point link (GB/s = bytes/ns). Megatron orders
    ranks tp fastest, then cp (``--rank-order tp-cp-ep-dp-pp``): a stage's t c GPUs are
    consecutive ranks, one node's when t c divides the GPUs per node (intra-node bandwidth);
    otherwise the ring crosses nodes (inter-node bandwidth)."""
    inside = cluster.gpus_per_node % (config.tp * config.cp) == 0
    return cluster.intra_node_gb_per_s if inside else cluster.inter_node_gb_per_s


def ring_attention_pass_ns(
    attention_kv_bytes: np.ndarray, config: ParallelConfig, cluster: Cluster
) -> np.ndarray:
    """Time of one pass of K/V (or dK/dV) around the ring per micro-batch, ns (floats):
    (c-1)/c b kv_l / t bytes leave each GPU (c - 1 steps of one chunk) over
    ``ring_bytes_per_ns``. A layer pays 3 passes (forward K/V; backward K/V and dK/dV), 4 when
    recomputed; counted as not overlapped with compute (TransformerEngine overlaps each step's
    send with the previous step's attention, which hides it only when attention is slower
    than the link: an upper bound)."""
    c = config.cp
    if c == 1:
        return np.zeros(len(attention_kv_bytes))
    moved = config.micro_batch * attention_kv_bytes * (c - 1) / (c * config.tp)
    return moved / ring_bytes_per_ns(config, cluster)


def check_context_parallel(graph: LayerGraph, cp: int, memory_model: str = "analytic") -> None:
    """InputError (one line, with the fix) unless the graph can be planned with context-parallel
    degree ``cp`` > 1: the analytic memory model, cp dividing the graph's sequence length
    (``meta["seq_len"]``, what ``profiling.export`` records; not checked when absent) and an
    ``attention_kv_bytes`` on some layer (graphs exported before the field lack it: without it
    the K/V exchange would silently cost nothing)."""
    if cp == 1:
        return
    if memory_model == "empirical":
        raise InputError(
            f"memory model empirical with cp({cp}): the statistics are measured on whole "
            "sequences of one pipeline; use --cp 1 or --memory-model analytic"
        )
    seq_len = graph.meta.get("seq_len")
    if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len % cp:
        raise InputError(
            f"{graph.source}: cp({cp}) does not divide the sequence length {seq_len} "
            "($.meta.seq_len); context parallelism gives each GPU s/cp tokens: pick a --cp that "
            "divides it or re-export with --seq a multiple of it"
        )
    if not any(layer.attention_kv_bytes for layer in graph.layers):
        raise InputError(
            f"{graph.source}: cp({cp}) needs attention_kv_bytes, which no layer has (a graph "
            "exported before the field); re-export the graph with this version's "
            "python -m profiling.export, or use --cp 1"
        )


def _ceil_div(numerator: np.ndarray, denominator: int) -> np.ndarray:
    return -(-numerator // denominator)


def _graph_columns(graph: LayerGraph) -> dict[str, np.ndarray]:
    """The graph's per-layer fields as numpy arrays (cached on the graph object)."""
    cached = getattr(graph, "_columns", None)
    if cached is not None:
        return cached
    layers = graph.layers
    ints = lambda key: np.array([getattr(x, key) for x in layers], dtype=np.int64)  # noqa: E731
    measured = np.array([x.fwd_ms is not None and x.bwd_ms is not None for x in layers])
    position = graph.index()
    cols = {key: ints(key) for key in INTEGER_FIELDS}
    cols["weight_grad_transient_bytes"] = np.array(
        [
            x.transient_bytes
            if x.weight_grad_transient_bytes is None
            else x.weight_grad_transient_bytes
            for x in layers
        ],
        dtype=np.int64,
    )
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
    )
    graph._columns = cols
    return cols


def _edge_tensors(graph: LayerGraph) -> np.ndarray:
    """An index per edge: edges naming one tensor (``Edge.tensor``) share it, others get their
    own."""
    index: dict[str, int] = {}
    tensors = []
    for position, edge in enumerate(graph.edges):
        key = f"#{position}" if edge.tensor is None else edge.tensor
        tensors.append(index.setdefault(key, len(index)))
    return np.array(tensors, dtype=np.int64)


@dataclass(kw_only=True)
class StageCost:
    """Exact per-GPU cost of one stage. Bytes per GPU; times in ns."""

    index: int
    layers: list[int]
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """k_s x (stored activations + relayed edges)."""
    buffer_bytes: int
    """Boundary tensors: receive buffers and held outputs (``boundary_copies``)."""
    transient_bytes: int
    in_flight: int
    """Micro-batches held at the peak (chunk-micro-batches with interleaving)."""
    time_ns: int
    """Per micro-batch, forward + backward (+ recompute), all chunks of the rank."""
    dp_sync_ns: int
    constant_bytes: int = 0
    """A calibration's constant per GPU (0 for the analytic model)."""
    recomputed: list[int] = field(default_factory=list)
    """Layers of the stage that are recomputed (positions, a subset of ``layers``)."""
    chunks: list[list[int]] = field(default_factory=list)
    """With interleaving: the layers of each of the rank's v chunks (virtual stages index,
    index + p, ...); [layers] without."""
    chunk_time_ns: list[int] = field(default_factory=list)
    """Per micro-batch time of each chunk, ns ([time_ns] without interleaving)."""
    chunk_forward_ns: list[int] = field(default_factory=list)
    """The forward's part of each chunk's ``chunk_time_ns``, ns (the rest is its backward,
    recompute included)."""
    optimizer_step_ns: int = 0
    """The optimizer step over the rank's parameters, ns per iteration."""
    moment: str = "forward"
    """The moment of the schedule that sets the peak (``MOMENTS``): forward (after a forward,
    k_s micro-batches held), first backward or after first backward (``first_backward_moments``),
    optimizer step (``optimizer_step_moment``: no activation, the step's temporary in
    ``transient_bytes``)."""

    @property
    def peak_bytes(self) -> int:
        return (
            self.constant_bytes
            + self.weight_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + self.buffer_bytes
            + self.transient_bytes
        )

    def breakdown(self) -> dict[str, int]:
        return {
            "weights": self.weight_bytes,
            "grads": self.grad_bytes,
            "optimizer": self.optimizer_bytes,
            "activations": self.activation_bytes,
            "buffers": self.buffer_bytes,
            "transient": self.transient_bytes,
        } | ({"constant": self.constant_bytes} if self.constant_bytes else {})


MOMENTS = ("forward", "first backward", "after first backward", "optimizer step")
"""The moments a stage's peak can be at (``StageCost.moment``)."""


def stage_costs(
    costs: LayerCosts,
    stage_of_layer: list[int] | np.ndarray,
    recomputed: list[bool] | np.ndarray | None = None,
) -> list[StageCost]:
    """Exact per-stage costs of an assignment (layer position -> stage index); ``recomputed``
    (a flag per layer) says which layers recompute under the "selective" mode."""
    stage_of = np.asarray(stage_of_layer, dtype=np.int64)
    mask = costs.recompute_mask(recomputed)
    stored_per_layer, transient_per_layer, time_per_layer = costs.coefficients(mask)
    num_stages = costs.num_stages
    into, out_of, relayed = boundary_bytes(costs, stage_of)
    adjust = direct_buffer_adjustments(costs, stage_of)
    weight, grad, optimizer, stored, time_ns, forward_ns, sync_ns, step_ns = (
        _per_stage_sum(values, stage_of, num_stages)
        for values in (
            costs.weight_bytes,
            costs.grad_bytes,
            costs.optimizer_bytes,
            stored_per_layer,
            time_per_layer,
            costs.forward_ns,
            costs.dp_sync_ns,
            costs.optimizer_step_ns,
        )
    )
    if costs.grad_buffer_bytes is not None:  # DDP's buckets, beside .grad all step
        buckets = _per_stage_sum(costs.grad_buffer_bytes, stage_of, num_stages)
    else:
        buckets = np.zeros(num_stages, dtype=np.int64)
    transient = np.zeros(num_stages, dtype=np.int64)
    np.maximum.at(transient, stage_of, transient_per_layer)
    members = np.argsort(stage_of, kind="stable")
    bounds = np.searchsorted(stage_of[members], np.arange(num_stages + 1))
    kept = stored + relayed  # per micro-batch kept by each virtual stage
    stages = []
    for rank in range(len(costs.in_flight_vectors)):
        own = costs.stages_of_rank(rank)
        chunks = [members[bounds[j] : bounds[j + 1]].tolist() for j in own]
        layers = [layer for chunk in chunks for layer in chunk]
        grads, largest = int(grad[own].sum()), int(transient[own].max())
        activations, buffers, vector = _rank_peak_moment(costs, rank, kept, into, out_of, adjust)
        moment = "forward"
        if costs.config.virtual_stages == 1 and costs.first_backward_peak[rank]:
            moments = first_backward_moments(
                costs,
                rank,
                chunks[0],
                stored_per_layer,
                transient_per_layer,
                int(relayed[rank]),
                into,
                out_of,
                adjust,
            )
            best = max(range(len(moments)), key=lambda i: sum(moments[i]))
            grads, activations, buffers, largest = moments[best]
            moment = "after first backward" if best == len(moments) - 1 else "first backward"
        grads += int(buckets[own].sum())
        if costs.step_bytes is not None:
            step = optimizer_step_moment(costs, rank, stage_of, into, out_of, adjust)
            all_grads = int(grad[own].sum()) + int(buckets[own].sum())
            if sum(step) + all_grads > grads + activations + buffers + largest:
                buffers, largest = step
                grads, activations, vector, moment = all_grads, 0, (0,), "optimizer step"
        stages.append(
            StageCost(
                index=rank,
                layers=layers,
                recomputed=[layer for layer in layers if mask[layer]],
                weight_bytes=int(weight[own].sum()),
                grad_bytes=grads,
                optimizer_bytes=int(optimizer[own].sum()),
                activation_bytes=activations,
                buffer_bytes=buffers,
                transient_bytes=largest,
                in_flight=sum(vector),
                time_ns=int(time_ns[own].sum()),
                dp_sync_ns=int(sync_ns[own].sum()),
                constant_bytes=costs.constant_bytes,
                chunks=chunks,
                chunk_time_ns=[int(time_ns[j]) for j in own],
                chunk_forward_ns=[int(forward_ns[j]) for j in own],
                optimizer_step_ns=int(step_ns[own].sum()),
                moment=moment,
            )
        )
    return stages


def optimizer_step_moment(
    costs: LayerCosts,
    rank: int,
    stage_of: np.ndarray,
    into: np.ndarray,
    out_of: np.ndarray,
    adjust: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[int, int]:
    """(buffers, step temporary) bytes of rank r at its optimizer step, beside its weights, every
    gradient and its optimizer state: the schedule has finished, so no micro-batch is held and
    no relayed tensor either, and the step makes its temporary (``LayerCosts.step_bytes``: a
    foreach Adam's ``torch._foreach_sqrt(exp_avg_sqs)`` over all the rank's parameters at once).
    The buffers are those the runtime keeps with 0 held (``LayerCosts.copies_at``): on the torch
    runtime the m receive buffers of each direction that every PipelineStage keeps for the run
    (the outputs it held until their backward are gone, and so are an interleaved schedule's
    pending sends, waited on at the end of ``step()``); megatron's one buffer per direction.
    ``stage_of``: the (virtual) stage of each layer; ``into``, ``out_of``: per (virtual) stage,
    per micro-batch (``boundary_bytes``); ``adjust``: ``direct_buffer_adjustments``."""
    own = costs.stages_of_rank(rank)
    buffers = sum(stage_buffer_bytes(costs, stage, 0, 0, into, out_of, adjust) for stage in own)
    step = int(costs.step_bytes[np.isin(stage_of, own)].sum())
    return buffers, step


def first_backward_moments(
    costs: LayerCosts,
    stage: int,
    layers: list[int],
    stored: np.ndarray,
    transient: np.ndarray,
    relayed: int,
    into: np.ndarray,
    out_of: np.ndarray,
    adjust: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[tuple[int, int, int, int]]:
    """(gradients, activations, buffers, transient) bytes of a stage whose gradients appear at
    its first backward (``LayerCosts.first_backward_peak``: step lifetime, every forward before
    it), at the moments that bound its peak. ``layers``: the stage's layer positions in forward
    order; ``stored``, ``transient``: per layer per micro-batch (recompute set applied).

    During the first backward, while layer l runs its backward (the stage's layers in reverse):
    the k - 1 other in-flight micro-batches keep everything, the current one its relayed tensors
    and the stored bytes of layers up to l (autograd frees a node's saved tensors once its
    backward has run), the layers after l have their gradients, and l has its transient, whose
    weight-gradient temporary is now the first of l's gradients being made (there is no
    ``.grad`` to add it to yet):

        during(l) = (k - 1) (stored_s + relay_s) + relay_s + stored(<= l) + grads(> l)
                    + transient_l + buffers at k held

    during(last layer) is the start of the first backward: every activation and no gradient.
    After the first backward every gradient exists and at most k - 1 micro-batches are held (the
    later backwards free more; a safe bound):

        after = (k - 1) (stored_s + relay_s) + grads_s + max transient_s + buffers at k - 1 held

    Measured on gpt-tiny (fp32, gloo, ``profiling.run``): a 1F1B stage with m = p peaks in its
    last block's backward at its first weight gradient, with no gradient accumulated yet, within
    0.2% of during(l). With the states (weights, optimizer) the largest moment is the stage's
    peak, at most the persistent one (k held with every gradient)."""
    k = costs.in_flight[stage]
    grads = costs.grad_bytes[layers]
    stored_here = stored[layers]
    total_stored, total_grads = int(stored_here.sum()), int(grads.sum())
    before = np.cumsum(stored_here)  # stored(<= l)
    later = total_grads - np.cumsum(grads)  # grads(> l)
    buffers_k = stage_buffer_bytes(costs, stage, k, 0, into, out_of, adjust)
    held = (k - 1) * (total_stored + relayed)
    moments = [
        (int(g), held + relayed + int(a), buffers_k, int(t))
        for g, a, t in zip(later, before, transient[layers], strict=True)
    ]
    after_buffers = stage_buffer_bytes(costs, stage, k - 1, 0, into, out_of, adjust)
    moments.append((total_grads, held, after_buffers, int(transient[layers].max(initial=0))))
    return moments


def boundary_bytes(
    costs: LayerCosts, stage_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(into, out_of, relayed) per (virtual) stage, per micro-batch: the bytes a stage
    receives, the bytes it sends, and those it relays, each tensor counted once per stage
    (``LayerCosts.tensor_groups``). A tensor made on stage a whose farthest consumer is on
    stage c > a crosses every boundary between them: a sends it, c receives it, and every stage
    in between receives it, keeps it in flight and sends it on (relay), whatever it consumes
    itself. With ``LayerCosts.direct_sends`` (the torch runtime) nothing is relayed
    (:func:`direct_boundary_bytes`)."""
    if costs.direct_sends:
        return direct_boundary_bytes(costs, stage_of)
    num_stages = costs.num_stages
    sent = np.zeros(num_stages, dtype=np.int64)
    received = np.zeros(num_stages, dtype=np.int64)
    relayed = np.zeros(num_stages, dtype=np.int64)
    producer, consumer = stage_of[costs.edge_src], stage_of[costs.edge_dst]
    for edges, size in costs.tensor_groups:
        made, farthest = int(producer[edges[0]]), int(consumer[edges].max())
        if farthest == made or not size:
            continue
        sent[made] += size
        received[farthest] += size
        relayed[made + 1 : farthest] += size
    return received + relayed, sent + relayed, relayed


def direct_boundary_bytes(
    costs: LayerCosts, stage_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(into, out_of, relayed = 0) per (virtual) stage, per micro-batch, when each tensor goes
    straight from its producer's stage to every stage that consumes it, as
    torch.distributed.pipelining sends it: a ``PipelineStage`` maps each output to all its
    destination stages (``act_send_info``) and a consumer stage allocates its receive buffers
    for it (``args_recv_info``); no stage in between sees it. Per tensor t and stage s:

      receive(t, s) = stage(producer) < s and some consumer of t is on s
      send(t, s)    = stage(producer) = s and some consumer of t is after s

    each counted once per stage however many of its layers read t."""
    num_stages = costs.num_stages
    sent = np.zeros(num_stages, dtype=np.int64)
    received = np.zeros(num_stages, dtype=np.int64)
    producer, consumer = stage_of[costs.edge_src], stage_of[costs.edge_dst]
    for edges, size in costs.tensor_groups:
        made = int(producer[edges[0]])
        readers = {int(s) for s in consumer[edges].tolist() if s > made}
        if not readers or not size:
            continue
        sent[made] += size
        for s in readers:
            received[s] += size
    return received, sent, np.zeros(num_stages, dtype=np.int64)


def direct_buffer_adjustments(
    costs: LayerCosts, stage_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(per held micro-batch, per micro-batch of the run) bytes per (virtual) stage that the
    torch runtime's buffers differ from R_s into + S_s out_of (``boundary_copies``), from what
    the graph says of each tensor (``LayerCosts.tensor_roles``; zeros on the megatron runtime
    and for graphs without these fields). Per tensor t of size n and stage s:

      received, saving known, no layer of s counts t   + held n  (R = m: every receive buffer
                                                                 holds t, none is a stored input)
      sent, a layer of s counts t                       - held n  (the held outputs are stored)
      sent, t does not require grad                     - m n     (no gradient receive buffers)

    (docs/cost-model.md, "Runtime torch: direct sends")."""
    num_stages = costs.num_stages
    per_held = np.zeros(num_stages, dtype=np.int64)
    no_grad = np.zeros(num_stages, dtype=np.int64)
    if not costs.direct_sends or costs.plain_boundaries:
        return per_held, no_grad
    producer, consumer = stage_of[costs.edge_src], stage_of[costs.edge_dst]
    roles = costs.tensor_roles
    for (edges, size), (grad, known, charged) in zip(costs.tensor_groups, roles, strict=True):
        made = int(producer[edges[0]])
        readers = {int(s) for s in consumer[edges].tolist() if s > made}
        if not readers or not size:
            continue
        counted = {int(stage_of[layer]) for layer in charged}
        if made in counted:
            per_held[made] -= size
        if not grad:
            no_grad[made] += size
        for s in readers:
            if known and s not in counted:
                per_held[s] += size
    return per_held, no_grad


def stage_buffer_bytes(
    costs: LayerCosts,
    stage: int,
    held: int,
    done: int,
    into: np.ndarray,
    out_of: np.ndarray,
    adjust: tuple[np.ndarray, np.ndarray] | None = None,
) -> int:
    """Boundary buffers of (virtual) stage j holding ``held`` micro-batches after ``done``
    backwards, bytes: R into + S out_of (``LayerCosts.copies_at``) plus the torch runtime's
    per-tensor adjustments (``direct_buffer_adjustments``; None: none)."""
    receive, send = costs.copies_at(stage, held, done)
    total = int(receive * into[stage] + send * out_of[stage])
    if adjust is not None:
        per_held, no_grad = adjust
        total += held * int(per_held[stage]) - costs.config.num_microbatches * int(no_grad[stage])
    return total


def _per_stage_sum(values: np.ndarray, stage_of: np.ndarray, num_stages: int) -> np.ndarray:
    """Exact int64 sums (np.bincount would go through float64)."""
    total = np.zeros(num_stages, dtype=np.int64)
    np.add.at(total, stage_of, values)
    return total


def _rank_peak_moment(
    costs: LayerCosts,
    rank: int,
    kept: np.ndarray,
    into: np.ndarray,
    out_of: np.ndarray,
    adjust: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[int, int, tuple[int, ...]]:
    """(activations, buffers, in-flight vector) at the moment of the rank's schedule with the
    most activations + buffers (buffers depend on the moment only on the torch runtime with
    interleaving; ties: the larger vector)."""
    own = costs.stages_of_rank(rank)
    moments = []
    for vector, dones in zip(
        costs.in_flight_vectors[rank], costs.backwards_done[rank], strict=True
    ):
        activations = int(sum(n * kept[j] for n, j in zip(vector, own, strict=True)))
        buffers = sum(
            stage_buffer_bytes(costs, stage, held, done, into, out_of, adjust)
            for held, done, stage in zip(vector, dones, own, strict=True)
        )
        moments.append((activations + buffers, activations, buffers, vector))
    _, activations, buffers, vector = max(moments)
    return activations, buffers, vector


PPM = 1_000_000
"""Utilization unit: parts per million of a GPU's capacity."""


def utilization_ppm(peak_bytes: int, capacity_bytes: int) -> int:
    """ceil(10^6 peak / capacity): a stage's share of its GPU memory, in parts per million."""
    return -(-PPM * int(peak_bytes) // int(capacity_bytes))


def placed_stage_costs(
    group_costs: list[LayerCosts],
    stage_of_layer: list[int] | np.ndarray,
    group_of_stage: list[int],
    recomputed: list[bool] | np.ndarray | None = None,
) -> list[StageCost]:
    """Exact per-stage costs when stage s runs on group ``group_of_stage[s]``: ``group_costs[k]``
    are the coefficients with group k's cluster (equal memory, group-specific times, recomputed
    layers' times included)."""
    per_group = {
        k: stage_costs(group_costs[k], stage_of_layer, recomputed) for k in set(group_of_stage)
    }
    return [per_group[k][s] for s, k in enumerate(group_of_stage)]


class BoundTerm(NamedTuple):
    """One lower bound on the iteration through one rank (``bound_terms``), ns: (m + own_time)
    T_r (the rank's m micro-batches of every chunk, T_r with its v h overhead) plus, each with
    its coefficient here,
      before_time T_<r and before_forward F_<r (the first chunks of the ranks before: forward
      and backward of one micro-batch, or its forward only), own_forward F_r (its forward per
      micro-batch, overhead included), own_tail X_r, after_time T_>r (one micro-batch through
      the ranks after), first_tail X_0 (rank 0's tail), and constant_ns (the overheads h of
      the forwards before and after: T_<r, F_<r and T_>r are the layers' times alone)."""

    before_time: int
    before_forward: int
    own_forward: int
    own_tail: int
    after_time: int
    first_tail: int
    constant_ns: int
    own_time: int = 0


def bound_terms(costs: LayerCosts) -> list[list[BoundTerm]]:
    """The terms of the iteration bound of each rank (``iteration_bound_ns``); every rank has
    as many (the chain backend stacks them).

    Rank r's first action waits for micro-batch 0's forward through the virtual stages before
    it (F_<r). It then runs m micro-batches, m T_r, and waits twice more:
      E_r = max(0, F_r + T_>r - c_r F_r): its first backward, after its c_r first forwards
            (``forwards_before_first_backward``), waits for micro-batch 0 through the ranks
            after it and back;
      D_r = max(0, T_>r - (d_r - 1) B_r): its last backward, d_r = c_r backwards after its last
            forward (``forwards_before_first_backward``), waits for micro-batch m - 1 the same way
            while it runs the d_r - 1 others.
    With 1F1B and m > c_r the two waits are apart (the first backward comes before the last
    forward) and add up; else only the larger counts. After its last backward the rank syncs
    and steps (X_r), while that micro-batch still runs backward through the virtual stages
    before (B_<r) and then rank 0 syncs and steps (X_0). The terms are these combinations; with
    interleaving only the two without waits."""
    config, h = costs.config, costs.microbatch_overhead_ns
    m, p, v = config.num_microbatches, config.pp, config.virtual_stages
    terms = []
    for r in range(p):
        # r h: the overhead of one forward on each virtual stage before; every term ends with
        # a rank's tail, its step overhead included
        before = r * h + costs.step_overhead_ns
        waits = [(0, 0, 0, 0)]  # (own_time, own_forward, after_time, overhead) of the waits
        if v == 1:
            c = d = forwards_before_first_backward(m, p, r, config.schedule)
            after = (p - 1 - r) * h  # the overhead of the forwards after
            first = (0, 1 - c, 1, after)  # E_r = F_r + T_>r - c_r F_r
            last = (1 - d, d - 1, 1, after)  # D_r = T_>r - (d_r - 1) (T_r - F_r)
            both = (1 - d, d - c, 2, 2 * after) if config.schedule == "1f1b" and m > c else first
            waits += [first, last, both]
        rank = []
        for own_time, own_forward, after_time, overhead in waits:
            constant = before + overhead
            rank += [  # ... + X_0 after the backwards before; + X_r
                BoundTerm(1, 0, own_forward, 0, after_time, 1, constant, own_time),
                BoundTerm(0, 1, own_forward, 1, after_time, 0, constant, own_time),
            ]
        terms.append(rank)
    return terms


def iteration_bound_ns(costs: LayerCosts, stages: list[StageCost]) -> int:
    """A lower bound on the simulated iteration of these stages (``solver.costs.schedule_time``),
    ns: the largest ``bound_terms`` term of any rank, on any schedule (1F1B, GPipe, interleaved)
    and any transfer times (they only delay): what every backend constrains and minimises
    (module docstring, "Iteration bound"). On an even split without data parallelism it is the
    bubble formula (m + p - 1) T."""
    m, h = costs.config.num_microbatches, costs.microbatch_overhead_ns
    total = sum(stage.time_ns for stage in stages)  # overheads: in the terms' constants
    first_tail = costs.stage_tail_ns(stages[0])
    bound = before_time = before_forward = 0
    for stage, terms in zip(stages, bound_terms(costs), strict=True):
        own = stage.time_ns + len(stage.chunk_time_ns) * h
        forward = sum(stage.chunk_forward_ns) + len(stage.chunk_time_ns) * h
        values = {
            "before_time": before_time,
            "before_forward": before_forward,
            "own_forward": forward,
            "own_tail": costs.stage_tail_ns(stage),
            "after_time": total - before_time - stage.time_ns,
            "first_tail": first_tail,
        }
        for term in terms:
            value = (m + term.own_time) * own + term.constant_ns
            value += sum(getattr(term, name) * amount for name, amount in values.items())
            bound = max(bound, value)
        # chunk 0 of this rank is virtual stage r, before every later rank's chunk 0
        before_time += stage.chunk_time_ns[0]
        before_forward += stage.chunk_forward_ns[0] if stage.chunk_forward_ns else 0
    return bound


def iteration_floor_ns(
    costs: LayerCosts, time_ns: np.ndarray | None = None, tail_ns: np.ndarray | None = None
) -> int:
    """An ``iteration_bound_ns`` no split of this config can beat, ns, from the layers' times
    alone (``time_ns``: per layer and micro-batch, default each layer's faster recompute state;
    ``tail_ns``: default ``LayerCosts.tail_ns``); each term below carries the m v h overhead.

    - the rank holding layer l: m time_l + tail_l;
    - without interleaving, a weighted sum of the ranks' first terms T_<r + m T_r with weights
      w_r = (1 - 1/m)^(p-1-r) / m counts every layer's time c = 1 times, and the weights sum to
      W = 1 - (1 - 1/m)^p, so their largest is >= sum_l time_l / W (an even split of a
      continuous chain meets it);
    - with interleaving, each rank's m T_r: at least m sum_l time_l / p."""
    config = costs.config
    m, p, v = config.num_microbatches, config.pp, config.virtual_stages
    if time_ns is None:
        time_ns = costs.bounding_coefficients(np.minimum)[2]
    tail_ns = costs.tail_ns if tail_ns is None else tail_ns
    total = int(np.sum(time_ns))
    if v == 1:  # total / W = total m^p / (m^p - (m-1)^p), floored (exact integers)
        spread = total * m**p // (m**p - (m - 1) ** p)
    else:
        spread = -(-m * total // p)
    single = int(np.max(m * np.asarray(time_ns, dtype=np.int64) + tail_ns, initial=0))
    return max(spread, single) + m * v * costs.microbatch_overhead_ns + costs.step_overhead_ns


def throughput(global_batch: int, iteration_ns: int) -> float:
    """Samples per second."""
    return global_batch * 1e9 / iteration_ns if iteration_ns > 0 else math.inf
