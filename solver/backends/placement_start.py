"""A complete start for a heterogeneous (placed) problem: a split, each stage's group, and the
recompute flags under selective recomputation.

A split alone does not say where its stages run, and CP-SAT or HiGHS may search a long time for a
first assignment of a 64-stage, two-group problem (GPT-3 175B on 256 + 256 mixed A100s, B 2048:
the first plan of the memory search came after 102 s and the 120 s limit left a 77% gap without
this start; with it the plan is proven optimal in about 60 s, benchmarks/bench_heterogeneous.md).
The start is built in a fraction of a second:

1. Splits. On a chain, the exact chain algorithm (``solver.backends.chain``) on one homogeneous
   problem
   with each layer's time and sync on its slowest group (so a split that meets the iteration
   budget there meets it on any placement): the smallest largest peak under the budget, and the
   fastest split under the smallest and under the largest group capacity. Under selective
   recomputation each of these with no layer and with every layer recomputed (both are choices
   of the selective problem). On a DAG, contiguous runs of the topological order balanced by
   model states plus stored activations (positions are topological, so precedence holds).
2. Groups. Stage peaks do not depend on the group (``solver.costs``), so for one split the largest
   utilization max_s peak_s / C_k(s) is smallest when the heaviest stages go to the largest GPUs
   (exchange argument: swapping a heavier stage on a smaller GPU with a lighter one on a larger
   GPU does not raise either ratio above the heavier stage's old one), respecting each group's
   stage count exactly; the largest peak does not depend on the groups at all. The slowest stages
   on the fastest groups is the other candidate, for the time objective.
3. The best candidate by (feasible first, objective) is the start; infeasible starts are still
   returned (the solver repairs or ignores them), None only without any candidate.

The start is a heuristic: it never changes what the solver can prove, only how soon it has a
plan (``keep_hint_if_better`` returns it when the solver finds nothing better in time).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, StageProblem
from solver.costs import LayerCosts, stage_costs

Start = tuple[list[int], list[int], list[bool] | None]
"""(stage of each layer, group of each stage, recompute flags or None)."""


def groups_by_peak(problem: StageProblem, peaks: list[int]) -> list[int]:
    """Heaviest stages on the largest GPUs, group k taking exactly stages_per_group[k] stages
    (ties: the earlier stage, the earlier group)."""
    placement = problem.placement
    slots = [
        k
        for k in sorted(range(placement.num_groups), key=lambda k: -placement.capacity_bytes[k])
        for _ in range(placement.stages_per_group[k])
    ]
    groups = [0] * len(peaks)
    for s, k in zip(sorted(range(len(peaks)), key=lambda s: -peaks[s]), slots, strict=True):
        groups[s] = k
    return groups


def groups_by_time(problem: StageProblem, times: list[int]) -> list[int]:
    """Slowest stages on the fastest groups (a group's speed: its total time over all layers)."""
    placement = problem.placement
    speed = [int(c.time_ns.sum()) for c in placement.group_costs]
    slots = [
        k
        for k in sorted(range(placement.num_groups), key=lambda k: speed[k])
        for _ in range(placement.stages_per_group[k])
    ]
    groups = [0] * len(times)
    for s, k in zip(sorted(range(len(times)), key=lambda s: -times[s]), slots, strict=True):
        groups[s] = k
    return groups


def complete_start(
    problem: StageProblem, split: list[int], recomputed: list[bool] | None
) -> list[int]:
    """The better of the two group assignments of ``split`` (feasible first, then objective)."""
    stages = stage_costs(problem.costs, split, recomputed if problem.selective else None)
    options = [
        groups_by_peak(problem, [s.peak_bytes for s in stages]),
        groups_by_time(problem, [s.time_ns for s in stages]),
    ]
    return min(options, key=lambda groups: _rank(problem, split, recomputed, groups))


def placement_start(problem: StageProblem, *, time_limit_s: float) -> Start | None:
    """The best start of the module docstring, or None (no candidate split: never on a valid
    problem, every problem with p <= L has one)."""
    assert problem.placement is not None
    deadline = time.perf_counter() + time_limit_s
    best: tuple[tuple, Start] | None = None
    for split, recomputed in _candidate_splits(problem, deadline):
        groups = complete_start(problem, split, recomputed)
        rank = _rank(problem, split, recomputed, groups)
        if best is None or rank < best[0]:
            best = (rank, (split, groups, recomputed))
    return None if best is None else best[1]


def _rank(
    problem: StageProblem, split: list[int], recomputed: list[bool] | None, groups: list[int]
) -> tuple[bool, int]:
    """(infeasible, objective value): smaller is better."""
    flags = recomputed if problem.selective else None
    infeasible = problem.violation(split, flags, groups) is not None
    return infeasible, problem.objective_value(split, flags, groups)


def _candidate_splits(problem: StageProblem, deadline: float):
    """(split, recompute flags) candidates of the module docstring, item 1."""
    from solver.backends.chain import solve_chain

    placement, costs = problem.placement, problem.costs
    slowest = dataclasses.replace(
        costs,
        time_ns=np.max([c.time_ns for c in placement.group_costs], axis=0),
        dp_sync_ns=np.max([c.dp_sync_ns for c in placement.group_costs], axis=0),
        recompute_time_ns=np.max([c.recompute_time_ns for c in placement.group_costs], axis=0),
    )
    states = (False, True) if problem.selective else (False,)
    for recompute in states:
        flags = [recompute] * problem.num_layers if problem.selective else None
        uniform = slowest.uniform(recompute)
        if not uniform.is_chain():
            yield _balanced_split(uniform), flags
            continue
        capacities = sorted(set(placement.capacity_bytes))
        subproblems = [
            StageProblem(
                costs=uniform,
                objective=OBJECTIVE_MEMORY,
                iteration_budget_ns=problem.iteration_budget_ns,
            ),
            *(
                StageProblem(costs=uniform, objective=OBJECTIVE_TIME, capacity_bytes=capacity)
                for capacity in (capacities[0], capacities[-1])
            ),
        ]
        for subproblem in subproblems:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            solution = solve_chain(subproblem, time_limit_s=left)
            if solution.has_solution:
                yield solution.stage_of_layer, flags


def _balanced_split(costs: LayerCosts) -> list[int]:
    """Contiguous runs of the topological order with about equal states + stored activations
    (one in-flight micro-batch), every stage non-empty."""
    num_layers, num_stages = costs.num_layers, costs.num_stages
    weight = (costs.state_bytes + costs.stored_bytes).astype(float) + 1.0
    midpoint = np.cumsum(weight) - weight / 2
    target = np.minimum((midpoint * num_stages / weight.sum()).astype(int), num_stages - 1)
    split, stage, spare = [], 0, num_layers - num_stages
    for layer, wanted in enumerate(target.tolist()):
        # one stage step at most, and room left for every later stage
        stage = max(min(wanted, stage + 1 if layer else 0), stage, layer - spare)
        split.append(stage)
    return split
