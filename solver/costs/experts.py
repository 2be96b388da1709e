"""The routed experts' terms (mixture of experts, expert parallelism ep = e; the router's facts
are read from the graph by ``solver.costs.moe``):

  X'_l = f b (R_l + (X_l - R_l) / t) / c  the routed experts' saved bytes per micro-batch
         (``expert_stored_bytes``): X_l = expert_activation_bytes, R_l = min(X_l,
         ep_comm_bytes / 4) the dispatched tokens' hidden states, which every TP rank keeps
         whole (Megatron all-gathers them over tp before the experts); not divided by ep (each
         GPU's experts receive b s k tokens at a balanced routing whatever ep is)
  f    the routing factor (``routing_factor``): the capacity factor c
         (``--moe-capacity-factor c``, Megatron's --moe-expert-capacity-factor with padding;
         1 = balanced) or, dropless, the worst case a router can reach on one GPU,
         f = ep min(k, E / ep) / k
  all-to-all (dispatch and combine, forward and backward; ``expert_all_to_all_ns``):
         b ep_comm_bytes f (ep-1)/ep (/ t with sequence parallelism, each TP rank dispatching its
         s / t tokens) over the intra-node bandwidth when t ep <= gpus_per_node, else
         inter-node; a recomputed layer's forward sends its half again
  megatron runtime, ep > 1: f b R_l / c more in the layer's transient, the all-to-all's
         received tokens beside the permuted ones (``all_to_all_copy_bytes``)
  the experts' parameters: expert_params / (t ep) per GPU (``states.ParamShares``), their
         largest tensor likewise (``largest_local_param``)

docs/cost-model.md, "Mixture of experts".
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from solver.costs.moe import RoutedExperts, check_expert_degree, routed_experts
from solver.costs.units import ceil_div
from solver.graph import LayerGraph
from solver.specs import MOE_DROPLESS, Cluster, ParallelConfig, TrainingConfig


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


def all_to_all_copy_bytes(
    cols: dict[str, np.ndarray], config: ParallelConfig, factor: Fraction
) -> np.ndarray:
    """Per layer, the bytes per GPU megatron-core's all-to-all dispatcher holds at ep > 1 beyond
    the profile (0 at ep 1): the received tokens, a new [f b s k, h] tensor beside the permuted
    ones it sent, where ep 1 skips the exchange (tagged at a stage-0 rank's peak, moe-tiny h 64,
    s 256, b 2, ep 2: the permutation's output, the all-to-all's output and the experts' output,
    each [f b s k, h]; ``token_dispatcher.py`` ``token_dispatch``); f b R_l, R_l = min(X_l,
    ep_comm_bytes_l / 4) as ``expert_stored_bytes`` takes it, / c, rounded up."""
    if config.ep == 1:
        return np.zeros(len(cols["ep_comm_bytes"]), dtype=np.int64)
    tokens = np.minimum(cols["expert_activation_bytes"], cols["ep_comm_bytes"] // 4)
    b, c = config.micro_batch, config.cp
    return -(-(b * factor.numerator * tokens) // (factor.denominator * c))


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
    return sent / config.dims.sequence_split / bytes_per_ns


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
    return np.where(in_experts, ceil_div(largest, config.tp * config.ep), largest)
