"""Baseline layouts as candidates of the fastest-plan search (issue 29: the default plan is never
slower than the best baseline config).

The exact searches of ``--recompute auto`` (no and full recomputation by the chain/DAG
algorithms on every config) contain every baseline family of ``best_baselines`` whose settings
are no or full recomputation: its split is one of the splits they optimise over. Two families
recompute some blocks only, which those searches leave out: Megatron's ``--recompute-method
block`` (the first N blocks of every stage) and torchtitan's selective activation checkpointing
(every second block). Their fastest fitting layouts, taken at their best config over the plan's
own candidate configs and ZeRO stages (no engine's usual stage beside them), are the seeds: a
seed is a plan of per-layer selective recomputation (its config's coefficients with
recompute "selective"), evaluated exactly by the cost model like any plan. The planner takes a
seed as its fastest plan when it is faster than the search's (``planner._throughput_limit``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from solver.costs import layer_costs
from solver.deadline import Deadline
from solver.evaluation import Evaluation
from solver.graph import LayerGraph
from solver.search.best_baselines import FAMILIES, FULL, NONE, best_baselines, describe
from solver.search.candidates import memory_lower_bound, time_lower_bound
from solver.search.config_search import ConfigEntry
from solver.search.ties import _Choice
from solver.specs import Cluster, TrainingConfig

SEED_FAMILIES = tuple(
    family for family in FAMILIES if any(setting not in (NONE, FULL) for setting in family.settings)
)
"""Families with a setting the exact searches lack (some blocks recomputed, not all)."""

SEEDED_RECOMPUTE = ("auto", "selective")
"""``--recompute`` values whose search space holds a seed (per-layer recomputation); a pinned
"none" or "full" has no seeds."""


class Seed(NamedTuple):
    """A baseline family's fastest fitting layout as a plan candidate."""

    choice: _Choice
    evaluation: Evaluation
    name: str
    """The family and its layout, e.g. 'megatron-recompute-block (pp1 tp2 ... block N=4)'."""


def baseline_seeds(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    entries: list[ConfigEntry],
    faster_than_ns: int,
    deadline: Deadline,
) -> list[Seed]:
    """The fastest fitting layout of each family of :data:`SEED_FAMILIES` on ``training``'s
    runtime, over the plan's candidate configs and ZeRO stages, fastest first; none where
    recomputation is pinned to none or full. Only configs whose lower bound on the iteration
    (the plan's ``entries`` with no or per-layer recomputation: recomputing only adds time) is
    below ``faster_than_ns`` (the search's fastest, simulated) are searched: no other can seed a
    faster plan, and most configs are not even costed."""
    if training.recompute not in SEEDED_RECOMPUTE:
        return []
    configs = [
        dataclasses.replace(entry.costs.config, recompute="selective")
        for entry in entries
        if entry.costs.config.recompute in ("none", "selective")
        and entry.time_bound < faster_than_ns
    ]
    if not configs:
        return []
    found = best_baselines(
        graph,
        cluster,
        training,
        deadline=deadline,
        families=SEED_FAMILIES,
        plan_zero=True,
        configs=configs,
        faster_than_ns=faster_than_ns,
    )
    fastest = [f for f in found.families if f.fastest is not None]
    fastest.sort(key=lambda f: f.fastest.evaluation.iteration_ns)
    seeds = []
    for order, family in enumerate(fastest, start=len(entries)):
        evaluation = family.fastest.evaluation
        if not any(evaluation.recomputed or ()):
            continue  # no recomputation: the exact searches hold this layout
        costs = layer_costs(graph, evaluation.config, cluster, training)
        entry = ConfigEntry(
            order=order,
            costs=costs,
            memory_bound=memory_lower_bound(costs),
            time_bound=time_lower_bound(costs),
        )
        choice = _Choice(entry, list(evaluation.stage_of_layer), list(evaluation.recomputed), None)
        seeds.append(Seed(choice, evaluation, f"{family.family.name} ({describe(family.fastest)})"))
    return seeds


def seed_note(seed: Seed, searched_ns: int | None) -> str:
    """The plan's note when a seed is the fastest plan."""
    if searched_ns:
        gain = f"{100 * (searched_ns / seed.evaluation.iteration_ns - 1):.1f}% faster than"
    else:
        gain = "found where there was no"
    return (
        f"the fastest plan is a baseline layout, {seed.name}: {gain} the search's fastest "
        "with no or full recomputation of every config; its recomputed layers are kept as "
        "per-layer selective recomputation"
    )
