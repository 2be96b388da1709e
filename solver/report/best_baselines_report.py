"""How the plan compares with what a user would run instead, each baseline family at its best
config (``solver.search.best_baselines``): the plan JSON's ``best_baselines`` field and the
report's lines. Throughputs in samples/s, peaks in bytes per GPU."""

from __future__ import annotations

import math
from typing import Any

from solver.search.best_baselines import BestBaselines, Candidate, FamilyBest, describe
from solver.units import format_bytes, format_throughput

AS_FAST = 0.005
"""A baseline within this fraction of the plan's throughput is "as fast"."""

NEAR_PEAK = 0.05
"""A plan as fast as the fastest baseline config whose peak is less than this fraction below
that config's: the verdict then says that memory-centric splitting buys little."""


def plan_fastest(plan) -> float:
    """The plan's fastest fitting throughput: the fastest plan of the search when it was
    computed, else the plan's own (samples/s)."""
    if plan.fastest_throughput is not None:
        return plan.fastest_throughput
    return plan.throughput


def _finite(value: float) -> float | None:
    """JSON has no Infinity: a graph without times has an infinite throughput, written null."""
    return value if math.isfinite(value) else None


def candidate_dict(candidate: Candidate | None) -> dict[str, Any] | None:
    if candidate is None:
        return None
    ev = candidate.evaluation
    return {
        "config": ev.config.label().replace(" selective-recompute", ""),
        "recompute": candidate.setting,
        "peak_bytes": ev.peak_bytes,
        "throughput": _finite(ev.throughput),
        "fits": ev.fits,
        "num_gpus": ev.cluster.num_gpus,
        "layer_counts": ev.layer_counts,
    }


def _family_dict(best: FamilyBest) -> dict[str, Any]:
    return {
        "name": best.family.name,
        "engine": best.family.engine,
        "source": best.family.source,
        "fits": best.fits,
        "fastest": candidate_dict(best.fastest),
        "smallest_peak": candidate_dict(best.smallest),
        "configs": best.configs,
        "evaluated": best.evaluated,
        "complete": best.complete,
    }


def best_baselines_dict(plan) -> dict[str, Any] | None:
    """The plan JSON's ``best_baselines`` (docs/plan.md); None when none was searched."""
    found: BestBaselines | None = plan.best_baselines
    if found is None:
        return None
    fastest, smallest = found.fastest, found.smallest
    ours = plan_fastest(plan)
    return {
        "families": [_family_dict(best) for best in found.families],
        "fastest": None
        if fastest is None
        else {"family": fastest.family.name, **candidate_dict(fastest.fastest)},
        "smallest_peak": None
        if smallest is None
        else {"family": smallest.family.name, **candidate_dict(smallest.smallest)},
        "plan": {
            "fastest_throughput": _finite(ours),
            "peak_bytes": plan.peak_bytes,
            "fits": plan.evaluation.fits,
            "num_gpus": plan.evaluation.cluster.num_gpus,
        },
        "throughput_change": None
        if fastest is None
        else _finite(ours / fastest.fastest.evaluation.throughput - 1),
        "peak_change": None
        if smallest is None
        else plan.peak_bytes / smallest.smallest.evaluation.peak_bytes - 1,
        "peak_change_vs_fastest": None
        if fastest is None
        else plan.peak_bytes / fastest.fastest.evaluation.peak_bytes - 1,
        "verdict": verdict(plan, found),
        "notes": list(found.notes),
    }


def verdict(plan, found: BestBaselines) -> str:
    """One sentence: how the plan compares with the best baseline configs."""
    fastest, smallest = found.fastest, found.smallest
    if smallest is None:
        return "no baseline config was evaluated"
    peak = smallest.smallest.evaluation.peak_bytes
    if fastest is None:
        fits = "fits" if plan.evaluation.fits else "does not fit either"
        return (
            f"no baseline config fits (smallest peak {format_bytes(peak)}, {smallest.family.name} "
            f"{describe(smallest.smallest)}); this plan {fits} at {format_bytes(plan.peak_bytes)}"
        )
    ours = plan_fastest(plan)
    theirs = fastest.fastest.evaluation.throughput
    fastest_peak = fastest.fastest.evaluation.peak_bytes
    smallest_text = _smallest_text(fastest, smallest)
    if not (math.isfinite(ours) and math.isfinite(theirs)):  # a graph without FLOPs or times
        return (
            f"throughput n/a; this plan's peak is {100 * (plan.peak_bytes / peak - 1):+.1f}% "
            f"against the smallest baseline peak ({smallest.family.name} "
            f"{describe(smallest.smallest)}, {format_bytes(peak)})"
        )
    speed = ours / theirs - 1
    config = describe(fastest.fastest)
    if speed < -AS_FAST:
        return (
            f"the best baseline config ({fastest.family.name} {config}) is "
            f"{-100 * speed:.1f}% faster than this plan's fastest: widen the search "
            "(--zero auto, --recompute auto)"
        )
    saving = 1 - plan.peak_bytes / fastest_peak
    if speed <= AS_FAST and saving < NEAR_PEAK:
        return (
            f"the best {fastest.family.name} config ({config}) is as fast at "
            f"{format_bytes(fastest_peak)}, {100 * saving:.1f}% above this plan's peak: "
            f"memory-centric splitting buys little here{smallest_text}"
        )
    own = plan.throughput / theirs - 1 if math.isfinite(plan.throughput) else speed
    return (
        f"this plan is {100 * own:+.1f}% throughput (its search's fastest {100 * speed:+.1f}%) "
        f"against the fastest baseline config ({fastest.family.name} {config}) and "
        f"{-100 * saving:+.1f}% peak against its {format_bytes(fastest_peak)}{smallest_text}"
    )


def _smallest_text(fastest: FamilyBest, smallest: FamilyBest) -> str:
    """'; the smallest baseline peak is ...' when another config than the fastest has it."""
    candidate = smallest.smallest
    if candidate.evaluation.peak_bytes >= fastest.fastest.evaluation.peak_bytes:
        return ""
    return (
        f"; the smallest baseline peak is {format_bytes(candidate.evaluation.peak_bytes)} "
        f"({smallest.family.name} {describe(candidate)}, "
        f"{format_throughput(candidate.evaluation.throughput)})"
    )


def best_baselines_lines(plan) -> list[str]:
    """The report's lines: each family at its best, then the verdict."""
    found: BestBaselines | None = plan.best_baselines
    if found is None:
        return []
    lines = []
    if found.families:
        gpus = plan.evaluation.cluster.num_gpus
        lines.append(
            f"baselines at their best config on {gpus} GPUs (fastest that fits; smallest peak):"
        )
    for best in found.families:
        fastest = (
            "none fits"
            if best.fastest is None
            else f"{format_throughput(best.fastest.evaluation.throughput, why=False)} at "
            f"{format_bytes(best.fastest.evaluation.peak_bytes)} ({describe(best.fastest)})"
        )
        smallest = (
            ""
            if best.smallest is None
            else f"; smallest peak {format_bytes(best.smallest.evaluation.peak_bytes)}"
            + ("" if best.fits else " (does not fit)")
        )
        lines.append(f"  {best.family.name}: {fastest}{smallest}")
    if found.families:
        lines.append(f"against the best baseline: {verdict(plan, found)}")
    lines.extend(f"note: {note}" for note in found.notes)
    return lines
