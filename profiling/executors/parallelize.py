"""Apply a plan's tensor and data parallelism to a stage of a model-zoo model (torchtitan's
``parallelize.py`` role); ``profiling.run`` builds the mesh, the stage and the pipeline around it.

Tensor parallelism (``torch.distributed.tensor.parallel``): Megatron's column/row pairs, the
self-attention's fused ``qkv`` and ``proj`` and the MLP's ``fc1`` and ``fc2``. A fused column
projection has its output rows regrouped before it is split (``shard_order``) so that each TP rank
holds whole heads of q, k and v (or matching gate and up columns); the attention's head counts
become the local ones. Vocabularies of at least ``VOCAB_PARALLEL_MIN_ROWS`` rows are split by
rows (embedding and LM head, with a vocabulary-parallel cross-entropy); norms, position tables
and smaller vocabularies stay replicated: the split ``profiling.trace.tensor_parallel`` assumes for
the cost model. Sequence parallelism (``apply_sequence_parallel``) adds torchtitan's Llama styles:
norms on [b, s/t, h] shards, the sequence gathered in front of attention and MLP.

Data parallelism by ZeRO stage (``apply_data_parallel``, ``build_optimizer``): 0 DDP, 1 DDP +
``ZeroRedundancyOptimizer``, 2 and 3 FSDP2 ``fully_shard``; with TP, zero 0 uses FSDP2's
``replicate`` because DDP does not take DTensor parameters.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from profiling._torch_compat import rebuild_ddp_buckets, replicate_with_fsdp, storage_use_count
from profiling.trace.tensor_parallel import VOCAB_PARALLEL_MIN_ROWS
from solver.errors import InputError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def shard_order(widths: list[int], tp: int) -> torch.Tensor:
    """Row order for a fused projection made of ``widths`` output segments (q, k, v; or gate, up)
    such that ColwiseParallel's contiguous shard r holds the r-th part of every segment, in
    segment order: each TP rank gets whole heads of q, k and v (or matching gate and up columns),
    and its local output splits as the unsplit module's does."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    parts = [
        torch.arange(start + r * (width // tp), start + (r + 1) * (width // tp))
        for r in range(tp)
        for start, width in zip(starts, widths, strict=True)
    ]
    return torch.cat(parts)


@dataclass(kw_only=True, frozen=True)
class TensorParallelPair:
    """One Megatron pair: a column-parallel Linear feeding a row-parallel one."""

    path: str
    """The owning module's full path (an ``Attention`` or an ``MLP``)."""
    column: str
    """The column-parallel Linear's name in it (``qkv`` or ``fc1``)."""
    row: str
    """The row-parallel Linear's name (``proj`` or ``fc2``)."""
    widths: list[int]
    """Output segments of the column Linear, each split over tp (q, k, v; gate, up; or one)."""


def tensor_parallel_pairs(model: nn.Module, layers: list[str], tp: int) -> list[TensorParallelPair]:
    """The column/row pairs of ``layers``: every self-attention and MLP of the model zoo.

    Raises ``InputError`` when a head count or MLP width is not a multiple of ``tp``.
    """
    from models.common import MLP, Attention

    pairs = []
    for path in layers:
        for name, module in model.get_submodule(path).named_modules():
            prefix = f"{path}.{name}" if name else path
            if isinstance(module, Attention) and not module.cross:
                if module.heads % tp or module.kv_heads % tp:
                    raise InputError(
                        f"{prefix}: heads ({module.heads}) and kv_heads ({module.kv_heads}) "
                        f"must be multiples of tp ({tp})"
                    )
                q, kv = module.heads * module.head_dim, module.kv_heads * module.head_dim
                pairs.append(
                    TensorParallelPair(path=prefix, column="qkv", row="proj", widths=[q, kv, kv])
                )
            elif isinstance(module, MLP):
                width = module.fc2.in_features
                if width % tp:
                    raise InputError(
                        f"{prefix}: MLP width ({width}) must be a multiple of tp ({tp})"
                    )
                widths = [width, width] if module.kind == "swiglu" else [width]
                pairs.append(
                    TensorParallelPair(path=prefix, column="fc1", row="fc2", widths=widths)
                )
    return pairs


def vocabulary_sizes(model: nn.Module) -> set[int]:
    """Row counts of the model's vocabulary tables: its ``nn.Embedding`` modules with at least
    ``VOCAB_PARALLEL_MIN_ROWS`` rows (the cost model's rule; call it on the full model)."""
    return {
        module.num_embeddings
        for module in model.modules()
        if isinstance(module, nn.Embedding) and module.num_embeddings >= VOCAB_PARALLEL_MIN_ROWS
    }


def vocabulary_parallel_paths(
    model: nn.Module, layers: list[str], vocab_sizes: set[int]
) -> list[str]:
    """Paths of the vocabulary tables in ``layers`` that TP splits by rows: embeddings with a
    vocabulary's row count and the ``lm_head`` of an ``LMHead`` producing that many logits.

    Raises ``InputError`` for a head tied to its embedding (one Parameter split two ways).
    """
    from models.common import LMHead

    paths = []
    for path in layers:
        for name, module in model.get_submodule(path).named_modules():
            prefix = f"{path}.{name}" if name else path
            if isinstance(module, nn.Embedding) and module.num_embeddings in vocab_sizes:
                paths.append(prefix)
            elif isinstance(module, LMHead) and module.lm_head.out_features in vocab_sizes:
                paths.append(f"{prefix}.lm_head")
    tables = [model.get_submodule(path).weight for path in paths]
    if len({id(table) for table in tables}) < len(tables):
        raise InputError(
            "tied embeddings with a vocabulary-parallel table (>= "
            f"{VOCAB_PARALLEL_MIN_ROWS} rows) under tp > 1: not supported; untie them"
        )
    return paths


def apply_tensor_parallel(
    model: nn.Module,
    layers: list[str],
    tp_mesh: DeviceMesh,
    vocab_sizes: set[int],
    *,
    sequence_parallel: bool = False,
) -> dict[str, list[int]]:
    """Megatron split of every self-attention and MLP in ``layers`` over ``tp_mesh``.

    Attention: ``qkv`` column-parallel (rows regrouped per head first, see ``shard_order``),
    ``proj`` row-parallel, and the module's head counts set to the local ones (torchtitan does the
    same). MLP: ``fc1`` column-parallel (gate and up regrouped for SwiGLU), ``fc2`` row-parallel.
    Vocabulary tables (``vocabulary_parallel_paths``): the embedding row-parallel (its output
    all-reduced), the LM head column-parallel with its logits left sharded for the
    vocabulary-parallel cross-entropy, which must run under
    ``torch.distributed.tensor.parallel.loss_parallel`` (forward and backward). Everything else
    (norms, position tables, small vocabularies) stays replicated. Returns the row order of each
    regrouped parameter, keyed by the full model's parameter name.

    ``sequence_parallel`` adds :func:`apply_sequence_parallel`'s styles: between the Linears the
    activations are [b, s/t, h] shards.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    orders: dict[str, list[int]] = {}
    for pair in tensor_parallel_pairs(model, layers, tp):
        module = model.get_submodule(pair.path)
        if len(pair.widths) > 1:
            order = shard_order(pair.widths, tp)
            with torch.no_grad():
                for name, param in module.get_submodule(pair.column).named_parameters():
                    param.copy_(param[order])
                    # a list: no tensor of this bookkeeping is live in the measured run
                    orders[f"{pair.path}.{pair.column}.{name}"] = order.tolist()
        row = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        parallelize_module(module, tp_mesh, {pair.column: ColwiseParallel(), pair.row: row})
        if pair.column == "qkv":
            module.heads //= tp
            module.kv_heads //= tp
    for path in vocabulary_parallel_paths(model, layers, vocab_sizes):
        style = (
            RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            if path.rpartition(".")[2] != "lm_head"
            else ColwiseParallel(
                input_layouts=Shard(1) if sequence_parallel else Replicate(),
                output_layouts=Shard(-1),
                use_local_output=False,
            )
        )
        parallelize_module(model.get_submodule(path), tp_mesh, style)
    if sequence_parallel:
        apply_sequence_parallel(model, layers, tp_mesh, vocab_sizes)
    return orders


def apply_sequence_parallel(
    model: nn.Module, layers: list[str], tp_mesh: DeviceMesh, vocab_sizes: set[int]
) -> None:
    """Sequence parallelism on top of the tensor-parallel split, as torchtitan's Llama
    ``apply_tp`` does (and ``solver.exports.torch_pipelining``' snippet says): every norm
    ``SequenceParallel()`` (its [b, s/t, h] shard in, a Shard(1) DTensor out), the sequence
    gathered in front of each self-attention and MLP (``PrepareModuleInput``, Shard(1) ->
    Replicate), the row-parallel outputs reduce-scattered (``apply_tensor_parallel``), the LM
    head's input gathered (``input_layouts=Shard(1)``). A layer without attention, MLP or head
    (the embedding) computes its output replicated, then keeps its sequence shard
    (``_scatter_sequence``); the stages send [b, s/t, h].

    Eager autograd saves what each column-parallel Linear reads: the gathered [b, s, h] input,
    where Megatron saves the shard and gathers it again in the backward; the layer graph's
    ``sp_gathered_bytes`` counts it for ``--runtime torch``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        SequenceParallel,
        parallelize_module,
    )

    from models.common import MLP, Attention, LMHead

    def gather() -> PrepareModuleInput:
        return PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )

    for path in layers:
        layer = model.get_submodule(path)
        if isinstance(layer, LMHead):
            parallelize_module(layer, tp_mesh, {"norm": SequenceParallel()})
            # a vocabulary-parallel head gathers its input itself (apply_tensor_parallel)
            if layer.lm_head.out_features not in vocab_sizes:
                parallelize_module(layer, tp_mesh, {"lm_head": gather()})
            continue
        plan: dict[str, Any] = {}
        for name, module in layer.named_modules():
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                plan[name] = SequenceParallel()
            elif isinstance(module, (Attention, MLP)):
                plan[name] = gather()
        if plan:
            parallelize_module(layer, tp_mesh, plan)
        else:
            layer.register_forward_hook(functools.partial(_scatter_sequence, tp_mesh))


def _scatter_sequence(tp_mesh: DeviceMesh, module: nn.Module, args: tuple, output: torch.Tensor):
    """Forward hook: a replicated [b, s, h] output -> this rank's [b, s/t, h] shard; the
    backward all-gathers the shards' gradients (DTensor's Shard(1) -> Replicate)."""
    from torch.distributed.tensor import Replicate, Shard

    replicated = DTensor.from_local(output, tp_mesh, [Replicate()], run_check=False)
    return replicated.redistribute(tp_mesh, [Shard(1)]).to_local()


GLOO_RELEASE_TIMEOUT_S = 5.0
"""How long a collective on gloo waits for gloo's worker thread to let go of its buffer."""


def released_by_gloo(tensor: torch.Tensor, collective: Callable[[], Any]) -> Any:
    """Run the synchronous ``collective`` on ``tensor``'s storage and return its result once
    gloo's worker thread holds none of it, as NCCL (which the cost model describes) releases a
    collective's tensors in the caller's ``wait``.

    gloo wakes the waiting caller before its worker drops the finished work (``runLoop``:
    ``workInProgress_`` reset after ``finishWorkGloo``), and that work holds the buffer: a worker
    descheduled there (2 CPUs, 4 ranks) held an FSDP2 layer's flat all-gather buffer past FSDP2's
    free while the next layer's was allocated, so a rank measured that buffer twice (+26,112 B,
    533,768 against 507,656, on stage 1 of ``tests/test_run.py``'s FSDP2 dp 2 x pp 2 ZeRO 3). The
    wait (at most ``GLOO_RELEASE_TIMEOUT_S``) yields the CPU until the storage's references are
    back to the caller's."""
    storage = tensor.untyped_storage()
    held = storage_use_count(storage)
    result = collective()
    deadline = time.monotonic() + GLOO_RELEASE_TIMEOUT_S
    while storage_use_count(storage) > held and time.monotonic() < deadline:
        time.sleep(0)  # releases the GIL and the CPU to gloo's worker
    return result


class InPlaceReduceScatter:
    """FSDP2's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) as gloo runs it on CPU
    without a second full-size buffer: the input, FSDP2's own flat copy of the layer's unsharded
    gradients, is all-reduced in place and this rank's chunk copied into the output. gloo's
    ``reduce_scatter_single`` allocates a temporary the size of the input (a layer's unsharded
    gradients) that NCCL, which the cost model describes, does not; on gloo its lifetime also
    follows the collective's thread, so data-parallel twins measured apart by up to that size.
    The input is released by gloo before the call returns (``released_by_gloo``)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        import torch.distributed as dist

        released_by_gloo(input_tensor, lambda: dist.all_reduce(input_tensor, op=op, group=group))
        rank = dist.get_rank(group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[rank].view_as(output_tensor))
        return None


class ReleasedAllGather:
    """FSDP2's all-gather (``FSDPModule.set_custom_all_gather``) as gloo runs it on CPU: torch's
    own (``all_gather_single`` into FSDP2's flat buffer), returning once gloo's worker thread
    has let go of the buffer (``released_by_gloo``), so that the buffer is freed where FSDP2 frees
    it, as on NCCL. An asynchronous all-gather (FSDP2's ``unshard(async_op=True)``, not what the
    executors run) returns its work unchanged."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        import torch.distributed as dist

        if async_op:
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
        released_by_gloo(
            output_tensor,
            lambda: dist.all_gather_single(output_tensor, input_tensor, group=group),
        )
        return None


def apply_data_parallel(
    stage_module: nn.Module,
    layers: list[nn.Module],
    mesh: DeviceMesh,
    zero: int,
    device: torch.device,
) -> nn.Module:
    """Wrap the stage for data parallelism over ``mesh["dp"]``; returns what the pipeline runs.

    zero 0 and 1: DDP (1 adds ZeroRedundancyOptimizer, see ``build_optimizer``); with tensor
    parallelism, FSDP2's ``replicate`` (DDP does not take DTensor parameters). zero 2 and 3: FSDP2
    ``fully_shard``, one unit per layer plus the stage; zero 2 keeps the gathered weights from the
    forward to the end of the backward (``reshard_after_forward=False``).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dp_mesh = mesh["dp"]
    if dp_mesh.size() == 1:
        return stage_module
    if zero >= 2:
        units = [*layers, stage_module]
        for unit in units:
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=zero == 3)
        if device.type == "cpu":
            for unit in units:
                unit.set_custom_all_gather(ReleasedAllGather())
                unit.set_custom_reduce_scatter(InPlaceReduceScatter())
        if mesh["pp"].size() > 1:
            # Handed to PipelineStage as it is, as torchtitan does: PipelineStage turns gradient
            # sync and resharding off for every micro-batch's backward and reduce-scatters once
            # per step (``perform_reduce_grad``), so each layer's unsharded gradients live from
            # its first backward, and its unsharded weights from its first backward (zero 3,
            # "always") or forward (zero 2, torchtitan's default under PP), to the step's end.
            return stage_module
        # pp 1: a plain Sequential (no PipelineStage FSDP handling), every layer reduce-scatters
        # its gradients (and reshards) after each backward, as FSDP2 alone runs
        return nn.Sequential(stage_module)
    if mesh["tp"].size() > 1:
        replicate_with_fsdp(stage_module, mesh=dp_mesh)
        return stage_module
    wrapped = DistributedDataParallel(
        stage_module,
        process_group=dp_mesh.get_group(),
        device_ids=[device] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # the gradients live in the buckets: no second copy
    )
    # Fix the bucket order now. Left to DDP, it records the gradient order during the first
    # step, and with the pipeline's no_sync micro-batches (2 micro-batches, torch 2.13) it records
    # every parameter twice and fails the next forward ("rebuilt parameter indices size is not
    # same as original model parameters size").
    rebuild_ddp_buckets(wrapped)
    return wrapped


def build_optimizer(
    params: list[nn.Parameter], mesh: DeviceMesh, zero: int, *, lr: float, impl: str = "foreach"
) -> torch.optim.Optimizer:
    """Adam; with zero=1 over dp > 1, ZeroRedundancyOptimizer shards its state over the group
    (its local Adam gets the same implementation).

    ``impl`` (``TrainingConfig.optimizer_impl``): foreach (``foreach=True``, what
    ``torch.optim.Adam(params)`` picks on a GPU; on CPU torch would pick the single-tensor loop,
    so it is asked for explicitly: its ``_foreach_sqrt`` of every ``exp_avg_sq`` is the step
    temporary the cost model counts) or fused (``fused=True``: in place, no temporary).

    With tensor parallelism the split layers' parameters are DTensors and the rest (norms,
    position tables) plain tensors; torch's foreach and fused kernels refuse a list that mixes
    them ("got mixed torch.Tensor and DTensor", torch 2.13), so each kind gets its own param
    group, stepped one after the other (and ``zero_grad`` loops over the tensors): the step's
    temporary is then the larger group's, which the cost model's sum over every parameter bounds
    (by the replicated parameters)."""
    options = {"foreach": True} if impl == "foreach" else {"fused": True}
    distributed = [param for param in params if isinstance(param, DTensor)]
    if distributed and len(distributed) < len(params):
        plain = [param for param in params if not isinstance(param, DTensor)]
        # per group, not as defaults: zero_grad(set_to_none=False) zeroes with one foreach call
        # over every group when the defaults ask for foreach
        params = [{"params": group, **options} for group in (distributed, plain)]
        options = {}
    if zero == 1 and mesh["dp"].size() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            params,
            optimizer_class=torch.optim.Adam,
            process_group=mesh["dp"].get_group(),
            lr=lr,
            **options,
        )
    return torch.optim.Adam(params, lr=lr, **options)
