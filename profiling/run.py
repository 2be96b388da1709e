"""Run a plan for real on torch.distributed and measure each rank's peak memory (issue 4).

    from profiling.run import run_plan
    reports = run_plan("gpt-tiny", "plan.json", iterations=2,
                       overrides={"layers": 4, "dropout": 0.0})
    for r in reports:
        print(r.rank, r.stage, r.measured_peak_bytes, r.predicted_peak_bytes, r.error_pct)

The plan (a path, a parsed dict or a ``PlanFile``) is read and checked by
``solver.plan_file.load_plan`` (docs/plan.md); ``run_plan`` then refuses what this executor
cannot run (``_check_runnable``) before spawning anything.

``run_plan`` spawns ``pp * dp * tp`` processes (gloo on CPU, or NCCL with one GPU per rank for
``device="cuda"``), builds on each the full model from the same seed (so every weight equals the
single-process model's), keeps the layers of its plan stage, and trains ``iterations`` steps with
``torch.distributed.pipelining`` (``PipelineStage`` and ``Schedule1F1B`` / ``ScheduleGPipe`` with
the plan's micro-batch count) and Adam. The ranks form a ``(pp, dp, tp)`` device mesh, row-major:
``rank = (stage * dp + dp_rank) * tp + tp_rank``, so a stage's TP group is adjacent ranks.

Stage module: runs its layers in plan order; the model's last layer (the head, whose forward takes
``(hidden, targets)`` and returns the loss) is applied by the schedule's ``loss_fn`` on the last
stage, so the loss is exactly the model's. Gradients are scaled by the micro-batch count (the
schedule) and averaged over data-parallel ranks: they equal the single-process gradients of the
mean loss over the global batch ``dp * micro_batch * num_microbatches``.

Interleaved plans (``config.virtual_stages`` v > 1, ``solver.plan --virtual-stages v``): virtual
stage j = c * pp + r is chunk c of pipeline rank r (``stages[r].chunks``). Each rank builds one
model per chunk from the seed, keeping only that chunk's layers, and one ``PipelineStage`` per
chunk (global index j of ``pp * v``, static shapes as below), and runs them with
``ScheduleInterleaved1F1B``: the input ids go to rank 0 (virtual stage 0), the head runs in
``loss_fn`` on rank pp - 1 (the last virtual stage). With dp > 1 each chunk gets its own DDP.
Supported: tp 1, ZeRO 0 when dp > 1, recompute none or full, a micro-batch count that is a
multiple of torch's rounds ``max(1, m // pp)``; anything else is an ``InputError``.

Tensor parallelism (``tp > 1``, ``torch.distributed.tensor.parallel``): Megatron's split of every
self-attention (fused ``qkv`` column-parallel with its rows regrouped so that each TP rank holds
whole heads of q, k and v, ``proj`` row-parallel, the module's head counts set to the local ones)
and MLP (``fc1`` column-parallel, gate and up regrouped for SwiGLU; ``fc2`` row-parallel).
Vocabularies of at least ``profiling.tensor_parallel.VOCAB_PARALLEL_MIN_ROWS`` rows are split by
rows: the token embedding row-parallel, the LM head column-parallel with its logits left sharded
and the cross-entropy run under ``loss_parallel``. Norms, position tables and smaller
vocabularies stay replicated. This is the split the cost model assumes (``tp_params``): on
gpt-tiny the measured weights equal the prediction to the byte (tests). See
``profiling.parallelize``.

Data parallelism over ``dp > 1`` by ZeRO stage: 0 DDP; 1 DDP + ``ZeroRedundancyOptimizer`` (Adam
state sharded); 2 FSDP2 ``fully_shard(reshard_after_forward=False)`` (gradients and Adam state
sharded; each layer's weights gathered from its forward to its backward); 3 FSDP2
``fully_shard`` (one unit per layer plus the stage). For 2 and 3 the stage reaches
``PipelineStage`` inside a plain ``nn.Sequential``: given an FSDP module it would turn gradient
sync and resharding off until the last micro-batch, so every layer reduce-scatters its gradients
and reshards after each backward, as ZeRO and the cost model assume. With tp > 1, zero 0 uses
FSDP2's ``replicate`` (DDP does not take DTensor parameters) and zero 1 is an ``InputError``
(``ZeroRedundancyOptimizer`` cannot shard DTensor parameters).

Recompute ``"full"``: every layer of the stage, the head included, runs under non-reentrant
``torch.utils.checkpoint``: only layer inputs (the cost model's stored output bytes) stay between
forward and backward, and one layer's saved tensors are re-materialised at a time.

Runtime choices the cost model's ``--runtime torch`` describes (``docs/cost-model.md``): each stage
gets static input/output shapes (left to infer them, ``PipelineStage`` runs a real forward and
backward of the first micro-batch whose graph partly stays alive on torch 2.13), the schedule runs
with ``return_outputs=False`` (else the last stage keeps every micro-batch's output), gradients
persist between steps (``zero_grad(set_to_none=False)``, as Megatron's and DeepSpeed's buffers do)
and DDP keeps them in its buckets (``gradient_as_bucket_view``: no second copy).

Memory: ``profiling.memory.LiveTensorTracker`` (exact live storage bytes) is active from before
the parallel wrappers, the stage and the optimizer are built; its peak is reset at the start of
every iteration and the last iteration's peak is reported, with the plan's
``stages[i].peak_bytes`` next to it. Gradients that FSDP2 (or ``replicate``) writes are tagged
``grads`` only after the backward, so at a peak inside it they count as ``other``. On CUDA,
``torch.cuda.max_memory_allocated`` over the last iteration is reported as well.

Not supported (``InputError``): tied weights split across (virtual) stages, a tied embedding and
head with a vocabulary-parallel table, ZeRO-1 with tp > 1 and dp > 1. The model's layers must form
a chain (each takes the previous one's output, the last takes ``(hidden, targets)``: the GPT/Llama
presets); a DAG model such as T5 fails inside the ranks, which ``run_plan`` reports as
``RunError``. Use dropout 0 for runs compared with a single process or with predictions (the CPU
dropout kernels differ from GPU ones, and dropout masks draw random numbers in a different order).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import multiprocessing.connection
import os
import shutil
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import models
from profiling.parallelize import (
    apply_data_parallel,
    apply_tensor_parallel,
    build_optimizer,
    tensor_parallel_pairs,
    vocabulary_parallel_paths,
    vocabulary_sizes,
)
from solver.errors import InputError, RunError
from solver.plan_file import PlanFile, load_plan
from solver.specs import SCHEDULES as SCHEDULES  # re-exported: the names profiling.run had
from solver.specs import ZERO_STAGES as ZERO_STAGES
from solver.specs import ParallelConfig

RECOMPUTE = ("none", "full")
"""The recompute modes (of ``solver.specs.RECOMPUTE_MODES``) this executor runs."""
DEVICES = ("cpu", "cuda")
LEARNING_RATE = 1e-3
"""Adam's learning rate (the other Adam settings are torch's defaults)."""


@dataclass(kw_only=True)
class RankReport:
    """What one rank measured on the last iteration."""

    rank: int
    """Global rank, ``(stage * dp + dp_rank) * tp + tp_rank``."""
    stage: int
    """Pipeline stage index (the plan's ``stages[i].index``)."""
    dp_rank: int
    """Data-parallel rank within the stage's replicas."""
    tp_rank: int
    """Tensor-parallel rank within the replica's TP group."""
    layers: list[str]
    """Layer names the stage holds."""
    measured_peak_bytes: int
    """Live tensor bytes at the peak of the last iteration (exact storage accounting)."""
    measured_breakdown: dict[str, int]
    """The live bytes at that peak by category (``profiling.memory.CATEGORIES``)."""
    predicted_peak_bytes: int | None
    """The plan's ``stages[stage].peak_bytes``; None when the plan does not give it."""
    predicted_breakdown: dict[str, int] | None
    """The plan's ``stages[stage].breakdown``."""
    error_pct: float | None
    """100 * (predicted - measured) / measured: negative when the plan under-predicts."""
    iteration_ms: list[float]
    """Wall time of each iteration on this rank (schedule step + optimizer step)."""
    cuda_max_allocated_bytes: int | None = None
    """``device="cuda"``: ``torch.cuda.max_memory_allocated`` over the last iteration (reset at
    its start), next to the tracker's count; None on CPU."""
    losses: list[float] = field(default_factory=list)
    """Last stage only: each iteration's loss (mean over micro-batches) on this rank's data."""
    grads: dict[str, torch.Tensor] | None = None
    """With ``capture_grads``: the last iteration's gradients (after the pipeline's scaling and the
    data-parallel average, before the optimizer step), keyed by the full model's parameter name."""


@dataclass(kw_only=True, frozen=True)
class _Job:
    preset: str
    overrides: dict[str, Any]
    plan: PlanFile
    iterations: int
    seed: int
    seq: int | None
    timeout_s: float
    master_port: int
    capture_grads: bool
    device: str
    fault: tuple[int, str] | None


# -- what this executor runs (parent) ----------------------------------------------------------


def _check_runnable(spec: models.ModelSpec, plan: PlanFile, max_processes: int) -> None:
    """InputError naming the field, unless this executor can run the (checked) plan on ``spec``:
    recompute none or full, no ZeRO-1 over tensor-parallel parameters, a supported interleaving,
    a tensor-parallel split of the model's heads, few enough processes, and the model's layers."""
    config = plan.config
    pp, tp, dp, zero = config.pp, config.tp, config.dp, config.zero
    if tp > 1 and dp > 1 and zero == 1:
        raise InputError(
            f"plan config: zero=1 with tp({tp}) and dp({dp}): ZeroRedundancyOptimizer cannot "
            "shard DTensor (tensor-parallel) parameters; use zero=2 or 3"
        )
    if config.recompute not in RECOMPUTE:
        raise InputError(
            f"plan config: recompute={config.recompute!r}; valid: {', '.join(RECOMPUTE)}"
        )
    _check_interleaving(config)
    if tp > 1:
        with torch.device("meta"):  # shapes only
            model = spec.build()
        tensor_parallel_pairs(model, spec.layers, tp)
        vocabulary_parallel_paths(model, spec.layers, vocabulary_sizes(model))
    if pp * dp * tp > max_processes:
        raise InputError(
            f"plan needs pp({pp}) * dp({dp}) * tp({tp}) = {pp * dp * tp} processes, more than "
            f"this machine allows ({max_processes}); plan for fewer GPUs"
        )
    layers = [name for chunk in plan.virtual_stage_layers for name in chunk]
    if layers != spec.layers:
        unknown = [name for name in layers if name not in spec.layers]
        absent = [name for name in spec.layers if name not in layers]
        detail = (
            f"unknown layers {unknown}" if unknown else f"missing layers {absent}" if absent else ""
        )
        raise InputError(
            f"plan does not match model {spec.name}: the stages' layers must be the model's "
            f"{len(spec.layers)} layers {spec.layers[0]}..{spec.layers[-1]} in order, got "
            f"{len(layers)} layers{'; ' + detail if detail else ' (out of order)'}"
        )


def _check_interleaving(config: ParallelConfig) -> None:
    """InputError unless ``config.virtual_stages`` is one this executor runs: 1, or v > 1 with
    1F1B (``ScheduleInterleaved1F1B``, which ParallelConfig requires), tp 1 and, over dp > 1,
    ZeRO 0 (one DDP per chunk)."""
    v, pp, tp, dp = config.virtual_stages, config.pp, config.tp, config.dp
    if v == 1:
        return
    m, zero = config.num_microbatches, config.zero
    rounds = max(1, m // pp)
    problems = (
        (pp < 2, f"pp={pp}: interleaving needs pp >= 2; plan with --virtual-stages 1"),
        (
            tp > 1,
            f"tp={tp}: interleaved plans run with tp=1 only; plan with --tp 1 or "
            "--virtual-stages 1",
        ),
        (
            dp > 1 and zero != 0,
            f"dp={dp} and zero={zero}: interleaved plans run data parallelism with DDP (zero=0) "
            "only; plan with --zero 0 or --virtual-stages 1",
        ),
        (
            m % rounds != 0,
            f"num_microbatches={m}: ScheduleInterleaved1F1B needs a multiple of its rounds "
            f"max(1, m // pp) = {rounds}; plan with a multiple of pp ({pp})",
        ),
    )
    for failed, problem in problems:
        if failed:
            raise InputError(f"plan config: virtual_stages={v} with {problem}")


def virtual_stage_layers(plan: dict[str, Any] | PlanFile) -> list[list[str]]:
    """The layer names of each (virtual) stage in pipeline order: with v chunks per rank,
    virtual stage j is chunk j // pp of rank j % pp (``stages[r].chunks``); else
    ``stages[r].layers`` (:attr:`solver.plan_file.PlanFile.virtual_stage_layers`)."""
    return load_plan(plan).virtual_stage_layers


def _check_device(device: str, world: int) -> None:
    """InputError unless ``device`` can host ``world`` ranks (NCCL: one GPU per rank)."""
    if device not in DEVICES:
        raise InputError(f"device {device!r}; valid: {', '.join(DEVICES)}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise InputError("device cuda: torch.cuda.is_available() is False on this machine")
        if world > torch.cuda.device_count():
            raise InputError(
                f"device cuda: the plan needs {world} ranks, one GPU each (NCCL), and this "
                f"machine has {torch.cuda.device_count()}"
            )


def _spec(preset: str, overrides: dict[str, Any]) -> models.ModelSpec:
    try:
        spec = models.get(preset, **overrides)
    except ValueError as error:
        raise InputError(str(error)) from error
    if not spec.layers:
        raise InputError(f"model {preset}: no default layer list")
    return spec


# -- one rank (child) --------------------------------------------------------------------------


def batch_for_iteration(
    spec: models.ModelSpec, *, batch: int, seq: int | None, seed: int, iteration: int
) -> tuple:
    """The global batch of ``iteration``: the same on every rank and in a single process."""
    torch.manual_seed(seed + 1 + iteration)
    return spec.example_inputs(batch, seq)


def build_model(spec: models.ModelSpec, seed: int) -> nn.Module:
    """The full model with weights from ``seed`` (what every rank and the reference build)."""
    torch.manual_seed(seed)
    return spec.build()


class _StageModule(nn.Module):
    """Runs ``run_paths`` of ``root`` in order; ``root`` keeps only this stage's layers.

    With ``recompute`` each layer runs under ``torch.utils.checkpoint`` (non-reentrant): only the
    layer's input is kept and its saved tensors are re-materialised in the backward, one layer at
    a time (the cost model's full recomputation).
    """

    def __init__(self, root: nn.Module, run_paths: list[str], *, recompute: bool = False):
        super().__init__()
        self.root = root
        self.run_paths = run_paths
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for path in self.run_paths:
            layer = self.root.get_submodule(path)
            x = checkpoint(layer, x, use_reentrant=False) if self.recompute else layer(x)
        return x


def _head_loss(
    head: nn.Module | None, recompute: bool, output: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    assert head is not None, "loss_fn called on a stage without the head"
    if recompute:  # the head is a layer too: the cost model stores only its (scalar) output
        return checkpoint(head, output, target, use_reentrant=False)
    return head(output, target)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective over its mesh), a plain tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def boundary_metas(
    model: nn.Module, spec: models.ModelSpec, micro_batch_input: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Meta tensors (shape, dtype) of every layer's output for one micro-batch, by layer path.

    Run under ``FakeTensorMode`` (no memory, no compute), so that the pipeline stages get static
    metadata: left to infer it, ``PipelineStage`` runs a real forward and backward of the first
    micro-batch on the first step, and on the first stage part of that graph stays alive for the
    whole run (torch 2.13), which would add about one micro-batch of activations to every peak.
    """
    from profiling._torch_compat import FakeTensorMode

    metas = {}
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        x = fake.from_tensor(micro_batch_input)
        for path in spec.layers[:-1]:
            x = model.get_submodule(path)(x)
            metas[path] = torch.empty(
                x.shape, dtype=x.dtype, device="meta", requires_grad=x.dtype.is_floating_point
            )
    return metas


def _keep_layers(model: nn.Module, all_layers: list[str], keep: list[str]) -> None:
    """Drop every layer not in ``keep`` (the module slot becomes None); check nothing is shared."""
    owner: dict[int, str] = {}
    for path in all_layers:
        for param in model.get_submodule(path).parameters():
            if id(param) in owner and owner[id(param)] != path:
                if (owner[id(param)] in keep) != (path in keep):
                    raise InputError(
                        f"layers {owner[id(param)]} and {path} share a parameter (tied weights) "
                        "but are on different stages; not supported yet"
                    )
            owner[id(param)] = path
    loose = [name for name, param in model.named_parameters() if id(param) not in owner]
    if loose:
        raise InputError(f"parameters outside every layer: {', '.join(loose[:5])}")
    for path in all_layers:
        if path not in keep:
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name, None)


@dataclass(kw_only=True, frozen=True)
class _Place:
    """Where a rank sits: ``rank = (stage * dp + dp_rank) * tp + tp_rank``, and its device."""

    rank: int
    stage: int
    dp_rank: int
    tp_rank: int
    first: bool
    """Holds the first (virtual) stage: feeds the input ids."""
    last: bool
    """Holds the last (virtual) stage: its loss_fn gets the targets."""
    device: torch.device


@dataclass(kw_only=True)
class _Chunk:
    """One model chunk of a rank: virtual stage ``index`` (chunk * pp + stage), a full model from
    the seed that keeps only the chunk's layers, and its static boundary shapes."""

    index: int
    model: nn.Module
    run_paths: list[str]
    """The chunk's layers the stage module runs (all but the loss head)."""
    stage_input: torch.Tensor
    stage_output: torch.Tensor


@dataclass(kw_only=True)
class _Measured:
    """What the iterations measured on one rank."""

    peak_bytes: int
    breakdown: dict[str, int]
    iteration_ms: list[float]
    losses: list[float]
    cuda_peak: int | None
    grads: dict[str, torch.Tensor] | None


def _place(rank: int, job: _Job) -> _Place:
    """The rank's mesh coordinates and device; sets its CPU threads (and CUDA device)."""
    config = job.plan.config
    replica, tp_rank = divmod(rank, config.tp)
    stage, dp_rank = divmod(replica, config.dp)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.num_gpus))
    cuda = job.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return _Place(
        rank=rank,
        stage=stage,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        first=stage == 0,
        last=stage == config.pp - 1,
        device=device,
    )


def _init_mesh(place: _Place, job: _Job):
    """Join the process group (gloo, or NCCL on CUDA) and build the (pp, dp, tp) device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    config = job.plan.config
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(job.master_port)
    dist.init_process_group(
        "nccl" if place.device.type == "cuda" else "gloo",
        rank=place.rank,
        world_size=config.num_gpus,
        timeout=timedelta(seconds=job.timeout_s),
    )
    # Row-major over (pp, dp, tp): rank = (stage * dp + dp_rank) * tp + tp_rank.
    return init_device_mesh(
        place.device.type, (config.pp, config.dp, config.tp), mesh_dim_names=("pp", "dp", "tp")
    )


def _build_chunks(
    spec: models.ModelSpec, job: _Job, place: _Place
) -> tuple[list[_Chunk], dict[str, int]]:
    """The rank's chunks on its device, and the full model's vocabulary sizes.

    One model per chunk (virtual stage chunk * pp + stage), each from the same seed and keeping
    only the chunk's layers, so that a chunk's module (and its DDP) owns exactly its parameters.
    Without interleaving: one chunk, the rank's stage."""
    config = job.plan.config
    virtual = job.plan.virtual_stage_layers
    head_path = spec.layers[-1]
    # static stage metadata: one micro-batch's input and output shapes
    example_ids, _ = batch_for_iteration(
        spec, batch=config.micro_batch, seq=job.seq, seed=job.seed, iteration=0
    )
    ids_meta = torch.empty(example_ids.shape, dtype=example_ids.dtype, device="meta")
    chunks: list[_Chunk] = []
    for chunk in range(config.virtual_stages):
        index = chunk * config.pp + place.stage
        model = build_model(spec, job.seed)
        if not chunks:
            # of the full model: a stage may hold only the head
            vocab_sizes = vocabulary_sizes(model)
            metas = boundary_metas(model, spec, example_ids)
        run_paths = [path for path in virtual[index] if path != head_path]
        stage_input = ids_meta if index == 0 else metas[virtual[index - 1][-1]]
        stage_output = metas[run_paths[-1]] if run_paths else stage_input
        _keep_layers(model, spec.layers, virtual[index])
        model.to(place.device)
        chunks.append(
            _Chunk(
                index=index,
                model=model,
                run_paths=run_paths,
                stage_input=stage_input,
                stage_output=stage_output,
            )
        )
    return chunks, vocab_sizes


def _parallelize(
    chunk: _Chunk, job: _Job, place: _Place, mesh, vocab_sizes: dict[str, int], tracker
) -> tuple[_StageModule, nn.Module, dict[str, torch.Tensor]]:
    """Tensor parallelism, the stage module (with recompute), then data parallelism (DDP, ZeRO,
    FSDP2) on one chunk. Returns the stage module, what the PipelineStage runs and the TP
    regrouping orders of its parameters."""
    config = job.plan.config
    layer_paths = job.plan.virtual_stage_layers[chunk.index]
    orders: dict[str, torch.Tensor] = {}
    if config.tp > 1:
        orders = apply_tensor_parallel(chunk.model, layer_paths, mesh["tp"], vocab_sizes)
    stage_module = _StageModule(chunk.model, chunk.run_paths, recompute=config.recompute == "full")
    layer_modules = [chunk.model.get_submodule(path) for path in layer_paths]
    submod = apply_data_parallel(stage_module, layer_modules, mesh, config.zero, place.device)
    tracker.track_module(stage_module)  # the shards are the weights now (TP, FSDP2)
    tracker.track_grads(stage_module)
    return stage_module, submod, orders


def _pipeline_stage(chunk: _Chunk, submod: nn.Module, job: _Job, mesh, device: torch.device):
    """The chunk's PipelineStage (global index of pp * v) with static input/output shapes."""
    from torch.distributed.pipelining import PipelineStage

    num_virtual = job.plan.config.pp * job.plan.config.virtual_stages
    shapes = {"input_args": chunk.stage_input, "output_args": chunk.stage_output}
    if "output_grads" in inspect.signature(PipelineStage).parameters:  # torch >= 2.12
        shapes |= {
            "output_grads": None if chunk.index == num_virtual - 1 else chunk.stage_output,
            "input_grads": None if chunk.index == 0 else chunk.stage_input,
        }
    return PipelineStage(
        submod, chunk.index, num_virtual, device, group=mesh["pp"].get_group(), **shapes
    )


def _schedule(
    chunks: list[_Chunk], pipeline_stages: list, spec: models.ModelSpec, job: _Job, place: _Place
):
    """The plan's schedule over the rank's stages; the head runs in loss_fn on the last rank."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    config = job.plan.config
    head = chunks[-1].model.get_submodule(spec.layers[-1]) if place.last else None
    # loss_fn on every rank: without it the first stage skips backward (and deadlocks).
    loss_fn = functools.partial(_head_loss, head, config.recompute == "full")
    if len(chunks) > 1:
        return ScheduleInterleaved1F1B(
            pipeline_stages, n_microbatches=config.num_microbatches, loss_fn=loss_fn
        )
    schedule_class = Schedule1F1B if config.schedule == "1f1b" else ScheduleGPipe
    return schedule_class(
        pipeline_stages[0], n_microbatches=config.num_microbatches, loss_fn=loss_fn
    )


def _iterate(
    schedule,
    optimizer,
    params: list,
    spec: models.ModelSpec,
    job: _Job,
    place: _Place,
    tracker,
    *,
    sharded_logits: bool,
) -> tuple[list[float], list[float], int | None]:
    """Run ``job.iterations`` steps (schedule, then optimizer), resetting the peaks at the start
    of each. Returns the iteration times (ms), the losses (last rank) and the last CUDA peak."""
    from torch.distributed.tensor.parallel import loss_parallel

    config, device, cuda = job.plan.config, place.device, place.device.type == "cuda"
    losses: list[float] = []
    iteration_ms: list[float] = []
    cuda_peak: int | None = None
    rows = config.micro_batch * config.num_microbatches
    for iteration in range(job.iterations):
        ids, targets = batch_for_iteration(
            spec, batch=rows * config.dp, seq=job.seq, seed=job.seed, iteration=iteration
        )
        local = slice(place.dp_rank * rows, (place.dp_rank + 1) * rows)
        args = (ids[local].to(device, copy=True),) if place.first else ()
        kwargs: dict[str, Any] = {}
        step_losses: list[torch.Tensor] = []
        if place.last:
            kwargs = {"target": targets[local].to(device, copy=True), "losses": step_losses}
        del ids, targets
        optimizer.zero_grad(set_to_none=False)  # persistent gradient buffers, as costed
        tracker.reset_peak()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        if job.fault and job.fault[0] == place.rank:
            if job.fault[1] == "hang":
                time.sleep(3600)
            raise RuntimeError(f"rank {place.rank}: injected failure (test hook)")
        with (
            tracker.saved_tensors(),
            loss_parallel() if sharded_logits else contextlib.nullcontext(),
        ):
            schedule.step(*args, **kwargs, return_outputs=False)
        for param in params:  # FSDP2 sets sharded grads without hooks
            if param.grad is not None:
                tracker.track(param.grad, "grads")
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)
            cuda_peak = torch.cuda.max_memory_allocated(device)
        iteration_ms.append((time.perf_counter() - started) * 1e3)
        if place.last:
            losses.append(float(torch.stack([_full(x) for x in step_losses]).detach().mean()))
        del args, kwargs, step_losses
    return iteration_ms, losses, cuda_peak


def _gradients(chunks: list[_Chunk], orders: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full gradients of the rank's parameters on CPU, in the single-process layout."""
    grads = {}
    for chunk in chunks:
        for name, param in chunk.model.named_parameters():
            if param.grad is not None:
                grad = _full(param.grad).detach().cpu()
                if name in orders:  # undo the per-head regrouping
                    grad = grad[torch.argsort(orders[name])]
                grads[name] = grad.clone()
    return grads


def _train_and_measure(
    chunks: list[_Chunk], spec: models.ModelSpec, job: _Job, place: _Place, mesh, vocab_sizes
) -> _Measured:
    """Parallelize the chunks, build the schedule and the optimizer, train, and measure the live
    tensors from before the wrappers on (the peak of the last iteration)."""
    from profiling.memory import LiveTensorTracker

    config = job.plan.config
    tracker = LiveTensorTracker()
    for chunk in chunks:
        tracker.track_module(chunk.model)
    orders: dict[str, torch.Tensor] = {}
    with tracker:
        pipeline_stages, stage_modules = [], []
        for chunk in chunks:
            stage_module, submod, chunk_orders = _parallelize(
                chunk, job, place, mesh, vocab_sizes, tracker
            )
            orders |= chunk_orders
            pipeline_stages.append(_pipeline_stage(chunk, submod, job, mesh, place.device))
            stage_modules.append(stage_module)
        # A vocabulary-parallel head leaves its logits sharded: its cross-entropy (forward and
        # backward) needs loss_parallel.
        virtual = job.plan.virtual_stage_layers
        sharded_logits = config.tp > 1 and any(
            path.endswith(".lm_head")
            for chunk in chunks
            for path in vocabulary_parallel_paths(chunk.model, virtual[chunk.index], vocab_sizes)
        )
        schedule = _schedule(chunks, pipeline_stages, spec, job, place)
        params = [param for module in stage_modules for param in module.parameters()]
        optimizer = build_optimizer(params, mesh, config.zero, lr=LEARNING_RATE)
        tracker.track_optimizer(getattr(optimizer, "optim", optimizer))  # ZeRO-1: the local Adam
        iteration_ms, losses, cuda_peak = _iterate(
            schedule, optimizer, params, spec, job, place, tracker, sharded_logits=sharded_logits
        )
        peak_bytes, breakdown = tracker.peak_bytes, dict(tracker.peak_breakdown)
        grads = _gradients(chunks, orders) if job.capture_grads else None
    return _Measured(
        peak_bytes=peak_bytes,
        breakdown=breakdown,
        iteration_ms=iteration_ms,
        losses=losses,
        cuda_peak=cuda_peak,
        grads=grads,
    )


def _rank_main(rank: int, job: _Job) -> RankReport:
    """One rank: place it, join the mesh, build its chunks, train and measure, and report next
    to the plan's prediction for its stage."""
    place = _place(rank, job)
    mesh = _init_mesh(place, job)
    spec = _spec(job.preset, job.overrides)
    chunks, vocab_sizes = _build_chunks(spec, job, place)
    measured = _train_and_measure(chunks, spec, job, place, mesh, vocab_sizes)
    stage = job.plan.stages[place.stage]
    predicted = stage.peak_bytes
    peak_bytes = measured.peak_bytes
    return RankReport(
        rank=rank,
        stage=place.stage,
        dp_rank=place.dp_rank,
        tp_rank=place.tp_rank,
        layers=list(stage.layers),
        measured_peak_bytes=peak_bytes,
        measured_breakdown=measured.breakdown,
        predicted_peak_bytes=predicted,
        predicted_breakdown=dict(stage.breakdown),
        error_pct=100.0 * (predicted - peak_bytes) / peak_bytes if predicted else None,
        iteration_ms=measured.iteration_ms,
        cuda_max_allocated_bytes=measured.cuda_peak,
        losses=measured.losses,
        grads=measured.grads,
    )


def _worker(rank: int, job: _Job, result_dir: str) -> None:
    """Child entry point: write ``rank{r}.pt`` (the report) or ``rank{r}.err`` and exit non-zero."""
    directory = Path(result_dir)
    try:
        report = _rank_main(rank, job)
        torch.save(report, directory / f"rank{rank}.tmp")
        os.replace(directory / f"rank{rank}.tmp", directory / f"rank{rank}.pt")
        import torch.distributed as dist

        dist.barrier()  # nobody tears down gloo while a peer still talks to it
        dist.destroy_process_group()
    except BaseException:
        (directory / f"rank{rank}.err").write_text(f"{time.time()}\n{traceback.format_exc()}")
        os._exit(1)  # skip atexit and gloo teardown: peers may be gone or stuck


# -- the launcher (parent) ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _stop(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(10)


def _first_error(directory: Path) -> str:
    """The traceback of the rank that failed first (others often fail only because it did)."""
    errors = []
    for path in directory.glob("rank*.err"):
        stamp, _, text = path.read_text().partition("\n")
        errors.append((float(stamp), path.stem, text.strip()))
    if not errors:
        return ""
    _, name, text = min(errors)
    return f"{name} failed first:\n{text}"


def run_plan(
    preset: str,
    plan: str | Path | dict[str, Any] | PlanFile,
    *,
    iterations: int = 2,
    seed: int = 0,
    timeout_s: float = 120,
    overrides: dict[str, Any] | None = None,
    seq: int | None = None,
    capture_grads: bool = False,
    max_processes: int | None = None,
    device: str = "cpu",
    _fault: tuple[int, str] | None = None,
) -> list[RankReport]:
    """Train ``iterations`` steps of ``preset`` with ``plan`` on ``pp * dp * tp`` local processes.

    ``plan``: a plan or evaluation document (a path, a parsed dict or a
    :class:`solver.plan_file.PlanFile`), checked by :func:`solver.plan_file.load_plan`.
    Returns one ``RankReport`` per rank, in rank order. ``seq`` defaults to the model's
    ``seq_len``; ``max_processes`` to ``max(4, 2 * cpu_count)``. ``device``: ``"cpu"`` (gloo) or
    ``"cuda"`` (NCCL, rank r on ``cuda:{r % device_count}``, one GPU per rank). Raises
    ``InputError`` for a plan this executor cannot run on the model or device, and ``RunError``
    when a rank fails or the run
    takes longer than ``timeout_s`` (every process is stopped first). ``_fault`` is a test hook:
    ``(rank, "raise")`` makes that rank raise at the start of its first iteration, ``(rank,
    "hang")`` makes it sleep there (its peers then wait in the pipeline's receives).
    """
    overrides = dict(overrides or {})
    if iterations < 1:
        raise InputError(f"iterations must be >= 1, got {iterations}")
    plan = load_plan(plan)
    spec = _spec(preset, overrides)
    limit = max_processes or max(4, 2 * (os.cpu_count() or 1))
    _check_runnable(spec, plan, limit)
    world = plan.config.num_gpus
    _check_device(device, world)
    job = _Job(
        preset=preset,
        overrides=overrides,
        plan=plan,
        iterations=iterations,
        seed=seed,
        seq=seq,
        timeout_s=timeout_s,
        master_port=_free_port(),
        capture_grads=capture_grads,
        device=device,
        fault=_fault,
    )
    context = torch.multiprocessing.get_context("spawn")
    directory = Path(tempfile.mkdtemp(prefix="memplan-run-"))
    processes = []
    try:
        for rank in range(world):
            process = context.Process(
                target=_worker, args=(rank, job, str(directory)), name=f"memplan-rank{rank}"
            )
            process.daemon = True  # never outlive the parent
            process.start()
            processes.append(process)
        pids = [process.pid for process in processes]
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [process.exitcode for process in processes]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                time.sleep(0.2)  # let the first failure's traceback land
                _stop(processes)
                detail = _first_error(directory) or f"exit codes {codes}"
                raise RunError(f"rank(s) {failed} failed; all ranks stopped. {detail}", pids=pids)
            if all(code == 0 for code in codes):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _stop(processes)
                running = [rank for rank, code in enumerate(codes) if code is None]
                raise RunError(
                    f"timed out after {timeout_s:g} s with ranks {running} still running; "
                    "all ranks stopped",
                    pids=pids,
                )
            multiprocessing.connection.wait(
                [process.sentinel for process in processes if process.exitcode is None],
                timeout=min(remaining, 0.5),
            )
        return [
            torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(world)
        ]
    finally:
        _stop(processes)
        with contextlib.suppress(OSError):
            shutil.rmtree(directory)


def format_reports(reports: list[RankReport]) -> str:
    """Text table: rank, stage, dp and tp rank, measured, predicted, error % and the measured
    breakdown (MiB); on CUDA also ``torch.cuda.max_memory_allocated`` (``cuda_MiB``)."""
    mib = 2**20
    cuda = any(r.cuda_max_allocated_bytes is not None for r in reports)
    lines = [
        "rank stage dp tp  measured_MiB predicted_MiB  error_%   "
        "params   grads  optimizer activations  other  iter_ms" + ("  cuda_MiB" if cuda else "")
    ]
    for r in reports:
        b = r.measured_breakdown
        predicted = "-" if r.predicted_peak_bytes is None else f"{r.predicted_peak_bytes / mib:.3f}"
        error = "-" if r.error_pct is None else f"{r.error_pct:+.1f}"
        iteration = r.iteration_ms[-1] if r.iteration_ms else math.nan
        line = (
            f"{r.rank:4d} {r.stage:5d} {r.dp_rank:2d} {r.tp_rank:2d} "
            f"{r.measured_peak_bytes / mib:13.3f} "
            f"{predicted:>13} {error:>8} {b['params'] / mib:8.3f} {b['grads'] / mib:7.3f} "
            f"{b['optimizer'] / mib:10.3f} {b['activations'] / mib:11.3f} "
            f"{b['other'] / mib:6.3f} {iteration:8.1f}"
        )
        if cuda:
            allocated = r.cuda_max_allocated_bytes
            line += f" {allocated / mib:9.3f}" if allocated is not None else f" {'-':>9}"
        lines.append(line)
    return "\n".join(lines)
