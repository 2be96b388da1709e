"""Plan documents as a contract (docs/plan.md): read and check one, and evaluate it again.

:func:`load_plan` reads what ``python -m solver.plan --json`` (format "plan") or ``python -m
solver.evaluate --json`` (format "evaluation") wrote, checks it against the JSON Schema in
``plan.schema.json`` (also linked from ``docs/``) and against what a schema cannot say (one stage
per pipeline rank, chunks that list each rank's layers, a stage of every layer that agrees with
the stages' layer lists, peaks that are the sums of their breakdowns), and returns a typed,
frozen :class:`PlanFile`. Every problem is one ``InputError`` line naming the file, the field
and the fix. The writers (``solver.report.plan_report``, ``solver.search.pareto``) pass every
document they write through the same checks, so a plan this code writes is one this reader accepts.

:func:`evaluate_plan` rebuilds the plan's config, split, recomputed layers, stage groups,
cluster and training options and evaluates them with ``solver.evaluation.evaluate``;
:func:`plan_differences` lists where the result differs from the numbers the plan records.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from solver.calibration import Calibration
from solver.costs import PPM
from solver.engine_rules import ModelFacts, check_config
from solver.errors import InputError, quote
from solver.evaluation import Evaluation, evaluate
from solver.files.jsonfile import read_json, schema_message
from solver.graph import LayerGraph, load_graph
from solver.parallel import chunk_places
from solver.reserve import MemoryReserve
from solver.specs import Cluster, NodeGroup, ParallelConfig, TrainingConfig

PLAN_FORMAT = "plan"
EVALUATION_FORMAT = "evaluation"
PARETO_FORMAT = "pareto"
PLAN_VERSION = 2
"""The version written (plans, evaluations and Pareto fronts share it)."""
READABLE_VERSIONS = (1, 2)
"""Version 1 lacks the graph, training and complete cluster records (see docs/plan.md)."""
_FIX = {
    PLAN_FORMAT: "re-create the plan with python -m solver.plan",
    EVALUATION_FORMAT: "re-create it with python -m solver.evaluate --json",
    PARETO_FORMAT: "re-create it with python -m solver.plan --pareto",
}


@cache
def schema() -> dict[str, Any]:
    """The JSON Schema of plan, evaluation and Pareto documents (``solver/plan.schema.json``)."""
    return json.loads(resources.files("solver").joinpath("plan.schema.json").read_text())


@cache
def _validator(kind: str) -> jsonschema.Draft202012Validator:
    """A validator for one format: ``$defs/<kind>`` of the schema (its errors name the field)."""
    return jsonschema.Draft202012Validator({"$defs": schema()["$defs"], "$ref": f"#/$defs/{kind}"})


@dataclass(kw_only=True, frozen=True)
class GraphRecord:
    """The layer graph a plan was made for (version 2)."""

    model: str
    path: str | None
    """The graph file as given to the CLI; None for a graph built in memory."""
    sha256: str
    """:meth:`solver.graph.LayerGraph.sha256` of that graph."""
    num_layers: int


@dataclass(kw_only=True, frozen=True)
class PlanStage:
    """One pipeline rank of a plan. Bytes per GPU; times in ms."""

    index: int
    layers: tuple[str, ...]
    """Layer names in graph order (with interleaving: its chunks concatenated)."""
    chunks: tuple[tuple[str, ...], ...]
    """Layers of each of the rank's chunks (virtual stage c * pp + index is chunk c; in a V,
    zbv and dualpipev, index and 2 pp - 1 - index); one chunk, ``layers``, without
    interleaving."""
    recomputed: tuple[str, ...]
    """Its layers whose activations are recomputed."""
    peak_bytes: int
    breakdown: dict[str, int]
    """Peak by component (weights, grads, optimizer, activations, buffers, transient[,
    constant]), bytes; they sum to ``peak_bytes``."""
    time_ms: float
    """Forward + backward (+ recompute) per micro-batch, ms."""
    group: str | None = None
    """The node group it runs on (heterogeneous clusters)."""


@dataclass(kw_only=True, frozen=True)
class PlanFile:
    """A checked plan (or evaluation) document: what it was made for and the layout it gives.

    ``cluster`` and ``training`` are None for version-1 documents, which recorded neither the
    cluster's FLOP/s and bandwidths nor the bytes per parameter.
    """

    source: str
    """The file it was read from, or "plan" for a dict."""
    format: str
    """"plan" or "evaluation"."""
    version: int
    model: str
    """The graph's model name."""
    graph: GraphRecord | None
    config: ParallelConfig
    cluster: Cluster | None
    training: TrainingConfig | None
    """The options the plan was made with (search space, global batch, bytes per parameter,
    runtime, memory model and objective, calibration)."""
    runtime: str
    """Pipeline runtime whose buffers the peaks count: megatron or torch."""
    memory_model: str
    memory_objective: str
    calibration: Calibration | None
    stages: tuple[PlanStage, ...]
    stage_of_layer: tuple[int, ...]
    """(Virtual) stage of every layer, in the graph's layer order."""
    peak_bytes: int
    iteration_ms: float
    exports: dict[str, Any] | None
    """Settings per runtime (torch_pipelining, megatron, deepspeed); None for an evaluation."""
    fits: bool = True
    """What the document says: every stage's peak within its usable memory."""
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The numbers the document derives from its stages, config and cluster (fits, throughput,
    each stage's usable bytes, moment, ...; :data:`DERIVED_FIELDS`), by path, as recorded:
    :func:`plan_differences` compares them with a new evaluation."""

    @property
    def global_batch(self) -> int:
        """Samples per step, dp * micro_batch * num_microbatches."""
        return self.config.global_batch

    @property
    def stage_peak_bytes(self) -> list[int]:
        return [stage.peak_bytes for stage in self.stages]

    @property
    def recomputed_layers(self) -> list[str]:
        """Names of every recomputed layer (all stages)."""
        return [name for stage in self.stages for name in stage.recomputed]

    @property
    def virtual_stage_layers(self) -> list[list[str]]:
        """Layer names of each (virtual) stage in pipeline order: virtual stage j is chunk
        j // pp of rank j % pp (in a V, zbv and dualpipev: ``parallel.chunk_places``)."""
        config = self.config
        places = chunk_places(config.schedule, config.pp, config.virtual_stages)
        return [list(self.stages[rank].chunks[chunk]) for rank, chunk in places]

    @property
    def group_of_stage(self) -> list[int] | None:
        """Index into ``cluster.groups`` of each stage's node group (heterogeneous clusters)."""
        if self.stages[0].group is None or self.cluster is None:
            return None
        names = [group.name for group in self.cluster.groups]
        return [names.index(stage.group) for stage in self.stages]


def load_plan(source: str | Path | dict[str, Any] | PlanFile) -> PlanFile:
    """Read and check a plan or evaluation document (a path or a parsed dict).

    Raises :class:`InputError` with one line naming the file, the field and the fix.
    """
    if isinstance(source, PlanFile):
        return source
    if isinstance(source, dict):
        return plan_from_dict(source, origin="plan")
    fix = "pass a plan from python -m solver.plan --json"
    return plan_from_dict(read_json(source, kind="plan", fix=fix), origin=str(source))


def plan_from_dict(document: Any, *, origin: str = "plan") -> PlanFile:
    """Check a parsed document (format, version, schema, structure) and build the view."""
    kind = _format_of(document, origin)
    if kind == PARETO_FORMAT:
        raise InputError(
            f'{origin}: a Pareto front (format "pareto"), not one plan; evaluate one of its '
            "points with python -m solver.evaluate --split, or plan it with pinned --pp/--tp/--dp"
        )
    check_schema(document, origin=origin)
    return _build(document, origin, kind)


def check_schema(document: dict[str, Any], *, origin: str = "plan") -> None:
    """InputError for the first schema violation of a document of known format and version."""
    kind = document["format"]
    validator = _validator(kind)
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    # a failing shared part (allOf) leaves its fields unevaluated: report the failure itself
    errors = [e for e in errors if e.validator != "unevaluatedProperties"] or errors
    if errors:
        error = jsonschema.exceptions.best_match(errors)
        where = error.json_path.removeprefix("$.").removeprefix("$") or "(top level)"
        raise InputError(f"{origin}: {where}: {_describe(error)}; {_FIX[kind]}")


def check_pareto(document: dict[str, Any], *, origin: str = "pareto") -> None:
    """Schema and per-point structure of a Pareto document (what ``solver.search.pareto``
    writes)."""
    _format_of(document, origin)
    check_schema(document, origin=origin)
    for i, point in enumerate(document["points"]):
        _build(point | {"version": document["version"]}, f"{origin}: points[{i}]", PARETO_FORMAT)


def _format_of(document: Any, origin: str) -> str:
    """The document's format, after checking it and its version are ones this reader knows."""
    kind = document.get("format") if isinstance(document, dict) else None
    if kind not in _FIX:
        raise InputError(
            f'{origin}: not a plan (expected "format": "plan" as written by python -m solver.plan '
            '--json, or "evaluation" by python -m solver.evaluate --json; evaluations written '
            "before version 2 have no format: write them again)"
        )
    version = document.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:  # 2.0 and true too
        raise InputError(
            f"{origin}: version: {_shown(version)} is not a version this reader knows "
            f"({', '.join(map(str, READABLE_VERSIONS))}); {_FIX[kind]}, or update memplan"
        )
    newer = [key for key in ("graph", "training") if key in document]
    if version == 1 and newer:
        raise InputError(
            f"{origin}: version: 1, but the document holds the {' and '.join(newer)} "
            f"record{'s' * (len(newer) > 1)} only version {PLAN_VERSION} writes (was the version "
            f"edited?); set it to {PLAN_VERSION} or {_FIX[kind]}"
        )
    return kind


def _shown(value: Any) -> str:
    """A JSON scalar as JSON (true, 2.0, null), anything else quoted (``errors.quote``)."""
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)
    return quote(value)


_TYPE_WORDS = {"integer": "an integer", "array": "an array", "object": "an object"}
_QUOTED = r"'([^']*)'"
"""A name in a jsonschema message."""


def _describe(error: jsonschema.ValidationError) -> str:
    """The problem of a schema error in words ("expected an integer, got 1.5")."""
    value = json.dumps(error.instance)
    got = value if len(value) <= 40 else value[:37] + "..."
    match error.validator:
        case "type":
            types = error.validator_value
            types = [types] if isinstance(types, str) else types
            words = [_TYPE_WORDS.get(name, f"a {name}") for name in types]
            return f"expected {' or '.join(words)}, got {got}"
        case "enum":
            return f"expected one of {', '.join(map(json.dumps, error.validator_value))}, got {got}"
        case "const":
            return f"expected {json.dumps(error.validator_value)}, got {got}"
        case "required":  # "'name' is a required property"
            return f"missing field {', '.join(re.findall(_QUOTED, error.message))}"
        case "additionalProperties" | "unevaluatedProperties":  # "... ('name' was unexpected)"
            return f"unknown field {', '.join(re.findall(_QUOTED, error.message))}; remove it"
        case "minimum" | "exclusiveMinimum" | "maximum":
            sign = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<="}[error.validator]
            return f"expected {sign} {error.validator_value}, got {got}"
        case "minItems":
            return f"expected at least {error.validator_value} item(s), got {len(error.instance)}"
        case _:
            return schema_message(error)


def _build(document: dict[str, Any], origin: str, kind: str) -> PlanFile:
    """The view of a schema-valid document, after the checks a schema cannot express."""

    def fail(where: str, problem: str) -> InputError:
        return InputError(f"{origin}: {where}: {problem}; {_FIX[kind]}")

    try:
        config = ParallelConfig(**document["config"])
    except InputError as error:
        raise fail("config", str(error)) from None
    cluster = _cluster(document["cluster"], fail)
    stages = tuple(_stage(item, i, config, fail) for i, item in enumerate(document["stages"]))
    _check_stages(document, config, stages, fail)
    _check_stage_groups(document, stages, fail)
    record = document.get("graph")
    graph = None if record is None else GraphRecord(**record)
    if graph is not None and graph.num_layers != len(document["stage_of_layer"]):
        raise fail(
            "stage_of_layer",
            f"{len(document['stage_of_layer'])} entries for graph.num_layers {graph.num_layers}",
        )
    calibration = document["calibration"]
    if calibration is not None:
        try:
            calibration = Calibration(
                scales=calibration["scales"],
                constant_bytes=calibration["constant_bytes"],
                source=f"{origin}: calibration",
            )
        except InputError as error:
            raise fail("calibration", str(error).removeprefix("calibration ")) from None
    memory_objective = document.get("memory_objective", "utilization")
    training = _training(document, memory_objective, calibration, fail)
    return PlanFile(
        source=origin,
        format=kind,
        version=document["version"],
        model=document["model"],
        graph=graph,
        config=config,
        cluster=cluster,
        training=training,
        runtime=document["runtime"],
        memory_model=document["memory_model"],
        memory_objective=memory_objective,
        calibration=calibration,
        stages=stages,
        stage_of_layer=tuple(document["stage_of_layer"]),
        peak_bytes=document["peak_bytes"],
        iteration_ms=document["iteration_ms"],
        exports=document.get("exports"),
        fits=document["fits"],
        derived=_recorded(document),
    )


def _check_stage_groups(document: dict[str, Any], stages: tuple, fail) -> None:
    """Every stage names a group of cluster.groups, and only on a heterogeneous cluster."""
    groups = [g["name"] for g in document["cluster"].get("groups", [])]
    for stage in stages:
        if (stage.group is None) != (not groups) or (groups and stage.group not in groups):
            raise fail(
                f"stages[{stage.index}].group",
                f"{quote(stage.group)} is not a group of cluster.groups "
                f"({', '.join(groups) or 'none: a homogeneous cluster'})",
            )


def _training(
    document: dict[str, Any], memory_objective: str, calibration: Calibration | None, fail
) -> TrainingConfig | None:
    """The training options of a document that records them (None: an older plan without)."""
    if "training" not in document:
        return None
    try:
        options = dict(document["training"])
        # a plan written before the reserve existed was checked against the whole capacity
        recorded = options.pop("reserve", {"fixed_bytes": 0, "fraction": 0.0})
        reserve = MemoryReserve(
            fixed_bytes=recorded["fixed_bytes"],
            fraction=recorded["fraction"],
            source=recorded.get("source", "not recorded: none"),
        )
        return TrainingConfig(
            **{
                key: tuple(value) if isinstance(value, list) else value
                # plans written before grad_lifetime existed ran with persistent gradients,
                # before optimizer_impl without a step temporary, before
                # sequence_parallel without SP
                for key, value in {
                    "grad_lifetime": "persistent",
                    "optimizer_impl": "fused",
                    "sequence_parallel": "off",
                    **options,
                }.items()
            },
            reserve=reserve,
            runtime=document["runtime"],
            memory_model=document["memory_model"],
            memory_objective=memory_objective,
            calibration=calibration,
        )
    except InputError as error:
        raise fail("training", str(error)) from None


def _cluster(record: dict[str, Any], fail) -> Cluster | None:
    """The cluster of a version-2 record (None for version 1, which lacks FLOP/s and links)."""
    if "gpu_flops" not in record:
        return None
    try:
        return Cluster(
            **{key: value for key, value in record.items() if key != "groups"},
            groups=tuple(NodeGroup(**group) for group in record.get("groups", ())),
        )
    except InputError as error:
        raise fail("cluster", str(error)) from None


def _stage(item: dict[str, Any], i: int, config: ParallelConfig, fail) -> PlanStage:
    """One stage: index i, chunks that list its layers, recomputed layers among them, a peak
    that is the sum of its breakdown."""
    where = f"stages[{i}]"
    if item["index"] != i:
        raise fail(f"{where}.index", f"{item['index']}, expected {i} (0..pp-1 in order)")
    layers = tuple(item["layers"])
    v = config.virtual_stages
    if v == 1:
        if "chunks" in item:
            raise fail(f"{where}.chunks", "given with virtual_stages=1; remove it")
        chunks = (layers,)
    else:
        given = item.get("chunks", [])
        if len(given) != v:
            raise fail(f"{where}.chunks", f"has {len(given)} chunks for virtual_stages={v}")
        chunks = tuple(tuple(chunk) for chunk in given)
        if tuple(name for chunk in chunks for name in chunk) != layers:
            raise fail(f"{where}.chunks", "must list its layers in order (chunk 0 first)")
    unknown = sorted(set(item["recomputed"]) - set(layers))
    if unknown:
        raise fail(f"{where}.recomputed", f"{quote(unknown[0])} is not one of the stage's layers")
    total = sum(item["breakdown"].values())
    if item["peak_bytes"] != total:
        raise fail(f"{where}.peak_bytes", f"{item['peak_bytes']} != the sum of breakdown {total}")
    return PlanStage(
        index=i,
        layers=layers,
        chunks=chunks,
        recomputed=tuple(item["recomputed"]),
        peak_bytes=item["peak_bytes"],
        breakdown=dict(item["breakdown"]),
        time_ms=item["time_ms"],
        group=item.get("group"),
    )


def _check_stages(
    document: dict[str, Any], config: ParallelConfig, stages: tuple[PlanStage, ...], fail
) -> None:
    """One stage per rank, each layer on one stage, stage_of_layer agreeing with the stages'
    layer lists, and the largest stage peak as peak_bytes."""
    pp, v = config.pp, config.virtual_stages
    if len(stages) != pp:
        raise fail("stages", f"{len(stages)} stages for pp={pp} (config.pp); one per rank")
    seen = Counter(name for stage in stages for name in stage.layers)
    twice = [name for name, count in seen.items() if count > 1]
    if twice:
        raise fail("stages", f"layer {quote(twice[0])} is on more than one stage")
    stage_of_layer = document["stage_of_layer"]
    if len(stage_of_layer) != len(seen):
        raise fail(
            "stage_of_layer",
            f"{len(stage_of_layer)} entries but the stages list {len(seen)} layers",
        )
    counts = Counter(stage_of_layer)
    for j, (rank, chunk) in enumerate(chunk_places(config.schedule, pp, v)):
        listed, found = len(stages[rank].chunks[chunk]), counts.pop(j, 0)
        if found != listed:
            raise fail(
                "stage_of_layer",
                f"{found} layers on (virtual) stage {j}, but stages[{rank}] lists {listed}",
            )
    if counts:
        raise fail("stage_of_layer", f"stage {min(counts)} outside 0..{pp * v - 1}")
    largest = max(stage.peak_bytes for stage in stages)
    if document["peak_bytes"] != largest:
        raise fail("peak_bytes", f"{document['peak_bytes']} != the largest stage peak {largest}")
    _check_fits(document, fail)


def _check_fits(document: dict[str, Any], fail) -> None:
    """``fits`` says what the document's own stages say: the largest peak positive and every
    stage's peak at most its ``usable_bytes`` (when the stages record them)."""
    records = document["stages"]
    if not all("usable_bytes" in item for item in records):
        return  # an older document: evaluate --plan compares fits with the new evaluation
    over = [item for item in records if item["peak_bytes"] > item["usable_bytes"]]
    fits = document["peak_bytes"] > 0 and not over
    if document["fits"] != fits:
        why = (
            f"stages[{over[0]['index']}].peak_bytes {over[0]['peak_bytes']} > its usable_bytes "
            f"{over[0]['usable_bytes']}"
            if over
            else f"peak_bytes is {document['peak_bytes']}"
            if document["peak_bytes"] <= 0
            else "every stage's peak_bytes is within its usable_bytes"
        )
        raise fail("fits", f"{json.dumps(document['fits'])}, but {why} (was it edited?)")


# -- evaluating a plan again -------------------------------------------------------------------


PASS_GRAPH = "python -m solver.evaluate --plan PLAN.json GRAPH.json"
"""How ``solver.evaluate`` takes the graph of a plan (``evaluate_plan``'s messages)."""


def evaluate_plan(
    plan: str | Path | dict[str, Any] | PlanFile,
    graph: str | Path | LayerGraph | None = None,
    *,
    pass_graph: str = PASS_GRAPH,
) -> Evaluation:
    """Evaluate a plan's own config, split, recomputed layers, stage groups, cluster and
    training options (``solver.evaluation.evaluate``) on its graph.

    ``graph`` defaults to the file the plan records (as given to solver.plan, else next to the
    plan file); a graph whose :meth:`~solver.graph.LayerGraph.sha256` differs from the plan's is
    an InputError, as is a version-1 plan (it lacks what an exact evaluation needs).
    ``pass_graph``: how the caller's command takes a graph, for the message when the plan's is
    not found.
    """
    plan = load_plan(plan)
    if plan.cluster is None or plan.training is None or plan.graph is None:
        raise InputError(
            f"{plan.source}: a version-{plan.version} {plan.format} records neither the graph, "
            "the cluster's FLOP/s and bandwidths nor the training options, so it cannot be "
            f"evaluated again exactly; {_FIX[plan.format]} (version {PLAN_VERSION})"
        )
    graph = _plan_graph(plan, graph, pass_graph)
    if graph.sha256() != plan.graph.sha256:
        raise InputError(
            f"{plan.source}: graph {graph.source} (sha256 {graph.sha256()[:12]}...) is not the "
            f"graph the plan was made for ({plan.graph.model}, {plan.graph.num_layers} layers, "
            f"sha256 {plan.graph.sha256[:12]}...); pass that graph or re-create the plan"
        )
    check_config(
        plan.config, ModelFacts.of_graph(graph), plan.training.runtime, where=f"{plan.source}: "
    )
    recomputed = None
    if plan.config.recompute == "selective":
        chosen = set(plan.recomputed_layers)
        recomputed = [name in chosen for name in graph.names]
    result = evaluate(
        graph,
        plan.config,
        list(plan.stage_of_layer),
        cluster=plan.cluster,
        training=plan.training,
        group_of_stage=plan.group_of_stage,
        recomputed=recomputed,
    )
    listed = [list(stage.layers) for stage in plan.stages]
    if result.stage_layer_names() != listed:
        raise InputError(
            f"{plan.source}: stages[].layers do not match stage_of_layer on graph "
            f"{graph.source}; {_FIX[plan.format]}"
        )
    return result


def _plan_graph(
    plan: PlanFile, graph: str | Path | LayerGraph | None, pass_graph: str = PASS_GRAPH
) -> LayerGraph:
    """The graph given, or the one the plan records (tried as given, then beside the plan)."""
    if isinstance(graph, LayerGraph):
        return graph
    if graph is not None:
        return load_graph(graph)
    if plan.graph.path is None:
        raise InputError(
            f"{plan.source}: graph.path is null (the plan was made from a graph in memory); "
            f"pass the graph file: {pass_graph}"
        )
    path = Path(plan.graph.path)
    beside = Path(plan.source).parent / path
    if not _exists(path) and not path.is_absolute() and _exists(beside):
        path = beside
    if not _exists(path):
        raise InputError(
            f"{plan.source}: graph.path {quote(plan.graph.path)} not found (neither from the "
            f"working directory nor beside the plan); pass the graph: {pass_graph}"
        )
    if not path.is_dir() and not path.is_file():  # a directory: load_graph's own message
        # a FIFO, a device or a socket the plan names: never opened (a FIFO without a writer
        # would wait; the user did not name it on this command line)
        raise InputError(
            f"{plan.source}: graph.path {quote(plan.graph.path)} is not a regular file (a FIFO, "
            f"device or socket); pass the graph: {pass_graph}"
        )
    return load_graph(path)


def _exists(path: Path) -> bool:
    """Path.exists() that is False for what cannot be a path (too long, a NUL character)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def plan_differences(plan: PlanFile, evaluation: Evaluation) -> list[str]:
    """Where ``evaluation`` differs from the numbers ``plan`` records (empty when every stage's
    peak, breakdown and time and the iteration time are equal: bytes exactly, ms as written)."""
    problems = []
    for recorded, stage in zip(plan.stages, evaluation.stages, strict=True):
        pairs = (
            ("peak_bytes", recorded.peak_bytes, stage.peak_bytes),
            ("breakdown", recorded.breakdown, stage.breakdown()),
            ("time_ms", recorded.time_ms, stage.time_ns / 1e6),
        )
        problems += [
            f"stages[{stage.index}].{name}: plan {old}, now {new}"
            for name, old, new in pairs
            if old != new
        ]
    if plan.iteration_ms != evaluation.iteration_ns / 1e6:
        problems.append(
            f"iteration_ms: plan {plan.iteration_ms}, now {evaluation.iteration_ns / 1e6}"
        )
    now = _derived(evaluation)
    problems += [
        f"{path}: plan {json.dumps(old)}, now {json.dumps(now[path])}"
        for path, old in plan.derived.items()
        if path in now and old != now[path]
    ]
    return problems


DERIVED_FIELDS = ("fits", "throughput", "iteration_bound_ms", "max_utilization")
"""Top-level numbers a document derives (:func:`plan_differences` compares them)."""
DERIVED_STAGE_FIELDS = (
    "usable_bytes",
    "in_flight_microbatches",
    "peak_moment",
    "forward_ms",
    "dp_sync_ms",
    "optimizer_step_ms",
    "chunk_time_ms",
    "capacity_bytes",
    "utilization",
)
"""Per-stage numbers a document derives."""


def _recorded(document: dict[str, Any]) -> dict[str, Any]:
    """The derived numbers the document records, by path ("fits", "stages[0].usable_bytes")."""
    recorded = {key: document[key] for key in DERIVED_FIELDS if key in document}
    for i, item in enumerate(document["stages"]):
        recorded |= {f"stages[{i}].{key}": item[key] for key in DERIVED_STAGE_FIELDS if key in item}
    return recorded


def _derived(evaluation: Evaluation) -> dict[str, Any]:
    """The same paths from an evaluation, as ``solver.report.plan_report`` writes them."""
    throughput = evaluation.throughput
    derived: dict[str, Any] = {
        "fits": evaluation.fits,
        "throughput": None if math.isinf(throughput) else throughput,
        "iteration_bound_ms": evaluation.iteration_bound_ns / 1e6,
    }
    ppm = evaluation.utilization_ppm
    if evaluation.group_of_stage is not None:
        derived["max_utilization"] = max(ppm) / PPM
    for stage, usable, capacity, used in zip(
        evaluation.stages, evaluation.usable_bytes, evaluation.capacity_bytes, ppm, strict=True
    ):
        values = {
            "usable_bytes": usable,
            "in_flight_microbatches": stage.in_flight,
            "peak_moment": stage.moment,
            "forward_ms": sum(stage.chunk_forward_ns) / 1e6,
            "dp_sync_ms": stage.dp_sync_ns / 1e6,
            "optimizer_step_ms": stage.optimizer_step_ns / 1e6,
            "chunk_time_ms": [t / 1e6 for t in stage.chunk_time_ns],
        }
        if evaluation.group_of_stage is not None:
            values |= {"capacity_bytes": capacity, "utilization": used / PPM}
        derived |= {f"stages[{stage.index}].{key}": value for key, value in values.items()}
    return derived
