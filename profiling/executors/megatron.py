"""One rank of a plan's real run on megatron-core (``profiling.run.run_plan(engine="megatron")``).

The rank joins gloo, initialises megatron-core's model-parallel state (its rank order
``tp-cp-ep-dp-pp`` is the executor's: ``rank = (stage * dp + dp_rank) * tp + tp_rank``; the
export's expert-parallel size groups ep consecutive data-parallel ranks), builds
its ``GPTModel`` chunks from the plan's Megatron export
(:mod:`profiling.executors.megatron_model`), checks
that they hold exactly the plan's layers, and trains ``iterations`` steps the way Megatron-LM's
``train_step`` does: ``Float16Module`` for bf16, Megatron's ``DistributedDataParallel`` (its
contiguous gradient buffer, fp32 ``main_grad`` with bf16 as Megatron-LM's
``accumulate_allreduce_grads_in_fp32``), ``get_megatron_optimizer`` (Adam; the distributed
optimizer with ``--use-distributed-optimizer``), ``finalize_model_grads`` and
``get_forward_backward_func`` (1F1B, or interleaved 1F1B with virtual stages). The live-tensor
tracker (:class:`profiling.trace.memory.LiveTensorTracker`) counts from before the wrappers on; the
last iteration's peak is reported next to the plan's prediction, and ``step_iterations`` more steps
are timed with it switched off (:func:`profiling.executors.base.clean_steps`). CUDA assumptions are
bypassed by :mod:`profiling.executors.megatron_cpu` only.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from profiling.executors.base import (
    LEARNING_RATE,
    Measured,
    RankReport,
    RunJob,
    batch_for_iteration,
    inject_fault,
    join_process_group,
    model_spec,
    place_rank,
    rank_report,
    weight_dtype,
    with_clean_steps,
)
from profiling.executors.megatron_cpu import megatron_on_cpu, quiet_fallback_warnings
from profiling.executors.megatron_hf import (
    check_layer_params,
    hf_batch,
    megatron_hf_spec,
    plan_implementation,
)
from profiling.executors.megatron_model import (
    build_chunks,
    chunk_layers,
    global_name,
    init_weights,
    megatron_settings,
    transformer_config,
)
from profiling.export import resolve_spec
from profiling.trace.memory import LiveTensorTracker
from solver.errors import InputError
from solver.files.plan_file import PlanFile


def plan_dtype_of(plan: PlanFile) -> torch.dtype:
    """bf16 for a plan with 2 weight bytes per parameter, fp32 for 4."""
    _, dtype = weight_dtype(
        plan,
        runs="the megatron engine runs",
        advice="plan with --bytes-per-param 2,4,12 or 4,4,8",
    )
    return dtype


def _check_layers(chunks, spec, job: RunJob, stage: int) -> None:
    """The export built exactly the plan's layers on this rank (else the export is wrong); an
    hf: model's Megatron modules stand for the graph's HF layers (``megatron_hf``)."""
    config = job.plan.config
    planned = [job.plan.virtual_stage_layers[c * config.pp + stage] for c in range(len(chunks))]
    megatron = spec.meta.get("megatron", {})
    hf_names = megatron.get("layer_names") if megatron.get("implementation") != "megatron" else None
    built = [chunk_layers(chunk, hf_names) for chunk in chunks]
    if built != planned:
        raise InputError(
            f"{job.plan.source}: exports.megatron builds layers {built} on pipeline rank {stage}, "
            f"but the plan's stages hold {planned}"
        )


def _wrap(chunks, tconfig, settings, dtype: torch.dtype):
    """Float16Module (bf16) and Megatron's DistributedDataParallel around every chunk."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype != torch.float32,
        use_distributed_optimizer=settings.distributed_optimizer,
        overlap_grad_reduce=False,
    )
    wrapped = []
    for index, chunk in enumerate(chunks):
        module = Float16Module(tconfig, chunk) if dtype != torch.float32 else chunk
        wrapped.append(
            DistributedDataParallel(
                tconfig,
                ddp_config,
                module,
                disable_bucketing=index > 0,  # as Megatron-LM
            )
        )
    return wrapped


def _optimizer(wrapped, settings, dtype: torch.dtype):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=LEARNING_RATE,
        weight_decay=0.0,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=settings.distributed_optimizer,
    )
    return get_megatron_optimizer(optimizer_config, wrapped)


def _track_training_state(tracker: LiveTensorTracker, wrapped, optimizer) -> None:
    """Tag what the wrappers and the optimizer allocated: parameters (a distributed optimizer's
    DDP moves them into one buffer), the gradient buffers, fp32 master copies and Adam state."""
    for ddp in wrapped:
        tracker.track_module(ddp.module)  # (Megatron's DDP names its gradient buffers buffers)
        for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers]:
            tracker.track(buffer.grad_data, "grads")
            if buffer.param_data is not None:
                tracker.track(buffer.param_data, "params")
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            for param in group["params"]:  # master copies; a model weight stays a weight
                tracker.track(param, "optimizer")
        tracker.track_optimizer(torch_optimizer)


def _micro_batches(spec, job: RunJob, place, iteration: int, chunk) -> list[dict]:
    """This data-parallel rank's micro-batches of the iteration's global batch, as ``chunk``
    reads them: token ids and positions on the first virtual stage, labels on the last, nothing
    in between (Megatron-LM's ``get_batch``)."""
    config = job.plan.config
    rows = config.micro_batch * config.num_microbatches
    ids, targets = batch_for_iteration(
        spec, batch=rows * config.dp, seq=job.seq, seed=job.seed, iteration=iteration
    )
    mask = None
    if job.traced:  # an hf: model's ids and (unshifted) labels: shifted here, the last masked
        targets, mask = hf_batch(ids)
    b, seq = config.micro_batch, ids.shape[1]
    batches = []
    for i in range(config.num_microbatches):
        start = place.dp_rank * rows + i * b
        batch = {}
        if chunk.pre_process:
            batch["tokens"] = ids[start : start + b].clone()
            batch["position_ids"] = torch.arange(seq).expand(b, seq)
        if chunk.post_process:
            batch["labels"] = targets[start : start + b].clone()
            if mask is not None:
                batch["loss_mask"] = mask[start : start + b].clone()
        batches.append(batch)
    return batches


def _forward_step(data_iterator, model):
    """Megatron's forward_step_func: the chunk's forward and the mean per-token loss."""
    batch = next(data_iterator)
    output = model(batch.get("tokens"), batch.get("position_ids"), None, labels=batch.get("labels"))
    mask = batch.get("loss_mask")

    def loss_func(per_token_loss: torch.Tensor):
        """The mean per-token loss (of the unmasked tokens, with a loss mask)."""
        if mask is None:
            loss = per_token_loss.float().mean()
        else:
            loss = (per_token_loss.float() * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach().clone()}  # the schedule divides loss in place

    return output, loss_func


def _full_gradients(wrapped, settings, gated: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (``main_grad``) in the single-GPU layout, by global name: the
    distributed optimizer's reduce-scattered shards are gathered over dp first (a routed
    expert's over the expert-data-parallel group, dp / ep ranks), tensor-parallel partitions
    over tp. A rank reports the routed experts it holds, under their global indices."""
    from megatron.core import parallel_state

    if settings.distributed_optimizer:
        dense_group = parallel_state.get_data_parallel_group()
        expert_group = parallel_state.get_expert_data_parallel_group()
        for ddp in wrapped:
            for buffers, group in (
                (ddp.buffers, dense_group),
                (ddp.expert_parallel_buffers, expert_group),
            ):
                size, rank = dist.get_world_size(group), dist.get_rank(group)
                for buffer in buffers:
                    for bucket in buffer.buckets:
                        shard = bucket.grad_data.view(size, -1)[rank].clone()
                        dist.all_gather_into_tensor(bucket.grad_data, shard, group=group)
    tp, tp_group = settings.tp, parallel_state.get_tensor_model_parallel_group()
    grads = {}
    for ddp in wrapped:
        chunk = ddp.module.module if hasattr(ddp.module, "module") else ddp.module
        for local, param in chunk.named_parameters():
            grad = param.main_grad.detach().float()
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(grad) for _ in range(tp)]
                dist.all_gather(parts, grad.contiguous(), group=tp_group)
                grad = _unpartition(local, parts, param.partition_dim, gated)
            grads[global_name(chunk, local)] = grad.clone()
    return grads


def _unpartition(name: str, parts: list[torch.Tensor], dim: int, gated: bool) -> torch.Tensor:
    """Inverse of :func:`profiling.executors.megatron_model.partition`."""
    if gated and ".linear_fc1." in name:
        halves = [part.chunk(2, dim=dim) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    return torch.cat(parts, dim)


def _build(spec, job: RunJob, place, settings, dtype: torch.dtype):
    """megatron-core's parallel state and this rank's chunks, checked against the plan and
    initialised from the seed; returns (TransformerConfig, chunks)."""
    from megatron.core import parallel_state

    tconfig = transformer_config(
        spec, settings, dtype=dtype, deallocate_pipeline_outputs=job.deallocate_pipeline_outputs
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=settings.tp,
        pipeline_model_parallel_size=settings.pp,
        virtual_pipeline_model_parallel_size=tconfig.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=tconfig.expert_model_parallel_size,
    )
    torch.manual_seed(job.seed)
    chunks = build_chunks(spec, tconfig)
    _check_layers(chunks, spec, job, place.stage)
    if job.traced:
        check_layer_params(chunks, spec, tp=settings.tp, ep=tconfig.expert_model_parallel_size)
    gated = spec.config.mlp == "swiglu"
    init_weights(chunks, seed=job.seed, tp=settings.tp, tp_rank=place.tp_rank, gated=gated)
    return tconfig, chunks


def _train_and_measure(spec, job: RunJob, place, settings, dtype, tconfig, chunks) -> Measured:
    """Wrap the chunks (Float16Module, DDP), build the optimizer and train ``job.iterations``
    steps as Megatron-LM's ``train_step``, measuring the live tensors from before the wrappers
    on (the peak of the last iteration)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = job.plan.config
    tracker = LiveTensorTracker()
    for chunk in chunks:
        tracker.track_module(chunk)
    losses: list[float] = []
    iteration_ms: list[float] = []
    with tracker:
        wrapped = _wrap(chunks, tconfig, settings, dtype)
        optimizer = _optimizer(wrapped, settings, dtype)
        _track_training_state(tracker, wrapped, optimizer)
        tconfig.finalize_model_grads_func = finalize_model_grads
        forward_backward = get_forward_backward_func()
        interleaved = len(wrapped) > 1

        def zeroed_batches(iteration: int) -> list:
            """The iteration's micro-batch iterators (one per chunk), gradients zeroed."""
            data = [iter(_micro_batches(spec, job, place, iteration, c)) for c in chunks]
            for ddp in wrapped:
                ddp.zero_grad_buffer()
            optimizer.zero_grad()
            return data

        def schedule(data: list) -> list:
            """One pass of megatron-core's pipeline schedule over the micro-batches; the last
            pipeline rank gets the losses."""
            return forward_backward(
                forward_step_func=_forward_step,
                data_iterator=data if interleaved else data[0],
                model=wrapped if interleaved else wrapped[0],
                num_microbatches=config.num_microbatches,
                seq_length=job.seq or spec.seq_len,
                micro_batch_size=config.micro_batch,
                forward_only=False,
            )

        for iteration in range(job.iterations):
            data = zeroed_batches(iteration)
            tracker.reset_peak()
            started = time.perf_counter()
            inject_fault(job, place)
            with tracker.saved_tensors():
                step_losses = schedule(data)
            optimizer.step()
            iteration_ms.append((time.perf_counter() - started) * 1e3)
            if step_losses:  # the last pipeline rank
                losses.append(float(torch.stack([x["loss"] for x in step_losses]).mean()))
        measured = Measured.at_peak(
            tracker, iteration_ms=iteration_ms, losses=losses, cuda_peak=None
        )
        # the main gradients outlive the step (zeroed at the next one): gathered after the
        # measurement
        gated = spec.config.mlp == "swiglu"
        if job.capture_grads:
            measured.grads = _full_gradients(wrapped, settings, gated)

    def prepare(iteration: int):
        data = zeroed_batches(iteration)

        def step() -> None:
            schedule(data)
            optimizer.step()

        return step

    return with_clean_steps(measured, prepare, job, place, tracker)


def megatron_rank_main(rank: int, job: RunJob) -> RankReport:
    """One rank of a megatron-core run: build, train, measure, and report next to the plan."""
    quiet_fallback_warnings()  # before megatron-core's first import
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as Megatron-LM's launch scripts
    place = place_rank(rank, job)
    settings = megatron_settings(job.plan)
    if job.traced:  # an hf: model, as GPTModel expresses it
        layers = [name for chunk in job.plan.virtual_stage_layers for name in chunk]
        spec = megatron_hf_spec(
            resolve_spec(job.preset, job.overrides), job.seq, plan_implementation(layers)
        )
    else:
        spec = model_spec(job.preset, job.overrides)
    dtype = plan_dtype_of(job.plan)
    join_process_group(place, job)
    with megatron_on_cpu():
        tconfig, chunks = _build(spec, job, place, settings, dtype)
        measured = _train_and_measure(spec, job, place, settings, dtype, tconfig, chunks)
    return rank_report(place, job, measured)
