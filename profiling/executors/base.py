"""One rank of a plan's real run (the child process of :func:`profiling.run.run_plan`): join
the ``(pp, dp, tp)`` mesh, build this rank's chunks of the model, apply its tensor and data
parallelism, train ``iterations`` steps with torch.distributed.pipelining and Adam, and report
the live-tensor peak of the last one next to the plan's prediction; then time
``step_iterations`` more steps with the memory instrumentation off (:func:`clean_steps`). How
the run works as a whole: :mod:`profiling.run`."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import models
from profiling.executors.parallelize import (
    apply_data_parallel,
    apply_tensor_parallel,
    build_optimizer,
    vocabulary_parallel_paths,
    vocabulary_sizes,
)
from solver.errors import InputError
from solver.files.plan_file import PlanFile
from solver.workers import exit_with_parent

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
    """The live bytes at that peak by category (``profiling.trace.memory.CATEGORIES``)."""
    predicted_peak_bytes: int | None
    """The plan's ``stages[stage].peak_bytes``; None when the plan does not give it."""
    predicted_breakdown: dict[str, int] | None
    """The plan's ``stages[stage].breakdown``."""
    error_pct: float | None
    """100 * (predicted - measured) / measured: negative when the plan under-predicts."""
    iteration_ms: list[float]
    """Wall time of each instrumented iteration on this rank (schedule step + optimizer step,
    with the live-tensor tracker counting)."""
    step_ms: list[float] = field(default_factory=list)
    """Each clean timed iteration after the instrumented ones (no tracker, no saved-tensor hooks,
    no storage tagging; all ranks start it after a barrier): the slowest rank's wall time of
    schedule step + optimizer step, the same on every rank (:func:`clean_steps`). Empty with
    ``step_iterations=0``."""
    threads: int | None = None
    """``torch.get_num_threads()`` the rank ran with (``RunJob.threads``)."""
    step_cpu_ms: list[float] = field(default_factory=list)
    """This rank's CPU time (``time.process_time``: all its threads, gloo's included) in each
    clean iteration: next to ``step_ms`` it tells waiting (on peers, or for a CPU on a shared
    machine) from work."""
    step_instrumentation: list[str] = field(default_factory=list)
    """What of the tracker was found installed around the clean iterations, or
    ``"tracker counted N tensors"`` if it counted any during them: empty when they were clean
    (:meth:`profiling.trace.memory.LiveTensorTracker.active_instrumentation`)."""
    cuda_max_allocated_bytes: int | None = None
    """``device="cuda"``: ``torch.cuda.max_memory_allocated`` over the last iteration (reset at
    its start), next to the tracker's count; None on CPU."""
    losses: list[float] = field(default_factory=list)
    """Last stage only: each iteration's loss (mean over micro-batches) on this rank's data."""
    grads: dict[str, torch.Tensor] | None = None
    """With ``capture_grads``: the last iteration's gradients (after the pipeline's scaling and the
    data-parallel average, before the optimizer step), keyed by the full model's parameter name."""


@dataclass(kw_only=True, frozen=True)
class RunJob:
    """What every rank of one run is given (sent to each child process)."""

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
    engine: str = "torch"
    """torch (torch.distributed.pipelining, this module) or megatron (megatron-core,
    :mod:`profiling.executors.megatron`)."""
    deallocate_pipeline_outputs: bool = True
    """megatron engine: free a sent pipeline output's data at once (the plan's training option,
    Megatron-LM's setting by default)."""
    traced: bool = False
    """torch engine on a model that is not a zoo preset (``preset`` is then ``hf:NAME`` or
    ``package.module:factory``): cut by tracing, :mod:`profiling.executors.traced`."""
    threads: int | None = None
    """CPU threads per rank (``torch.set_num_threads``); None: ``cpu_count // world`` (at
    least 1). :func:`profiling.run.rank_threads` chooses it."""
    step_iterations: int = 1
    """Clean timed iterations after the measured ones (:func:`clean_steps`)."""


def grad_lifetime(plan: PlanFile) -> str:
    """The gradient lifetime a plan was made for (``TrainingConfig.grad_lifetime``): what the
    executor's ``optimizer.zero_grad`` runs; persistent for a plan without training options."""
    return "persistent" if plan.training is None else plan.training.grad_lifetime


def optimizer_impl(plan: PlanFile) -> str:
    """How the plan's optimizer step runs (``TrainingConfig.optimizer_impl``): what the
    executor's Adam is built with; fused (no step temporary) for a plan without training
    options, as plans written before the field are read."""
    return "fused" if plan.training is None else plan.training.optimizer_impl


def model_spec(preset: str, overrides: dict[str, Any]) -> models.ModelSpec:
    """The zoo model ``preset`` with ``overrides``; InputError if unknown or without layers."""
    try:
        spec = models.get(preset, **overrides)
    except ValueError as error:
        raise InputError(str(error)) from error
    if not spec.layers:
        raise InputError(f"model {preset}: no default layer list")
    return spec


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


def _sequence_shard(meta: torch.Tensor, tp: int) -> torch.Tensor:
    """The meta tensor of one rank's sequence shard of a [b, s, ...] boundary tensor."""
    shape = (meta.shape[0], meta.shape[1] // tp, *meta.shape[2:])
    return torch.empty(shape, dtype=meta.dtype, device="meta", requires_grad=meta.requires_grad)


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
class Measured:
    """What the iterations measured on one rank."""

    peak_bytes: int
    breakdown: dict[str, int]
    iteration_ms: list[float]
    losses: list[float]
    cuda_peak: int | None
    grads: dict[str, torch.Tensor] | None
    step_ms: list[float] = field(default_factory=list)
    step_cpu_ms: list[float] = field(default_factory=list)
    step_instrumentation: list[str] = field(default_factory=list)


def place_rank(rank: int, job: RunJob) -> _Place:
    """The rank's mesh coordinates and device; sets its CPU threads (and CUDA device)."""
    config = job.plan.config
    replica, tp_rank = divmod(rank, config.tp)
    stage, dp_rank = divmod(replica, config.dp)
    torch.set_num_threads(job.threads or max(1, (os.cpu_count() or 1) // config.num_gpus))
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


def join_process_group(place: _Place, job: RunJob) -> None:
    """Join the run's process group: gloo, or NCCL on CUDA."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(job.master_port)
    dist.init_process_group(
        "nccl" if place.device.type == "cuda" else "gloo",
        rank=place.rank,
        world_size=job.plan.config.num_gpus,
        timeout=timedelta(seconds=job.timeout_s),
    )


def inject_fault(job: RunJob, place: _Place) -> None:
    """The test hook ``job.fault``: this rank raises, or hangs (its peers then wait in their
    receives), at the start of its iteration."""
    if job.fault and job.fault[0] == place.rank:
        if job.fault[1] == "hang":
            time.sleep(3600)
        raise RuntimeError(f"rank {place.rank}: injected failure (test hook)")


def init_mesh(place: _Place, job: RunJob):
    """Join the process group and build the (pp, dp, tp) device mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    config = job.plan.config
    join_process_group(place, job)
    # Row-major over (pp, dp, tp): rank = (stage * dp + dp_rank) * tp + tp_rank.
    return init_device_mesh(
        place.device.type, (config.pp, config.dp, config.tp), mesh_dim_names=("pp", "dp", "tp")
    )


def _build_chunks(
    spec: models.ModelSpec, job: RunJob, place: _Place
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
            if config.sp:  # the stages send their [b, s/t, h] shard
                metas = {path: _sequence_shard(meta, config.tp) for path, meta in metas.items()}
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
    chunk: _Chunk, job: RunJob, place: _Place, mesh, vocab_sizes: dict[str, int], tracker
) -> tuple[_StageModule, nn.Module, dict[str, torch.Tensor]]:
    """Tensor parallelism, the stage module (with recompute), then data parallelism (DDP, ZeRO,
    FSDP2) on one chunk. Returns the stage module, what the PipelineStage runs and the TP
    regrouping orders of its parameters."""
    config = job.plan.config
    layer_paths = job.plan.virtual_stage_layers[chunk.index]
    orders: dict[str, torch.Tensor] = {}
    if config.tp > 1:
        orders = apply_tensor_parallel(
            chunk.model, layer_paths, mesh["tp"], vocab_sizes, sequence_parallel=config.sp
        )
    stage_module = _StageModule(chunk.model, chunk.run_paths, recompute=config.recompute == "full")
    layer_modules = [chunk.model.get_submodule(path) for path in layer_paths]
    submod = apply_data_parallel(stage_module, layer_modules, mesh, config.zero, place.device)
    tracker.track_module(stage_module)  # the shards are the weights now (TP, FSDP2)
    tracker.track_grads(stage_module)
    return stage_module, submod, orders


def _pipeline_stage(chunk: _Chunk, submod: nn.Module, job: RunJob, mesh, device: torch.device):
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
    chunks: list[_Chunk], pipeline_stages: list, spec: models.ModelSpec, job: RunJob, place: _Place
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


def _step_inputs(
    spec: models.ModelSpec, job: RunJob, place: _Place, iteration: int
) -> tuple[tuple, dict[str, Any], list[torch.Tensor]]:
    """The schedule's arguments for ``iteration`` on this rank: the input ids (first stage), the
    targets and the list the losses go to (last stage)."""
    config = job.plan.config
    rows = config.micro_batch * config.num_microbatches
    ids, targets = batch_for_iteration(
        spec, batch=rows * config.dp, seq=job.seq, seed=job.seed, iteration=iteration
    )
    local = slice(place.dp_rank * rows, (place.dp_rank + 1) * rows)
    args = (ids[local].to(place.device, copy=True),) if place.first else ()
    kwargs: dict[str, Any] = {}
    step_losses: list[torch.Tensor] = []
    if place.last:
        kwargs = {"target": targets[local].to(place.device, copy=True), "losses": step_losses}
    return args, kwargs, step_losses


def _iterate(
    schedule,
    optimizer,
    params: list,
    spec: models.ModelSpec,
    job: RunJob,
    place: _Place,
    tracker,
    *,
    sharded_logits: bool,
) -> tuple[list[float], list[float], int | None]:
    """Run ``job.iterations`` steps (schedule, then optimizer), resetting the peaks at the start
    of each. Returns the iteration times (ms), the losses (last rank) and the last CUDA peak."""
    device, cuda = place.device, place.device.type == "cuda"
    losses: list[float] = []
    iteration_ms: list[float] = []
    cuda_peak: int | None = None
    for iteration in range(job.iterations):
        args, kwargs, step_losses = _step_inputs(spec, job, place, iteration)
        # the plan's gradient lifetime: step frees every gradient (torch's default), persistent
        # keeps them as buffers (DDP keeps its buckets either way; the cost model knows)
        optimizer.zero_grad(set_to_none=grad_lifetime(job.plan) == "step")
        tracker.reset_peak()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        inject_fault(job, place)
        with tracker.saved_tensors(), _loss_parallel(sharded_logits):
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


def _loss_parallel(sharded_logits: bool):
    """``loss_parallel()`` for a vocabulary-parallel head's sharded logits, else nothing."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if sharded_logits else contextlib.nullcontext()


def clean_steps(
    prepare: Callable[[int], Callable[[], None]], job: RunJob, place: _Place, tracker
) -> tuple[list[float], list[float], list[str]]:
    """Time ``job.step_iterations`` training steps with the memory instrumentation off.

    Call after the instrumented iterations, outside the tracker's mode: the tracker is closed
    first (:meth:`profiling.trace.memory.LiveTensorTracker.close`: no gradient or optimizer hooks,
    no weak references on storages), and nothing runs under saved-tensor hooks. For iteration
    ``job.iterations + k``, ``prepare(iteration)`` does the untimed work (inputs, zeroing the
    gradients) and returns the step (schedule + optimizer); every rank enters it after a barrier
    (and a CUDA synchronise), and the step time is the slowest rank's (an all-reduce of the
    max), so it is the pipeline's wall time, not one stage's share. Returns the step times (ms,
    the same on every rank), this rank's CPU time in each (``time.process_time``, ms) and what
    was found instrumented around them (empty: clean)."""
    import torch.distributed as dist

    tracker.close()
    cuda = place.device.type == "cuda"
    step_ms: list[float] = []
    cpu_ms: list[float] = []
    found: list[str] = []
    for k in range(job.step_iterations):
        step = prepare(job.iterations + k)
        found += [name for name in tracker.active_instrumentation() if name not in found]
        tracked = tracker.num_tracked
        if cuda:
            torch.cuda.synchronize(place.device)
        dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        step()
        if cuda:
            torch.cuda.synchronize(place.device)
        elapsed = torch.tensor([(time.perf_counter() - started) * 1e3], dtype=torch.float64)
        cpu_ms.append((time.process_time() - cpu_started) * 1e3)
        found += [name for name in tracker.active_instrumentation() if name not in found]
        if tracker.num_tracked != tracked:
            found.append(f"tracker counted {tracker.num_tracked - tracked} tensors")
        elapsed = elapsed.to(place.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        step_ms.append(float(elapsed.item()))
    return step_ms, cpu_ms, found


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
    chunks: list[_Chunk], spec: models.ModelSpec, job: RunJob, place: _Place, mesh, vocab_sizes
) -> Measured:
    """Parallelize the chunks, build the schedule and the optimizer, train, and measure the live
    tensors from before the wrappers on (the peak of the last iteration)."""
    from profiling.trace.memory import LiveTensorTracker

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
        optimizer = build_optimizer(
            params, mesh, config.zero, lr=LEARNING_RATE, impl=optimizer_impl(job.plan)
        )
        tracker.track_optimizer(getattr(optimizer, "optim", optimizer))  # ZeRO-1: the local Adam
        iteration_ms, losses, cuda_peak = _iterate(
            schedule, optimizer, params, spec, job, place, tracker, sharded_logits=sharded_logits
        )
        peak_bytes, breakdown = tracker.peak_bytes, dict(tracker.peak_breakdown)
        grads = _gradients(chunks, orders) if job.capture_grads else None

    def prepare(iteration: int) -> Callable[[], None]:
        args, kwargs, _ = _step_inputs(spec, job, place, iteration)
        optimizer.zero_grad(set_to_none=grad_lifetime(job.plan) == "step")

        def step() -> None:
            with _loss_parallel(sharded_logits):
                schedule.step(*args, **kwargs, return_outputs=False)
            optimizer.step()

        return step

    step_ms, step_cpu_ms, step_instrumentation = clean_steps(prepare, job, place, tracker)
    return Measured(
        peak_bytes=peak_bytes,
        breakdown=breakdown,
        iteration_ms=iteration_ms,
        losses=losses,
        cuda_peak=cuda_peak,
        grads=grads,
        step_ms=step_ms,
        step_cpu_ms=step_cpu_ms,
        step_instrumentation=step_instrumentation,
    )


def _rank_main(rank: int, job: RunJob) -> RankReport:
    """One rank: place it, join the mesh, build its chunks, train and measure, and report next
    to the plan's prediction for its stage."""
    place = place_rank(rank, job)
    mesh = init_mesh(place, job)
    spec = model_spec(job.preset, job.overrides)
    chunks, vocab_sizes = _build_chunks(spec, job, place)
    return rank_report(place, job, _train_and_measure(chunks, spec, job, place, mesh, vocab_sizes))


def rank_report(place: _Place, job: RunJob, measured: Measured) -> RankReport:
    """What a rank measured, next to the plan's prediction for its stage."""
    stage = job.plan.stages[place.stage]
    predicted = stage.peak_bytes
    peak_bytes = measured.peak_bytes
    return RankReport(
        rank=place.rank,
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
        step_ms=measured.step_ms,
        step_cpu_ms=measured.step_cpu_ms,
        threads=torch.get_num_threads(),
        step_instrumentation=measured.step_instrumentation,
        cuda_max_allocated_bytes=measured.cuda_peak,
        losses=measured.losses,
        grads=measured.grads,
    )


def rank_worker(rank: int, job: RunJob, result_dir: str) -> None:
    """Child entry point: write ``rank{r}.pt`` (the report) or ``rank{r}.err`` and exit non-zero.
    Ctrl-C is the parent's to handle (it stops every rank); a rank ends with its parent even
    when the parent is killed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    directory = Path(result_dir)
    try:
        if job.engine == "megatron":
            from profiling.executors.megatron import megatron_rank_main

            report = megatron_rank_main(rank, job)
        elif job.traced:
            from profiling.executors.traced import traced_rank_main

            report = traced_rank_main(rank, job)
        else:
            report = _rank_main(rank, job)
        torch.save(report, directory / f"rank{rank}.tmp")
        os.replace(directory / f"rank{rank}.tmp", directory / f"rank{rank}.pt")
        import torch.distributed as dist

        dist.barrier()  # nobody tears down gloo while a peer still talks to it
        dist.destroy_process_group()
    except InputError as error:  # the plan or model, found wrong on this rank: one line
        (directory / f"rank{rank}.input").write_text(str(error))
        os._exit(1)
    except BaseException:
        (directory / f"rank{rank}.err").write_text(f"{time.time()}\n{traceback.format_exc()}")
        os._exit(1)  # skip atexit and gloo teardown: peers may be gone or stuck
