"""Time of the layers, the gradient sync, the optimizer step and the pipeline links, in integer
nanoseconds (rounded up per layer so that every backend sums the same integers).

  per-sample compute of a layer: fwd_ms + bwd_ms when measured, else
      (fwd_flops + bwd_flops) / (gpu_flops * flops_efficiency), bwd_flops defaulting to 2 fwd_flops
  per micro-batch (``layer_time_ns``): b * compute / t  +  b * tp_comm_bytes * 2 (t-1)/t /
      intra-node bandwidth (ring) + b * forward compute / t for a recomputed layer (the forward
      runs twice); the same with sequence parallelism: each all-reduce becomes an all-gather plus
      a reduce-scatter, (t-1)/t of the buffer each, the same bytes per GPU (Korthikanti et al.
      2022) + the expert-parallel all-to-alls (``experts.expert_all_to_all_ns``) + the ring
      attention passes (``context_parallel.ring_attention_pass_ns``); / c with context
      parallelism
  T_s  = sum of its layers' micro-batch times
  AR_s = non-overlapped data-parallel gradient sync of stage s (``layer_dp_sync_ns``): ring
         all-reduce of its gradients, 2 (d-1)/d * sum_l P'_l g bytes (z <= 2: all-reduce, or
         reduce-scatter + all-gather of the updated shards), 3 (d-1)/d with z = 3 (parameters are
         all-gathered again for backward); over the intra-node bandwidth when t d <=
         gpus_per_node, else inter-node; the routed experts' gradients over their d_e = d c / ep
         expert-data-parallel ranks, 2 (d_e - 1)/d_e
  forward_l = the forward's share of a layer's time (``layer_forward_ns``), backward_l = time_l -
         forward_l (a recomputed layer's includes its second forward)
  step_l = the optimizer step over the layer's stepped parameters (``layer_optimizer_step_ns``);
         X_r = AR_r + sum step_l + the profiled per-step overhead: rank r's tail
  iteration = the simulated schedule (``solver.costs.schedule_time``: each rank's forwards and
         backwards in the runtime's order, transfers over ``pipeline_links``, tails);
         throughput = B / iteration

On a heterogeneous cluster T_s and AR_s use the FLOP/s, efficiency and bandwidths of the group
stage s runs on (``stages.placed_stage_costs``). docs/cost-model.md, "Time".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from solver.costs.context_parallel import ring_attention_pass_ns
from solver.costs.experts import expert_all_to_all_ns
from solver.costs.stage_cost import StageCost
from solver.costs.states import ParamShares
from solver.costs.units import NS_PER_MS
from solver.specs import Cluster, ParallelConfig, TrainingConfig


def layer_time_ns(
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


def layer_forward_ns(
    cols: dict[str, np.ndarray], config: ParallelConfig, cluster: Cluster, factor: Fraction
) -> np.ndarray:
    """The forward's part of every layer's kept time per micro-batch (``layer_time_ns`` index 0),
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


def layer_dp_sync_ns(
    params: ParamShares, config: ParallelConfig, cluster: Cluster, training: TrainingConfig
) -> np.ndarray:
    """Each layer's share of AR_s, the data-parallel gradient sync (module docstring): 2 (d-1)/d
    of its dense gradient bytes per GPU and 2 (d_e-1)/d_e of its expert gradient bytes over the
    d_e = d c / ep expert-data-parallel ranks, 3 rounds with ZeRO-3, intra-node when t d fits in a
    node (the expert-data-parallel group spans the same GPUs); with context parallelism the
    group is dp x cp (d -> d c: the cp ranks hold the same parameters and their gradients are
    summed too, Megatron's ``with_context_parallel`` data parallel group; the experts' d c / ep,
    Megatron's expert-data-parallel group of world / (pp tp ep) ranks)."""
    t, d, e = config.tp, config.dims.sharding_degree, config.ep
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


def layer_optimizer_step_ns(
    params: ParamShares,
    config: ParallelConfig,
    cluster: Cluster,
    training: TrainingConfig,
    measured: float | None,
) -> np.ndarray:
    """The optimizer step over each layer's parameters on one GPU, ns per iteration: the
    parameters it steps (its ZeRO shard from stage 1, ``ParamShares.sharded``) times the
    profiled ``meta.timing.optimizer_step_ns_per_param`` (``measured``, ns per parameter) when
    the graph has it (``graph_inputs.profiled_times``), else times the
    bytes an element-wise step moves per parameter over the GPU's memory bandwidth: it reads
    and writes the optimizer state (master weights and moments, 2 o), reads the gradient (g)
    and writes the weight (w) (``Cluster.memory_gb_per_s``; a memory-bound kernel)."""
    stepped = params.sharded(1, config, config.zero >= 1)
    if measured is not None:
        return np.ceil(stepped * float(measured))
    moved = (
        2 * training.optimizer_bytes_per_param
        + training.grad_bytes_per_param
        + training.weight_bytes_per_param
    )
    return np.ceil(stepped * moved / cluster.memory_gb_per_s)


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


def throughput(global_batch: int, iteration_ns: int) -> float:
    """Samples per second."""
    return global_batch * 1e9 / iteration_ns if iteration_ns > 0 else math.inf


class TimeViews:
    """The time views of ``LayerCosts`` (mixed into it; they read its time fields)."""

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
