"""What every executor's rank shares (:mod:`profiling.executors.torch_zoo`,
:mod:`profiling.executors.traced`, :mod:`profiling.executors.megatron`): the job it is given
(:class:`RunJob`), its place in the ``(pp, dp, tp)`` mesh and the process group it joins, the
global batch of an iteration, the test hook that fails a rank, the clean timed steps after the
instrumented ones (:func:`clean_steps`, with the live-tensor tracker closed) and the report next
to the plan's prediction (:class:`RankReport`). Which executor runs a job:
:mod:`profiling.executors.dispatch`; how the run works as a whole: :mod:`profiling.run`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

import models
from profiling.trace.memory import write_peak_tags
from solver.errors import InputError
from solver.files.plan_file import PlanFile
from solver.parallel import rank_stages

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
    action_bytes: list[int] = field(default_factory=list)
    """The peak live bytes of the last instrumented iteration up to the end of each of the rank's
    schedule actions, in the order it ran them (``ActionRecorder``; the plan's
    ``schedule_actions`` order); empty where the engine does not record them (megatron)."""


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


WEIGHT_DTYPES = {2: torch.bfloat16, 4: torch.float32}
"""Weights' dtype by the plan's weight bytes per parameter (the megatron and traced executors)."""


def weight_dtype(plan: PlanFile, *, runs: str, advice: str) -> tuple[int, torch.dtype]:
    """(weight bytes per parameter, dtype): bf16 for a plan with 2, fp32 for 4 (and for a plan
    without training options); else InputError "``runs`` bf16 (2) or fp32 (4) weights;
    ``advice``"."""
    training = plan.training
    weight_bytes = training.weight_bytes_per_param if training is not None else 4
    if weight_bytes not in WEIGHT_DTYPES:
        raise InputError(
            f"{plan.source}: weight_bytes_per_param {weight_bytes}: {runs} bf16 (2) or fp32 (4) "
            f"weights; {advice}"
        )
    return weight_bytes, WEIGHT_DTYPES[weight_bytes]


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


@dataclass(kw_only=True, frozen=True)
class Place:
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
class Measured:
    """What the iterations measured on one rank."""

    peak_bytes: int
    breakdown: dict[str, int]
    iteration_ms: list[float]
    losses: list[float]
    cuda_peak: int | None
    grads: dict[str, torch.Tensor] | None = None
    step_ms: list[float] = field(default_factory=list)
    step_cpu_ms: list[float] = field(default_factory=list)
    step_instrumentation: list[str] = field(default_factory=list)
    action_bytes: list[int] = field(default_factory=list)

    @classmethod
    def at_peak(
        cls,
        tracker,
        *,
        iteration_ms: list[float],
        losses: list[float],
        cuda_peak: int | None,
        grads: dict[str, torch.Tensor] | None = None,
    ) -> Measured:
        """The tracker's peak now (bytes, and by category) with what the iterations recorded
        (and, with ``MEMPLAN_PEAK_TAGS``, the storages live at it written out)."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        write_peak_tags(tracker, rank)
        return cls(
            peak_bytes=tracker.peak_bytes,
            breakdown=dict(tracker.peak_breakdown),
            iteration_ms=iteration_ms,
            losses=losses,
            cuda_peak=cuda_peak,
            grads=grads,
        )


def place_rank(rank: int, job: RunJob) -> Place:
    """The rank's mesh coordinates and device; sets its CPU threads (and CUDA device)."""
    config = job.plan.config
    replica, tp_rank = divmod(rank, config.tp)
    stage, dp_rank = divmod(replica, config.dp)
    torch.set_num_threads(job.threads or max(1, (os.cpu_count() or 1) // config.num_gpus))
    cuda = job.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # the virtual stages it holds: loop placement, or a V (rank 0 holds the first and the last)
    held = rank_stages(config.schedule, config.pp, config.virtual_stages, stage)
    return Place(
        rank=rank,
        stage=stage,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        first=0 in held,
        last=config.pp * config.virtual_stages - 1 in held,
        device=device,
    )


def join_process_group(place: Place, job: RunJob) -> None:
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


def inject_fault(job: RunJob, place: Place) -> None:
    """The test hook ``job.fault``: this rank raises, or hangs (its peers then wait in their
    receives), at the start of its iteration."""
    if job.fault and job.fault[0] == place.rank:
        if job.fault[1] == "hang":
            time.sleep(3600)
        raise RuntimeError(f"rank {place.rank}: injected failure (test hook)")


def init_mesh(place: Place, job: RunJob):
    """Join the process group and build the (pp, dp, tp) device mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    config = job.plan.config
    join_process_group(place, job)
    # Row-major over (pp, dp, tp): rank = (stage * dp + dp_rank) * tp + tp_rank.
    return init_device_mesh(
        place.device.type, (config.pp, config.dp, config.tp), mesh_dim_names=("pp", "dp", "tp")
    )


def clean_steps(
    prepare: Callable[[int], Callable[[], None]], job: RunJob, place: Place, tracker
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


def with_clean_steps(
    measured: Measured,
    prepare: Callable[[int], Callable[[], None]],
    job: RunJob,
    place: Place,
    tracker,
) -> Measured:
    """Every executor's ending: ``measured`` with the clean timed iterations after the
    instrumented ones (:func:`clean_steps`; ``prepare`` as there)."""
    measured.step_ms, measured.step_cpu_ms, measured.step_instrumentation = clean_steps(
        prepare, job, place, tracker
    )
    return measured


def rank_report(place: Place, job: RunJob, measured: Measured) -> RankReport:
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
        action_bytes=measured.action_bytes,
    )


ACTION_METHODS = {
    "forward_one_chunk": "F",
    "backward_one_chunk": "B",
    "backward_weight_one_chunk": "W",
}
"""The ``PipelineStage`` methods every torch.distributed.pipelining schedule runs an action
with, and the action each is (a split backward's input-gradient step is B)."""


class ActionRecorder:
    """The live-tensor peak up to the end of every schedule action of the rank's pipeline stages
    (``LiveTensorTracker.take_window``), recorded by wrapping each stage's action methods on
    the instance for the instrumented iterations only (:meth:`remove` before the clean ones)."""

    def __init__(self, stages: list, tracker) -> None:
        self.kinds: list[str] = []
        self.bytes: list[int] = []
        self._stages = stages
        for stage in stages:
            for method, kind in ACTION_METHODS.items():
                if hasattr(stage, method):
                    setattr(stage, method, self._recording(getattr(stage, method), kind, tracker))

    def _recording(self, run: Callable, kind: str, tracker) -> Callable:
        def recorded(*args, **kwargs):
            result = run(*args, **kwargs)
            self.kinds.append(kind)
            self.bytes.append(tracker.take_window())
            return result

        return recorded

    def last_iteration(self, iterations: int) -> list[int]:
        """The last of ``iterations`` equal iterations' values (each runs the same actions)."""
        per_iteration = len(self.bytes) // max(1, iterations)
        return self.bytes[len(self.bytes) - per_iteration :]

    def remove(self) -> None:
        """Restore the stages' own methods."""
        for stage in self._stages:
            for method in ACTION_METHODS:
                stage.__dict__.pop(method, None)
