"""The per-config partitioning problem every backend solves, and what a backend returns.

Data flows one way: graph -> candidate config -> :class:`StageProblem` (cost coefficients from
``solver.costs``) -> a backend (chain, CP-SAT, MILP) -> :class:`StageSolution` -> plan.

The problem: assign each layer a stage 0..p-1 so that for every edge u->v stage(u) <= stage(v),
every stage is non-empty, every stage peak <= ``capacity_bytes`` (when set) and the iteration time
<= ``iteration_budget_ns`` (when set); minimise the largest stage peak (objective "memory") or
the iteration time (objective "time"). Under ``recompute="selective"`` a solution also says
which layers are recomputed (``StageSolution.recomputed``), chosen jointly with the split.

Heterogeneous clusters add a :class:`Placement`: each stage also chooses a node group k(s), group k
hosts exactly ``stages_per_group[k]`` stages (every GPU is used; see ``solver.search.candidates``),
every
stage peak <= the capacity of its group, times come from the group's coefficients, and "memory"
means the largest utilization (ppm, ``costs.utilization_ppm``) or the largest peak (bytes).
A solution then carries ``group_of_stage`` too, and under selective recomputation its recompute
flags (a recomputed layer's time on each group from that group's coefficients).

Interleaving (``config.virtual_stages`` v > 1): the stages are the p v virtual stages (every one
non-empty, edges never going back), virtual stage j runs on rank j mod p, and peaks and times are
per rank (``costs.stage_costs`` returns one :class:`StageCost` per rank, with its chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.costs import (
    LayerCosts,
    stages_iteration_ns,
    StageCost,
    iteration_bound_ns,
    placed_stage_costs,
    stage_costs,
    utilization_ppm,
)

OPTIMAL = "OPTIMAL"
FEASIBLE = "FEASIBLE"  # a solution, optimality not proven (time limit)
INFEASIBLE = "INFEASIBLE"  # proven: no assignment satisfies the constraints
UNKNOWN = "UNKNOWN"  # time limit hit before any solution and before a proof

Recomputed = list[bool] | np.ndarray | None
"""A recompute flag per layer (only under ``recompute="selective"``); None: no layer."""

OBJECTIVE_MEMORY = "memory"
OBJECTIVE_TIME = "time"


UTILIZATION = "utilization"
ABSOLUTE = "absolute"


@dataclass(kw_only=True)
class Placement:
    """Node groups a heterogeneous problem places its stages on (index k = group)."""

    group_costs: list[LayerCosts]
    """Coefficients of the config on each group's cluster (same memory, the group's times)."""
    capacity_bytes: list[int]
    """GPU memory of each group."""
    stages_per_group: list[int]
    """Stages each group hosts: its GPUs / (tp d)."""
    names: list[str]
    """Group names (display)."""
    memory_objective: str = UTILIZATION
    """utilization: "memory" is max_s utilization_ppm(peak_s, capacity_k(s)); absolute: bytes."""

    @property
    def num_groups(self) -> int:
        return len(self.capacity_bytes)


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
    placement: Placement | None = None
    """Node groups of a heterogeneous cluster (None: homogeneous)."""
    utilization_limit_ppm: int | None = None
    """With a placement: every stage's utilization must be <= this (ppm)."""
    simulated: bool = False
    """The time objective and the budget are the SIMULATED iteration
    (``costs.stages_iteration_ns``), which every backend's model bounds from below by the
    iteration bound (``costs.iteration_bound_ns``): ``solver.backends.simulated`` closes the gap
    by bounding and simulating. False: the bound itself (what a backend's model constrains)."""
    excluded: tuple[tuple, ...] = ()
    """Assignments cut off (``assignment_key``): the splits a bound-and-simulate search has
    simulated already (``solver.backends.simulated``); every backend that takes cuts
    (``CUT_BACKENDS``) leaves them out, and :meth:`violation` refuses them."""

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

    def stages(
        self,
        stage_of_layer: list[int] | np.ndarray,
        recomputed: Recomputed = None,
        group_of_stage: list[int] | None = None,
    ) -> list[StageCost]:
        """Per-stage costs from the cost model (on each stage's group with a placement); the
        last assignment's are kept (a check and a measure of one split follow each other, and
        on 10^4 stages each evaluation takes a second)."""
        key = (
            np.asarray(stage_of_layer, dtype=np.int64).tobytes(),
            None if recomputed is None else np.asarray(recomputed, dtype=bool).tobytes(),
            None if group_of_stage is None else tuple(group_of_stage),
        )
        last = self.__dict__.get("_last_stages")
        if last is not None and last[0] == key:
            return last[1]
        if self.placement is None:
            stages = stage_costs(self.costs, stage_of_layer, recomputed)
        else:
            stages = placed_stage_costs(
                self.placement.group_costs, stage_of_layer, group_of_stage, recomputed
            )
        self.__dict__["_last_stages"] = (key, stages)
        return stages

    def memory_value(self, stages: list[StageCost], group_of_stage: list[int] | None) -> int:
        """The memory objective: largest peak (bytes), or largest utilization (ppm)."""
        placement = self.placement
        if placement is None or placement.memory_objective == ABSOLUTE:
            return max(s.peak_bytes for s in stages)
        return max(
            utilization_ppm(stage.peak_bytes, placement.capacity_bytes[k])
            for stage, k in zip(stages, group_of_stage, strict=True)
        )

    def measure(
        self,
        stage_of_layer: list[int] | np.ndarray,
        recomputed: Recomputed = None,
        group_of_stage: list[int] | None = None,
    ) -> tuple[int, int]:
        """(memory objective, iteration ns) of an assignment (with the layers ``recomputed``
        flags under "selective", each stage's group with a placement), from the cost model: the
        memory objective is the max stage peak in bytes unless a placement asks for utilization."""
        stages = self.stages(stage_of_layer, recomputed, group_of_stage)
        return self.memory_value(stages, group_of_stage), iteration_bound_ns(self.costs, stages)

    def iteration_of(self, stages: list[StageCost], stage_of_layer) -> int:
        """The iteration the time objective and the budget mean: simulated (``simulated``, on
        the schedules ``solver.backends.simulated.needs_simulation`` names) or the bound, ns."""
        costs = self.costs
        if self.simulated and costs.rank_rows and costs.has_compute_time:
            return stages_iteration_ns(self.costs, stages, stage_of_layer)
        return iteration_bound_ns(self.costs, stages)

    def objective_of(
        self,
        stages: list[StageCost],
        group_of_stage: list[int] | None = None,
        stage_of_layer=None,
    ) -> int:
        """The objective of a split from its :meth:`stages` (a simulated time needs the split)."""
        if self.objective == OBJECTIVE_MEMORY:
            return self.memory_value(stages, group_of_stage)
        if self.simulated:
            return self.iteration_of(stages, stage_of_layer)
        return iteration_bound_ns(self.costs, stages)

    def objective_value(
        self,
        stage_of_layer: list[int] | np.ndarray,
        recomputed: Recomputed = None,
        group_of_stage: list[int] | None = None,
    ) -> int:
        if self.objective == OBJECTIVE_MEMORY or not self.simulated:
            memory, iteration = self.measure(stage_of_layer, recomputed, group_of_stage)
            return memory if self.objective == OBJECTIVE_MEMORY else iteration
        stages = self.stages(stage_of_layer, recomputed, group_of_stage)
        return self.iteration_of(stages, stage_of_layer)

    def violation(
        self,
        stage_of_layer: list[int] | np.ndarray,
        recomputed: Recomputed = None,
        group_of_stage: list[int] | None = None,
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
        if self.excluded and assignment_key(stage_of, recomputed, group_of_stage) in self.excluded:
            return "cut off (simulated already)"
        costs = self.costs
        backwards = stage_of[costs.edge_src] > stage_of[costs.edge_dst]
        if backwards.any():
            e = int(np.flatnonzero(backwards)[0])
            return f"edge {costs.edge_src[e]}->{costs.edge_dst[e]} goes to an earlier stage"
        placement = self.placement
        if placement is not None:
            reason = _placement_violation(placement, self.num_stages, group_of_stage)
            if reason is not None:
                return reason
        stages = self.stages(stage_of, recomputed, group_of_stage)
        peak = max(s.peak_bytes for s in stages)
        if self.capacity_bytes is not None and peak > self.capacity_bytes:
            return f"peak {peak} B > capacity {self.capacity_bytes} B"
        if placement is not None:
            for stage, k in zip(stages, group_of_stage, strict=True):
                if stage.peak_bytes > placement.capacity_bytes[k]:
                    return (
                        f"stage {stage.index} peak {stage.peak_bytes} B > capacity "
                        f"{placement.capacity_bytes[k]} B of group {placement.names[k]}"
                    )
            utilization = self.memory_value(stages, group_of_stage)
            limit = self.utilization_limit_ppm
            if limit is not None and placement.memory_objective == UTILIZATION:
                if utilization > limit:
                    return f"utilization {utilization} ppm > limit {limit} ppm"
        if self.iteration_budget_ns is not None:
            iteration = self.iteration_of(stages, stage_of)
            if iteration > self.iteration_budget_ns:
                return f"iteration {iteration} ns > budget {self.iteration_budget_ns} ns"
        return None


def assignment_key(stage_of_layer, recomputed: Recomputed = None, group_of_stage=None) -> tuple:
    """An assignment as a hashable key (``StageProblem.excluded``): its split, the recompute
    flags (None: none recomputed) and the stage groups."""
    flags = None
    if recomputed is not None and np.any(recomputed):
        flags = tuple(bool(f) for f in recomputed)
    return (
        tuple(int(s) for s in stage_of_layer),
        flags,
        None if group_of_stage is None else tuple(int(k) for k in group_of_stage),
    )


def _placement_violation(
    placement: Placement, num_stages: int, group_of_stage: list[int] | None
) -> str | None:
    """Every stage on a known group; group k hosts exactly stages_per_group[k] stages."""
    if group_of_stage is None or len(group_of_stage) != num_stages:
        return f"a heterogeneous problem needs a group for each of the {num_stages} stages"
    if any(not 0 <= k < placement.num_groups for k in group_of_stage):
        return f"group index outside 0..{placement.num_groups - 1}"
    for k, wanted in enumerate(placement.stages_per_group):
        placed = sum(1 for g in group_of_stage if g == k)
        if placed != wanted:
            return f"group {placement.names[k]} hosts {placed} stages, not {wanted}"
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
    group_of_stage: list[int] | None = None
    """Node group of each stage (heterogeneous problems only)."""
    recomputed: list[bool] | None = None
    """Under "selective": which layers recompute (a flag per layer); None otherwise."""
    stages: list[StageCost] | None = None
    """The cost model's per-stage costs of the split (``StageProblem.stages``) when the backend
    computed them for ``objective``: the planner's evaluation of the split reuses them."""

    @property
    def has_solution(self) -> bool:
        return self.stage_of_layer is not None

    @property
    def gap(self) -> float:
        if self.objective is None or self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)
