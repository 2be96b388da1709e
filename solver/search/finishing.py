"""The time a planning call keeps back from its searches for the work after them.

Once the searches stop, a plan still costs a few full cost-model evaluations that cannot be cut
short: the fastest plan's simulated iteration, the chosen split's evaluation, its report and
exports. They take microseconds on ordinary configs but about a second each on 10^4 pipeline
stages (per-stage Python), so ``--time-limit`` holds at any size only if the searches stop that
much earlier, or, when even that time is not left, the call stops at once and says so.
"""

from __future__ import annotations

import time

from solver.costs.stages import stage_costs
from solver.errors import NoSolutionError
from solver.graph import LayerGraph
from solver.report.baselines import even_split
from solver.search.config_search import ConfigEntry
from solver.specs import Cluster, TrainingConfig

PROBE_MIN_STAGES = 1024
"""(Virtual) stages from which one evaluation is timed: below, it takes milliseconds."""
PROBE_MIN_LAYERS = 100_000
"""Layers from which one evaluation is timed whatever the stages."""
FINISH_EVALUATIONS = 4.0
"""Stage-cost evaluations' worth of time kept back for after the searches (the fastest plan's
simulated iteration, the chosen split's evaluation, the report and exports)."""


def finishing_seconds(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig, entries: list[ConfigEntry]
) -> float:
    """Seconds to keep back for the work after the searches: ``FINISH_EVALUATIONS`` times one
    timed evaluation of the even split of the config with the most stages; 0 for small configs
    and node-group placements (their stage counts are small)."""
    plain = [entry for entry in entries if entry.placement is None]
    if not plain:
        return 0.0
    entry = max(plain, key=lambda e: (e.costs.num_stages, -e.order))
    costs = entry.costs
    if costs.num_stages < PROBE_MIN_STAGES and costs.num_layers < PROBE_MIN_LAYERS:
        return 0.0
    split = even_split(graph, costs.num_stages)
    started = time.perf_counter()
    stage_costs(costs, split, [False] * costs.num_layers if costs.selective else None)
    return FINISH_EVALUATIONS * (time.perf_counter() - started)


def check_time_to_finish(finishing_s: float, remaining_s: float, stages: int) -> None:
    """NoSolutionError (exit 4) when the time left cannot even hold the work after the
    searches: a plan would come past the limit."""
    if finishing_s > remaining_s:
        raise NoSolutionError(
            f"time limit reached before searching: on {stages:,} stages one plan's evaluation, "
            f"report and exports take about {finishing_s:.1f} s and {remaining_s:.1f} s are "
            f"left; raise --time-limit by at least {finishing_s - remaining_s + 1:.0f} s"
        )
