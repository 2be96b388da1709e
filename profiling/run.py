"""Run a plan for real on torch.distributed and measure each rank's peak memory.

    from profiling.run import run_plan
    reports = run_plan("gpt-tiny", "plan.json", iterations=2,
                       overrides={"layers": 4, "dropout": 0.0})
    for r in reports:
        print(r.rank, r.stage, r.measured_peak_bytes, r.predicted_peak_bytes, r.error_pct)

The plan (a path, a parsed dict or a ``PlanFile``) is read and checked by
``solver.files.plan_file.load_plan`` (docs/plan.md); ``run_plan`` then refuses what this executor
cannot run (``_check_runnable``) before spawning anything.

This module checks the plan and launches the ranks; what each rank does is
:mod:`profiling.executors.torch_zoo` (``engine="torch"`` on a zoo model, described below) or
:mod:`profiling.executors.megatron` (``engine="megatron"``: megatron-core runs the plan's own
Megatron export, on CPU over gloo; docs/running.md); :mod:`profiling.executors.dispatch` picks.
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
Vocabularies of at least ``profiling.trace.tensor_parallel.VOCAB_PARALLEL_MIN_ROWS`` rows are split
by rows: the token embedding row-parallel, the LM head column-parallel with its logits left sharded
and the cross-entropy run under ``loss_parallel``. Norms, position tables and smaller
vocabularies stay replicated. This is the split the cost model assumes (``tp_params``): on
gpt-tiny the measured weights equal the prediction to the byte (tests). See
``profiling.executors.parallelize``.

Data parallelism over ``dp > 1`` by ZeRO stage: 0 DDP; 1 DDP + ``ZeroRedundancyOptimizer`` (Adam
state sharded); 2 FSDP2 ``fully_shard(reshard_after_forward=False)`` (gradients and Adam state
sharded; each layer's weights gathered from its forward to its backward); 3 FSDP2
``fully_shard`` (one unit per layer plus the stage). At pp > 1 the FSDP stage is handed to
``PipelineStage`` as torchtitan does: it turns gradient sync and resharding off for every
micro-batch's backward and reduce-scatters once per step, so every layer's unsharded gradients
and weights stay to the step's end (the cost model's ``states.reduces_per_step``); at pp 1 it
reaches the schedule inside a plain ``nn.Sequential`` and every layer reduce-scatters its
gradients and reshards after each backward, as FSDP2 alone does. With tp > 1, zero 0 uses
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

Memory: ``profiling.trace.memory.LiveTensorTracker`` (exact live storage bytes) is active from
before
the parallel wrappers, the stage and the optimizer are built; its peak is reset at the start of
every iteration and the last iteration's peak is reported, with the plan's
``stages[i].peak_bytes`` next to it. Gradients that FSDP2 (or ``replicate``) writes are tagged
``grads`` only after the backward, so at a peak inside it they count as ``other``. On CUDA,
``torch.cuda.max_memory_allocated`` over the last iteration is reported as well.

Time: ``RankReport.iteration_ms`` is each instrumented iteration's wall time on the rank (the
tracker takes 21-30% of it on gpt-tiny on a CPU, benchmarks/bench_clean_timing.md); after
them ``step_iterations`` clean iterations run with the tracker closed (no dispatch mode,
saved-tensor or gradient hooks, no storage tagging), each started on every rank after a
barrier, and ``RankReport.step_ms`` is the slowest rank's time of each
(:func:`profiling.executors.base.clean_steps`): the step time to compare with the plan's
``iteration_ms``. Each rank runs with ``threads`` CPU threads (:func:`rank_threads`: the count
the graph's layer times were measured with, ``meta.timing.threads``, when the plan's graph file
records it; else ``cpu_count // world``), reported as ``RankReport.threads``.

Tied weights split across (virtual) stages (a head sharing the embedding's table): each rank
whose layers use the table keeps its own copy (with its gradient and Adam state), and before the
optimizer step the copies' gradients are summed over those pipeline ranks
(:mod:`profiling.executors.tied`), as torchtitan and ``pipeline()`` run them.

Not supported (``InputError``): a tied embedding and head with a vocabulary-parallel table,
ZeRO-1 with tp > 1 and dp > 1, sequence parallelism (``config.sp``) on a model other than the
GPT/Llama presets or with a sequence tp does not divide. For a zoo
preset the model's layers must form a chain (each takes the previous one's output, the last takes
``(hidden, targets)``: the GPT/Llama presets); a DAG preset such as t5-tiny fails inside the
ranks, which ``run_plan`` reports as ``RunError``. Any other model (``hf:NAME``,
``package.module:factory``, T5 included) is cut by tracing: :mod:`profiling.executors.traced`
(docs/running.md). Use dropout 0 for runs compared with a single process
or with predictions (the CPU dropout kernels differ from GPU ones, and dropout masks draw random
numbers in a different order).
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing.connection
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import models
from profiling.executors.base import RankReport, RunJob, model_spec
from profiling.executors.dispatch import rank_worker
from profiling.executors.fork_server import start_fork_server, stop_fork_server
from profiling.executors.parallelize import (
    tensor_parallel_pairs,
    vocabulary_parallel_paths,
    vocabulary_sizes,
)
from profiling.executors.traced import check_traced_plan
from profiling.export import MAX_THREADS, resolve_spec
from solver.errors import InputError, PlannerError, RunError, quote
from solver.files.plan_file import PlanFile, load_plan
from solver.specs import SCHEDULES as SCHEDULES  # re-exported: the names profiling.run had
from solver.specs import ZERO_STAGES as ZERO_STAGES
from solver.specs import ParallelConfig

ENGINES = ("torch", "megatron")
"""torch: torch.distributed.pipelining (:mod:`profiling.executors.torch_zoo`); megatron:
megatron-core (:mod:`profiling.executors.megatron`)."""
RECOMPUTE = ("none", "full")
"""The recompute modes (of ``solver.specs.RECOMPUTE_MODES``) this executor runs."""
DEVICES = ("cpu", "cuda")

logger = logging.getLogger(__name__)


# -- what this executor runs (parent) ----------------------------------------------------------


def _check_runnable(
    spec: models.ModelSpec,
    plan: PlanFile,
    max_processes: int,
    engine: str = "torch",
    *,
    traced: bool = False,
    seq: int | None = None,
) -> None:
    """InputError naming the field, unless ``engine`` can run the (checked) plan on ``spec``:
    the plan's model and layers, few enough processes, and what the engine supports. ``traced``:
    a model that is not a zoo preset (:func:`profiling.executors.traced.check_traced_plan`)."""
    config = plan.config
    pp, tp, dp = config.pp, config.tp, config.dp
    if engine not in ENGINES:
        raise InputError(f"engine {engine!r}; valid: {', '.join(ENGINES)}")
    _check_model(spec, plan)
    if config.cp > 1:
        raise InputError(
            f"plan config: cp={config.cp}: no executor here runs context parallelism (torch "
            "2.13's context_parallel has no CPU ring attention: "
            "aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy; "
            "megatron-core's local DotProductAttention asserts context_parallel_size == 1 "
            "without TransformerEngine); docs/running.md, plan with --cp 1 to run it"
        )
    if traced and engine == "megatron":  # an hf: model that GPTModel expresses
        spec = _megatron_hf_spec(spec, seq, plan)
        _check_megatron(spec, plan)
        traced = False  # its layers are checked below, as a preset's
    elif traced:
        check_traced_plan(spec, plan)
    elif engine == "megatron":
        _check_megatron(spec, plan)
    else:
        _check_torch(spec, config)
    if pp * dp * tp > max_processes:
        raise InputError(
            f"plan needs pp({pp}) * dp({dp}) * tp({tp}) = {pp * dp * tp} processes, more than "
            f"this machine allows ({max_processes}); plan for fewer GPUs"
        )
    layers = [name for chunk in plan.virtual_stage_layers for name in chunk]
    if not traced and layers != spec.layers:
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


def _megatron_hf_spec(spec: models.ModelSpec, seq: int | None, plan: PlanFile) -> models.ModelSpec:
    """The megatron engine's spec of a traced model (:mod:`profiling.executors.megatron_hf`):
    an ``hf:`` model GPTModel expresses, else InputError naming what it does not; its layers
    HF's or Megatron's, as the plan's graph has them."""
    from profiling.executors.megatron_hf import megatron_hf_spec, plan_implementation

    if not spec.name.startswith("hf:"):
        raise InputError(
            f"engine megatron runs the zoo's GPT/Llama presets and hf: models GPTModel "
            f"expresses; {spec.name} runs with --engine torch"
        )
    layers = [name for chunk in plan.virtual_stage_layers for name in chunk]
    return megatron_hf_spec(spec, seq, plan_implementation(layers))


def _check_torch(spec: models.ModelSpec, config: ParallelConfig) -> None:
    """What the torch executor runs: recompute none or full, no expert parallelism, no ZeRO-1
    over tensor-parallel parameters, a supported interleaving, a tensor-parallel split of the
    model's heads, and sequence parallelism on GPT/Llama presets (``_check_sequence_parallel``;
    eager torch saves each column-parallel Linear's gathered [b, s, h] input, which a plan for
    --runtime torch counts as the layers' ``sp_gathered_bytes``)."""
    tp, dp, zero = config.tp, config.dp, config.zero
    if config.sp:
        _check_sequence_parallel(spec, tp)
    if tp > 1 and dp > 1 and zero == 1:
        raise InputError(
            f"plan config: zero=1 with tp({tp}) and dp({dp}): ZeroRedundancyOptimizer cannot "
            "shard DTensor (tensor-parallel) parameters; use zero=2 or 3"
        )
    if config.recompute not in RECOMPUTE:
        raise InputError(
            f"plan config: recompute={config.recompute!r}; valid: {', '.join(RECOMPUTE)}"
        )
    if config.ep > 1:
        raise InputError(
            f"plan config: ep={config.ep}: the torch engine runs every expert on every "
            "data-parallel rank (no expert parallelism); plan with --ep 1, or run it with "
            "--engine megatron"
        )
    _check_interleaving(config)
    if tp > 1:
        with torch.device("meta"):  # shapes only
            model = spec.build()
        tensor_parallel_pairs(model, spec.layers, tp)
        vocabulary_parallel_paths(model, spec.layers, vocabulary_sizes(model))


def _check_sequence_parallel(spec: models.ModelSpec, tp: int) -> None:
    """What the torch engine's sequence parallelism runs: a dense GPT/Llama preset (a chain of
    embedding, blocks and LM head, ``profiling.executors.parallelize.apply_sequence_parallel``)
    whose sequence the tp ranks split evenly."""
    config = spec.config
    if not isinstance(config, models.gpt.GPTConfig):
        raise InputError(
            f"plan config: sp=true: the torch engine runs sequence parallelism on the gpt and "
            f"llama presets, not {spec.name}; plan with --sequence-parallel off"
        )
    if config.seq_len % tp:
        raise InputError(
            f"plan config: sp=true with tp {tp} splits the sequence, and tp does not divide "
            f"seq_len ({config.seq_len}) of {spec.name}; set seq_len to a multiple"
        )
    if config.num_experts:
        raise InputError(
            f"plan config: sp=true on {spec.name}, a mixture of experts: the torch engine runs "
            "sequence parallelism on dense blocks only; plan with --sequence-parallel off"
        )


def _check_megatron(spec: models.ModelSpec, plan: PlanFile) -> None:
    """What the megatron engine runs: megatron-core installed, a plan for the megatron runtime
    with a Megatron export that Megatron can take, a GPT/Llama preset whose heads, KV heads,
    vocabulary and MLP width the TP degree divides, 1F1B, ZeRO 0 or 1 (the distributed
    optimizer), and bf16 or fp32 weights."""
    from profiling.executors.megatron import plan_dtype_of
    from profiling.executors.megatron_model import (
        check_model,
        megatron_settings,
        require_megatron,
        transformer_config,
    )

    config = plan.config
    require_megatron()
    if plan.runtime != "megatron":
        raise InputError(
            f"{plan.source}: planned for the {plan.runtime} runtime; the megatron engine runs "
            "plans for the megatron runtime (plan with --runtime megatron)"
        )
    problems = (
        (config.schedule != "1f1b", f"schedule={config.schedule}: Megatron runs 1F1B only"),
        (
            config.zero > 1,
            f"zero={config.zero}: Megatron's distributed optimizer is ZeRO 1; plan with "
            "--zero 0 or 1",
        ),
        (
            config.virtual_stages > 1 and config.num_microbatches % config.pp != 0,
            f"num_microbatches={config.num_microbatches}: interleaved 1F1B needs a multiple of "
            f"pp ({config.pp})",
        ),
    )
    for failed, problem in problems:
        if failed:
            raise InputError(f"plan config: {problem}")
    settings = megatron_settings(plan)
    export = plan.exports["megatron"]
    recompute_warnings = [w for w in export.get("warnings", []) if w.startswith("recompute:")]
    if recompute_warnings:
        raise InputError(f"{plan.source}: exports.megatron: {recompute_warnings[0]}")
    check_model(spec, settings.tp, sequence_parallel=settings.sequence_parallel)
    try:  # megatron-core's own checks of the settings (the layout against pp, the split)
        transformer_config(
            spec, settings, dtype=plan_dtype_of(plan), deallocate_pipeline_outputs=True
        )
    except (AssertionError, ValueError, TypeError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        raise InputError(
            f"{plan.source}: exports.megatron: megatron-core rejects the settings: {message}; "
            "re-create the plan with python -m solver.plan"
        ) from None


def _check_model(spec: models.ModelSpec, plan: PlanFile) -> None:
    """InputError unless the plan was made for this model: the graph's model name (a graph from
    ``profiling.export PRESET`` carries the preset's name) and its layer names in order. Presets of
    one family share their layer names (gpt-tiny, llama-tiny), so the names alone do not tell."""
    if plan.model != spec.name:
        raise InputError(
            f"{plan.source}: made for model {quote(plan.model)}, not {quote(spec.name)}: the "
            "model does not match the plan; run it with --model "
            f"{quote(plan.model, 40, bare=True)} if that is a preset, or plan for this model's "
            f"graph (python -m profiling.export {quote(spec.name, 40, bare=True)})"
        )


_INTERLEAVED_CLASS = {
    "1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
}
"""torch's loop-placed multi-chunk classes, which need m a multiple of max(1, m // pp); the V
schedules (zbv, dualpipev) have their own rules (``solver.parallel.check_zero_bubble``)."""


def _check_interleaving(config: ParallelConfig) -> None:
    """InputError unless ``config.virtual_stages`` is one this executor runs: 1, or v > 1 with
    1F1B (``ScheduleInterleaved1F1B``) or a split-backward schedule (``ScheduleZBVZeroBubble``,
    ``ScheduleDualPipeV``, ``ScheduleInterleavedZeroBubble``), tp 1 and, over dp > 1, ZeRO 0
    (one DDP per chunk)."""
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
            config.schedule in ("1f1b", "interleaved-zb") and m % rounds != 0,
            f"num_microbatches={m}: {_INTERLEAVED_CLASS.get(config.schedule)} needs a multiple of "
            f"its rounds max(1, m // pp) = {rounds}; plan with a multiple of pp ({pp})",
        ),
    )
    for failed, problem in problems:
        if failed:
            raise InputError(f"plan config: virtual_stages={v} with {problem}")


def virtual_stage_layers(plan: dict[str, Any] | PlanFile) -> list[list[str]]:
    """The layer names of each (virtual) stage in pipeline order: with v chunks per rank,
    virtual stage j is chunk j // pp of rank j % pp (``stages[r].chunks``); else
    ``stages[r].layers`` (:attr:`solver.files.plan_file.PlanFile.virtual_stage_layers`)."""
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


# -- the launcher (parent) ---------------------------------------------------------------------


def recorded_graph(plan: PlanFile):
    """The graph file the plan records (``graph.path`` as given, else beside the plan), when it
    is there, loads, and is still the plan's graph (same sha256); else None."""
    from solver.graph import load_graph

    record = plan.graph
    if record is None or not record.path:
        return None
    path = Path(record.path)
    if not path.is_absolute() and not path.is_file() and plan.source:
        path = Path(plan.source).parent / path
    try:
        if not path.is_file():
            return None
        graph = load_graph(path)
    except (PlannerError, OSError, ValueError):
        return None
    return graph if graph.sha256() == record.sha256 else None


def rank_threads(
    plan: PlanFile, device: str = "cpu", threads: int | None = None
) -> tuple[int, str]:
    """The CPU threads each rank runs with, and where the count comes from: ``threads`` when
    given; else the count the plan's graph measured its layer times with
    (``meta.timing.threads`` of :func:`recorded_graph`, timed on the same device type), so that
    the plan and the run time the same thing; else ``cpu_count // world`` (at least 1)."""
    from solver.graph import timing_of

    if threads is not None:
        if (
            isinstance(threads, bool)
            or not isinstance(threads, int)
            or not 1 <= threads <= MAX_THREADS
        ):
            raise InputError(f"threads must be an integer in 1..{MAX_THREADS}, got {threads!r}")
        return threads, "given"
    graph = recorded_graph(plan)
    timing = timing_of(graph) if graph is not None else None
    if timing is not None and timing.get("device", "cpu").split(":")[0] == device:
        return timing["threads"], f"{plan.graph.path}: meta.timing.threads"
    world = plan.config.num_gpus
    return max(1, (os.cpu_count() or 1) // world), f"cpu_count {os.cpu_count()} // world {world}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


RANK_PRELOAD = ("profiling.executors.preload",)
"""The modules the ranks' fork server imports once (``profiling.executors.preload``)."""


def _rank_context():
    """The multiprocessing context the ranks start from: a fork server (one per launching
    process, started on first use) that has imported :data:`RANK_PRELOAD`. A fork of that clean
    server, not of this process: no threads, CUDA state or open files of the caller are copied
    (what ``spawn`` guarantees), and the imports are paid once per launcher rather than once per
    rank. The ranks are the fork server's children: ``_stop`` ends them by pid."""
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_PRELOAD))
    return context


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


def resolve_model(model: str, overrides: dict[str, Any]) -> tuple[models.ModelSpec, bool]:
    """The spec of ``model`` (a zoo preset, ``hf:NAME`` or ``package.module:factory``) and
    whether it runs traced (not a zoo preset). A factory that raises is an InputError."""
    if model in models.presets():
        return model_spec(model, overrides), False
    try:
        spec = resolve_spec(model, overrides)
    except PlannerError:
        raise
    except Exception as error:  # the user's factory: one line, not a traceback
        message = " ".join(str(error).split())[:200]
        raise InputError(
            f"{model}: the model factory failed: {type(error).__name__}: {message}"
        ) from None
    return spec, True


def run_plan(
    model: str,
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
    engine: str = "torch",
    threads: int | None = None,
    step_iterations: int = 1,
    _fault: tuple[int, str] | None = None,
) -> list[RankReport]:
    """Train ``iterations`` steps of ``model`` with ``plan`` on ``pp * dp * tp`` local processes.

    ``model``: a zoo preset (cut by hand, :mod:`profiling.executors.torch_zoo`), or ``hf:NAME`` or
    ``package.module:factory`` (cut by tracing with ``torch.distributed.pipelining.pipeline`` at
    the plan's layers, :mod:`profiling.executors.traced`); ``overrides`` are its ``--set`` fields.

    ``plan``: a plan or evaluation document (a path, a parsed dict or a
    :class:`solver.files.plan_file.PlanFile`), checked by :func:`solver.files.plan_file.load_plan`.
    Returns one ``RankReport`` per rank, in rank order. ``seq`` defaults to the model's
    ``seq_len``; ``max_processes`` to ``max(4, 2 * cpu_count)``. ``device``: ``"cpu"`` (gloo) or
    ``"cuda"`` (NCCL, rank r on ``cuda:{r % device_count}``, one GPU per rank). ``threads``:
    CPU threads per rank (default :func:`rank_threads`: the graph's recorded count, else
    ``cpu_count // world``). ``step_iterations``: clean timed iterations after the measured ones
    (``RankReport.step_ms``; 0: none). Raises
    ``InputError`` for a plan this executor cannot run on the model or device, and ``RunError``
    when a rank fails or the run
    takes longer than ``timeout_s`` (every process is stopped first). ``_fault`` is a test hook:
    ``(rank, "raise")`` makes that rank raise at the start of its first iteration, ``(rank,
    "hang")`` makes it sleep there (its peers then wait in the pipeline's receives).
    """
    overrides = dict(overrides or {})
    if iterations < 1:
        raise InputError(f"iterations must be >= 1, got {iterations}")
    if step_iterations < 0:
        raise InputError(f"step_iterations must be >= 0, got {step_iterations}")
    plan = load_plan(plan)
    spec, traced = resolve_model(model, overrides)
    limit = max_processes or max(4, 2 * (os.cpu_count() or 1))
    _check_runnable(spec, plan, limit, engine, traced=traced, seq=seq)
    world = plan.config.num_gpus
    _check_device(device, world)
    if engine == "megatron" and device != "cpu":
        raise InputError("engine megatron runs on device cpu here (gloo); use --device cpu")
    threads_per_rank, threads_from = rank_threads(plan, device, threads)
    _warn_if_oversubscribed(device, world, threads_per_rank, threads_from)
    job = RunJob(
        preset=model,
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
        engine=engine,
        traced=traced,
        threads=threads_per_rank,
        step_iterations=step_iterations,
        deallocate_pipeline_outputs=(
            plan.training is None or plan.training.deallocate_pipeline_outputs
        ),
    )
    return _run_ranks(job, world)


def _warn_if_oversubscribed(
    device: str, world: int, threads_per_rank: int, threads_from: str
) -> None:
    """Log a warning when ``world`` ranks of ``threads_per_rank`` CPU threads each outnumber the
    CPUs (``threads_from`` says where the count came from)."""
    cpus = os.cpu_count() or 1
    if device == "cpu" and threads_per_rank * world > cpus:
        logger.warning(
            "%d ranks x %d threads (%s) on %d CPUs: oversubscribed, the step time will exceed "
            "the plan's; profile with --threads %d (profiling.export) or run with --threads",
            world,
            threads_per_rank,
            threads_from,
            cpus,
            max(1, cpus // world),
        )


def _run_ranks(job: RunJob, world: int) -> list[RankReport]:
    """Start ``world`` rank processes on ``job`` (:func:`profiling.executors.dispatch.rank_worker`),
    wait for them, and read their reports; every process is stopped and the result folder
    removed on the way out, whatever happens; after a stop signal the fork server too
    (:mod:`profiling.executors.fork_server`)."""
    context = _rank_context()
    directory = Path(tempfile.mkdtemp(prefix="memplan-run-"))
    processes = []
    try:
        start_fork_server()
        for rank in range(world):
            process = context.Process(
                target=rank_worker, args=(rank, job, str(directory)), name=f"memplan-rank{rank}"
            )
            process.daemon = True  # never outlive the parent
            process.start()
            processes.append(process)
        _wait_for_ranks(processes, directory, job.timeout_s)
        return [
            torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(world)
        ]
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP (solver.console): end everything now
        _stop(processes)
        stop_fork_server()  # it may be importing still, with a rank's start queued
        raise
    finally:
        _stop(processes)
        with contextlib.suppress(OSError):
            shutil.rmtree(directory)


def _wait_for_ranks(processes: list, directory: Path, timeout_s: float) -> None:
    """Return when every rank has exited 0. InputError with the first rank's one-line
    ``rank*.input`` when one found the plan or model wrong; RunError with the first failure's
    traceback when one failed, or when ``timeout_s`` passed (every process stopped first)."""
    pids = [process.pid for process in processes]
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [process.exitcode for process in processes]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            time.sleep(0.2)  # let the first failure's traceback land
            _stop(processes)
            bad_input = sorted(directory.glob("rank*.input"))
            if bad_input:
                raise InputError(bad_input[0].read_text())
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


def format_reports(reports: list[RankReport]) -> str:
    """Text table: rank, stage, dp and tp rank, measured, predicted, error % and the measured
    breakdown (MiB), the last instrumented iteration's time (``iter_ms``), the median clean step
    time (``step_ms``, the slowest rank's) and the rank's threads; on CUDA also
    ``torch.cuda.max_memory_allocated`` (``cuda_MiB``)."""
    mib = 2**20
    cuda = any(r.cuda_max_allocated_bytes is not None for r in reports)
    lines = [
        "rank stage dp tp  measured_MiB predicted_MiB  error_%   "
        "params   grads  optimizer activations  other  iter_ms  step_ms threads"
        + ("  cuda_MiB" if cuda else "")
    ]
    for r in reports:
        b = r.measured_breakdown
        predicted = "-" if r.predicted_peak_bytes is None else f"{r.predicted_peak_bytes / mib:.3f}"
        error = "-" if r.error_pct is None else f"{r.error_pct:+.1f}"
        iteration = r.iteration_ms[-1] if r.iteration_ms else math.nan
        step = statistics.median(r.step_ms) if r.step_ms else math.nan
        threads = "-" if r.threads is None else str(r.threads)
        line = (
            f"{r.rank:4d} {r.stage:5d} {r.dp_rank:2d} {r.tp_rank:2d} "
            f"{r.measured_peak_bytes / mib:13.3f} "
            f"{predicted:>13} {error:>8} {b['params'] / mib:8.3f} {b['grads'] / mib:7.3f} "
            f"{b['optimizer'] / mib:10.3f} {b['activations'] / mib:11.3f} "
            f"{b['other'] / mib:6.3f} {iteration:8.1f} {step:8.1f} {threads:>7}"
        )
        if cuda:
            allocated = r.cuda_max_allocated_bytes
            line += f" {allocated / mib:9.3f}" if allocated is not None else f" {'-':>9}"
        lines.append(line)
    return "\n".join(lines)


def step_ms(reports: list[RankReport]) -> float | None:
    """The run's clean step time: the median over the clean iterations of the slowest rank's
    time (ms); None without clean iterations."""
    count = min((len(r.step_ms) for r in reports), default=0)
    times = [max(r.step_ms[k] for r in reports) for k in range(count)]
    return statistics.median(times) if times else None
