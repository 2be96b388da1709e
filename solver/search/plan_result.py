"""The planner's answer: :class:`Plan`, a chosen config and split with its exact costs, and the
engine exports and baseline splits it builds when first read."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from solver.costs import LayerCosts
from solver.evaluation import Evaluation, evaluate_assignment
from solver.exports import build_exports
from solver.graph import LayerGraph
from solver.report.baselines import BASELINES
from solver.specs import Cluster, SolverReport, TrainingConfig


@dataclass(kw_only=True)
class Plan:
    """A chosen config and split, its exact costs, how it was found, and its exports."""

    evaluation: Evaluation
    solver: SolverReport
    make_exports: Callable[[], dict[str, Any]] = field(repr=False, compare=False)
    """Builds :attr:`exports` when first read."""
    make_baselines: Callable[[], dict[str, Evaluation]] = field(
        default=dict, repr=False, compare=False
    )
    """Builds :attr:`baselines` when first read."""
    make_best_baselines: Callable[[], Any] = field(default=lambda: None, repr=False, compare=False)
    """Builds :attr:`best_baselines` when first read."""
    required_throughput: float | None = None
    """The throughput constraint that was applied (samples/s), if any."""
    fastest_throughput: float | None = None
    """Throughput of the fastest plan that fits in memory, when it was computed."""
    iteration_budget_ns: int | None = None
    """The longest simulated iteration the plan was allowed (the throughput constraint), ns."""
    fastest_iteration_ns: int | None = None
    """The simulated iteration of the fastest plan that fits, when it was searched, ns."""

    @functools.cached_property
    def exports(self) -> dict[str, Any]:
        """The plan for each engine (``solver.exports.build_exports``), built when first
        read: a millisecond or two that an in-process caller wanting only the split skips."""
        return self.make_exports()

    @functools.cached_property
    def baselines(self) -> dict[str, Evaluation]:
        """The same config split the usual ways (even, parameters), for comparison: same ZeRO
        stage and recompute mode, the plan's recomputed layers under selective recomputation,
        the plan's stage groups on a heterogeneous cluster; evaluated when first read."""
        return self.make_baselines()

    @functools.cached_property
    def best_baselines(self):
        """What a user would run instead, each baseline family at its best config over the
        candidate configs (``solver.search.best_baselines.BestBaselines``), searched when first
        read within the planning call's time limit; None when not searched."""
        return self.make_best_baselines()

    @property
    def config(self):
        return self.evaluation.config

    @property
    def stages(self):
        return self.evaluation.stages

    @property
    def peak_bytes(self) -> int:
        return self.evaluation.peak_bytes

    @property
    def throughput(self) -> float:
        return self.evaluation.throughput

    @property
    def stage_of_layer(self) -> list[int]:
        return self.evaluation.stage_of_layer


def _plan_exports(
    graph: LayerGraph,
    training: TrainingConfig,
    evaluation: Evaluation,
    costs: LayerCosts | None = None,
    placed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The engine exports of an evaluated plan (``Plan.exports``). When the Megatron export's
    recompute flags realise a per-stage choice other than the plan's (``recompute.exact`` false),
    each stage's peak under those flags is evaluated with ``costs`` and added as
    ``recompute.realised_peak_bytes``."""
    exports = build_exports(
        graph,
        evaluation.config,
        evaluation.virtual_stage_layer_names(),
        recomputed=evaluation.virtual_stage_recomputed_names(),
        moe_capacity_factor=training.moe_capacity_factor,
        precision=training.precision,
        optimizer=training.optimizer,
        bytes_per_param=(
            training.weight_bytes_per_param,
            training.grad_bytes_per_param,
            training.optimizer_bytes_per_param,
        ),
    )
    record = exports["megatron"].get("recompute")  # none in a refused section
    if costs is not None and record is not None and not record["exact"]:
        chosen = {name for names in record["exported_per_stage"] for name in names}
        realised = evaluate_assignment(
            graph,
            costs,
            evaluation.stage_of_layer,
            cluster=evaluation.cluster,
            training=training,
            recomputed=[name in chosen for name in graph.names],
            **(placed or {}),
        )
        record["realised_peak_bytes"] = [stage.peak_bytes for stage in realised.stages]
    return exports


def _baseline_evaluations(
    graph: LayerGraph,
    costs: LayerCosts,
    *,
    cluster: Cluster,
    training: TrainingConfig,
    recomputed: list[bool] | None,
    placed: dict[str, Any],
) -> dict[str, Evaluation]:
    """The usual splits of the plan's config (``Plan.baselines``), like with like: the plan's
    config (ZeRO stage, recompute mode, schedule), and under selective recomputation the plan's
    recomputed layers (a flag per layer, so it applies to any split), and on a heterogeneous
    cluster the plan's stage groups."""
    return {
        name: evaluate_assignment(
            graph,
            costs,
            split_of(graph, costs.num_stages),
            cluster=cluster,
            training=training,
            recomputed=recomputed,
            **placed,
        )
        for name, split_of in BASELINES.items()
    }
