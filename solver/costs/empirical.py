"""The empirical memory model (``TrainingConfig.memory_model = "empirical"``, mCAP/CAPSlog
statistics in the graph): a stage holding layers a..b peaks at mem_isolated(a) +
sum_{l=a+1..b} mem_added(l), nothing else (``empirical_layer_costs``); times stay analytic.
docs/cost-model.md, "Empirical memory model".
"""

from __future__ import annotations

import numpy as np

from solver.calibration import Calibration
from solver.costs.coefficients import LayerCosts
from solver.errors import InputError
from solver.graph import LayerGraph
from solver.specs import ParallelConfig


def empirical_layer_costs(
    graph: LayerGraph, config: ParallelConfig, costs: LayerCosts
) -> LayerCosts:
    """The empirical (mCAP/CAPSlog) memory model in the cost model's terms; times from ``costs``.

    A stage holding layers a..b peaks at mem_isolated(a) + sum mem_added(a+1..b). On a chain that
    is: weight_bytes[l] = mem_added(l) (mem_isolated for layer 0, always a first layer), and the
    edge l-1 -> l carries mem_isolated(l) - mem_added(l), received once (R_s = 1) by the stage it
    starts; nothing else. Every backend then solves the empirical model exactly.
    """
    layers = graph.layers
    missing = [layer.name for layer in layers if layer.mem_isolated is None]
    if missing:
        raise InputError(
            f"memory model empirical: layers {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''} have no mem_isolated/mem_added; profile them "
            "or plan with the analytic model"
        )
    if not graph.is_chain:
        raise InputError(
            "memory model empirical: the graph is not a chain; the statistics (first layer of a "
            "stage + the layers it adds) describe contiguous stages of a chain"
        )
    if config.tp * config.dp > 1:
        raise InputError(
            f"memory model empirical: config {config.label()} has tp or dp > 1; the statistics "
            "describe one pipeline (pin --tp 1 --dp 1)"
        )
    added = np.array([layer.mem_added for layer in layers], dtype=np.int64)
    isolated = np.array([layer.mem_isolated for layer in layers], dtype=np.int64)
    weight = added.copy()
    weight[0] = isolated[0]
    zeros = np.zeros(len(layers), dtype=np.int64)
    return LayerCosts(
        config=config,
        weight_bytes=weight,
        grad_bytes=zeros,
        optimizer_bytes=zeros,
        stored_bytes=zeros,
        transient_bytes=zeros,
        time_ns=costs.time_ns,
        forward_ns=costs.forward_ns,
        dp_sync_ns=costs.dp_sync_ns,
        edge_src=np.arange(len(layers) - 1, dtype=np.int64),
        edge_dst=np.arange(1, len(layers), dtype=np.int64),
        edge_bytes=(isolated - added)[1:],
        in_flight=costs.in_flight,
        receive_copies=[0] + [1] * (config.pp - 1),
        send_copies=[0] * config.pp,
    )


def check_empirical_options(config: ParallelConfig, calibration: Calibration | None) -> None:
    if config.recompute == "selective":
        raise InputError(
            "memory model empirical: the statistics are measured for one recompute setting; "
            "selective recomputation needs the analytic model"
        )
    if calibration is not None:
        raise InputError(
            "memory model empirical: a calibration scales the analytic model; give one or the other"
        )
