"""Exact live-tensor memory accounting on any device (CPU runs have no allocator statistics).

``LiveTensorTracker`` is a ``TorchDispatchMode`` that sees every tensor an operator returns, counts
each storage once (``UntypedStorage.nbytes()``, views share it) from the moment it appears until
its Python storage object is finalized, and keeps the running total and its peak. Each storage
carries a category, so the peak comes with a breakdown:

    params       registered with ``track_module`` (weights and buffers that existed before)
    grads        a parameter's ``.grad`` once accumulated (``track_grads`` hooks; FSDP2's unsharded
                 gradients stay ``other`` until reduce-scattered and tagged by the caller)
    optimizer    optimizer state after a step (``track_optimizer``)
    activations  tensors saved for backward (``saved_tensors``), unless already params/grads
    other        everything else: stage inputs/outputs, receive buffers, DDP buckets, temporaries

With ``tag_peak=True`` (or the environment variable ``MEMPLAN_PEAK_TAGS`` set to a folder, which
the engines' ranks read: ``profiling.executors.base.Measured.at_peak`` writes
``rank<N>.txt`` there) every storage also carries a tag when it appears: its shape and dtype and
the innermost frames of the code that made it; ``peak_tags`` groups the storages live at the peak
by category and tag. That is how a measured peak is taken apart byte by byte (slower: a stack per
storage and a copy of the live set at every new peak).

This is the accounting of ``torch.distributed._tools.mem_tracker.MemTracker`` (same weak-reference
scheme), reduced to what the executor needs: a peak reset per iteration (``reset_peak``) and a
split that matches the cost model's terms. Tensors created before the mode was entered are only
counted when registered; tensors created by other threads without the mode (gloo's own buffers)
are not counted.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from profiling._torch_compat import (
    TorchDispatchMode,
    local_shard,
    patch_storage_resize,
    storage_key,
    tree_flatten,
)

CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
"""Breakdown keys, in report order."""

_RETAGGABLE = {
    "params": ("other",),
    "grads": ("other", "activations"),
    "optimizer": ("other", "activations", "grads"),
    "activations": ("other",),
    "other": (),
}
"""Which categories a storage may move from when tagged again (a weight saved for backward stays a
weight; a fresh gradient or optimizer state leaves the catch-all; a weight re-created by sharding
is registered again as one)."""

PEAK_TAGS_ENV = "MEMPLAN_PEAK_TAGS"
"""A folder: the engines' ranks tag their storages and write what was live at the peak there."""
_TAG_FRAMES = 5
_SKIPPED = (
    "/torch/utils/",
    "/torch/_dynamo/",
    "/torch/_compile.py",
    "/torch/overrides.py",
    "/torch/_tensor.py",
    "/profiling/trace/memory.py",
    "/profiling/executors/megatron_cpu.py",
)
"""Frames a tag leaves out: the tracker's own, dispatch and torch-function plumbing."""


def storage_tag(tensor: torch.Tensor) -> str:
    """Shape, dtype and the innermost frames (file:line:function, innermost first; paths from
    ``site-packages/`` or the checkout) of the code that made ``tensor``."""
    frames = [
        f"{_short(frame.filename)}:{frame.lineno}:{frame.name}"
        for frame in traceback.extract_stack()
        if not any(part in frame.filename for part in _SKIPPED)
    ]
    return f"{tuple(tensor.shape)} {tensor.dtype} | " + " < ".join(frames[::-1][:_TAG_FRAMES])


def _short(path: str) -> str:
    if "site-packages/" in path:
        return path.split("site-packages/")[-1]
    for root in ("/profiling/", "/models/", "/solver/", "/scripts/"):
        if root in path:
            return root[1:] + path.split(root, 1)[1]
    return path


def write_peak_tags(tracker: LiveTensorTracker, rank: int) -> None:
    """With ``MEMPLAN_PEAK_TAGS`` set and ``tracker.tag_peak``, write ``rank<rank>.txt`` there
    (the folder made if missing: a rank that fails to write its tags fails its run): the peak,
    its breakdown and every group of ``peak_tags`` (count x bytes = total)."""
    folder = os.environ.get(PEAK_TAGS_ENV)
    if not folder or not tracker.tag_peak:
        return
    lines = [f"peak {tracker.peak_bytes} {tracker.peak_breakdown}"]
    for category, tag, count, total in tracker.peak_tags():
        lines.append(f"{category:<11} {count:4d} x = {total:>11}  {tag}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{rank}.txt"), "w", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")


class LiveTensorTracker(TorchDispatchMode):
    """Live storage bytes, their peak since ``reset_peak`` and the breakdown at that peak."""

    def __init__(self, tag_peak: bool | None = None) -> None:
        """``tag_peak``: tag every storage and keep the live set at the peak (``peak_tags``);
        None: when ``MEMPLAN_PEAK_TAGS`` is set."""
        super().__init__()
        self._live: dict[int, list] = {}  # storage key -> [nbytes, category, weakref]
        self.tag_peak = bool(os.environ.get(PEAK_TAGS_ENV)) if tag_peak is None else tag_peak
        self._tags: dict[int, str] = {}  # storage key -> tag (``tag_peak`` only)
        self._peak_live: list[tuple[int, str, str]] = []  # (bytes, category, tag) at the peak
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.current_bytes = 0
        self.peak_bytes = 0
        self.peak_breakdown = dict(self.current)
        self.window_bytes = 0
        """The peak since the last :meth:`take_window` (or ``reset_peak``)."""
        self.num_tracked = 0
        """Calls of :meth:`track` so far (whatever called it: the mode, a hook, the caller)."""
        self._handles: dict[str, list] = {"gradient hooks": [], "optimizer hooks": []}
        self._entered = False
        self._saving = False

    # -- accounting -------------------------------------------------------------------------

    def _release(self, key: int, _ref: weakref.ref) -> None:
        self._tags.pop(key, None)
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current[entry[1]] -= entry[0]
            self.current_bytes -= entry[0]

    def track(self, tensor: torch.Tensor, category: str = "other") -> None:
        """Count ``tensor``'s storage once; retag it to ``category`` if ``_RETAGGABLE`` allows."""
        if isinstance(tensor, DTensor):
            tensor = local_shard(tensor)  # a shard: count the local storage
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        self.num_tracked += 1
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        nbytes = storage.nbytes()
        entry = self._live.get(key)
        if entry is None:
            ref = weakref.ref(storage, functools.partial(self._release, key))
            self._live[key] = [nbytes, category, ref]
            if self.tag_peak:
                self._tags[key] = storage_tag(tensor)
            self.current[category] += nbytes
            self.current_bytes += nbytes
        else:
            if entry[0] != nbytes:  # resized in place
                self.current[entry[1]] += nbytes - entry[0]
                self.current_bytes += nbytes - entry[0]
                entry[0] = nbytes
            if category != entry[1] and entry[1] in _RETAGGABLE[category]:
                self.current[entry[1]] -= nbytes
                self.current[category] += nbytes
                entry[1] = category
        self._update_peak()

    def _update_peak(self) -> None:
        if self.current_bytes > self.window_bytes:
            self.window_bytes = self.current_bytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self.peak_breakdown = dict(self.current)
            self._keep_peak_live()

    def _keep_peak_live(self) -> None:
        if self.tag_peak:
            self._peak_live = [
                (entry[0], entry[1], self._tags.get(key, "(tracked before tagging)"))
                for key, entry in self._live.items()
            ]

    def peak_tags(self) -> list[tuple[str, str, int, int]]:
        """The storages live at the peak (``tag_peak``), grouped: (category, tag, count, bytes),
        by category, then the largest first; their bytes sum to ``peak_bytes``."""
        groups: dict[tuple[str, str], list[int]] = {}
        for nbytes, category, tag in self._peak_live:
            group = groups.setdefault((category, f"{nbytes} B {tag}"), [0, 0])
            group[0] += 1
            group[1] += nbytes
        return sorted(
            ((category, tag, count, total) for (category, tag), (count, total) in groups.items()),
            key=lambda row: (CATEGORIES.index(row[0]), -row[3]),
        )

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes (call at the start of an iteration)."""
        self.peak_bytes = self.window_bytes = self.current_bytes
        self.peak_breakdown = dict(self.current)
        self._keep_peak_live()

    def take_window(self) -> int:
        """The peak live bytes since the last call (or ``reset_peak``); starts the next window
        at the current live bytes (the memory at each action of a schedule,
        ``profiling.executors.base.ActionRecorder``)."""
        peak, self.window_bytes = self.window_bytes, self.current_bytes
        return peak

    # -- registration -----------------------------------------------------------------------

    def track_module(self, module: nn.Module) -> None:
        """Count the module's existing parameters and buffers as ``params``."""
        for tensor in (*module.parameters(), *module.buffers()):
            self.track(tensor, "params")

    def track_grads(self, module: nn.Module) -> None:
        """Tag each parameter's ``.grad`` as ``grads`` whenever it has been accumulated."""
        for param in module.parameters():
            if param.requires_grad:
                handle = param.register_post_accumulate_grad_hook(
                    lambda p: self.track(p.grad, "grads") if p.grad is not None else None
                )
                self._handles["gradient hooks"].append(handle)

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Tag the optimizer's state tensors as ``optimizer`` after every step."""

        def tag_states(opt: torch.optim.Optimizer, *_args) -> None:
            for state in opt.state.values():
                for value in state.values():
                    self.track(value, "optimizer")

        self._handles["optimizer hooks"].append(optimizer.register_step_post_hook(tag_states))

    @contextlib.contextmanager
    def saved_tensors(self) -> Iterator[None]:
        """Within it, tensors autograd saves for backward are tagged ``activations``."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.track(tensor, "activations")
            # the same storage without its grad_fn: a packed output that kept its own node would
            # be a reference cycle through C++ autograd nodes that nothing frees, once a graph
            # outlives its backward (retain_graph=True: the split backward's input step)
            return tensor.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            self._saving = True
            try:
                yield
            finally:
                self._saving = False

    # -- switching it off -------------------------------------------------------------------

    def close(self) -> None:
        """Stop counting for good (after the mode was exited): remove the gradient and optimizer
        hooks and forget the live storages, whose weak-reference callbacks go with them. The peak
        read so far stays. What a clean, uninstrumented timing runs after
        (``profiling.executors.base.clean_steps``)."""
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
            handles.clear()
        self._live.clear()
        self._tags.clear()

    def active_instrumentation(self) -> list[str]:
        """What of this tracker is installed now: its dispatch mode, its saved-tensor hooks, its
        storage-resize patch, gradient or optimizer hooks still registered (empty after
        :meth:`close` outside the mode)."""
        found = [
            name
            for name, on in (
                ("dispatch mode", self._entered),
                ("saved-tensor hooks", self._saving),
                ("storage resize patch", hasattr(torch.UntypedStorage.resize_, "__wrapped__")),
            )
            if on
        ]
        for name, handles in self._handles.items():
            installed = [h for h in handles if (hooks := h.hooks_dict_ref()) and h.id in hooks]
            if installed:
                found.append(f"{name} ({len(installed)})")
        return found

    # -- the mode ---------------------------------------------------------------------------

    def __enter__(self) -> LiveTensorTracker:
        # FSDP2 frees and re-allocates unsharded parameters with ``UntypedStorage.resize_``,
        # which no dispatch mode sees (MemTracker patches it the same way).
        self._unpatch_resize = patch_storage_resize(self._resized)
        self._entered = True
        return super().__enter__()

    def __exit__(self, *args) -> None:
        self._unpatch_resize()
        self._entered = False
        super().__exit__(*args)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._live.get(storage_key(storage))
        if entry is not None and entry[0] != storage.nbytes():
            self.current[entry[1]] += storage.nbytes() - entry[0]
            self.current_bytes += storage.nbytes() - entry[0]
            entry[0] = storage.nbytes()
            self._update_peak()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented  # let DTensor run its local ops, which come back through here
        result = func(*args, **(kwargs or {}))
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor):
                self.track(value)
        return result
