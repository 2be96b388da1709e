"""Context parallelism (``ParallelConfig.cp`` = c; Megatron-LM's ``--context-parallel-size``,
ring attention as TransformerEngine's ``AttnFuncWithCPAndKVP2P`` runs it): a stage runs on t c d
GPUs; each GPU holds s/c tokens of every sequence of its micro-batch, so

  stored_l  = ceil(b A'_l / c) (ceil(b t A'_l / (t c)) exactly), recomputed ceil(b output_l / c)
              (/ (t c) with sequence parallelism: ``ParallelDims.sequence_split``)
  edges     = ceil(b bytes / c) ([s/c, b, h]; / (t c) with sequence parallelism)
  transient = ceil(b transient_l / c) (and the recomputed layer's re-materialised A'_l / c)
              + ring_l = max(c, 4) ceil(b attention_kv_bytes_l / (t c)) for c > 1: the K/V
              chunks live while the layer's attention runs, c in the forward (TE keeps every
              received chunk until the forward ends), 4 in the backward (K/V and dK/dV, used and
              received) (``ring_attention_bytes``)
  states    parameters, gradients and optimizer state are replicated over cp; ZeRO shards them,
              and the gradient sync runs, over the d c ranks of Megatron's data-parallel group
              with context parallelism: d -> d c in states_s, step_l, AR_s
            (``ParallelDims.sharding_degree``)
  time      b compute / (t c), TP all-reduces of b tp_comm_bytes / c, + 3 ring passes (4
              recomputed), one pass (c-1)/c b attention_kv_bytes_l / t bytes over the intra-node
              bandwidth when t c divides the GPUs per node (Megatron's rank order tp-cp-...:
              consecutive ranks), else inter-node; not overlapped (``ring_attention_pass_ns``)

A graph planned with c > 1 needs ``attention_kv_bytes`` on some layer, c | ``meta.seq_len`` and
the analytic model (``solver.parallel.check_context_parallel``). docs/cost-model.md, "Context
parallelism".
"""

from __future__ import annotations

import numpy as np

from solver.costs.units import ceil_div
from solver.specs import Cluster, ParallelConfig

RING_BACKWARD_CHUNKS = 4
"""K/V chunks (each b * attention_kv_bytes / (t c)) a GPU holds while ring attention's backward
runs: TransformerEngine's ``AttnFuncWithCPAndKVP2P.backward`` (Megatron-LM's CP attention,
``cp_comm_type="p2p"``, context_parallel.py at TE d0067d0) allocates ``p2p_comm_buffers`` as
two tensors of shape (2, *kv.shape): the K/V being used and its dK/dV, and the K/V and dK/dV
being received."""


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
    chunk = ceil_div(config.micro_batch * attention_kv_bytes, config.tp * c)
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
