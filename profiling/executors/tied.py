"""Tied parameters across pipeline stages on the torch engine (:mod:`profiling.executors.torch_zoo`
and :mod:`profiling.executors.traced`): an LM head sharing its weight with the input embedding,
planned on another stage.

What torch users run (torchtitan with tied embeddings, ``torch.distributed.pipelining``'s
``pipeline()``, which replicates a parameter used by several stages): every pipeline rank whose
layers use the parameter holds its own copy, with its own gradient and optimizer state; each
copy accumulates the gradient of its own uses, and before the optimizer step the copies'
gradients are summed over the ranks that hold them (an all-reduce over a process group of those
pipeline ranks, one group per data- and tensor-parallel coordinate), so every copy takes the
same step and the copies stay equal: the gradient is the single-process one. The cost model
charges the copy (``solver/costs/embeddings.py``): weights, gradient and optimizer state on the
using stage; the all-reduce is in place (no buffer the tracker sees).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from profiling._torch_compat import local_shard
from solver.parallel import stage_ranks


@dataclass(frozen=True)
class TiedParameter:
    """A parameter that layers of several pipeline ranks use."""

    name: str
    """Its name in the full model (``named_parameters()``, the first of its aliases)."""
    ranks: tuple[int, ...]
    """The pipeline ranks (stages) holding a copy, ascending."""


def tied_parameters(
    model: nn.Module, virtual_layers: list[list[str]], pp: int, schedule: str = "1f1b"
) -> list[TiedParameter]:
    """The parameters of ``model`` (the full model; meta is enough) that layers of two or more
    pipeline ranks use: virtual stage j's layers ``virtual_layers[j]`` run on rank ``j % pp``
    (in a V, zbv and dualpipev: ``solver.parallel.stage_ranks``). The same list, in the same
    order, on every rank."""
    owner = stage_ranks(schedule, pp, max(1, len(virtual_layers) // pp))
    names = {id(param): name for name, param in model.named_parameters()}
    ranks: dict[int, set[int]] = defaultdict(set)
    for index, layers in enumerate(virtual_layers):
        for layer in layers:
            for param in model.get_submodule(layer).parameters():
                ranks[id(param)].add(owner[index])
    return [
        TiedParameter(name=names[key], ranks=tuple(sorted(held)))
        for key, held in ranks.items()
        if len(held) > 1
    ]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2, ``replicate``), a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return local_shard(tensor) if isinstance(tensor, DTensor) else tensor


class TiedGradSync:
    """Sums the tied copies' gradients over the pipeline ranks that hold them.

    Build it on every rank, in the same order (``dist.new_group`` is collective): one group per
    set of holding ranks and per (dp, tp) coordinate, ``rank = (stage * dp + dp_rank) * tp +
    tp_rank``. ``copies`` maps each tied parameter's full-model name to this rank's copies of it
    (one per chunk that uses it). Call the instance after the backward, before the optimizer
    step."""

    def __init__(
        self,
        tied: list[TiedParameter],
        copies: dict[str, list[nn.Parameter]],
        *,
        stage: int,
        dp_rank: int,
        tp_rank: int,
        dp: int,
        tp: int,
    ):
        import torch.distributed as dist

        groups = {}
        for held in sorted({item.ranks for item in tied}):
            for d in range(dp):
                for t in range(tp):
                    group = dist.new_group([(s * dp + d) * tp + t for s in held])
                    if stage in held and (d, t) == (dp_rank, tp_rank):
                        groups[held] = group
        self._work = [
            (groups[item.ranks], copies[item.name])
            for item in tied
            if stage in item.ranks and copies.get(item.name)
        ]

    def __call__(self) -> None:
        """All-reduce (sum) each tied parameter's gradient over its holders, in place."""
        import torch.distributed as dist

        for group, params in self._work:
            grads = [_local(param.grad) for param in params if param.grad is not None]
            if len(grads) != len(params):  # its peers would wait in the all-reduce
                raise RuntimeError("a tied parameter's copy has no gradient after the backward")
            total = grads[0]
            for other in grads[1:]:  # two chunks of this rank hold copies: add theirs first
                total.add_(other)
            dist.all_reduce(total, group=group)
            for other in grads[1:]:
                other.copy_(total)

    @property
    def num_tied(self) -> int:
        """How many tied parameters this rank holds copies of."""
        return len(self._work)
