"""Model states per GPU: parameters, gradients, optimizer state, the optimizer step's temporary.

Notation: config (p, t, d), ZeRO stage z, bytes per parameter (w, g, o) (default 2, 4, 12 on the
megatron runtime: bf16 weights, fp32 gradient accumulation (Megatron's ``main_grad``), fp32 Adam
master + 2 moments; 2, 2, 12 on the torch runtime: bf16 gradients; ZeRO paper;
``specs.GRAD_BYTES_PER_PARAM``).

  P'_l = (params - tp_params - expert_params) + tp_params / t + expert_params / (t ep)
         parameters held per GPU: the routed experts are sharded over ep ranks (Megatron's
         expert parallelism, within the data-parallel ranks) and each expert split over t
         (expert tensor parallelism = tp, Megatron's default; ``ParamShares``)
  states_s  = sum_l P'_l (w / d[z>=3] + g / d[z>=2] + o / d[z>=1])  each term rounded up per layer
              (the expert part of P'_l sharded over the d c / ep expert-data-parallel ranks
              instead of d c: Megatron's distributed optimizer keeps the expert parameters'
              states on ``intra_expt_dp_group``)
              (+ w P'_l / d with ZeRO-2 on the torch runtime: FSDP2 keeps the sharded parameters
              next to the gathered ones)
  FSDP2 under pipelining (torch runtime, ZeRO 2/3, d > 1, p > 1; ``reduces_per_step``):
              sum_l (w P'_l + w P'_l / d + g P'_l), ZeRO 2 and 3 alike: ``PipelineStage`` runs
              every micro-batch's backward without gradient sync or resharding and
              reduce-scatters once per step, so each layer's unsharded gradients (accumulated in
              the reduce dtype) and unsharded weights stay to the step's end
              (+ g P'_l / d with persistent gradients: the reduced shards kept between steps)
  DDP on torch with the "step" gradient lifetime keeps its buckets beside the fresh .grad all
              step: + g P'_l per layer (``ddp_bucket_bytes``)
  count_l   = 4 N_l with Adam or AdamW (``step_count_bytes``): torch's Adam keeps
              ``state['step']``, a 0-dim fp32 tensor, per parameter tensor (N_l: the graph's
              param_tensors, 0 where not counted; + the tied copy's tensors at p > 1),
              in the optimizer state; not sharded (over under ZeRO)
  inputs_l  = m b model_input_bytes_l on the torch runtime (``input_batch_bytes``): step()
              is given the replica's whole batch and splits it into micro-batch views, so the
              stage that reads the model's inputs (ids, labels) holds all of them all step
  step_l    = ceil(P'_l u / d[z>=1]) the optimizer step's temporary (``optimizer_step_bytes``;
              ``TrainingConfig.optimizer_impl`` foreach, torch's default on a GPU: Adam's
              ``_multi_tensor_adam`` makes sqrt(exp_avg_sq) of every parameter at once; u the
              bytes of one state element, ``solver.precision.step_temporary_bytes_per_param``:
              4 fp32 states, 0 fused), sharded like the optimizer state

With context parallelism d -> d c (``ParallelDims.sharding_degree``). docs/cost-model.md,
"Model states".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.costs.graph_inputs import graph_columns
from solver.costs.units import ceil_div
from solver.graph import LayerGraph
from solver.specs import ParallelConfig, TrainingConfig

STEP_COUNT_BYTES = 4
"""Bytes of one Adam ``state['step']``: a 0-dim tensor of torch's ``_get_scalar_dtype()``
(float32 unless the default dtype is float64)."""
STEP_COUNT_OPTIMIZERS = ("adam", "adamw")
"""The optimizers (``TrainingConfig.optimizer``) that keep a step count per parameter tensor:
torch.optim's Adam and AdamW (SGD keeps none; Lion has no torch.optim implementation)."""


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
        dense = ceil_div(self.dense_times_t * per_param, self.tp * dense_shards)
        return dense + ceil_div(self.expert * per_param, self.tp * self.ep * expert_shards)

    def sharded(self, per_param: int, config: ParallelConfig, sharded: bool) -> np.ndarray:
        """``bytes_per_gpu`` with the dense part over the d c data-parallel ranks
        (``sharding_degree``) and the experts over the d c / ep expert-data-parallel ranks when
        ``sharded`` (ZeRO / Megatron's distributed optimizer: ``_get_param_groups_and_buffers``
        builds the expert parameters' optimizer over ``intra_expt_dp_group``, world / (pp tp
        ep) ranks), else unsharded."""
        if not sharded:
            return self.bytes_per_gpu(per_param, 1, 1)
        shards = config.dims.sharding_degree
        return self.bytes_per_gpu(per_param, shards, shards // config.ep)


def uses_fsdp2(config: ParallelConfig, runtime: str) -> bool:
    """The torch runtime with ZeRO 2 or 3 over more than one data-parallel rank (FSDP2
    ``fully_shard``, one unit per layer: ``profiling.executors.parallelize``, torchtitan)."""
    return runtime == "torch" and config.zero >= 2 and config.dims.sharding_degree > 1


def reduces_per_step(config: ParallelConfig, runtime: str) -> bool:
    """FSDP2 (``uses_fsdp2``) handed to ``PipelineStage`` (p > 1), as torchtitan does: torch
    2.13's ``PipelineStage.backward_maybe_with_nosync`` sets ``set_requires_gradient_sync(False)``
    and ``set_reshard_after_backward(False)`` on every micro-batch's backward and
    ``perform_reduce_grad`` reduce-scatters and reshards once, after the step's last backward
    (torch/distributed/pipelining/stage.py:844-847, 1164-1190). Each layer's unsharded
    gradients live from its first backward and its unsharded weights from its first forward
    (``reshard_after_forward=False``, torchtitan's default under PP) or first backward (ZeRO 3,
    "always": every later forward reshards, but the last backwards keep them) to the step's
    end. Measured (gpt-tiny, dp 2 x pp 2, ZeRO 3): both whole at the first stage's peak."""
    return uses_fsdp2(config, runtime) and config.pp > 1


def model_state_bytes(
    params: ParamShares, config: ParallelConfig, training: TrainingConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weights, gradients and optimizer state per GPU of every layer (the terms of states_s in
    the module docstring): tp splits the tp parameters, t ep the routed experts'; ZeRO stage z
    shards the optimizer state (z >= 1), gradients (z >= 2) and weights (z = 3) over dp x cp
    (``sharding_degree``; the experts' over dp x cp / ep); FSDP2 under pipelining keeps its
    unsharded weights and gradients too (``reduces_per_step``)."""
    d, z = config.dims.sharding_degree, config.zero
    w, g, o = (
        training.weight_bytes_per_param,
        training.grad_bytes_per_param,
        training.optimizer_bytes_per_param,
    )
    optimizer = params.sharded(o, config, z >= 1)
    if reduces_per_step(config, training.runtime):
        # unsharded weights beside their shards, unsharded gradients (ZeRO 2 = ZeRO 3 here)
        weight = params.sharded(w, config, False) + params.sharded(w, config, True)
        grad = params.sharded(g, config, False)
        if training.grad_lifetime == "persistent":
            grad = grad + params.sharded(g, config, True)
        return weight, grad, optimizer
    weight = params.sharded(w, config, z >= 3)
    if z == 2 and d > 1 and training.runtime == "torch":
        # FSDP2 keeps the sharded parameters next to the gathered ones
        weight = weight + params.sharded(w, config, True)
    grad = params.sharded(g, config, z >= 2)
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


def step_count_bytes(
    graph: LayerGraph, cols: dict[str, np.ndarray], config: ParallelConfig, training: TrainingConfig
) -> np.ndarray:
    """Adam's step counts of every layer per GPU, bytes: 4 per parameter tensor (``cols``'s
    ``param_tensors``; none where the graph does not count them), and at p > 1 per tensor of
    a tied copy (the owner's count, at most the tied elements). torch 2.13's Adam and AdamW
    keep ``state['step']`` per parameter, a 0-dim tensor on the parameter's device with
    ``fused=True`` or ``capturable=True`` (torchtitan's default implementation is fused), and
    on the CPU otherwise (the foreach default on a GPU: 0 GPU bytes there, so this is over);
    the CPU engines hold it beside every parameter (measured: 14 x 4 B on a stage of the
    embedding and a block). Megatron-LM's FusedAdam keeps one per parameter group, at most one
    per tensor. Not divided over ZeRO ranks (ZeroRedundancyOptimizer holds only its shard's:
    over), nor over expert-parallel ranks (over). None where the optimizer state is 0 bytes per
    parameter (``optimizer_bytes_per_param=0``: no optimizer memory at all).

    A layer without ``param_tensors`` (a hand-made graph, an older export) gets none: not
    ``params``, which would be 4 B per parameter (+280 GB on a 70B model) for a term of a few
    KiB per GPU even there (4 B per tensor), that torch's default foreach Adam keeps on the CPU
    anyway, and below the closed-form error of such graphs; re-export to count it."""
    count = np.zeros(graph.num_layers, dtype=np.int64)
    if training.optimizer not in STEP_COUNT_OPTIMIZERS or not training.optimizer_bytes_per_param:
        return count  # no step count, or no optimizer state at all (o = 0 given)
    count = count + cols["param_tensors"]
    if config.pp > 1:
        ties = graph_columns(graph)
        owner_tensors = cols["param_tensors"][ties["tie_owner"]]
        np.add.at(count, ties["tie_user"], np.minimum(owner_tensors, ties["tie_elements"]))
    return STEP_COUNT_BYTES * count


def input_batch_bytes(
    cols: dict[str, np.ndarray], config: ParallelConfig, training: TrainingConfig
) -> np.ndarray | None:
    """The model inputs a torch pipeline holds all step, per layer and GPU, bytes, or None:
    m b model_input_bytes_l on the torch runtime. ``PipelineSchedule.step(*args, target=...)``
    is given the replica's whole batch (m micro-batches of b) and splits it into views
    (``tensor_split``), so the stage whose layer reads the model's inputs (token ids on the
    first, labels on the last) holds all of them until ``step()`` returns, and the caller
    through the optimizer step (measured: a (16, 32) int64 batch of ids on the first stage and
    of labels on the last, gpt-tiny pp 4 m 8 b 2). Over by the views the layer saves for its
    in-flight micro-batches, which its activations count too. Megatron's ``get_batch`` loads
    one micro-batch at a time: None."""
    if training.runtime != "torch" or not cols["model_input_bytes"].any():
        return None
    return config.num_microbatches * config.micro_batch * cols["model_input_bytes"]
