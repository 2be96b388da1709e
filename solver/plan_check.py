"""Backend-agnostic plan checker: recompute every reported number from the graph and the config.

It rebuilds the cost coefficients from scratch (``evaluate``), so a backend or search bug that
reports a peak, a time or a split inconsistent with the cost model is caught.
"""

from __future__ import annotations

from solver.evaluation import evaluate
from solver.search.planner import Plan


def check_plan(plan: Plan) -> list[str]:
    """Problems found (empty when the plan is consistent and satisfies its constraints)."""
    problems = []
    ev = plan.evaluation
    config = ev.config
    if config.num_gpus != ev.cluster.num_gpus:
        problems.append(f"pp*tp*cp*dp = {config.num_gpus} != {ev.cluster.num_gpus} GPUs")
    if config.global_batch != ev.training.global_batch:
        problems.append(
            f"dp*b*m = {config.global_batch} != global batch {ev.training.global_batch}"
        )
    fresh = evaluate(
        ev.graph,
        config,
        list(plan.stage_of_layer),
        cluster=ev.cluster,
        training=ev.training,
        group_of_stage=ev.group_of_stage,
        recomputed=ev.recomputed,
    )
    for reported, recomputed in zip(ev.stages, fresh.stages, strict=True):
        if reported.breakdown() != recomputed.breakdown():
            problems.append(
                f"stage {reported.index}: reported {reported.breakdown()} != "
                f"recomputed {recomputed.breakdown()}"
            )
        if reported.recomputed != recomputed.recomputed:
            problems.append(
                f"stage {reported.index}: recomputed layers {reported.recomputed} != "
                f"{recomputed.recomputed}"
            )
        if reported.time_ns != recomputed.time_ns:
            problems.append(
                f"stage {reported.index}: time {reported.time_ns} != {recomputed.time_ns} ns"
            )
    if fresh.iteration_ns != ev.iteration_ns:
        problems.append(f"iteration {ev.iteration_ns} != recomputed {fresh.iteration_ns} ns")
    for stage, usable in zip(fresh.stages, fresh.usable_bytes, strict=True):
        if stage.peak_bytes > usable:  # capacity - reserve
            problems.append(
                f"stage {stage.index}: peak {stage.peak_bytes} B exceeds usable memory {usable} B"
            )
    if plan.required_throughput is not None and fresh.throughput < plan.required_throughput * (
        1 - 1e-9
    ):
        problems.append(
            f"throughput {fresh.throughput:.6g} < required {plan.required_throughput:.6g} samples/s"
        )
    memory = fresh.peak_bytes
    if ev.cluster.is_heterogeneous and ev.training.memory_objective == "utilization":
        memory = max(fresh.utilization_ppm)  # the objective is in ppm
    if (
        plan.solver.objective is not None
        and ev.training.objective == "memory"
        and (plan.solver.objective != memory)
    ):
        problems.append(f"solver objective {plan.solver.objective} != memory objective {memory}")
    if plan.solver.bound > memory and ev.training.objective == "memory":
        problems.append(f"bound {plan.solver.bound} above the plan's own memory objective")
    return problems
