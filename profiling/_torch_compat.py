"""The one home of the private torch APIs that profiling/, tests/ and scripts/ use.

Private means outside torch's public API: an underscore module or attribute, or a name missing
from its module's ``__all__``. Each entry of :data:`PRIVATE_APIS` was checked on torch
:data:`CHECKED_ON` (the pin in pyproject.toml) and has a canary in tests/test_torch_compat.py, so
a torch upgrade that breaks one fails there, with a message naming the API and what depends on it
(docs/profiling.md, "Torch internals").

A private name this torch lacks does not break ``import profiling...``: it becomes a stand-in
that raises :class:`TorchInternalsError` (the API, this torch, what needs it) where it is used.
Names from slow or optional modules (``torch.distributed``) are looked up at the call.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

CHECKED_ON = "2.13.0"
"""The torch version every API here was checked against."""

PRIVATE_APIS: dict[str, tuple[str, str]] = {
    "torch._C._current_autograd_node": (
        "charge each backward op to the layer whose autograd node runs it",
        "profiling/trace/dataflow.py",
    ),
    "torch.utils._python_dispatch.TorchDispatchMode": (
        "see every aten op (dataflow tracing, live-memory accounting)",
        "profiling/trace/dataflow.py, profiling/trace/memory.py",
    ),
    "torch.utils._python_dispatch._disable_current_modes": (
        "run an op beside the active dispatch modes, unseen by them (the megatron engine's "
        "all-to-all copies, which gloo may hold past the call)",
        "profiling/executors/megatron_cpu.py",
    ),
    "torch.utils._pytree.tree_map": (
        "make fake copies of nested example inputs",
        "profiling/trace/profile.py",
    ),
    "torch.utils._pytree.tree_leaves": (
        "find the tensors in a layer's nested inputs and outputs",
        "profiling/trace/dataflow.py",
    ),
    "torch.utils._pytree.tree_flatten": (
        "find the tensors an op returns",
        "profiling/trace/memory.py",
    ),
    "torch._subclasses.fake_tensor.FakeTensorMode": (
        "run models of any size without memory or compute (fake tensors)",
        "profiling/trace/profile.py, profiling/run.py",
    ),
    "torch.utils.flop_counter.flop_registry": (
        "count each op's FLOPs with torch's own formulas",
        "profiling/trace/dataflow.py",
    ),
    "torch.utils.flop_counter.sdpa_flop_count": (
        "count the FLOPs of the CPU flash-attention forward",
        "profiling/trace/dataflow.py",
    ),
    "torch.utils.flop_counter.sdpa_backward_flop_count": (
        "count the FLOPs of the CPU flash-attention backward",
        "profiling/trace/dataflow.py",
    ),
    "torch.ops.aten._scaled_dot_product_flash_attention": (
        "the CUDA flash kernel's outputs (its meta kernel), against which the CUDA-like "
        "attention's saved tensors are checked",
        "tests/test_korthikanti.py",
    ),
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": (
        "recognise the attention kernel SDPA runs on CPU (FLOPs), and run it where a GPU runs "
        "its memory-efficient kernel with a learned bias",
        "profiling/trace/dataflow.py, profiling/trace/cuda_attention.py",
    ),
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward": (
        "recognise the attention backward kernel SDPA runs on CPU (FLOPs), and run it for a "
        "learned bias",
        "profiling/trace/dataflow.py, profiling/trace/cuda_attention.py",
    ),
    "torch.distributed.tensor.DTensor._local_tensor": (
        "count the storage of a DTensor's local shard",
        "profiling/trace/memory.py",
    ),
    "torch.distributed.pipelining.stage._PipelineStage": (
        "a traced pipeline stage whose constant boundary tensors carry no gradient",
        "profiling/executors/traced_boundaries.py",
    ),
    "torch.distributed.pipelining._IR._modify_graph_op_device": (
        "move a traced stage's device constants to the rank's device, as build_stage does",
        "profiling/executors/traced_boundaries.py",
    ),
    "torch.UntypedStorage._cdata": (
        "key live storages by the C++ storage behind them",
        "profiling/trace/memory.py",
    ),
    "torch._C._storage_Use_Count": (
        "wait until gloo's worker thread has let go of a collective's buffer",
        "profiling/executors/parallelize.py",
    ),
    "torch.UntypedStorage.resize_": (
        "see FSDP2 free and re-allocate unsharded parameters (patched: no dispatch mode sees it)",
        "profiling/trace/memory.py",
    ),
    "torch.distributed._composable.replicate_with_fsdp.replicate": (
        "run data parallelism over tensor-parallel (DTensor) parameters, which DDP does not take",
        "profiling/executors/parallelize.py",
    ),
    "torch.nn.parallel.DistributedDataParallel.reducer._push_all_rebuilt_params": (
        "fix DDP's bucket order before the pipeline's no_sync micro-batches",
        "profiling/executors/parallelize.py",
    ),
    "torch.nn.parallel.DistributedDataParallel.reducer._rebuild_buckets": (
        "fix DDP's bucket order before the pipeline's no_sync micro-batches",
        "profiling/executors/parallelize.py",
    ),
    "torch.distributed._tools.mem_tracker.MemTracker": (
        "cross-check LiveTensorTracker's peak against torch's own tracker",
        "tests/test_run.py",
    ),
    "torch.distributed.pipelining.schedules.ScheduleInterleaved1F1B"
    "._calculate_single_rank_operations": (
        "replay torch's interleaved 1F1B order as the in-flight oracle",
        "tests/test_interleaved.py",
    ),
}
"""Private API (dotted path; ``.reducer`` is the attribute of a DDP instance) -> (what it is
needed for, the files that need it)."""


class TorchInternalsError(RuntimeError):
    """A private torch API that memplan needs is missing or changed in this torch version."""


def missing(name: str) -> TorchInternalsError:
    """The error for the entry ``name`` of :data:`PRIVATE_APIS` when this torch lacks it."""
    what, used_by = PRIVATE_APIS[name]
    return TorchInternalsError(
        f"torch {torch.__version__} has no {name} "
        f"(checked on {CHECKED_ON}; used by {used_by} to {what})"
    )


class _Missing:
    """Stands in for a private API this torch lacks: raises :class:`TorchInternalsError` when
    called, unpacked (``{**mapping}``) or instantiated as a base class."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise missing(self.name)

    def keys(self) -> Any:
        raise missing(self.name)

    def __mro_entries__(self, bases: tuple) -> tuple[type]:
        stand_in = self

        class Missing:  # ``class Tracer(TorchDispatchMode)`` still defines; ``Tracer()`` raises
            def __init__(self, *args: Any, **kwargs: Any):
                stand_in()

        return (Missing,)


def _private(name: str) -> Any:
    """The object at ``name`` (a module path, then attributes), or a :class:`_Missing`."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
            break
        except ImportError:
            continue
    try:
        for part in parts[split:]:
            found = getattr(found, part)
    except AttributeError:
        return _Missing(name)
    return found


# -- names needed when profiling/ is imported (base classes, module-level tables) ---------------

current_autograd_node: Callable[[], Any] = _private("torch._C._current_autograd_node")
"""The autograd node the backward is running, else None (checked on 2.13.0; public: none)."""

TorchDispatchMode: type = _private("torch.utils._python_dispatch.TorchDispatchMode")
"""Base class of modes that see every aten op (checked on 2.13.0; public: none)."""

disable_current_modes: Callable[[], Any] = _private(
    "torch.utils._python_dispatch._disable_current_modes"
)
"""Context manager: the active dispatch modes are off inside it (checked on 2.13.0; public:
none)."""

tree_map: Callable[..., Any] = _private("torch.utils._pytree.tree_map")
"""``fn`` applied to every leaf of nested lists/tuples/dicts (checked on 2.13.0; public: none)."""

tree_leaves: Callable[[Any], list[Any]] = _private("torch.utils._pytree.tree_leaves")
"""The leaves of nested lists/tuples/dicts, in order (checked on 2.13.0; public: none)."""

tree_flatten: Callable[[Any], tuple[list[Any], Any]] = _private("torch.utils._pytree.tree_flatten")
"""(leaves, structure) of nested lists/tuples/dicts (checked on 2.13.0; public: none)."""

FakeTensorMode: type = _private("torch._subclasses.fake_tensor.FakeTensorMode")
"""Mode whose tensors have shapes and no data (checked on 2.13.0; public: none)."""

flop_registry: dict[Any, Callable[..., int]] = _private("torch.utils.flop_counter.flop_registry")
"""FlopCounterMode's FLOP formulas by aten op packet (checked on 2.13.0; public: none)."""

sdpa_flop_count: Callable[..., int] = _private("torch.utils.flop_counter.sdpa_flop_count")
"""FLOPs of attention from (query, key, value) shapes (checked on 2.13.0; public: none)."""

sdpa_backward_flop_count: Callable[..., int] = _private(
    "torch.utils.flop_counter.sdpa_backward_flop_count"
)
"""FLOPs of attention's backward from (grad, q, k, v) shapes (checked on 2.13.0; public: none)."""

cuda_flash_attention: Any = _private("torch.ops.aten._scaled_dot_product_flash_attention")
"""The aten op SDPA runs on the CUDA flash kernel; its meta kernel gives the shapes of its outputs
on any machine (checked on 2.13.0; public: none)."""

cpu_flash_attention: Any = _private("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu")
"""The aten op SDPA runs on CPU for plain attention (checked on 2.13.0; public: none)."""

cpu_flash_attention_backward: Any = _private(
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward"
)
"""Its backward op (checked on 2.13.0; public: none)."""


# -- attributes of objects, and names from torch.distributed (looked up at the call) ------------


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (checked on 2.13.0; public: ``to_local()``, but a view op)."""
    try:
        return tensor._local_tensor
    except AttributeError:
        raise missing("torch.distributed.tensor.DTensor._local_tensor") from None


def storage_key(storage: torch.UntypedStorage) -> int:
    """Address of the C++ storage, the same for every view (checked on 2.13.0; public: none)."""
    try:
        return storage._cdata
    except AttributeError:
        raise missing("torch.UntypedStorage._cdata") from None


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many references hold the C++ storage (every tensor or view on it, every Python storage
    object, a collective's work still holding its tensors) (checked on 2.13.0; public: none)."""
    return _private("torch._C._storage_Use_Count")(storage_key(storage))


def patch_storage_resize(after: Callable[[torch.UntypedStorage], None]) -> Callable[[], None]:
    """Call ``after(storage)`` after each ``UntypedStorage.resize_``; returns the undo (checked on
    2.13.0; public: none, FSDP2 frees and re-allocates parameters with it, unseen by modes)."""
    original = torch.UntypedStorage.resize_

    @functools.wraps(original)
    def resize_(storage: torch.UntypedStorage, size: int):
        result = original(storage, size)
        after(storage)
        return result

    torch.UntypedStorage.resize_ = resize_
    return functools.partial(setattr, torch.UntypedStorage, "resize_", original)


def replicate_with_fsdp(module: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2's ``replicate``: DP for modules with DTensor parameters (checked on 2.13.0; public:
    none)."""
    return _private("torch.distributed._composable.replicate_with_fsdp.replicate")(
        module, mesh=mesh
    )


def rebuild_ddp_buckets(ddp: nn.Module) -> None:
    """Fix a DDP module's gradient buckets now, in parameter order, not from its first step
    (checked on 2.13.0; public: none)."""
    steps = []
    for name in ("_push_all_rebuilt_params", "_rebuild_buckets"):
        step = getattr(ddp.reducer, name, None)
        if step is None:
            raise missing(f"torch.nn.parallel.DistributedDataParallel.reducer.{name}")
        steps.append(step)
    for step in steps:
        step()


def mem_tracker() -> Any:
    """A new torch ``MemTracker``, the tests' oracle for LiveTensorTracker (checked on 2.13.0;
    public: none)."""
    return _private("torch.distributed._tools.mem_tracker.MemTracker")()


def interleaved_1f1b_actions(
    microbatches: int, stages: int, chunks: int, rank: int
) -> list[tuple[int, str]]:
    """torch's interleaved 1F1B order for one pipeline rank, as (stage index, computation type
    name: ``FORWARD`` or ``FULL_BACKWARD``), idle steps left out (checked on 2.13.0; public: none,
    the schedule objects need a live process group)."""
    name = (
        "torch.distributed.pipelining.schedules.ScheduleInterleaved1F1B"
        "._calculate_single_rank_operations"
    )
    calculate = _private(name)
    rounds = max(1, microbatches // stages)
    schedule = SimpleNamespace(  # the attributes the method reads of a real schedule
        n_local_stages=chunks,
        microbatches_per_round=microbatches // rounds,
        pp_group_size=stages,
        _n_microbatches=microbatches,
    )
    actions = calculate(schedule, rank)
    return [(a.stage_index, a.computation_type.name) for a in actions if a is not None]


def pipeline_stage_base() -> type:
    """torch's ``_PipelineStage``, the stage ``Pipe.build_stage`` makes from a traced pipe, to
    subclass (checked on 2.13.0; public: ``build_stage`` only)."""
    return _private("torch.distributed.pipelining.stage._PipelineStage")


def modify_graph_op_device(module: Any, device: torch.device) -> None:
    """Point the device arguments of a traced stage's ops at ``device``, as ``build_stage`` does
    (checked on 2.13.0; public: none)."""
    _private("torch.distributed.pipelining._IR._modify_graph_op_device")(module, device)
