"""Plans and evaluations as JSON documents and as readable text tables (display only)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from solver.costs import PPM, routing_factor
from solver.costs.moe import routed_experts
from solver.errors import InputError
from solver.evaluation import Evaluation
from solver.files.plan_file import EVALUATION_FORMAT, PLAN_FORMAT, PLAN_VERSION, load_plan
from solver.precision import describe as describe_precision
from solver.reserve import usable_text
from solver.search.planner import Plan
from solver.specs import MOE_DROPLESS, Cluster, SearchStatus, TrainingConfig
from solver.units import format_bytes, format_throughput


def evaluation_to_dict(evaluation: Evaluation) -> dict[str, Any]:
    """The evaluation JSON (format "evaluation", version 2; docs/plan.md): what
    ``python -m solver.evaluate --json`` writes."""
    document = {"format": EVALUATION_FORMAT, "version": PLAN_VERSION}
    return checked(document | evaluation_fields(evaluation))


def evaluation_fields(evaluation: Evaluation) -> dict[str, Any]:
    """What a plan, an evaluation and a Pareto point share: the graph, cluster, config and
    training options, and the per-stage costs (bytes per GPU, ms), peak and throughput."""
    names = evaluation.stage_layer_names()
    recomputed = evaluation.stage_recomputed_names()
    graph = evaluation.graph
    document = {
        "model": graph.model,
        "graph": {
            "model": graph.model,
            "path": graph.path,
            "sha256": graph.sha256(),
            "num_layers": graph.num_layers,
        },
        "cluster": cluster_to_dict(evaluation.cluster),
        "config": evaluation.config.to_dict(),
        "training": training_to_dict(evaluation.training),
        "runtime": evaluation.training.runtime,
        "memory_model": evaluation.training.memory_model,
        "memory_objective": evaluation.training.memory_objective,
        "stages": [
            {
                "index": stage.index,
                "usable_bytes": usable,
                "layers": names[stage.index],
                "recomputed": recomputed[stage.index],
                "peak_bytes": stage.peak_bytes,
                "breakdown": stage.breakdown(),
                "in_flight_microbatches": stage.in_flight,
                "peak_moment": stage.moment,
                **(
                    {}
                    if evaluation.config.virtual_stages == 1
                    else {
                        "chunks": [[evaluation.graph.names[i] for i in c] for c in stage.chunks],
                        "chunk_time_ms": [t / 1e6 for t in stage.chunk_time_ns],
                    }
                ),
                "time_ms": stage.time_ns / 1e6,
                "forward_ms": sum(stage.chunk_forward_ns) / 1e6,
                "dp_sync_ms": stage.dp_sync_ns / 1e6,
                "optimizer_step_ms": stage.optimizer_step_ns / 1e6,
            }
            for stage, usable in zip(evaluation.stages, evaluation.usable_bytes, strict=True)
        ],
        "stage_of_layer": evaluation.stage_of_layer,
        "peak_bytes": evaluation.peak_bytes,
        "fits": evaluation.fits,
        "iteration_ms": evaluation.iteration_ns / 1e6,
        "iteration_bound_ms": evaluation.iteration_bound_ns / 1e6,
        "throughput": finite_or_none(evaluation.throughput),
        "calibration": calibration_to_dict(evaluation),
    }
    if evaluation.group_of_stage is not None:
        _add_groups(document, evaluation)
    return document


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """Every field of the cluster (its groups only when heterogeneous): rebuilds it exactly."""
    document = {
        "num_gpus": cluster.num_gpus,
        "gpu_memory_bytes": cluster.gpu_memory_bytes,
        "gpus_per_node": cluster.gpus_per_node,
        "gpu_flops": cluster.gpu_flops,
        "flops_efficiency": cluster.flops_efficiency,
        "intra_node_gb_per_s": cluster.intra_node_gb_per_s,
        "inter_node_gb_per_s": cluster.inter_node_gb_per_s,
        "memory_gb_per_s": cluster.memory_gb_per_s,
        "p2p_latency_us": cluster.p2p_latency_us,
    }
    if cluster.groups:
        document["groups"] = [
            {
                "name": g.name,
                "num_nodes": g.num_nodes,
                "gpus_per_node": g.gpus_per_node,
                "gpu_memory_bytes": g.gpu_memory_bytes,
                "gpu_flops": g.gpu_flops,
                "flops_efficiency": g.flops_efficiency,
                "intra_node_gb_per_s": g.intra_node_gb_per_s,
                "inter_node_gb_per_s": g.inter_node_gb_per_s,
                "memory_gb_per_s": g.memory_gb_per_s,
                "p2p_latency_us": g.p2p_latency_us,
            }
            for g in cluster.groups
        ]
    return document


def _grad_lifetime_text(evaluation) -> str:
    """How the plan counts gradients (``TrainingConfig.grad_lifetime``; DDP keeps its buckets)."""
    from solver.costs import ddp_bucket_bytes

    training = evaluation.training
    if training.grad_lifetime == "persistent":
        return "persistent (--grad-lifetime persistent)" + _fsdp_pipelined_text(evaluation)
    text = "from each layer's first backward (zero_grad(set_to_none=True), --grad-lifetime step)"
    if ddp_bucket_bytes(evaluation.config, training, np.zeros(1)) is not None:
        text += ", beside DDP's buckets"
    return text + _fsdp_pipelined_text(evaluation)


def _fsdp_pipelined_text(evaluation) -> str:
    """What FSDP2 under pipelining holds (``states.reduces_per_step``), or ''."""
    from solver.costs.states import reduces_per_step

    if not reduces_per_step(evaluation.config, evaluation.training.runtime):
        return ""
    return (
        "; FSDP2 under PipelineStage reduce-scatters once per step: every layer's unsharded "
        "weights and gradients are held all step beside the shards (ZeRO 2 and 3 the same "
        "memory)"
    )


def _optimizer_step_text(evaluation: Evaluation) -> str:
    """'optimizer step: foreach adam, a 4 bytes/param temporary; it sets the peak of stages 0, 3'
    when the step makes a temporary (``TrainingConfig.optimizer_step_bytes_per_param``), else
    ''."""
    training = evaluation.training
    per_param = training.optimizer_step_bytes_per_param
    if not per_param or training.memory_model != "analytic":
        return ""
    at_step = [str(s.index) for s in evaluation.stages if s.moment == "optimizer step"]
    where = (
        f"it sets the peak of stage{'s' if len(at_step) > 1 else ''} {', '.join(at_step)}"
        if at_step
        else "no stage peaks there"
    )
    return (
        f"optimizer step: {training.optimizer_impl} {training.optimizer}, a {per_param} "
        f"bytes/param temporary (--optimizer-impl fused for none); {where}"
    )


def _experts_text(evaluation: Evaluation) -> str:
    """A mixture-of-experts graph's line: experts per GPU and the routing factor used
    (``costs.routing_factor``); "" for a dense graph."""
    experts = routed_experts(evaluation.graph)
    if experts is None:
        return ""
    config, factor_option = evaluation.config, evaluation.training.moe_capacity_factor
    factor = routing_factor(evaluation.graph, config, evaluation.training)
    if factor_option == MOE_DROPLESS:
        reach = min(experts.top_k, experts.num_experts // config.ep)
        why = f"dropless worst case, ep min(k, E/ep) / k = {config.ep} x {reach} / {experts.top_k}"
    elif factor_option == 1:
        why = "balanced routing"
    else:
        why = f"capacity factor {factor_option:g}, padded"
    if experts.profiled_capacity_factor != 1:
        why += f"; relative to the graph's profiled capacity {experts.profiled_capacity_factor:g}"
    return (
        f"experts: {experts.num_experts} routed, top-{experts.top_k}, ep {config.ep} "
        f"({experts.num_experts // config.ep} per GPU); routing factor {float(factor):.4g} ({why})"
    )


def training_to_dict(training: TrainingConfig) -> dict[str, Any]:
    """The training options but runtime, memory model and objective and calibration (top-level
    fields of the document); the reserve as used (``TrainingConfig.memory_reserve``)."""
    top_level = ("runtime", "memory_model", "memory_objective", "calibration", "reserve")
    document = {
        name: list(value) if isinstance(value, tuple) else value
        for name, spec in TrainingConfig.__dataclass_fields__.items()
        if spec.init and name not in top_level
        for value in [getattr(training, name)]
    }
    reserve = training.memory_reserve
    document["reserve"] = reserve.to_dict() | {"source": reserve.source}
    return document


CHECKED_MAX_LAYERS = 4096
"""Largest graph whose written documents :func:`checked` reads back: jsonschema takes about 0.3 ms
per layer (a minute at 2 x 10^5 layers), and the invariant is the tests' to hold."""


def checked(document: dict[str, Any]) -> dict[str, Any]:
    """``document``, after checking that :func:`solver.files.plan_file.load_plan` accepts it (an
    internal invariant: the writer never writes a plan its own reader rejects; on graphs of up
    to ``CHECKED_MAX_LAYERS`` layers)."""
    if document.get("graph", {}).get("num_layers", 0) > CHECKED_MAX_LAYERS:
        return document
    try:
        load_plan(document)
    except InputError as error:
        raise AssertionError(f"internal error: a written plan fails its reader: {error}") from None
    return document


def _add_groups(document: dict[str, Any], evaluation: Evaluation) -> None:
    """Heterogeneous clusters: each stage's group, capacity and utilization."""
    for stage, group, capacity, ppm in zip(
        document["stages"],
        evaluation.group_names,
        evaluation.capacity_bytes,
        evaluation.utilization_ppm,
        strict=True,
    ):
        stage["group"] = group
        stage["capacity_bytes"] = capacity
        stage["utilization"] = ppm / PPM
    document["max_utilization"] = max(evaluation.utilization_ppm) / PPM


def calibration_to_dict(evaluation: Evaluation) -> dict[str, Any] | None:
    """The calibration the training options carry (scales per component, constant per GPU)."""
    calibration = evaluation.training.calibration
    if calibration is None:
        return None
    return {"scales": dict(calibration.scales), "constant_bytes": calibration.constant_bytes}


def _recomputed_layer_names(evaluation: Evaluation) -> list[str]:
    """Every recomputed layer of an evaluation (all stages), in graph order."""
    names = evaluation.graph.names
    return [names[i] for i in sorted(i for stage in evaluation.stages for i in stage.recomputed)]


def _baseline_basis(ours: Evaluation, baseline: Evaluation) -> str:
    """What a baseline split shares with the plan, and what differs: the config always (ZeRO,
    recompute mode, schedule); under selective recomputation the recomputed layers; on a
    heterogeneous cluster the stage groups."""
    basis = "the same config"
    if ours.config.recompute == "selective":
        theirs = sum(baseline.recomputed or [])
        mine = sum(ours.recomputed or [])
        total = ours.graph.num_layers
        basis += (
            f" and recomputed layers ({mine} of {total})"
            if (baseline.recomputed or []) == (ours.recomputed or [])
            else f" but other recomputed layers ({theirs} of {total}; the plan: {mine})"
        )
    if ours.group_of_stage is not None and baseline.group_of_stage != ours.group_of_stage:
        basis += " but other stage groups"
    return basis


def _search_text(search: SearchStatus) -> str:
    """One search of the solver line: its name and role, time, quick splits, proof."""
    role = "" if search.role == "answer" else f" (for the {search.role})"
    proof = "proven" if search.proven else f"NOT proven, {search.configs_open} configs open"
    if search.time_limit_reached:
        proof += ", time limit reached"
    return (
        f"{search.name}{role} {search.wall_s:.2f} s ({search.incumbent_s:.2f} s quick splits: "
        f"{search.configs_with_incumbent} configs, {search.configs_closed_by_incumbent} closed), "
        f"{proof}"
    )


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan JSON (format "plan", version 2; docs/plan.md, solver/plan.schema.json)."""
    report = plan.solver
    document = {"format": PLAN_FORMAT, "version": PLAN_VERSION}
    document |= evaluation_fields(plan.evaluation)
    document["solver"] = {
        "backend": report.backend,
        "status": report.status,
        "objective": report.objective,
        "objective_unit": objective_unit(plan.evaluation),
        "bound": report.bound,
        "gap": report.gap,
        "wall_s": report.wall_s,
        "configs_total": report.configs_total,
        "configs_solved": report.configs_solved,
        "configs_pruned": report.configs_pruned,
        "notes": report.notes,
        "time_limit_reached": report.time_limit_reached,
        "searches": [dataclasses.asdict(search) for search in report.searches],
    }
    document["required_throughput"] = plan.required_throughput
    document["fastest_throughput"] = plan.fastest_throughput
    document["baselines"] = {
        name: {
            "peak_bytes": ev.peak_bytes,
            "throughput": finite_or_none(ev.throughput),
            "fits": ev.fits,
            "meets_throughput": meets_throughput(plan, ev),
            "layer_counts": ev.layer_counts,
            "recomputed": _recomputed_layer_names(ev),
        }
        for name, ev in plan.baselines.items()
    }
    document["exports"] = plan.exports
    return checked(document)


def objective_unit(evaluation: Evaluation) -> str:
    """bytes or ns, or ppm for the utilization objective of a heterogeneous cluster."""
    if evaluation.training.objective != "memory":
        return "ns"
    heterogeneous = evaluation.group_of_stage is not None
    return (
        "ppm"
        if heterogeneous and evaluation.training.memory_objective == "utilization"
        else "bytes"
    )


BREAKDOWN_COLUMNS = ("weights", "grads", "optimizer", "activations", "buffers", "transient")
"""The parts of a stage's peak the table shows, in order (``StageCost.breakdown`` keys)."""


def format_evaluation(evaluation: Evaluation, title: str) -> str:
    """Text table: config line, one row per stage, peak line."""
    config, cluster = evaluation.config, evaluation.cluster
    lines = [
        title,
        f"config: {config.label()}   throughput {format_throughput(evaluation.throughput)} "
        f"(iteration {evaluation.iteration_ns / 1e6:.4g} ms, global batch "
        f"{config.global_batch})",
    ]
    lines += _stage_table(evaluation)
    lines += _model_lines(evaluation)
    placed = evaluation.group_of_stage is not None
    verdict = "fits" if evaluation.fits else "DOES NOT FIT"
    reserve = evaluation.training.memory_reserve
    if placed:
        lines.append(
            f"peak: {format_bytes(evaluation.peak_bytes)} per GPU; largest utilization "
            f"{max(evaluation.utilization_ppm) / 1e4:.1f}% of its group's usable memory "
            f"({verdict}; reserve {reserve.label()} per GPU, {reserve.source})"
        )
        return "\n".join(lines)
    usable = evaluation.usable_bytes[0]
    share = 100 * evaluation.peak_bytes / usable
    lines.append(
        f"peak: {format_bytes(evaluation.peak_bytes)} per GPU ({share:.1f}% of "
        f"{usable_text(reserve, cluster.gpu_memory_bytes)}; {verdict})"
    )
    return "\n".join(lines)


def _stage_table(evaluation: Evaluation) -> list[str]:
    """One line per stage under a header: its layers, the parts of its peak, its peak and time
    per micro-batch (with a placement its group, capacity and utilization; under selective
    recomputation its recomputed layers)."""
    config = evaluation.config
    names = evaluation.graph.names
    header = ["stage", "layers", *BREAKDOWN_COLUMNS, "peak", "time/mb"]
    placed = evaluation.group_of_stage is not None
    if placed:
        header[1:1] = ["group"]
        header += ["capacity", "util"]
    selective = config.recompute == "selective"
    if selective:
        header.append("recomputed")
        recomputed = evaluation.stage_recomputed_names()
    rows = []
    for stage in evaluation.stages:
        breakdown = stage.breakdown()
        rows.append(
            [
                str(stage.index),
                _rank_layers(evaluation, stage, names),
                *(format_bytes(breakdown[key]) for key in BREAKDOWN_COLUMNS),
                format_bytes(stage.peak_bytes),
                f"{stage.time_ns / 1e6:.3g} ms",
            ]
        )
        if placed:
            rows[-1][1:1] = [evaluation.group_names[stage.index]]
            rows[-1] += [
                format_bytes(evaluation.capacity_bytes[stage.index]),
                f"{evaluation.utilization_ppm[stage.index] / 1e4:.1f}%",
            ]
        if selective:  # last, as in the header
            rows[-1].append(_recomputed_text(recomputed[stage.index]))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def _model_lines(evaluation: Evaluation) -> list[str]:
    """What the memory model assumed beyond the config line: the memory model, the runtime's
    buffers and gradients, the precision, experts, the optimizer step, a calibration."""
    lines = []
    if evaluation.training.memory_model == "empirical":
        lines.append(
            "memory model: empirical (weights = sum of mem_added, the first stage's first layer "
            "at mem_isolated; buffers = each later stage's first-layer mem_isolated - mem_added)"
        )
    if evaluation.training.runtime != "megatron":
        lines.append(
            f"runtime: {evaluation.training.runtime} (its pipeline buffers are counted); "
            f"gradients: {_grad_lifetime_text(evaluation)}"
        )
    elif not evaluation.training.deallocate_pipeline_outputs:
        lines.append(
            "runtime: megatron, sent pipeline outputs kept until their backward "
            "(--no-deallocate-pipeline-outputs)"
        )
    lines.append(describe_precision(evaluation.training))
    experts_line = _experts_text(evaluation)
    if experts_line:
        lines.append(experts_line)
    step_line = _optimizer_step_text(evaluation)
    if step_line:
        lines.append(step_line)
    if evaluation.training.calibration is not None:
        lines.append(f"calibration: {evaluation.training.calibration.summary()}")
    return lines


def format_plan(plan: Plan) -> str:
    """The CLI's printout: the plan table, comparison with the usual splits, solver status."""
    cluster = plan.evaluation.cluster
    title = (
        f"Plan for {plan.evaluation.graph.model} on {cluster.num_gpus} GPUs x "
        f"{format_bytes(cluster.gpu_memory_bytes)}"
    )
    if cluster.is_heterogeneous:
        groups = " + ".join(
            f"{g.num_gpus} x {format_bytes(g.gpu_memory_bytes)} ({g.name})" for g in cluster.groups
        )
        title = (
            f"Plan for {plan.evaluation.graph.model} on {groups}; memory objective: "
            f"{plan.evaluation.training.memory_objective}"
        )
    lines = [format_evaluation(plan.evaluation, title)]
    if plan.required_throughput is not None:
        fastest = (
            ""
            if plan.fastest_throughput is None
            else f" (fastest plan that fits: {plan.fastest_throughput:.4g} samples/s)"
        )
        lines.append(f"throughput constraint: >= {plan.required_throughput:.4g} samples/s{fastest}")
    by_utilization = objective_unit(plan.evaluation) == "ppm"
    for name, baseline in plan.baselines.items():
        ours, theirs = plan.peak_bytes, baseline.peak_bytes
        if by_utilization:
            ours, theirs = max(plan.evaluation.utilization_ppm), max(baseline.utilization_ppm)
        change = _relative_change(ours, theirs)
        counts = ",".join(str(count) for count in baseline.layer_counts)
        caveats = [] if baseline.fits else ["does not fit"]
        if not meets_throughput(plan, baseline):
            caveats.append("below the throughput constraint")
        caveat = f" ({', '.join(caveats)})" if caveats else ""
        lines.append(
            f"{name} split ({counts}) on {_baseline_basis(plan.evaluation, baseline)}: "
            f"{format_bytes(baseline.peak_bytes)} peak, "
            f"{_throughput_cell(baseline.throughput)}{caveat}; this plan: {change} "
            + ("largest utilization" if by_utilization else "peak")
        )
    report = plan.solver
    unit = {"bytes": "B", "ns": "ns", "ppm": "ppm"}[objective_unit(plan.evaluation)]
    proof = (
        "proven optimal"
        if report.status == "OPTIMAL"
        else f"NOT proven optimal, gap {100 * report.gap:.2f}%"
    )
    lines.append(
        f"solver: {report.backend} {report.status} ({proof}), objective {report.objective} {unit}"
        f", bound {report.bound} {unit}, {report.wall_s:.2f} s; configs: {report.configs_total} "
        f"total, {report.configs_solved} solved, {report.configs_pruned} pruned by bounds"
    )
    if report.searches:
        lines.append("searches: " + "; ".join(_search_text(s) for s in report.searches))
    lines.extend(f"note: {note}" for note in report.notes)
    split_spec = plan.exports.get("torch_pipelining", {}).get("split_spec")
    if split_spec:
        lines.append(f"torch.distributed.pipelining split points: {', '.join(split_spec)}")
    return "\n".join(lines)


def meets_throughput(plan: Plan, evaluation: Evaluation) -> bool:
    """Whether a split satisfies the plan's throughput constraint (True when there is none)."""
    required = plan.required_throughput
    return required is None or evaluation.throughput >= required * (1 - 1e-12)


def _recomputed_text(names: list[str]) -> str:
    """'-', the names (up to 3), or the count with the first and last (the JSON lists all)."""
    if len(names) <= 3:
        return ",".join(names) or "-"
    return f"{len(names)}: {names[0]} ... {names[-1]}"


def _rank_layers(evaluation: Evaluation, stage, names: list[str]) -> str:
    """The layers of a stage (``names``: the graph's); with interleaving, each chunk's span,
    separated by ' | '."""
    if evaluation.config.virtual_stages == 1:
        return _layer_span([names[i] for i in stage.layers])
    return " | ".join(_layer_span([names[i] for i in chunk]) for chunk in stage.chunks)


def _layer_span(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    return f"{names[0]}..{names[-1]} ({len(names)})"


def finite_or_none(value: float) -> float | None:
    return None if math.isinf(value) else value


def _relative_change(ours: int, theirs: int) -> str:
    """'+1.5%': how much the plan's value differs from a baseline's ('n/a' when the baseline's
    is 0, e.g. a calibration that scales every component to 0)."""
    return f"{100 * (ours - theirs) / theirs:+.1f}%" if theirs else "n/a"


def _throughput_cell(samples_per_s: float) -> str:
    """'12.03 samples/s', or 'throughput n/a' for a graph without FLOPs or times."""
    text = format_throughput(samples_per_s, why=False)
    return text if math.isfinite(samples_per_s) else f"throughput {text}"
