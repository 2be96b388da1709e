"""Mixture-of-experts facts of a layer graph: how many routed experts, how many each token picks.

A graph with routed experts has ``expert_params > 0`` on some layer (``solver.graph.Layer``) and
says in its meta what the router does (``profiling.export`` writes it)::

    "meta": {"moe": {"num_experts": 8, "top_k": 2, "shared_experts": 0, "capacity_factor": 1.0}}

The cost model needs E and k for the dropless routing factor (``solver.costs.routing_factor``) and
the search needs E for the expert-parallel degrees it may try (ep | E). ``capacity_factor``
(optional, default 1.0) is the capacity the graph's expert fields were profiled at (the zoo's
drop-and-pad dispatch: C = ceil(c T k / E) tokens per expert); the routing factor is taken
relative to it. Other keys (``profiling.export`` adds a description) are ignored. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from solver.errors import InputError
from solver.graph import LayerGraph
from solver.parallel import check_expert_degree as check_expert_degree_of

MOE_META_KEYS = ("num_experts", "top_k", "shared_experts", "capacity_factor")
"""Keys of ``meta.moe`` the planner reads (shared_experts optional, default 0; capacity_factor
optional, default 1.0)."""


@dataclass(frozen=True, kw_only=True)
class RoutedExperts:
    """The router of a mixture-of-experts graph (every MoE layer alike)."""

    num_experts: int
    """E: routed experts per MoE layer."""
    top_k: int
    """k: experts each token is sent to (k <= E)."""
    shared_experts: int = 0
    """Experts every token passes through (DeepSeek-MoE); dense weights, not sharded by ep."""
    profiled_capacity_factor: float = 1.0
    """The capacity factor the graph's expert_activation_bytes and ep_comm_bytes were measured
    at (1.0: a balanced routing, each expert T k / E tokens)."""


def routed_experts(graph: LayerGraph) -> RoutedExperts | None:
    """The graph's router from ``meta.moe``, or None for a dense graph (no layer has expert
    parameters). InputError naming the field when a graph with expert parameters lacks a
    valid ``meta.moe`` (cached on the graph object)."""
    if "_routed_experts" in graph.__dict__:
        return graph.__dict__["_routed_experts"]
    result = None
    if any(layer.expert_params for layer in graph.layers):
        result = _parse(graph.meta.get("moe"), graph.source)
    graph.__dict__["_routed_experts"] = result
    return result


def _parse(record: object, source: str) -> RoutedExperts:
    where = f"{source}: $.meta.moe"
    fix = (
        'a graph with routed experts (expert_params > 0) gives {"num_experts": E, "top_k": k, '
        '"shared_experts": n}; re-export it with profiling.export'
    )
    if not isinstance(record, dict):
        raise InputError(f"{where}: missing or not an object; {fix}")
    values = {}
    for key, low in (("num_experts", 1), ("top_k", 1), ("shared_experts", 0)):
        value = record.get(key, 0 if key == "shared_experts" else None)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 2**24:
            raise InputError(f"{where}.{key}: {value!r} is not an integer in {low}..2^24; {fix}")
        values[key] = value
    factor = record.get("capacity_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor <= 1024:
        raise InputError(
            f"{where}.capacity_factor: {factor!r} is not a number in 1..1024 (the capacity the "
            "expert fields were profiled at); re-export the graph or remove the key"
        )
    values["profiled_capacity_factor"] = float(factor)
    if values["top_k"] > values["num_experts"]:
        raise InputError(
            f"{where}.top_k: {values['top_k']} exceeds num_experts ({values['num_experts']}); "
            "each token picks k of the E routed experts"
        )
    return RoutedExperts(**values)


def num_routed_experts(graph: LayerGraph) -> int | None:
    """E of a mixture-of-experts graph, None for a dense one (``routed_experts``)."""
    experts = routed_experts(graph)
    return None if experts is None else experts.num_experts


def check_expert_degree(graph: LayerGraph, ep: int, *, flag: str = "--ep") -> None:
    """InputError unless expert-parallel degree ``ep`` fits the graph's routed experts
    (``solver.parallel.check_expert_degree``: 1 on any graph; above 1 only on a graph with routed
    experts, and dividing their number)."""
    check_expert_degree_of(ep, num_routed_experts(graph), graph.source, flag=flag)
