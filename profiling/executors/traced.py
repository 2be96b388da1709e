"""One rank of a plan's real run on any profiled model (``hf:NAME``, ``package.module:factory``),
cut by tracing: what :func:`profiling.run.run_plan` runs for a model that is not a zoo preset.

The rank builds the whole model from the seed (in bf16 when the plan keeps 2 weight bytes per
parameter, else fp32), traces it with ``torch.distributed.pipelining.pipeline(module,
mb_args=one micro-batch, split_spec={first layer of each stage j > 0: SplitPoint.BEGINNING})``
(exactly what the plan's torch export tells users, ``solver.exports.torch_pipelining``), builds its
stage with ``pipe.build_stage(stage, device, group)`` and trains with ``Schedule1F1B`` /
``ScheduleGPipe`` and Adam (``profiling.executors.parallelize.build_optimizer`` with the plan's
``optimizer_impl``: foreach by default on the torch runtime, whose step temporary the plan
counts).

What is traced and where the loss runs (:func:`traceable`): with ``spec.loss_outside``
(``models.registry.LossOutside``: an HF model, say) the module returns the logits, the last stage
computes ``loss_fn(output, target)`` in the schedule's ``loss_fn`` and the targets go to
``schedule.step`` on the last rank; a spec without one traces ``build()`` itself, whose forward
returns the loss, and ``loss_fn`` is that output.

Inputs used after the first stage: the traced stages receive only activations, and pipelining
gives the model's inputs to the first stage alone (a later stage that reads one fails with
``PipeliningMetadataError``). That happens to the targets of a model that computes its own loss
and to T5's ``decoder_input_ids`` when the encoder is split. Such a module is traced again behind
a copy of its inputs (:func:`_copy_inputs_first`): the copies are made on the first stage and
sent, like activations, to the stages that read them (``b * s`` int64 per micro-batch: a receive
buffer per micro-batch on the reading stage, and on the first stage the copy itself, an output
kept until its micro-batch's backward; the first stage's layers then save the copies, and the
whole batch ``step()`` is given stays live beside them for the step: measured on T5 split in its
encoder, pp 3 GPipe m 8, 4 KiB of copies and 8 KiB of batch on rank 0, which the plan does not
count).

Masks and attention as an eager GPU run has them: tracing runs under
``_transformers_compat.traced_run_masks`` (transformers would otherwise materialise the causal
mask for the exported program, send it to every stage and hand SDPA an explicit mask, with K/V
copies per head on grouped-query models), and on a CPU the training step runs under
``cuda_attention.cuda_like_kernels`` (SDPA on the fused kernels a GPU picks, e.g. for T5's learned
position bias, instead of the CPU math fallback): what the profile counts.

Recompute ``"full"``: every planned layer's traced submodule runs under non-reentrant
``torch.utils.checkpoint`` (its forward is replaced on the traced stage, names unchanged).
A tied parameter used on two stages (an LM head sharing the embedding's table): ``pipeline()``
gives each stage its own copy (and leaves the original, unread, under the other alias on the
embedding's stage, which is dropped); the copies' gradients are summed over the holding ranks
before the step (:mod:`profiling.executors.tied`).
Gradients persist between steps (``zero_grad(set_to_none=False)``) unless the plan's training
section says ``grad_lifetime: "step"`` (then ``set_to_none=True``). Data parallelism
(dp > 1, ZeRO 0): DDP over each stage's traced module (gradients in its buckets, synced on the
last micro-batch). Supported: pp >= 1, dp >= 1 with ZeRO 0, tp = 1, no sequence parallelism,
recompute none or full, 1F1B or GPipe, fp32 or bf16
(:func:`check_traced_plan` says what else is refused, in the parent, before any process starts).
Memory is measured as for the zoo path (``profiling.trace.memory.LiveTensorTracker``, from the built
stage on).
"""

from __future__ import annotations

import copy
import functools
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
    RankReport,
    RunJob,
    batch_for_iteration,
    init_mesh,
    inject_fault,
    optimizer_impl,
    place_rank,
    rank_report,
    weight_dtype,
    with_clean_steps,
)
from profiling.executors.parallelize import build_optimizer
from profiling.executors.tied import TiedGradSync, TiedParameter
from profiling.executors.traced_boundaries import (
    check_no_gradient_skips,
    constant_aware_stage,
    make_boundaries_contiguous,
)
from profiling.trace.cuda_attention import cuda_like_kernels
from solver.errors import InputError
from solver.files.plan_file import PlanFile

# -- what is traced ----------------------------------------------------------------------------


@dataclass(kw_only=True)
class Traceable:
    """What the pipeline traces, what it is fed and how its loss is computed."""

    module: nn.Module
    """The module ``pipeline()`` traces (shares the built model's parameters)."""
    model_inputs: Callable[[tuple], tuple]
    """``spec.example_inputs(...)`` tuple -> the module's positional inputs."""
    target: Callable[[tuple], torch.Tensor] | None
    """Example tuple -> the target given to ``loss_fn``; None: the module returns the loss."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss_fn(last stage output, target micro-batch)`` -> scalar loss."""


def _output_is_loss(output: torch.Tensor, _target: Any) -> torch.Tensor:
    return output


def traceable(spec: models.ModelSpec, model: nn.Module) -> Traceable:
    """The spec's ``loss_outside`` applied to ``model``, or the model itself returning its loss."""
    make = getattr(spec, "loss_outside", None)
    if make is None:
        return Traceable(module=model, model_inputs=tuple, target=None, loss_fn=_output_is_loss)
    outside = make(model)
    return Traceable(
        module=outside.module,
        model_inputs=outside.model_inputs,
        target=outside.target,
        loss_fn=outside.loss_fn,
    )


def plan_dtype(plan: PlanFile) -> torch.dtype:
    """bf16 for a plan with 2 weight bytes per parameter, fp32 for 4; InputError otherwise, and
    when the plan's optimizer state is not in the weights' dtype (a mixed precision's fp32
    master copy and moments): traced runs train with torch.optim, whose states follow the
    weights (``--precision fp32`` or ``bf16``)."""
    from solver.precision import MOMENTS

    training = plan.training
    weight_bytes, dtype = weight_dtype(
        plan, runs="traced runs train", advice="plan with --precision bf16 or fp32"
    )
    if training is not None:
        states = weight_bytes * MOMENTS[training.optimizer]
        if training.optimizer_bytes_per_param != states or training.optimizer != "adam":
            raise InputError(
                f"{plan.source}: training: {training.optimizer} with "
                f"{training.optimizer_bytes_per_param} optimizer bytes per parameter: traced runs "
                f"train torch.optim.Adam, whose states take {states} bytes per parameter in the "
                "weights' dtype; plan with --precision fp32 or bf16 and --optimizer adam"
            )
    return dtype


def build_model(spec: models.ModelSpec, seed: int, dtype: torch.dtype) -> nn.Module:
    """The full model with weights from ``seed`` (built in fp32, then cast to ``dtype``): what
    every rank and a single-process reference build. A failing ``build()`` is an InputError."""
    torch.manual_seed(seed)
    try:
        model = spec.build()
    except Exception as error:  # the user's code: one line, not a traceback
        raise InputError(
            f"model {spec.name}: build() failed: {type(error).__name__}: {error}"
        ) from None
    return model.to(dtype)


# -- checks before any process starts (parent) -------------------------------------------------


def check_traced_plan(spec: models.ModelSpec, plan: PlanFile) -> None:
    """InputError naming the field unless a traced run can take ``plan`` on ``spec``: tp 1, no
    sequence or expert parallelism, no interleaving, ZeRO 0 over dp > 1, recompute none or
    full, bf16 or fp32 weights, every planned layer a module of the model and every parameter
    inside a planned layer. A parameter that layers of two stages share (tied weights) is held
    by each (:mod:`profiling.executors.tied`)."""
    config = plan.config
    problems = (
        (config.tp > 1, f"tp={config.tp}: traced models run with tp=1; plan with --tp 1"),
        (config.sp, "sp=true: traced models run without sequence parallelism"),
        (
            config.ep > 1,
            f"ep={config.ep}: traced models run every expert on every data-parallel rank; "
            "plan with --ep 1",
        ),
        (
            config.virtual_stages > 1,
            f"virtual_stages={config.virtual_stages}: traced models run one stage per rank; "
            "plan with --virtual-stages 1",
        ),
        (
            config.dp > 1 and config.zero != 0,
            f"zero={config.zero} with dp={config.dp}: traced models run data parallelism with "
            "DDP (zero 0); plan with --zero 0",
        ),
        (
            config.recompute not in ("none", "full"),
            f"recompute={config.recompute!r}: traced models run recompute none or full",
        ),
    )
    for failed, problem in problems:
        if failed:
            raise InputError(f"plan config: {problem}")
    plan_dtype(plan)
    with torch.device("meta"):  # shapes only
        model = build_model(spec, 0, torch.float32)
    stages = plan.virtual_stage_layers
    modules = dict(model.named_modules())
    missing = [name for layers in stages for name in layers if name not in modules]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise InputError(
            f"{plan.source}: layer(s) {shown} are not modules of {spec.name}; plan for this "
            f"model's graph (python -m profiling.export {spec.name})"
        )
    _check_parameter_owners(model, stages, plan.source)


def _check_parameter_owners(model: nn.Module, stages: list[list[str]], source: str) -> None:
    """Every parameter lies in a planned layer."""
    planned = {id(param) for layers in stages for layer in layers for param in
               model.get_submodule(layer).parameters()}  # fmt: skip
    loose = [name for name, param in model.named_parameters() if id(param) not in planned]
    if loose:
        raise InputError(
            f"{source}: parameters outside every planned layer: {', '.join(loose[:5])}; export "
            "the graph with layers that cover the whole model"
        )


# -- tracing (rank) ----------------------------------------------------------------------------


def _copy_inputs_first(module: nn.Module) -> nn.Module:
    """``module`` (same submodules, same names) whose forward first copies its inputs, so that
    the copies are made on the first stage and sent to whichever stage reads them."""
    base = type(module)

    def forward(self, *inputs):
        return base.forward(self, *(x.clone() for x in inputs))

    routed = copy.copy(module)  # shares _modules and _parameters
    routed.__class__ = type(base.__name__, (base,), {"forward": forward})
    return routed


def _inputs_read_late(pipe) -> list[str]:
    """Names of the model inputs that a stage after the first reads (pipelining gives inputs
    to the first stage only)."""
    stage_nodes = [node for node in pipe.split_gm.graph.nodes if node.op == "call_module"]
    return [
        node.name
        for node in pipe.split_gm.graph.nodes
        if node.op == "placeholder" and any(user in stage_nodes[1:] for user in node.users)
    ]


def trace(
    spec: models.ModelSpec, make: Callable[[], Traceable], stages: list[list[str]], example: tuple
):
    """``pipeline()`` of ``make()``'s module with the plan's split points, and that Traceable.
    When a later stage reads a model input, a fresh ``make()`` is traced again behind
    :func:`_copy_inputs_first` (``pipeline()`` patches the split modules' forwards and moves the
    parameters: a module is traced once)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from profiling.hf._transformers_compat import traced_run_masks

    split_spec = {layers[0]: SplitPoint.BEGINNING for layers in stages[1:]}

    def run(module: nn.Module, mb_args: tuple):
        try:
            with traced_run_masks():  # no causal mask where an eager run skips it
                return pipeline(module, mb_args=mb_args, split_spec=split_spec)
        except Exception as error:  # export's own message (the innermost) says which op
            while error.__cause__ is not None:
                error = error.__cause__
            message = " ".join(str(error).split())[:300]
            raise InputError(
                f"model {spec.name}: torch.distributed.pipelining.pipeline() cannot trace it "
                f"({type(error).__name__}: {message})"
            ) from None

    traced = make()
    owners = planned_owners(traced.module, stages)
    pipe = run(traced.module, traced.model_inputs(example))
    if _inputs_read_late(pipe):
        traced = make()
        owners = planned_owners(traced.module, stages)
        pipe = run(_copy_inputs_first(traced.module), traced.model_inputs(example))
    if pipe.num_stages != len(stages):
        raise InputError(
            f"model {spec.name}: tracing with split points {list(split_spec)} gave "
            f"{pipe.num_stages} stages, the plan has {len(stages)}; a split layer must run once, "
            "at the top of the forward's order"
        )
    return pipe, traced, owners


def planned_owners(
    module: nn.Module, stages: list[list[str]]
) -> dict[str, tuple[frozenset[int], str]]:
    """Every name of every parameter (a tied one has several) -> (the planned stages holding
    it, its first name), taken before tracing: one stage, or several for a tied parameter (each
    keeps a copy). By name: tracing gives a tied parameter new objects, under its aliases."""
    names = {id(param): name for name, param in module.named_parameters()}
    held: dict[int, set[int]] = {}
    for stage, layers in enumerate(stages):
        for layer in layers:
            for param in module.get_submodule(layer).parameters():
                held.setdefault(id(param), set()).add(stage)
    return {
        alias: (frozenset(held.get(id(param), ())), names[id(param)])
        for alias, param in module.named_parameters(remove_duplicate=False)
    }


def _drop_unused_tied_aliases(
    stage_module: nn.Module, owners: dict[str, tuple[frozenset[int], str]]
) -> None:
    """Remove the tied parameters the traced stage holds but never reads: ``pipeline()`` leaves
    the original of a tied table under its other alias (e.g. ``lm_head.weight`` on the
    embedding's stage), a table of weights no plan counts and no gradient reaches."""
    read = set()
    for scope, module in stage_module.named_modules():
        for node in getattr(getattr(module, "graph", None), "nodes", ()):
            if node.op == "get_attr":
                read.add(f"{scope}.{node.target}" if scope else node.target)
    for name, _ in list(stage_module.named_parameters(remove_duplicate=False)):
        if len(owners.get(name, ((),))[0]) > 1 and name not in read:
            parent, _, attr = name.rpartition(".")
            del stage_module.get_submodule(parent)._parameters[attr]


def _recompute_layers(stage_module: nn.Module, layers: list[str]) -> None:
    """Run every planned layer of the traced stage under non-reentrant checkpoint."""
    for layer in layers:
        try:
            submodule = stage_module.get_submodule(layer)
        except AttributeError:
            continue  # a layer without its own call in the traced graph (e.g. a tied alias)
        submodule.forward = functools.partial(checkpoint, submodule.forward, use_reentrant=False)


# -- training (rank) ---------------------------------------------------------------------------


def _traced_parameters(stage):
    """The stage's parameters under the traced module's own names (inside DDP's ``module.``)."""
    from torch.nn.parallel import DistributedDataParallel

    module = stage.submod
    if isinstance(module, DistributedDataParallel):
        module = module.module
    return module.named_parameters()


def _tied_sync(stage, owners, place, job: RunJob) -> TiedGradSync:
    """The all-reduce of the stage's tied copies' gradients (``pipeline()`` gives each stage
    that uses a parameter its own copy), over the pipeline ranks holding each."""
    tied = sorted(
        {TiedParameter(name=name, ranks=tuple(sorted(where))) for where, name in owners.values()
         if len(where) > 1},
        key=lambda item: item.name,
    )  # fmt: skip
    copies: dict[str, list[nn.Parameter]] = {}
    for name, param in _traced_parameters(stage):
        where, first = owners.get(name, ((), name))
        if len(where) > 1:
            copies.setdefault(first, []).append(param)
    config = job.plan.config
    return TiedGradSync(
        tied, copies, stage=place.stage, dp_rank=place.dp_rank, tp_rank=0, dp=config.dp, tp=1
    )


def _iterate(
    schedule, optimizer, stage, spec, traced, job, place, tracker, owners, sync_tied
) -> Measured:
    """Run ``job.iterations`` steps; the live-tensor peak of the last one."""
    step_lifetime = getattr(job.plan.training, "grad_lifetime", "persistent") == "step"
    cuda = place.device.type == "cuda"
    losses, iteration_ms, cuda_peak = [], [], None
    for iteration in range(job.iterations):
        args, kwargs = _step_inputs(spec, traced, job, place, iteration)
        step_losses: list[torch.Tensor] = kwargs.get("losses", [])
        optimizer.zero_grad(set_to_none=step_lifetime)
        tracker.reset_peak()
        if cuda:
            torch.cuda.synchronize(place.device)
            torch.cuda.reset_peak_memory_stats(place.device)
        started = time.perf_counter()
        inject_fault(job, place)
        # on a CPU, attention runs the fused kernels a GPU runs (what the profile counts)
        with tracker.saved_tensors(), cuda_like_kernels(place.device.type == "cpu"):
            schedule.step(*args, **kwargs, return_outputs=False)
        sync_tied()  # the tied copies' gradients summed, before the step
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(place.device)
            cuda_peak = torch.cuda.max_memory_allocated(place.device)
        iteration_ms.append((time.perf_counter() - started) * 1e3)
        if place.last:
            losses.append(float(torch.stack(step_losses).detach().float().mean()))
        del args, kwargs, step_losses
    grads = None
    if job.capture_grads:
        grads = {  # by the full model's parameter names (a tied alias traces under another)
            owners.get(name, (None, name))[1]: param.grad.detach().cpu().clone()
            for name, param in _traced_parameters(stage)
            if param.grad is not None
        }
    return Measured.at_peak(
        tracker, iteration_ms=iteration_ms, losses=losses, cuda_peak=cuda_peak, grads=grads
    )


def _step_inputs(spec, traced, job: RunJob, place, iteration: int) -> tuple[tuple, dict]:
    """The schedule's arguments for ``iteration`` on this rank (model inputs on the first stage,
    targets and the loss list on the last)."""
    config = job.plan.config
    rows = config.micro_batch * config.num_microbatches
    local = slice(place.dp_rank * rows, (place.dp_rank + 1) * rows)
    example = batch_for_iteration(
        spec, batch=rows * config.dp, seq=job.seq, seed=job.seed, iteration=iteration
    )
    example = tuple(tensor[local] for tensor in example)  # this replica's rows
    inputs = traced.model_inputs(example) if place.first else ()
    args = tuple(x.to(place.device) for x in inputs)
    kwargs: dict[str, Any] = {}
    if place.last:
        target = traced.target(example) if traced.target else torch.zeros(rows)
        kwargs = {"target": target.to(place.device), "losses": []}
    return args, kwargs


def _with_clean_steps(
    measured, schedule, optimizer, spec, traced, job: RunJob, place, tracker, sync_tied
):
    """``measured`` with the clean timed iterations
    (:func:`profiling.executors.base.clean_steps`) of a traced stage."""
    step_lifetime = getattr(job.plan.training, "grad_lifetime", "persistent") == "step"

    def prepare(iteration: int):
        args, kwargs = _step_inputs(spec, traced, job, place, iteration)
        optimizer.zero_grad(set_to_none=step_lifetime)

        def step() -> None:
            with cuda_like_kernels(place.device.type == "cpu"):
                schedule.step(*args, **kwargs, return_outputs=False)
            sync_tied()
            optimizer.step()

        return step

    return with_clean_steps(measured, prepare, job, place, tracker)


def traced_rank_main(rank: int, job: RunJob) -> RankReport:
    """One rank: build and trace the model, keep its stage, train and measure, and report next
    to the plan's prediction for its stage."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from profiling.export import resolve_spec
    from profiling.trace.memory import LiveTensorTracker

    place = place_rank(rank, job)
    mesh = init_mesh(place, job)
    config = job.plan.config
    spec = resolve_spec(job.preset, job.overrides)
    dtype = plan_dtype(job.plan)
    stages = job.plan.virtual_stage_layers
    example = batch_for_iteration(
        spec, batch=config.micro_batch, seq=job.seq, seed=job.seed, iteration=0
    )
    pipe, traced, owners = trace(
        spec, lambda: traceable(spec, build_model(spec, job.seed, dtype)), stages, example
    )
    stage_module = pipe.get_stage_module(place.stage)
    _drop_unused_tied_aliases(stage_module, owners)
    _check_traced_stage(stage_module, owners, place.stage, job.plan.source)
    if config.recompute == "full":
        _recompute_layers(stage_module, stages[place.stage])
    make_boundaries_contiguous(pipe)
    check_no_gradient_skips(pipe, spec.name)
    stage = constant_aware_stage(pipe, place.stage, place.device, mesh["pp"].get_group())
    del pipe, traced.module, example  # the other stages' modules go with the pipe
    tracker = LiveTensorTracker()
    tracker.track_module(stage.submod)
    with tracker:
        tracker.track_grads(stage.submod)
        if config.dp > 1:
            _data_parallel(stage, mesh, place.device)
        schedule_class = Schedule1F1B if config.schedule == "1f1b" else ScheduleGPipe
        schedule = schedule_class(
            stage, n_microbatches=config.num_microbatches, loss_fn=traced.loss_fn
        )
        optimizer = build_optimizer(
            list(stage.submod.parameters()),
            mesh,
            config.zero,
            lr=LEARNING_RATE,
            impl=optimizer_impl(job.plan),
        )
        tracker.track_optimizer(optimizer)
        sync_tied = _tied_sync(stage, owners, place, job)
        recorder = ActionRecorder([stage], tracker)
        measured = _iterate(
            schedule, optimizer, stage, spec, traced, job, place, tracker, owners, sync_tied
        )
        measured.action_bytes = recorder.last_iteration(job.iterations)
        recorder.remove()
    measured = _with_clean_steps(
        measured, schedule, optimizer, spec, traced, job, place, tracker, sync_tied
    )
    return rank_report(place, job, measured)


def _data_parallel(stage, mesh, device: torch.device) -> None:
    """Wrap the stage's traced module in DDP over ``mesh["dp"]`` (gradients in its buckets, the
    buckets fixed now, as on the zoo path: profiling.executors.parallelize.apply_data_parallel); the
    pipeline then syncs gradients on the last micro-batch only (its ``no_sync`` handling)."""
    from torch.nn.parallel import DistributedDataParallel

    from profiling._torch_compat import rebuild_ddp_buckets

    traced = stage.submod
    wrapped = DistributedDataParallel(
        traced,
        process_group=mesh["dp"].get_group(),
        device_ids=[device] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    rebuild_ddp_buckets(wrapped)
    wrapped.graph = traced.graph  # the traced frontend reads its stage's fx graph from submod
    stage.submod = wrapped


def _check_traced_stage(
    stage_module: nn.Module, owners: dict[str, tuple[frozenset[int], str]], stage: int, source: str
) -> None:
    """The traced stage holds the parameters of exactly its planned layers: else the plan's layer
    order is not the order the model's forward runs them in."""
    held = {
        owners[name][1]
        for name, _ in stage_module.named_parameters(remove_duplicate=False)
        if name in owners
    }
    planned = {first for where, first in owners.values() if stage in where}
    extra = sorted(held - planned)
    absent = sorted(planned - held)
    if extra or absent:
        detail = (
            f"also holds {', '.join(extra[:3])} (planned on other stages)"
            if extra
            else f"lacks {', '.join(absent[:3])} (the forward runs it on another stage)"
        )
        raise InputError(
            f"{source}: stage {stage}, traced at its split points, {detail}: "
            "torch.distributed.pipelining cuts the forward in the order it runs, so each stage "
            "must hold layers the forward runs one after another; re-plan with the layers in "
            "that order (e.g. python -m solver.evaluate --split with layer counts)"
        )
