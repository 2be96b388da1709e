"""``attention_kv_bytes``: the keys and values each layer's attention reads, what ring attention
passes around under context parallelism (``solver.costs.ring_attention_bytes``).

:class:`AttentionKV` watches a profiled forward and adds, per owning layer, the bytes of the
``key`` and ``value`` of every attention call:

- ``F.scaled_dot_product_attention`` and the aten op a ``torch.export`` trace calls (the zoo's
  ``attention="sdpa"``, HuggingFace's ``sdpa`` attention);
- the zoo's explicit attention (``models.common.explicit_attention``, patched for the run).

The zoo's explicit attention also adds ``score_bytes_by_owner``: the bytes of one [b, heads, s_q,
s_k] score matrix per call, in q's dtype (``attention_score_bytes``: what Megatron's own
``DotProductAttention`` sizes its buffers by, ``solver.costs.megatron_attention``); fused
attention makes none.

Bytes are the *distinct* elements of k and v: grouped-query attention that widens its KV heads
to the query heads before the call (HuggingFace's ``repeat_kv``: an ``expand`` then a copying
``reshape``; the zoo's explicit path: ``repeat_interleave``) still counts its kv heads, as a
context-parallel run exchanges K/V before widening them (TransformerEngine takes GQA natively). A
shape op's result remembers the distinct bytes of its input (``_SHAPE_OPS``); a stride-0
dimension (``expand``) holds no new elements. Per batch; ``graph_builder`` divides by it.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

_SDPA_CALLS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)

_SHAPE_OPS = frozenset(
    {
        torch.Tensor.repeat_interleave,
        torch.repeat_interleave,
        torch.Tensor.reshape,
        torch.reshape,
        torch.Tensor.view,
        torch.Tensor.expand,
        torch.Tensor.contiguous,
        torch.Tensor.transpose,
        torch.transpose,
        torch.Tensor.__getitem__,
        torch.Tensor.flatten,
        torch.flatten,
    }
)
"""Ops whose result holds no more distinct elements than their input (widened GQA heads)."""


class AttentionKV(TorchFunctionMode):
    """Adds k + v bytes of each attention call in the forward to ``bytes_by_owner[owner()]``.

    ``phase`` and ``owner`` are the tracer's (``profiling.trace.dataflow.Tracer``): only calls while
    ``phase() == "fwd"`` count, each to the layer running it."""

    def __init__(self, phase, owner) -> None:
        super().__init__()
        self._phase = phase
        self._owner = owner
        self.bytes_by_owner: dict[int, int] = defaultdict(int)
        self.score_bytes_by_owner: dict[int, int] = defaultdict(int)
        self._distinct = WeakIdKeyDictionary()

    def distinct_bytes(self, tensor: torch.Tensor) -> int:
        """Bytes of the distinct elements ``tensor`` holds (see the module docstring)."""
        elements = math.prod(
            size for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if stride
        )
        own = elements * tensor.element_size()
        known = self._distinct.get(tensor)
        return own if known is None else min(own, known)

    def record(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Count one attention call's keys and values to the running layer."""
        if self._phase() == "fwd":
            self.bytes_by_owner[self._owner()] += self.distinct_bytes(key)
            self.bytes_by_owner[self._owner()] += self.distinct_bytes(value)

    def record_scores(self, query: torch.Tensor, key: torch.Tensor) -> None:
        """Count one explicit attention call's [b, heads, s_q, s_k] scores to the running layer."""
        if self._phase() == "fwd":
            scores = query.shape[:-1].numel() * key.shape[-2] * query.element_size()
            self.score_bytes_by_owner[self._owner()] += scores

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA_CALLS:
            key = kwargs["key"] if "key" in kwargs else args[1]
            value = kwargs["value"] if "value" in kwargs else args[2]
            self.record(key, value)
        out = func(*args, **kwargs)
        if func in _SHAPE_OPS and isinstance(out, torch.Tensor):
            source = args[0] if args else kwargs.get("input")
            if isinstance(source, torch.Tensor) and out.numel():
                self._distinct[out] = self.distinct_bytes(source)
        return out


@contextlib.contextmanager
def attention_kv(phase, owner):
    """Run under :class:`AttentionKV`, with the zoo's explicit attention recorded too; yields the
    mode (its ``bytes_by_owner`` per owner, per batch)."""
    mode = AttentionKV(phase, owner)
    zoo = sys.modules.get("models.common")
    explicit = getattr(zoo, "explicit_attention", None)
    if explicit is not None:

        def recorded(q, k, v, *args, **kwargs):
            mode.record(k, v)
            mode.record_scores(q, k)
            return explicit(q, k, v, *args, **kwargs)

        zoo.explicit_attention = recorded
    try:
        with mode:
            yield mode
    finally:
        if explicit is not None:
            zoo.explicit_attention = explicit
