"""One rank of a plan's real run of a zoo model on torch.distributed.pipelining (the torch engine,
``profiling.run.run_plan(engine="torch")`` on a ``models`` preset): build this rank's chunks of
the model, apply its tensor and data parallelism, train ``iterations`` steps with
``PipelineStage`` and Adam, and report the live-tensor peak of the last one next to the plan's
prediction; then time ``step_iterations`` more steps with the memory instrumentation off
(:func:`profiling.executors.base.clean_steps`). How the run works as a whole:
:mod:`profiling.run`."""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import models
from profiling.executors.base import (
    LEARNING_RATE,
    ActionRecorder,
    Measured,
    Place,
    RankReport,
    RunJob,
    batch_for_iteration,
    build_model,
    grad_lifetime,
    init_mesh,
    inject_fault,
    model_spec,
    optimizer_impl,
    place_rank,
    rank_report,
    with_clean_steps,
)
from profiling.executors.parallelize import (
    apply_data_parallel,
    apply_tensor_parallel,
    build_optimizer,
    vocabulary_parallel_paths,
    vocabulary_sizes,
)
from profiling.executors.tied import TiedGradSync, TiedParameter, tied_parameters
from solver.errors import InputError
from solver.parallel import rank_stages


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
    # A view, no copy: after a split backward's input step (stage_backward_input) the last
    # stage detaches its output in place (torch 2.13, ``backward_one_chunk``), and the head,
    # whose weights' step (W) comes later, saved it; a view is left alone.
    output = output.view_as(output)
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


def _keep_layers(model: nn.Module, all_layers: list[str], keep: list[str]) -> dict[str, str]:
    """Drop every layer not in ``keep`` (the module slot becomes None). A parameter that a kept
    and a dropped layer share (tied weights) stays: this chunk's copy
    (:mod:`profiling.executors.tied`). Returns the kept parameters' full-model names by their
    names in the chunk (a tied head's weight is named as the embedding it copies)."""
    full_names = {id(param): name for name, param in model.named_parameters()}
    owner = {id(param) for path in all_layers for param in model.get_submodule(path).parameters()}
    loose = [name for name, param in model.named_parameters() if id(param) not in owner]
    if loose:
        raise InputError(f"parameters outside every layer: {', '.join(loose[:5])}")
    for path in all_layers:
        if path not in keep:
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name, None)
    return {name: full_names[id(param)] for name, param in model.named_parameters()}


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
    full_names: dict[str, str]
    """The full-model name of each of the chunk's parameters, by its name in the chunk."""


def _build_chunks(
    spec: models.ModelSpec, job: RunJob, place: Place
) -> tuple[list[_Chunk], dict[str, int], list[TiedParameter]]:
    """The rank's chunks on its device, the full model's vocabulary sizes and its parameters
    tied across pipeline ranks.

    One model per chunk (virtual stage chunk * pp + stage), each from the same seed and keeping
    only the chunk's layers, so that a chunk's module (and its DDP) owns exactly its parameters.
    Without interleaving: one chunk, the rank's stage; in a V (zbv, dualpipev) rank r holds
    virtual stages r and 2 pp - 1 - r (``solver.parallel.rank_stages``)."""
    config = job.plan.config
    held = rank_stages(config.schedule, config.pp, config.virtual_stages, place.stage)
    virtual = job.plan.virtual_stage_layers
    head_path = spec.layers[-1]
    # static stage metadata: one micro-batch's input and output shapes
    example_ids, _ = batch_for_iteration(
        spec, batch=config.micro_batch, seq=job.seq, seed=job.seed, iteration=0
    )
    ids_meta = torch.empty(example_ids.shape, dtype=example_ids.dtype, device="meta")
    chunks: list[_Chunk] = []
    for index in held:
        model = build_model(spec, job.seed)
        if not chunks:
            # of the full model: a stage may hold only the head
            vocab_sizes = vocabulary_sizes(model)
            tied = tied_parameters(model, virtual, config.pp, config.schedule)
            metas = boundary_metas(model, spec, example_ids)
            if config.sp:  # the stages send their [b, s/t, h] shard
                metas = {path: _sequence_shard(meta, config.tp) for path, meta in metas.items()}
        run_paths = [path for path in virtual[index] if path != head_path]
        stage_input = ids_meta if index == 0 else metas[virtual[index - 1][-1]]
        stage_output = metas[run_paths[-1]] if run_paths else stage_input
        full_names = _keep_layers(model, spec.layers, virtual[index])
        model.to(place.device)
        chunks.append(
            _Chunk(
                index=index,
                model=model,
                run_paths=run_paths,
                stage_input=stage_input,
                stage_output=stage_output,
                full_names=full_names,
            )
        )
    return chunks, vocab_sizes, tied


def _parallelize(
    chunk: _Chunk, job: RunJob, place: Place, mesh, vocab_sizes: dict[str, int], tracker
) -> tuple[_StageModule, nn.Module, dict[str, list[int]]]:
    """Tensor parallelism, the stage module (with recompute), then data parallelism (DDP, ZeRO,
    FSDP2) on one chunk. Returns the stage module, what the PipelineStage runs and the TP
    regrouping orders of its parameters."""
    config = job.plan.config
    layer_paths = job.plan.virtual_stage_layers[chunk.index]
    orders: dict[str, list[int]] = {}
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


SCHEDULE_CLASSES = {
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""torch's class of each split-backward schedule (``solver.parallel.ZERO_BUBBLE_SCHEDULES``):
its ``pipeline_order`` is ``solver.costs.schedule_orders.pipeline_order``
(tests/test_schedule_orders.py); zbv and dualpipev place the stages in a V themselves
(``generate_stage_to_rank_mapping(style="v")``)."""


def _schedule(
    chunks: list[_Chunk], pipeline_stages: list, spec: models.ModelSpec, job: RunJob, place: Place
):
    """The plan's schedule over the rank's stages (torch's own class for each name: 1F1B, GPipe,
    interleaved 1F1B, and the split-backward ``SCHEDULE_CLASSES``); the head runs in loss_fn on
    the rank holding the last stage."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    config = job.plan.config
    head = chunks[-1].model.get_submodule(spec.layers[-1]) if place.last else None
    # loss_fn on every rank: without it the first stage skips backward (and deadlocks).
    loss_fn = functools.partial(_head_loss, head, config.recompute == "full")
    if config.schedule in SCHEDULE_CLASSES:
        import torch.distributed.pipelining as pipelining

        schedule_class = getattr(pipelining, SCHEDULE_CLASSES[config.schedule])
        return schedule_class(
            pipeline_stages, n_microbatches=config.num_microbatches, loss_fn=loss_fn
        )
    if len(chunks) > 1:
        return ScheduleInterleaved1F1B(
            pipeline_stages, n_microbatches=config.num_microbatches, loss_fn=loss_fn
        )
    schedule_class = Schedule1F1B if config.schedule == "1f1b" else ScheduleGPipe
    return schedule_class(
        pipeline_stages[0], n_microbatches=config.num_microbatches, loss_fn=loss_fn
    )


def _step_inputs(
    spec: models.ModelSpec, job: RunJob, place: Place, iteration: int
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
    place: Place,
    tracker,
    *,
    sharded_logits: bool,
    sync_tied: Callable[[], None],
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
        sync_tied()  # the tied copies' gradients summed, before the step
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


def _gradients(chunks: list[_Chunk], orders: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The full gradients of the rank's parameters on CPU, in the single-process layout."""
    grads = {}
    for chunk in chunks:
        for name, param in chunk.model.named_parameters():
            if param.grad is not None:
                grad = _full(param.grad).detach().cpu()
                if name in orders:  # undo the per-head regrouping
                    grad = grad[torch.argsort(torch.tensor(orders[name]))]
                grads[chunk.full_names[name]] = grad.clone()
    return grads


def _tied_sync(
    chunks: list[_Chunk], tied: list[TiedParameter], job: RunJob, place: Place
) -> TiedGradSync:
    """The all-reduce of the rank's tied copies' gradients (after the parallel wrappers, whose
    parameters the copies are now)."""
    copies: dict[str, list[nn.Parameter]] = {}
    names = {item.name for item in tied}
    for chunk in chunks:
        for name, param in chunk.model.named_parameters():
            if chunk.full_names[name] in names:
                copies.setdefault(chunk.full_names[name], []).append(param)
    config = job.plan.config
    return TiedGradSync(
        tied,
        copies,
        stage=place.stage,
        dp_rank=place.dp_rank,
        tp_rank=place.tp_rank,
        dp=config.dp,
        tp=config.tp,
    )


def _train_and_measure(
    chunks: list[_Chunk],
    spec: models.ModelSpec,
    job: RunJob,
    place: Place,
    mesh,
    vocab_sizes,
    tied: list[TiedParameter],
) -> Measured:
    """Parallelize the chunks, build the schedule and the optimizer, train, and measure the live
    tensors from before the wrappers on (the peak of the last iteration)."""
    from profiling.trace.memory import LiveTensorTracker

    config = job.plan.config
    tracker = LiveTensorTracker()
    for chunk in chunks:
        tracker.track_module(chunk.model)
    orders: dict[str, list[int]] = {}
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
        sync_tied = _tied_sync(chunks, tied, job, place)
        recorder = ActionRecorder(pipeline_stages, tracker)
        iteration_ms, losses, cuda_peak = _iterate(
            schedule,
            optimizer,
            params,
            spec,
            job,
            place,
            tracker,
            sharded_logits=sharded_logits,
            sync_tied=sync_tied,
        )
        measured = Measured.at_peak(
            tracker, iteration_ms=iteration_ms, losses=losses, cuda_peak=cuda_peak
        )
        measured.action_bytes = recorder.last_iteration(job.iterations)
        recorder.remove()
        if job.capture_grads:  # gathered after the peak is read
            measured.grads = _gradients(chunks, orders)

    def prepare(iteration: int) -> Callable[[], None]:
        args, kwargs, _ = _step_inputs(spec, job, place, iteration)
        optimizer.zero_grad(set_to_none=grad_lifetime(job.plan) == "step")

        def step() -> None:
            with _loss_parallel(sharded_logits):
                schedule.step(*args, **kwargs, return_outputs=False)
            sync_tied()
            optimizer.step()

        return step

    return with_clean_steps(measured, prepare, job, place, tracker)


def zoo_rank_main(rank: int, job: RunJob) -> RankReport:
    """One rank: place it, join the mesh, build its chunks, train and measure, and report next
    to the plan's prediction for its stage."""
    place = place_rank(rank, job)
    mesh = init_mesh(place, job)
    spec = model_spec(job.preset, job.overrides)
    chunks, vocab_sizes, tied = _build_chunks(spec, job, place)
    measured = _train_and_measure(chunks, spec, job, place, mesh, vocab_sizes, tied)
    return rank_report(place, job, measured)
