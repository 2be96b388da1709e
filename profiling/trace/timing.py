"""Per-layer forward and backward time of a real run (``profile_module(mode="real")``).

    fwd_ms, bwd_ms = time_layers(selection, run_loss, params, device=device)   # ms per batch

One warm-up run, then ``TIMED_RUNS`` timed forward + backward runs; each layer keeps the median.
Each run's wall time is cut into intervals by timestamps: the **forward** at the selected layers'
forward pre-hooks and hooks (the hooks' own time is left out; glue code between layers goes to
the layer that finished last, glue before the first layer to the first layer, as in
``dataflow.py``); the **backward** at pre-hooks on the autograd nodes, each node owned by the
layer whose forward made it (glue nodes as in the forward). Timestamps are CUDA events on a GPU
and ``time.perf_counter`` on the CPU. The caller divides by the batch size for ms per sample.

The runs use the process's ``torch.get_num_threads()`` CPU threads; :func:`timing_meta` is what
the graph records of them (``meta.timing``), so that a real run of a plan gives each rank the
same count (``profiling.run.rank_threads``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from profiling.trace.cuda_attention import cuda_like_kernels
from profiling.trace.dataflow import PENDING, assign_nodes, tensors_in

TIMED_RUNS = 3
"""Timed forward + backward runs in real mode (after one warm-up); the median is kept."""


class _LayerTimer:
    """Splits each run's wall time between layers at forward hooks and autograd-node pre-hooks."""

    def __init__(self, num_layers: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.num_layers = num_layers
        self.marks: list[tuple[Any, str | None, int]] = []
        self.active: int | None = None
        self.last_finished: int | None = None
        self.first_layer: int | None = None
        self.node_owner: dict[Any, int] = {}
        self.bwd_owner: int | None = None

    def _stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self, phase: str | None, owner: int) -> None:
        self.marks.append((self._stamp(), phase, owner))

    def glue_owner(self) -> int:
        return self.last_finished if self.last_finished is not None else PENDING

    def _hook_node(self, node, owner):
        try:
            node.register_prehook(lambda _grads, owner=owner: self._enter_node(owner))
        except RuntimeError:  # a node that takes no pre-hook
            pass

    def _enter_node(self, owner: int) -> None:
        owner = self.first_layer if owner == PENDING else owner
        if owner != self.bwd_owner:
            self.bwd_owner = owner
            self.mark("bwd", owner)

    def enter(self, index: int, args, kwargs) -> None:
        self.mark(None, index)  # hook overhead is left out on the CPU
        assign_nodes(
            tensors_in((args, kwargs)), self.glue_owner(), self.node_owner, self._hook_node
        )
        if self.first_layer is None:
            self.first_layer = index
        self.active = index
        self.mark("fwd", index)

    def exit(self, index: int, output) -> None:
        self.mark(None, index)
        assign_nodes(tensors_in(output), index, self.node_owner, self._hook_node)
        self.active, self.last_finished = None, index
        self.mark("fwd", index)

    def start_backward(self, loss: torch.Tensor) -> None:
        self.mark(None, 0)
        assign_nodes([loss], self.glue_owner(), self.node_owner, self._hook_node)
        self.bwd_owner = None
        self._enter_node(self.glue_owner())

    def totals(self) -> tuple[list[float], list[float]]:
        """(forward ms, backward ms) per layer for the marks of one run."""
        if self.cuda:
            torch.cuda.synchronize()
        fwd, bwd = [0.0] * self.num_layers, [0.0] * self.num_layers
        for (start, phase, owner), (end, _, _) in zip(self.marks, self.marks[1:], strict=False):
            if phase is None:
                continue
            owner = self.first_layer if owner == PENDING else owner
            elapsed = start.elapsed_time(end) if self.cuda else (end - start) * 1000.0
            (fwd if phase == "fwd" else bwd)[owner] += elapsed
        return fwd, bwd


def timing_meta(device: torch.device) -> dict[str, Any]:
    """How :func:`time_layers` times on ``device`` now, for the graph's ``meta.timing``: the
    device type, ``torch.get_num_threads()`` and the timed runs per layer."""
    return {"device": device.type, "threads": torch.get_num_threads(), "timed_runs": TIMED_RUNS}


def time_layers(
    selection: list[tuple[str, nn.Module]],
    run_loss: Callable[[], torch.Tensor],
    params: list[torch.Tensor],
    *,
    device: torch.device,
    progress: Callable[[str], None] | None = None,
    cuda_like: bool = True,
) -> tuple[list[float], list[float]]:
    """Median per-layer forward and backward time (ms per batch) over TIMED_RUNS runs.

    ``run_loss`` runs the forward and returns the loss; ``params`` are the tensors the run
    differentiates, whose ``.grad`` is cleared after each run; ``cuda_like`` runs dropout and
    attention as CUDA does (``cuda_attention.cuda_like_kernels``, as the traced run does);
    ``progress`` is called once per run.
    """
    say = progress or (lambda _message: None)
    index_of = {id(m): i for i, (_, m) in enumerate(selection)}
    timer: _LayerTimer | None = None

    def pre(mod, args, kwargs):
        if timer is not None and timer.active is None:
            timer.enter(index_of[id(mod)], args, kwargs)

    def post(mod, args, kwargs, output):
        if timer is not None and timer.active == index_of[id(mod)]:
            timer.exit(index_of[id(mod)], output)

    handles = []
    for _, mod in selection:
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    runs: list[tuple[list[float], list[float]]] = []
    try:
        for run in range(1 + TIMED_RUNS):
            say(f"timing run {run + 1}/{1 + TIMED_RUNS}" + (" (warm-up)" if run == 0 else ""))
            timer = _LayerTimer(len(selection), device)
            if timer.cuda:
                torch.cuda.synchronize()
            timer.mark("fwd", PENDING)
            with cuda_like_kernels(cuda_like):
                loss = run_loss()
                timer.start_backward(loss)
                loss.backward()
            timer.mark(None, 0)
            if run > 0:
                runs.append(timer.totals())
            timer = None
            for tensor in params:
                tensor.grad = None
    finally:
        for handle in handles:
            handle.remove()
    fwd = [statistics.median(r[0][i] for r in runs) for i in range(len(selection))]
    bwd = [statistics.median(r[1][i] for r in runs) for i in range(len(selection))]
    return fwd, bwd
