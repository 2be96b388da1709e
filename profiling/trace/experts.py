"""Mixture-of-experts fields of a profiled layer: ``expert_params``, ``expert_activation_bytes``,
``ep_comm_bytes`` and the graph's ``meta["moe"]``.

The rule is by module name, as Megatron-core, the zoo (``models/moe.py``) and transformers name
their routed experts: a module whose path has a component ``experts`` (zoo ``layers.3.mlp.experts``,
HF Mixtral and Qwen-MoE ``model.layers.3.mlp.experts``, older Linear-per-expert layouts
``...experts.0.w1``) is a routed expert. ``shared_experts`` / ``shared_expert`` (DeepSeek, Qwen)
and the router are not: they run for every token on every rank.

- ``expert_params``: parameters under such a module. They are never split by the
  tensor-parallel rule (``tensor_parallel.py`` skips Linear calls inside experts), so they are
  disjoint from ``tp_params``.
- ``expert_activation_bytes``: bytes first saved for backward by an op that runs inside the
  experts module (``Tracer.in_experts``): with the zoo's and transformers' experts signature
  ``experts(hidden (T, h), top_k_index (T, k), top_k_weights (T, k))`` that is the capacity map,
  the permutation indices, the permuted tokens, the experts' own tensors, their outputs and the
  permuted probabilities (``models/moe.py`` lists them), not the router's. A saved tensor the
  tensor-parallel rule splits is left to ``tp_activation_bytes`` (disjoint).
- ``ep_comm_bytes``: per call of an experts module, the dispatch all-to-all sends the permuted
  tokens (E x C x h) and the combine all-to-all the expert outputs (E x C x h), each once in the
  forward and once (their gradients) in the backward: 4 E C h bytes-per-element, with C the
  capacity ``models.moe.expert_capacity(T, k, E, CF)``. CF is the module's
  ``capacity_factor`` (the zoo's config field), 1.0 when it has none (transformers' experts,
  profiled through the capacity dispatch of ``_transformers_compat.use_capacity_experts``): a
  balanced routing, each expert receiving T k / E tokens.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch import nn

from models.moe import expert_capacity
from profiling.trace.dataflow import Tracer, tensors_in

EXPERTS = "experts"
"""The path component that marks routed experts."""

SHARED_EXPERTS = ("shared_experts", "shared_expert")
"""Names of the always-active shared experts next to ``experts`` (DeepSeek, Qwen-MoE)."""


def is_expert_path(path: str) -> bool:
    """Whether a module or parameter path lies inside a routed-experts module."""
    return EXPERTS in path.split(".")


def _num_experts(module: nn.Module) -> int:
    count = getattr(module, "num_experts", None)
    if isinstance(count, int) and count > 0:
        return count
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return len(module)
    first = next(module.parameters(), None)
    return int(first.shape[0]) if first is not None and first.dim() == 3 else 1


def _expert_width(module: nn.Module, num_experts: int, hidden: int) -> int:
    """One routed expert's MLP width (Megatron's ``--moe-ffn-hidden-size``): the smallest
    dimension other than the hidden size among its weight matrices (stacked (E, a, b) tensors
    or one Linear per expert), so a fused gate-and-up projection (2 f) does not count; the
    hidden size when every dimension is."""
    dims = set()
    for param in module.parameters():
        if param.dim() == 3 and param.shape[0] == num_experts:
            dims.update(param.shape[1:])
        elif param.dim() == 2:
            dims.update(param.shape)
    return min((d for d in dims if d != hidden), default=hidden)


class ExpertTracker:
    """Follows the experts modules during the traced forward (called from the module hooks)."""

    def __init__(self, root: nn.Module, tracer: Tracer):
        self.tracer = tracer
        self.root = root
        self.paths = {module: path for path, module in root.named_modules()}
        self.expert_modules = {id(m) for m, path in self.paths.items() if is_expert_path(path)}
        self.depth = 0
        self.comm_bytes: dict[int, int] = defaultdict(int)
        """Layer -> all-to-all bytes, forward + backward, batch total."""
        self.moe: dict[str, Any] | None = None
        """``{"num_experts", "top_k", "shared_experts", "capacity_factor", "expert_ffn_hidden",
        "shared_expert_ffn_hidden"}`` of the first experts call, for the graph's meta."""
        tracer.in_experts = self.inside

    def inside(self) -> bool:
        return self.depth > 0

    def enter(self, module: nn.Module) -> None:
        if id(module) in self.expert_modules:
            self.depth += 1

    def exit(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if id(module) not in self.expert_modules:
            return
        self.depth -= 1
        path = self.paths.get(module, "")
        if self.depth or path.split(".")[-1] != EXPERTS:
            return
        tensors = tensors_in((args, kwargs))
        index = next((t for t in tensors[1:] if not t.is_floating_point()), None)
        if not tensors or index is None or tensors[0].dim() == 0:
            return
        hidden = tensors[0]
        width = hidden.shape[-1]
        tokens, top_k = hidden.numel() // width, index.shape[-1]
        num_experts = _num_experts(module)
        factor = float(getattr(module, "capacity_factor", 1.0))
        capacity = expert_capacity(
            tokens, top_k=top_k, num_experts=num_experts, capacity_factor=factor
        )
        layer = self.tracer.active if self.tracer.active is not None else self.tracer.owner()
        self.comm_bytes[layer] += 4 * num_experts * capacity * width * hidden.element_size()
        if self.moe is None:
            self.moe = {
                "num_experts": num_experts,
                "top_k": int(top_k),
                "shared_experts": self._shared(path, module, num_experts),
                "capacity_factor": factor,
                "expert_ffn_hidden": _expert_width(module, num_experts, width),
                "shared_expert_ffn_hidden": self._shared_width(path, width),
                "expert_fields": (
                    "expert_activation_bytes and ep_comm_bytes at a balanced routing: each "
                    "expert takes C = ceil(capacity_factor x tokens x top_k / num_experts) "
                    "tokens (drop-and-pad dispatch)"
                ),
            }

    def _shared_width(self, path: str, hidden: int) -> int:
        """The shared experts' MLP width (all of them as one MLP, Megatron's
        ``--moe-shared-expert-intermediate-size``; 0: none): the input width of their Linear
        projecting back to the hidden size (the smallest, when several do)."""
        parent = self.root.get_submodule(path.rpartition(".")[0]) if "." in path else self.root
        widths = [
            m.in_features
            for name in SHARED_EXPERTS
            if isinstance(getattr(parent, name, None), nn.Module)
            for m in getattr(parent, name).modules()
            if isinstance(m, nn.Linear) and m.out_features == hidden
        ]
        return min(widths, default=0)

    def _shared(self, path: str, experts: nn.Module, num_experts: int) -> int:
        """Shared experts next to ``experts``, in units of one routed expert's parameters
        (DeepSeek-MoE 16B: 2; Qwen1.5-MoE-A2.7B's one shared MLP of 4 x 1408: 4)."""
        parent = self.root.get_submodule(path.rpartition(".")[0]) if "." in path else self.root
        per_expert = sum(p.numel() for p in experts.parameters()) / num_experts
        shared = sum(
            p.numel()
            for name in SHARED_EXPERTS
            if isinstance(getattr(parent, name, None), nn.Module)
            for p in getattr(parent, name).parameters()
        )
        return round(shared / per_expert) if per_expert else 0
