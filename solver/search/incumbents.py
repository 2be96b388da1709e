"""Incumbents: a feasible split for a config from quick methods, before any exact solve.

An exact solve (CP-SAT, MILP) of a large DAG, interleaved or selective config may run out of
time before it finds any split; a search that stops then has no plan although feasible layouts
are easy to find (issue 17: T5-11B on 256 GPUs exited 4 after 60 s). So before the exact pass
every config the search will visit is given the best of a few quick candidates:

1. The baseline splits (``solver.report.baselines.BASELINES``: Megatron's even split, DeepSpeed's
   parameter split) of the config's stages, computed from the graph by ``search.build_entries``
   (``ConfigEntry.splits``). An interleaved config splits its p v virtual stages, so its even
   split is Megatron's layout (``ConfigEntry.start``). Under selective recomputation each split
   with no layer and with every layer recomputed (both are choices of the selective problem);
   on a heterogeneous cluster each split with the best group assignment
   (``placement_start.complete_start``).
2. The methods of :data:`QUICK_METHODS`, each ``method(problem, *, time_limit_s) ->
   StageSolution`` where its ``applies(problem)``: the exact chain optima with uniform
   recomputation (selective chains), the complete start of a placed problem
   (``solver.backends.placement_start``). Adding a method is one entry in that list.

A candidate is an incumbent only when ``StageProblem.violation`` accepts it (capacity, iteration
budget, utilization limit, precedence, non-empty stages), and its objective is recomputed by the
cost model (``StageProblem.objective_value``), never taken from the method. The incumbent is a
FEASIBLE solution whose bound is the config's lower bound, OPTIMAL when it meets that bound.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from solver.backends.dag import topological_split
from solver.backends.problem import FEASIBLE, OPTIMAL, StageProblem, StageSolution

QuickSplit = Callable[..., StageSolution]
"""``method(problem, *, time_limit_s) -> StageSolution`` (a split or none; status and objective
are not trusted: the candidate is checked and evaluated here)."""


def _plain(problem: StageProblem) -> bool:
    """Homogeneous, every layer's recomputation fixed."""
    return problem.placement is None and not problem.selective


def one_chunk_per_rank(problem: StageProblem) -> bool:
    """Plain (:func:`_plain`) and not interleaved: each rank holds one contiguous stage."""
    return _plain(problem) and not problem.costs.rank_rows


def _selective_chain(problem: StageProblem) -> bool:
    """A selective chain whose ranks each hold one contiguous stage (the chain algorithm's
    uniform-recompute optima; interleaved and split-backward ranks are not one stage)."""
    return (
        problem.placement is None
        and problem.selective
        and problem.costs.is_chain()
        and not problem.costs.rank_rows
    )


def _placed(problem: StageProblem) -> bool:
    return problem.placement is not None


def uniform_recompute_split(problem: StageProblem, *, time_limit_s: float) -> StageSolution:
    """The better of the exact chain optima with no layer and with every layer recomputed (a
    selective chain problem); UNKNOWN status without a split when neither is feasible."""
    from solver.backends.chain import solve_chain

    started, deadline = time.perf_counter(), time.perf_counter() + time_limit_s
    best: StageSolution | None = None
    for recompute in (False, True):
        uniform = dataclasses.replace(problem, costs=problem.costs.uniform(recompute))
        solution = solve_chain(uniform, time_limit_s=max(deadline - time.perf_counter(), 0.001))
        if solution.has_solution and (best is None or solution.objective < best.objective):
            best = dataclasses.replace(solution, recomputed=[recompute] * problem.num_layers)
    if best is None:
        return _nothing(problem, started, "uniform-recompute")
    return best


def placed_start_split(problem: StageProblem, *, time_limit_s: float) -> StageSolution:
    """``placement_start.placement_start``: a split, its stage groups and recompute flags."""
    from solver.backends.placement_start import placement_start

    started = time.perf_counter()
    start = placement_start(problem, time_limit_s=time_limit_s)
    if start is None:
        return _nothing(problem, started, "placement-start")
    split, groups, recomputed = start
    return StageSolution(
        status=FEASIBLE,
        stage_of_layer=split,
        objective=None,
        bound=0,
        wall_s=time.perf_counter() - started,
        backend="placement-start",
        group_of_stage=groups,
        recomputed=recomputed,
    )


def _nothing(problem: StageProblem, started: float, backend: str) -> StageSolution:
    return StageSolution(
        status="UNKNOWN",
        stage_of_layer=None,
        objective=None,
        bound=0,
        wall_s=time.perf_counter() - started,
        backend=backend,
    )


@dataclass(frozen=True, kw_only=True)
class QuickMethod:
    """A quick split method and the problems it applies to."""

    name: str
    split: QuickSplit
    applies: Callable[[StageProblem], bool] = _plain


QUICK_METHODS: list[QuickMethod] = [
    QuickMethod(name="topological", split=topological_split, applies=one_chunk_per_rank),
    QuickMethod(name="uniform-recompute", split=uniform_recompute_split, applies=_selective_chain),
    QuickMethod(name="placement-start", split=placed_start_split, applies=_placed),
]
"""The quick methods tried after the baseline splits, in order (each within its share of the
incumbent pass's time), on the configs CP-SAT or MILP would solve (``search._Search``): the
exact DP over the prefixes of the layer order (``backends.dag.topological_split``: the best
split whose stages are runs of a topological order, relays and direct sends costed), the best
uniform recomputation of a selective chain, a heterogeneous cluster's complete start. ``applies``
defaults to every homogeneous config with fixed recomputation."""


@dataclass(kw_only=True)
class Candidate:
    """A split to try, with its recompute flags and stage groups (None: not applicable)."""

    method: str
    split: list[int]
    recomputed: list[bool] | None = None
    groups: list[int] | None = None


def incumbent(
    problem: StageProblem,
    splits: dict[str, list[int]],
    *,
    bound: int,
    time_limit_s: float,
    methods: list[QuickMethod] | None = None,
) -> StageSolution | None:
    """The best allowed candidate (module docstring) as a solution: OPTIMAL when its objective
    meets ``bound`` (the config's proven lower bound, in the objective's unit), FEASIBLE with
    that bound otherwise; None when no candidate is allowed. ``splits``: the baseline splits of
    the config by name; ``time_limit_s`` is shared by the timed methods."""
    started = time.perf_counter()
    deadline = started + time_limit_s
    best: tuple[int, Candidate] | None = None
    for candidate in _candidates(problem, splits, deadline, methods):
        flags = candidate.recomputed if problem.selective else None
        if problem.violation(candidate.split, flags, candidate.groups) is not None:
            continue
        value = problem.objective_value(candidate.split, flags, candidate.groups)
        if best is None or value < best[0]:
            best = (value, candidate)
            if value <= bound:
                break  # nothing is better than the bound
    if best is None:
        return None
    value, chosen = best
    return StageSolution(
        status=OPTIMAL if value <= bound else FEASIBLE,
        stage_of_layer=[int(s) for s in chosen.split],
        objective=value,
        bound=min(bound, value),
        wall_s=time.perf_counter() - started,
        backend=chosen.method,
        group_of_stage=chosen.groups,
        recomputed=(
            [bool(f) for f in chosen.recomputed]
            if problem.selective and chosen.recomputed is not None
            else ([False] * problem.num_layers if problem.selective else None)
        ),
    )


def chunk_balanced_splits(num_layers: int, pp: int, num_stages: int) -> dict[str, list[int]]:
    """Splits of a chain into ``num_stages`` virtual stages (stage j on rank j mod ``pp``) of
    floor(L / J) layers each, the R = L mod J layers left over one each on R of them: the last R
    stages, the first R, or the last rank's chunks (then the one before it...), or the first
    rank's: the layouts a user would script for an interleaved or V schedule (a candidate
    incumbent; its simulated time may beat the even split's)."""
    base, extra = divmod(num_layers, num_stages)
    if base == 0:
        return {}
    by_last_rank = sorted(range(num_stages), key=lambda j: (-(j % pp), -j))
    by_first_rank = sorted(range(num_stages), key=lambda j: (j % pp, j))
    orders = {
        "balanced-last": list(range(num_stages - 1, -1, -1)),
        "balanced-first": list(range(num_stages)),
        "balanced-last-rank": by_last_rank,
        "balanced-first-rank": by_first_rank,
    }
    splits = {}
    for name, order in orders.items():
        counts = [base] * num_stages
        for j in order[:extra]:
            counts[j] += 1
        splits[name] = [j for j, count in enumerate(counts) for _ in range(count)]
    return splits


def _candidates(
    problem: StageProblem,
    splits: dict[str, list[int]],
    deadline: float,
    methods: list[QuickMethod] | None,
) -> Iterator[Candidate]:
    """The baseline splits (with uniform recompute flags, placed), then the quick methods."""
    flag_sets = (
        [[False] * problem.num_layers, [True] * problem.num_layers] if problem.selective else [None]
    )
    seen = set()
    if problem.costs.rank_rows:
        pp = problem.costs.config.pp
        splits = {**splits, **chunk_balanced_splits(problem.num_layers, pp, problem.num_stages)}
    for name, split in splits.items():
        if len(split) != problem.num_layers or max(split, default=0) >= problem.num_stages:
            continue
        if tuple(split) in seen:  # the even and parameter splits often agree
            continue
        seen.add(tuple(split))
        for flags in flag_sets:
            groups = None
            if problem.placement is not None:
                from solver.backends.placement_start import complete_start

                groups = complete_start(problem, split, flags)
            yield Candidate(method=name, split=split, recomputed=flags, groups=groups)
    for method in QUICK_METHODS if methods is None else methods:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        if not method.applies(problem):
            continue
        solution = method.split(problem, time_limit_s=left)
        if solution.has_solution:
            yield Candidate(
                method=method.name,
                split=solution.stage_of_layer,
                recomputed=solution.recomputed,
                groups=solution.group_of_stage,
            )


__all__ = [
    "QUICK_METHODS",
    "Candidate",
    "QuickMethod",
    "chunk_balanced_splits",
    "QuickSplit",
    "incumbent",
    "one_chunk_per_rank",
    "placed_start_split",
    "uniform_recompute_split",
]
