"""Evaluate any given split under one config: the exact per-stage costs a plan reports."""

from __future__ import annotations

import re
from dataclasses import dataclass

from solver.costs import (
    LayerCosts,
    StageCost,
    iteration_bound_ns,
    layer_costs,
    placed_stage_costs,
    stage_costs,
    throughput,
    utilization_ppm,
)
from solver.costs.moe import check_expert_degree
from solver.costs.schedule_time import stages_iteration_ns
from solver.errors import InputError
from solver.graph import LayerGraph
from solver.parallel import ZERO_BUBBLE_SCHEDULES, interleaving_fits
from solver.precision import for_graph
from solver.report.baselines import BASELINES, PARTITIONERS, counts_to_assignment
from solver.reserve import check_usable
from solver.search.candidates import check_interleaving, sequence_parallel
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from solver.units import format_bytes


@dataclass(kw_only=True)
class Evaluation:
    """Costs of one split under one config. Bytes per GPU, times in ns."""

    graph: LayerGraph
    config: ParallelConfig
    cluster: Cluster
    training: TrainingConfig
    stage_of_layer: list[int]
    stages: list[StageCost]
    iteration_ns: int
    """The simulated iteration (``solver.costs.schedule_time``): its pipeline schedule run action by
    action with the stages' forward and backward times, the transfers, the data-parallel
    sync and the optimizer step."""
    iteration_bound_ns: int = 0
    """The iteration bound the solvers search with (``costs.iteration_bound_ns``), never
    above ``iteration_ns``."""
    group_of_stage: list[int] | None = None
    """Node group of each stage on a heterogeneous cluster (index into ``cluster.groups``)."""
    recomputed: list[bool] | None = None
    """Under recompute "selective": a flag per layer (each stage lists its own in
    ``StageCost.recomputed``)."""

    @property
    def peak_bytes(self) -> int:
        """Largest per-GPU peak over the stages."""
        return max(stage.peak_bytes for stage in self.stages)

    @property
    def capacity_bytes(self) -> list[int]:
        """GPU memory of each stage's GPUs."""
        if self.group_of_stage is None:
            return [self.cluster.gpu_memory_bytes] * len(self.stages)
        return [self.cluster.groups[k].gpu_memory_bytes for k in self.group_of_stage]

    @property
    def usable_bytes(self) -> list[int]:
        """The memory each stage may fill: its GPUs' capacity - the reserve
        (``TrainingConfig.memory_reserve``)."""
        return [self.training.usable_bytes(capacity) for capacity in self.capacity_bytes]

    @property
    def utilization_ppm(self) -> list[int]:
        """Each stage's peak / its usable memory, parts per million (rounded up)."""
        return [
            utilization_ppm(stage.peak_bytes, usable)
            for stage, usable in zip(self.stages, self.usable_bytes, strict=True)
        ]

    @property
    def group_names(self) -> list[str] | None:
        if self.group_of_stage is None:
            return None
        return [self.cluster.groups[k].name for k in self.group_of_stage]

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return throughput(self.config.global_batch, self.iteration_ns)

    @property
    def fits(self) -> bool:
        """Every stage's peak within its usable memory (capacity - reserve), and the largest
        peak positive (``check_stage_peaks`` refuses any other; never "fits" on 0 B)."""
        return self.peak_bytes > 0 and all(
            stage.peak_bytes <= usable
            for stage, usable in zip(self.stages, self.usable_bytes, strict=True)
        )

    def stage_layer_names(self) -> list[list[str]]:
        names = self.graph.names
        return [[names[i] for i in stage.layers] for stage in self.stages]

    def stage_recomputed_names(self) -> list[list[str]]:
        """Names of the recomputed layers of every stage."""
        names = self.graph.names
        return [[names[i] for i in stage.recomputed] for stage in self.stages]

    @property
    def num_virtual_stages(self) -> int:
        """p v: the stages the layers are split into (p without interleaving)."""
        return self.config.pp * self.config.virtual_stages

    @property
    def layer_counts(self) -> list[int]:
        """Layers of every (virtual) stage, in pipeline order (--split accepts them back)."""
        return [len(names) for names in self.virtual_stage_layer_names()]

    def virtual_stage_layer_names(self) -> list[list[str]]:
        """Layer names of every (virtual) stage in pipeline order: stage_layer_names without
        interleaving; with it, virtual stage j runs on rank j mod p."""
        return self._by_virtual_stage(range(len(self.stage_of_layer)))

    def virtual_stage_recomputed_names(self) -> list[list[str]]:
        """Names of the recomputed layers of every (virtual) stage."""
        return self._by_virtual_stage(
            sorted(layer for stage in self.stages for layer in stage.recomputed)
        )

    def _by_virtual_stage(self, layers) -> list[list[str]]:
        """The names of ``layers`` (positions, in order) grouped by their (virtual) stage."""
        names = self.graph.names
        grouped: list[list[str]] = [[] for _ in range(self.num_virtual_stages)]
        for layer in layers:
            grouped[self.stage_of_layer[layer]].append(names[layer])
        return grouped


def default_training(config: ParallelConfig) -> TrainingConfig:
    """Training options matching a config (its global batch, schedule and recompute); the rest
    are TrainingConfig's defaults: the megatron runtime with its bytes per parameter (2, 4, 12:
    fp32 gradients) and sent pipeline outputs deallocated, as Megatron-LM runs."""
    return TrainingConfig(
        global_batch=config.global_batch,
        micro_batch_sizes=(config.micro_batch,),
        zero_stages=(config.zero,),
        recompute=config.recompute,
        schedule=config.schedule,
        virtual_stages=(config.virtual_stages,),
        sequence_parallel="on" if config.sp else "off",
        cp=(config.cp,),
        ep=(config.ep,),
    )


_DEFAULTS = TrainingConfig(global_batch=1)


def prepare_training(
    graph: LayerGraph, cluster: Cluster, training: TrainingConfig
) -> TrainingConfig:
    """``training`` as plan and evaluate use it: its precision resolved for ``graph`` (the
    graph's dtype when None, ``precision.for_graph``), and InputError when its reserve leaves
    nothing of a GPU of ``cluster``."""
    training = for_graph(training, graph)
    for ep in training.ep or ():
        check_expert_degree(graph, ep)
    capacities = (
        {f"node group {g.name}'s GPU": g.gpu_memory_bytes for g in cluster.groups}
        if cluster.is_heterogeneous
        else {"each GPU's": cluster.gpu_memory_bytes}
    )
    check_usable(training.memory_reserve, capacities)
    return training


def check_training(config: ParallelConfig, training: TrainingConfig) -> None:
    """InputError naming both values when ``training`` contradicts ``config``.

    The config is the layout that is evaluated; the training options must admit it: its
    schedule among the searched ones (``TrainingConfig.schedules``), the same global batch
    (dp * b * m), its virtual stages among the candidates, its
    recompute mode (or auto, which covers every mode), its micro-batch size and ZeRO stage among
    the candidates when those lists are not the defaults (the default lists restrict nothing
    here), pp/tp/dp equal to any pinned degree, config.ep among training.ep (unless auto),
    and config.sp what its sequence_parallel option gives for its tp
    (``candidates.sequence_parallel``). Only then do the training options'
    bytes per parameter, runtime (and its output deallocation), memory model and calibration
    describe this layout.
    """
    problems = []
    if config.schedule not in training.schedules:
        problems.append(
            f"config.schedule {config.schedule!r} not in training.schedule {training.schedule!r}"
        )
    if config.virtual_stages not in training.virtual_stages:
        problems.append(
            f"config.virtual_stages {config.virtual_stages} not in training.virtual_stages "
            f"{list(training.virtual_stages)}"
        )
    if config.cp not in training.cp:
        problems.append(f"config.cp {config.cp} not in training.cp {list(training.cp)}")
    if config.sp != sequence_parallel(training, config.tp):
        problems.append(
            f"training.sequence_parallel {training.sequence_parallel!r} gives sp "
            f"{sequence_parallel(training, config.tp)} with tp {config.tp}, config.sp {config.sp}"
        )
    if training.ep is not None and config.ep not in training.ep:
        problems.append(f"config.ep {config.ep} not in training.ep {list(training.ep)}")
    if training.recompute not in (config.recompute, "auto"):
        problems.append(
            f"training.recompute {training.recompute!r} != config.recompute {config.recompute!r}"
        )
    for field, candidates in (("micro_batch", "micro_batch_sizes"), ("zero", "zero_stages")):
        allowed, value = getattr(training, candidates), getattr(config, field)
        if allowed != getattr(_DEFAULTS, candidates) and value not in allowed:
            problems.append(f"config.{field} {value} not in training.{candidates} {list(allowed)}")
    for degree in ("pp", "tp", "dp"):
        pinned, value = getattr(training, degree), getattr(config, degree)
        if pinned is not None and pinned != value:
            problems.append(f"training.{degree} {pinned} != config.{degree} {value}")
    if training.global_batch != config.global_batch:
        problems.append(
            f"training.global_batch {training.global_batch} != config dp({config.dp}) * "
            f"micro_batch({config.micro_batch}) * num_microbatches({config.num_microbatches}) = "
            f"{config.global_batch}"
        )
    if problems:
        raise InputError(
            f"training options contradict the config: {'; '.join(problems)}; make them agree "
            "or omit training (it is then derived from the config)"
        )


def evaluate(
    graph: LayerGraph,
    config: ParallelConfig,
    split: str | list[int],
    *,
    cluster: Cluster | None = None,
    training: TrainingConfig | None = None,
    group_of_stage: list[int] | None = None,
    recomputed: list[bool] | None = None,
) -> Evaluation:
    """Per-stage peaks and times of ``split`` under ``config``.

    ``split``: "even" (Megatron default), "parameters" (DeepSpeed parameter-balanced), layer counts
    per stage (chains, list order), or a stage index per layer (any DAG). ``recomputed``: a flag
    per layer, under ``config.recompute == "selective"`` (default: no layer). On a heterogeneous
    cluster ``group_of_stage`` says which node group runs each stage (tp * dp GPUs of it).
    ``training`` gives the precision and bytes per parameter, runtime, output deallocation,
    memory model, calibration and reserve; it must admit ``config`` (:func:`check_training`,
    InputError otherwise); None derives it from config. A precision of None is the graph's
    (``precision.for_graph``).
    """
    cluster = cluster or Cluster(num_gpus=config.num_gpus)
    if training is None:
        training = default_training(config)
    else:
        check_training(config, training)
    training = prepare_training(graph, cluster, training)
    if config.schedule in ZERO_BUBBLE_SCHEDULES:
        _check_split_backward(cluster, training, config)
    elif config.virtual_stages > 1:
        check_interleaving(cluster, training)
        m, p, v = config.num_microbatches, config.pp, config.virtual_stages
        if not interleaving_fits(graph.num_layers, p, m, v):
            raise InputError(
                f"interleaved 1F1B with pp({p}) and {v} virtual stages per rank needs pp >= 2, "
                f"pp * v <= layers ({graph.num_layers}) and pp | micro-batches ({m}, Megatron's "
                "default micro-batch group); change --virtual-stages or the global batch"
            )
    stage_of_layer = resolve_split(graph, config.pp * config.virtual_stages, split)
    if recomputed is not None and config.recompute != "selective" and any(recomputed):
        raise InputError(f"recomputed layers given with recompute={config.recompute!r}")
    if recomputed is not None and len(recomputed) != graph.num_layers:
        raise InputError(f"{len(recomputed)} recompute flags for {graph.num_layers} layers")
    if not cluster.is_heterogeneous:
        costs = layer_costs(graph, config, cluster, training)
        return evaluate_assignment(
            graph, costs, stage_of_layer, cluster=cluster, training=training, recomputed=recomputed
        )
    check_placement(cluster, config, group_of_stage)
    group_costs = [
        layer_costs(graph, config, cluster.group_cluster(k), training)
        for k in range(len(cluster.groups))
    ]
    return evaluate_assignment(
        graph,
        group_costs[0],
        stage_of_layer,
        cluster=cluster,
        training=training,
        group_costs=group_costs,
        group_of_stage=group_of_stage,
        recomputed=recomputed,
    )


def _check_split_backward(
    cluster: Cluster, training: TrainingConfig, config: ParallelConfig
) -> None:
    """The split-backward schedules (``ZERO_BUBBLE_SCHEDULES``) are modelled for the analytic
    memory model on homogeneous clusters (their stage costs replay torch's action lists,
    ``stages.stage_costs``); anything else is a one-line error."""
    if training.memory_model != "analytic":
        raise InputError(
            f"--schedule {config.schedule}: the empirical statistics describe 1F1B stages; use "
            "--memory-model analytic"
        )
    if cluster.is_heterogeneous:
        raise InputError(
            f"--schedule {config.schedule} on a heterogeneous cluster is not supported; use "
            "--schedule 1f1b with --cluster"
        )


def recompute_flags(
    graph: LayerGraph, spec: str, *, flag: str = "--recompute-layers"
) -> list[bool]:
    """A recompute flag per layer from ``spec``: comma-separated layer names, topological
    positions (0-based) and inclusive position ranges, e.g. ``0-3,7,block5``; an empty spec is
    no layer. A token that is a layer name means that layer, even if it also reads as a number.
    Raises InputError naming ``flag`` for unknown names, positions outside the graph, reversed
    ranges and empty items."""
    num_layers = graph.num_layers
    flags = [False] * num_layers
    if not spec.strip():
        return flags
    position = graph.index()
    for token in (part.strip() for part in spec.split(",")):
        if not token:
            raise InputError(
                f"{flag} {spec!r}: empty item; separate names and positions by one comma"
            )
        if token in position:
            flags[position[token]] = True
            continue
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", token)
        if match is None:
            raise InputError(
                f"{flag}: {token!r} is not a layer name, a position 0..{num_layers - 1} or a "
                f"range like 0-3 (names: {', '.join(graph.names[:3])}, ...)"
            )
        first = int(match[1])
        last = first if match[2] is None else int(match[2])
        if first > last:
            raise InputError(f"{flag}: range {token} runs backwards; write {last}-{first}")
        if last >= num_layers:
            raise InputError(
                f"{flag}: position {last} outside 0..{num_layers - 1} (the graph has "
                f"{num_layers} layers); use a position in range or a layer name"
            )
        flags[first : last + 1] = [True] * (last + 1 - first)
    return flags


def check_placement(cluster: Cluster, config: ParallelConfig, group_of_stage: list[int] | None):
    """A group for each stage, tp | the group's GPUs per node, and no group over its GPUs."""
    names = [g.name for g in cluster.groups]
    if group_of_stage is None or len(group_of_stage) != config.pp:
        raise InputError(
            f"a heterogeneous cluster needs a node group for each of the {config.pp} stages "
            f"(--stage-groups, names: {', '.join(names)})"
        )
    for k, group in enumerate(cluster.groups):
        width = config.tp * config.cp * config.dp  # the GPUs of one stage
        used = width * sum(1 for g in group_of_stage if g == k)
        if used > group.num_gpus:
            cp = f" * cp({config.cp})" if config.cp > 1 else ""
            raise InputError(
                f"group {group.name}: its stages need tp({config.tp}){cp} * dp({config.dp}) * "
                f"{used // width} = {used} GPUs > its {group.num_gpus}"
            )
        if used and group.gpus_per_node % config.tp:
            raise InputError(
                f"group {group.name}: tp({config.tp}) does not divide its gpus_per_node "
                f"({group.gpus_per_node}); tensor parallelism stays inside a node"
            )


def evaluate_assignment(
    graph: LayerGraph,
    costs: LayerCosts,
    stage_of_layer: list[int],
    *,
    cluster: Cluster,
    training: TrainingConfig,
    recomputed: list[bool] | None = None,
    group_costs: list[LayerCosts] | None = None,
    group_of_stage: list[int] | None = None,
    stages: list[StageCost] | None = None,
) -> Evaluation:
    """Evaluation from precomputed coefficients (the planner's path); on a heterogeneous
    cluster, stage s uses ``group_costs[group_of_stage[s]]`` (its group's times). ``stages``:
    ``stage_costs(costs, stage_of_layer)`` when the caller has it already (a backend's
    solution without recomputed layers or placement)."""
    if not costs.selective:
        recomputed = None
    elif recomputed is None:
        recomputed = [False] * costs.num_layers
    if stages is not None:
        assert recomputed is None and group_of_stage is None, "stages of a plain split only"
    elif group_of_stage is None:
        stages = stage_costs(costs, stage_of_layer, recomputed)
    else:
        stages = placed_stage_costs(group_costs, stage_of_layer, group_of_stage, recomputed)
    check_stage_peaks(graph, costs.config, stages, training)
    return Evaluation(
        graph=graph,
        config=costs.config,
        cluster=cluster,
        training=training,
        stage_of_layer=list(stage_of_layer),
        stages=stages,
        iteration_ns=(
            stages_iteration_ns(costs, stages, stage_of_layer) if costs.has_compute_time else 0
        ),
        iteration_bound_ns=iteration_bound_ns(costs, stages) if costs.has_compute_time else 0,
        group_of_stage=None if group_of_stage is None else list(group_of_stage),
        recomputed=None if recomputed is None else [bool(flag) for flag in recomputed],
    )


def check_stage_peaks(
    graph: LayerGraph, config: ParallelConfig, stages: list[StageCost], training: TrainingConfig
) -> None:
    """InputError unless every stage's peak holds at least its model states (weights, gradients
    and optimizer state as the breakdown counts them at the peak: what the GPU must hold) and
    the largest peak is positive; a calibration's negative constant may not take a stage to 0 B
    or below. The analytic terms are never negative, so only a calibration (or a corrupt
    graph) can fail this: the one guard, where every plan's, baseline's and evaluation's
    peaks are assembled (bytes per GPU)."""
    low = [
        stage
        for stage in stages
        if stage.peak_bytes < _states(stage) or (stage.peak_bytes <= 0 and stage.constant_bytes < 0)
    ]
    if low:
        raise InputError(_low_peak(graph, config, stages, low[0], training.calibration))
    if stages and max(stage.peak_bytes for stage in stages) <= 0:
        raise InputError(
            f"{graph.source}: {config.label()}: every stage's peak is 0 B or less; the graph's "
            "layers (and the calibration's scales) must give some memory"
        )


def _states(stage: StageCost) -> int:
    """The model states of a stage's breakdown at its peak: weights, gradients, optimizer state."""
    return stage.weight_bytes + stage.grad_bytes + stage.optimizer_bytes


def _low_peak(
    graph: LayerGraph,
    config: ParallelConfig,
    stages: list[StageCost],
    stage: StageCost,
    calibration,
) -> str:
    """The message of a stage peak below its model states (or at 0 B): the calibration's
    constant and the least every stage of the config admits, or, without one, the graph."""
    stage_text = f"stage {stage.index} of {config.label()}"
    if calibration is None or stage.constant_bytes >= 0:
        return (
            f"{graph.source}: {stage_text} peaks at {format_bytes(stage.peak_bytes)}, below its "
            f"model states ({format_bytes(_states(stage))}) or not positive; a layer's memory "
            "fields must not be negative (re-export the graph)"
        )
    # c >= states - (peak - c) on every stage, and > -(peak - c) where the states are 0
    least = max(_states(s) - (s.peak_bytes - s.constant_bytes) + (not _states(s)) for s in stages)
    return (
        f"{calibration.source or 'calibration'}: constant_bytes {stage.constant_bytes} takes "
        f"{stage_text} to {format_bytes(stage.peak_bytes)}, below its "
        f"{format_bytes(_states(stage))} of model states; here it must be >= {least} "
        f"({format_bytes(least)}): a negative constant may only take from activations, buffers "
        "and transients"
    )


def resolve_split(graph: LayerGraph, num_stages: int, split: str | list[int]) -> list[int]:
    """Turn a split description into a valid stage index per layer, or raise InputError."""
    num_layers = graph.num_layers
    if num_stages > num_layers:
        raise InputError(
            f"pp({num_stages}) > number of layers ({num_layers}); every stage needs a layer"
        )
    if isinstance(split, str):
        if split not in BASELINES:
            raise InputError(
                f"--split {split!r}: use 'even', 'parameters', layer counts per "
                "stage (e.g. 5,7,7,5) or a stage index per layer"
            )
        assignment = BASELINES[split](graph, num_stages)
    else:
        values = [int(v) for v in split]
        if len(values) == num_stages and sum(values) == num_layers and min(values) >= 1:
            assignment = counts_to_assignment(values)
        elif len(values) == num_layers:
            assignment = values
        else:
            raise InputError(
                f"--split has {len(values)} numbers summing to {sum(values)}: give {num_stages} "
                f"positive layer counts summing to {num_layers}, or {num_layers} stage indices"
            )
    _check_assignment(graph, num_stages, assignment)
    return assignment


def _check_assignment(graph: LayerGraph, num_stages: int, assignment: list[int]) -> None:
    bad = [s for s in assignment if not 0 <= s < num_stages]
    if bad:
        raise InputError(f"--split: stage index {bad[0]} outside 0..{num_stages - 1}")
    empty = sorted(set(range(num_stages)) - set(assignment))
    if empty:
        raise InputError(f"--split: stage {empty[0]} has no layer; every stage needs one")
    position = graph.index()
    for edge in graph.edges:
        if assignment[position[edge.src]] > assignment[position[edge.dst]]:
            raise InputError(
                f"--split: edge {edge.src} -> {edge.dst} would go from stage "
                f"{assignment[position[edge.src]]} back to stage "
                f"{assignment[position[edge.dst]]}; stages must follow the data flow"
            )


def evaluate_partitioners(
    graph: LayerGraph,
    costs: LayerCosts,
    *,
    cluster: Cluster,
    training: TrainingConfig,
    names: tuple[str, ...] | None = None,
):
    """name -> Evaluation of each partitioner's split of the config of ``costs`` (exact costs
    from ``costs.stage_costs``, as for a plan); the throughput-first split fits in
    the usable memory (``cluster.gpu_memory_bytes`` - the reserve) when any split does."""
    return {
        name: evaluate_assignment(
            graph,
            costs,
            PARTITIONERS[name](graph, costs, training.usable_bytes(cluster.gpu_memory_bytes)),
            cluster=cluster,
            training=training,
        )
        for name in (names or tuple(PARTITIONERS))
    }
