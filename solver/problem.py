"""The per-config partitioning problem every backend solves, and what a backend returns.

Data flows one way: graph -> candidate config -> :class:`StageProblem` (cost coefficients from
``cost_model``) -> a backend (chain, CP-SAT, MILP) -> :class:`StageSolution` -> plan.

The problem: assign each layer a stage 0..p-1 so that for every edge u->v stage(u) <= stage(v),
every stage is non-empty, every stage peak <= ``capacity_bytes`` (when set) and the iteration time
<= ``iteration_budget_ns`` (when set); minimise the largest stage peak (objective "memory") or
the iteration time (objective "time"). Under ``recompute="selective"`` a solution also says
which layers are recomputed (``StageSolution.recomputed``), chosen jointly with the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.cost_model import LayerCosts, iteration_time_ns, stage_costs

OPTIMAL = "OPTIMAL"
FEASIBLE = "FEASIBLE"  # a solution, optimality not proven (time limit)
INFEASIBLE = "INFEASIBLE"  # proven: no assignment satisfies the constraints
UNKNOWN = "UNKNOWN"  # time limit hit before any solution and before a proof

Recomputed = list[bool] | np.ndarray | None
"""A recompute flag per layer (only under ``recompute="selective"``); None: no layer."""

OBJECTIVE_MEMORY = "memory"
OBJECTIVE_TIME = "time"


@dataclass(kw_only=True)
class StageProblem:
    """One config's assignment problem. Limits are inclusive."""

    costs: LayerCosts
    objective: str = OBJECTIVE_MEMORY
    """memory: minimise max stage peak (bytes); time: minimise iteration time (ns)."""
    capacity_bytes: int | None = None
    """Every stage peak must be <= this (bytes per GPU)."""
    iteration_budget_ns: int | None = None
    """(m + p - 1) max_s T_s + max_s AR_s must be <= this (ns)."""

    @property
    def num_stages(self) -> int:
        return self.costs.num_stages

    @property
    def num_layers(self) -> int:
        return self.costs.num_layers

    @property
    def selective(self) -> bool:
        """The recomputed layers are part of the decision (``LayerCosts.selective``)."""
        return self.costs.selective

    def measure(
        self, stage_of_layer: list[int] | np.ndarray, recomputed: Recomputed = None
    ) -> tuple[int, int]:
        """(max stage peak bytes, iteration ns) of an assignment (with the layers ``recomputed``
        flags, under "selective"), from the cost model."""
        stages = stage_costs(self.costs, stage_of_layer, recomputed)
        return max(s.peak_bytes for s in stages), iteration_time_ns(self.costs, stages)

    def objective_value(
        self, stage_of_layer: list[int] | np.ndarray, recomputed: Recomputed = None
    ) -> int:
        peak, iteration = self.measure(stage_of_layer, recomputed)
        return peak if self.objective == OBJECTIVE_MEMORY else iteration

    def violation(
        self, stage_of_layer: list[int] | np.ndarray, recomputed: Recomputed = None
    ) -> str | None:
        """Why an assignment is not allowed, or None when it is."""
        stage_of = np.asarray(stage_of_layer)
        if len(stage_of) != self.num_layers:
            return f"{len(stage_of)} stage indices for {self.num_layers} layers"
        if recomputed is not None and np.any(recomputed):
            if not self.selective:
                return f"layers recomputed under recompute={self.costs.config.recompute!r}"
            if len(recomputed) != self.num_layers:
                return f"{len(recomputed)} recompute flags for {self.num_layers} layers"
        if stage_of.min() < 0 or stage_of.max() >= self.num_stages:
            return f"stage index outside 0..{self.num_stages - 1}"
        empty = sorted(set(range(self.num_stages)) - set(stage_of.tolist()))
        if empty:
            return f"stage {empty[0]} is empty"
        costs = self.costs
        backwards = stage_of[costs.edge_src] > stage_of[costs.edge_dst]
        if backwards.any():
            e = int(np.flatnonzero(backwards)[0])
            return f"edge {costs.edge_src[e]}->{costs.edge_dst[e]} goes to an earlier stage"
        peak, iteration = self.measure(stage_of, recomputed)
        if self.capacity_bytes is not None and peak > self.capacity_bytes:
            return f"peak {peak} B > capacity {self.capacity_bytes} B"
        if self.iteration_budget_ns is not None and iteration > self.iteration_budget_ns:
            return f"iteration {iteration} ns > budget {self.iteration_budget_ns} ns"
        return None


@dataclass(kw_only=True)
class StageSolution:
    """What a backend returns. ``objective`` is recomputed from the cost model, never trusted
    from the solver; ``bound`` is a proven lower bound on the optimum (same unit)."""

    status: str
    stage_of_layer: list[int] | None
    objective: int | None
    bound: int
    wall_s: float
    backend: str
    recomputed: list[bool] | None = None
    """Under "selective": which layers recompute (a flag per layer); None otherwise."""

    @property
    def has_solution(self) -> bool:
        return self.stage_of_layer is not None

    @property
    def gap(self) -> float:
        if self.objective is None or self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)
