"""Layer-graph format v1: JSON <-> :class:`LayerGraph` (a networkx DiGraph), strictly validated.

The JSON Schema in ``layer_graph.schema.json`` (also linked from ``docs/``) checks types and
required fields; this module adds what a schema cannot say: unique names, known edge endpoints,
acyclicity, topological list order, and ``tp_* <= total``. Every error names the file, the field
and the fix.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Any

import fastjsonschema
import jsonschema
import networkx as nx

from solver.deadline import Deadline, checked
from solver.errors import InputError, quote
from solver.graph_fields import (
    INTEGER_FIELDS,
    OPTIONAL_INTEGER_FIELDS,
    UNBATCHED_FIELDS,
    check_grad_moments,
    check_param_tensors,
    check_unbatched,
    check_vocab,
)
from solver.files.jsonfile import check_name, read_json, schema_message

MAX_COUNT = 2**48
"""Largest parameter count or byte figure of one layer (or edge), per sample: 2^48 = 256 TiB
(2.8e14 parameters). With it, and the bounds on the training options (``solver.specs``), every
int64 sum of the cost model stays exact; ``costs.check_exact_range`` checks the products of
each config (docs/layer-graph.md, "Limits")."""
MAX_FLOPS = 1e21
"""Largest FLOPs of one layer per sample (a GPT-3 175B block: 7e12)."""
MAX_MS = 1e9
"""Largest measured time of one layer per sample, ms (11.6 days)."""
LIMITS: dict[str, float] = (
    dict.fromkeys(
        (*INTEGER_FIELDS, *OPTIONAL_INTEGER_FIELDS, *UNBATCHED_FIELDS)
        + ("mem_isolated", "mem_added"),
        MAX_COUNT,
    )
    | dict.fromkeys(("fwd_flops", "bwd_flops"), MAX_FLOPS)
    | dict.fromkeys(("fwd_ms", "bwd_ms"), MAX_MS)
)
"""The largest value of every numeric layer field."""

FORMAT_NAME = "layer-graph"
FORMAT_VERSION = 1


@dataclass(kw_only=True, frozen=True)
class Layer:
    """One layer. Bytes and FLOPs are per sample; ``params`` is the layer's total count."""

    name: str
    params: int
    """Parameter count."""
    activation_bytes: int
    """Bytes saved for backward, per sample."""
    output_bytes: int
    """Bytes of the layer's output, per sample."""
    tp_params: int = 0
    """Parameters split across tensor-parallel ranks."""
    tp_activation_bytes: int = 0
    """Saved bytes split across tensor-parallel ranks, per sample."""
    fwd_flops: float = 0.0
    """Forward FLOPs per sample."""
    bwd_flops: float | None = None
    """Backward FLOPs per sample; None means 2 x fwd_flops."""
    fwd_ms: float | None = None
    """Measured forward time per sample (ms); overrides FLOPs when set with bwd_ms."""
    bwd_ms: float | None = None
    """Measured backward time per sample (ms)."""
    tp_comm_bytes: int = 0
    """Bytes all-reduced across TP ranks per sample, forward + backward."""
    transient_bytes: int = 0
    """Extra peak per sample while the layer runs, beyond what it saves."""
    weight_grad_transient_bytes: int | None = None
    """The extra live bytes per sample at the moments the layer's weight gradients are made (at
    most ``transient_bytes``): the weight-gradient temporary adds to this one only. None: not
    measured, taken as ``transient_bytes`` (the conservative sum)."""
    weight_op_grad_bytes: int | None = None
    """Bytes per sample of the gradients at the outputs of the layer's weight ops that its own
    backward makes (not saved tensors, not its output's gradient): what a split backward's
    input step keeps for the weight step (torch's ``stage_backward_input``). None: not
    measured (the cost model estimates it, over)."""
    weight_op_output_grad_bytes: int | None = None
    """Bytes per sample of the layer's output gradient among those gradients (a weight op's
    output is the layer's output): kept as a new storage where a consumer of the output runs in
    the same pipeline stage. None: not measured."""
    weight_step_moments: list[tuple[int, int, int]] | None = None
    """The moments of the layer's part of a split backward's weight step (torch's
    ``stage_backward_weight``, one ``autograd.grad`` per param group in parameter order), as
    (params, tp_params, bytes per sample) points: the parameters whose weight gradients are live
    beside the held tensors then (the previous group's and the running group's, of them
    tp_params split by TP) and the other bytes then, the layer's frees so far (its dY and saved
    storages, negative) (``profiling.trace.weight_step``). None: not measured (the moment takes
    ``transient_bytes``)."""
    input_step_transient_bytes: int | None = None
    """Bytes per sample the layer's part of a split backward's input step (torch's
    ``stage_backward_input``: the graph retained, no weight gradient, the weight ops' output
    gradients kept) holds at its peak beyond what it keeps for the weight step
    (``profiling.trace.weight_step``). None: not measured (taken as its transient)."""
    weight_step_end: tuple[int, int, int] | None = None
    """The same point at the end of the layer's weight step (its last group's gradients, every
    free of the layer): what the next layer's weight step runs beside. None: not measured."""
    backward_grad_moments: list[tuple[int, int, int]] | None = None
    """Moments of the layer's backward, (params, tp_params, bytes per sample): its own
    parameters with a gradient then (of them TP-split), and its extra live bytes then (as
    ``transient_bytes``), the points no other dominates (``profiling.trace.own_grads``). None:
    not measured (a first backward's moment counts all of the layer's gradients)."""
    largest_param: int = 0
    """Elements of the layer's largest parameter tensor that is not split across TP ranks."""
    param_tensors: int | None = None
    """How many parameter tensors the layer's ``params`` are (at most ``params``): Adam keeps a
    4-byte ``step`` count per tensor (``solver.costs.states.step_count_bytes``). None: not
    counted (the cost model charges none: a few bytes per tensor; re-export to count them)."""
    model_input_bytes: int | None = None
    """Bytes per sample of the model's inputs this layer is the first to read (token ids, labels,
    masks the data loader gives, not another layer's output): a torch pipeline's ``step()``
    holds the whole batch of them on the stage that reads them
    (``solver.costs.states.input_batch_bytes``). None: not measured (0)."""
    largest_tp_param: int = 0
    """Elements of its largest TP-split parameter tensor (before the split)."""
    grad_partner_params: int = 0
    """Elements of the gradients one backward op returns beside its largest (a linear's bias
    gradient beside its weight's), the most over the layer's ops: temporaries beside the weight
    gradient's (``solver.costs.layers``: gtemp_l)."""
    expert_params: int = 0
    """How many of ``params`` are routed-expert weights (mixture of experts): split over the
    expert-parallel ranks (and over t, Megatron's expert tensor parallelism = tp). Disjoint from
    ``tp_params``: tp_params + expert_params <= params."""
    expert_activation_bytes: int = 0
    """How many of ``activation_bytes`` the routed experts and their token dispatch and combine
    save, per sample, at a balanced routing (each expert receives tokens * top_k / num_experts).
    Disjoint from ``tp_activation_bytes``."""
    ep_comm_bytes: int = 0
    """Bytes per sample one GPU sends in the layer's expert-parallel all-to-alls (dispatch and
    combine), forward + backward, at a balanced routing, before the (ep-1)/ep share that leaves
    the GPU."""
    attention_kv_bytes: int = 0
    """Bytes per sample of the keys and values the layer's attention reads (whole sequence, all
    KV heads): what ring attention passes around under context parallelism."""
    attention_score_bytes: int = 0
    """Bytes per sample of one [heads, s, s] score matrix the layer's explicit (written-out)
    attention makes, in the activations' dtype; 0 for fused (flash) attention. On the megatron
    runtime it sizes Megatron's own ``DotProductAttention`` buffers (``solver.costs.
    megatron_attention``). Optional; absent in older graphs."""
    attention_backward_transient_bytes: int | None = None
    """With explicit attention: the layer's extra live bytes per sample in its backward alone,
    the saved storages it has released by then deducted (at most ``transient_bytes``); Megatron's
    in-place mask adds one score matrix there (``solver.costs.megatron_attention``). None: not
    measured, taken as ``transient_bytes``. Optional; absent in older graphs."""
    sp_gathered_bytes: int = 0
    """Bytes per sample the layer saves from the whole sequence under sequence parallelism: the
    distinct inputs of its column-parallel Linears and LM head, which SP all-gathers in front of
    them, and what a Linear left replicated (a small vocabulary's LM head) computes from them.
    Eager torch autograd saves the gathered tensors where Megatron saves the [s/t] shard and
    gathers it again in the backward, so ``--runtime torch`` with sp keeps (t-1)/t of this
    beyond ``activation_bytes / t``. Part of ``activation_bytes``."""
    mem_isolated: int | None = None
    """Empirical (mCAP/CAPSlog): peak bytes of a GPU holding only this layer, measured at the
    target GPU count; used with ``memory_model="empirical"``."""
    mem_added: int | None = None
    """Empirical: extra peak bytes when this layer joins a stage after its first layer."""
    kind: str | None = None
    """embedding | block | head | other; None means inferred from the name."""
    tied_params: dict[str, int] | None = None
    """Parameters this layer uses that are counted in another layer's ``params`` (tied
    weights: an LM head sharing the input embedding), elements per owning layer: {"<owner>":
    elements}. A stage holding this layer but not the owner keeps its own copy (with gradient
    and optimizer state) and all-reduces its gradient with the owner's stage (Megatron's
    ``share_embeddings_and_output_weights``, torch pipelining's tied module on two stages).
    None: no tied parameter."""
    vocab_rows: int = 0
    """Rows of the vocabulary table(s) in the layer (a word embedding; an LM head's output
    features, tied or not), before any padding; 0: none. A runtime splits them over TP by rows:
    Megatron always, padded to a multiple of 128 tp; the torch runtime from 16384 rows, as the
    profile's ``tp_params`` do (``solver.costs.vocab``)."""
    vocab_params: int = 0
    """How many of ``params`` are vocabulary tables (``vocab_rows`` x elements per row: an
    embedding's weight, an LM head's weight and bias); in ``tp_params`` when ``vocab_rows`` >=
    16384 (the profile splits those), else replicated there."""
    vocab_activation_bytes: int = 0
    """How many of ``activation_bytes`` are vocabulary-sized (an LM head's logits and what the
    loss computes from them: a last dimension of ``vocab_rows``), per sample; in
    ``tp_activation_bytes`` when ``vocab_rows`` >= 16384."""
    vocab_transient_bytes: int | None = None
    """The largest vocabulary-sized part of the layer's live extra bytes at any moment of its
    run, per sample (the fp32 logits and their gradient); None: not measured."""
    fixed_transient_bytes: int | None = None
    """The largest part that does not scale with the vocabulary at any moment, per sample (the
    gradient of the head's input, b s h). A vocabulary split over t ranks holds at most
    fixed + vocab / t (both maxima: never below any moment's); None: not measured."""
    vocab_weight_grad_transient_bytes: int | None = None
    """``vocab_transient_bytes`` at the moments the weight gradients are made."""
    fixed_weight_grad_transient_bytes: int | None = None
    """``fixed_transient_bytes`` at the moments the weight gradients are made."""
    unbatched_activation_bytes: int | None = None
    """The part F of ``activation_bytes`` that does not grow with the batch (a causal mask):
    b samples save b (X - F) + F; None: 0. Also for the three figures below
    (``UNBATCHED_FIELDS``)."""
    unbatched_transient_bytes: int | None = None
    unbatched_weight_grad_transient_bytes: int | None = None
    unbatched_attention_backward_transient_bytes: int | None = None

    @property
    def role(self) -> str:
        """The layer's kind; when not given (graphs written before the profiler set it, or by
        hand), inferred from its name: embedding names, then head names and the final norms
        (a norm outside any numbered block: ``model.norm``, ``transformer.ln_f``,
        ``gpt_neox.final_layer_norm``), else block."""
        if self.kind:
            return self.kind
        lowered = self.name.lower()
        if any(key in lowered for key in ("embed", "wte", "wpe", "tok_")):
            return "embedding"
        if any(key in lowered for key in ("head", "loss", "lm_", "output", "ln_f", "norm_f")):
            return "head"
        parts = lowered.split(".")
        if "norm" in parts[-1] and not any(part.isdigit() for part in parts):
            return "head"
        return "block"


@dataclass(kw_only=True, frozen=True)
class Edge:
    """Data flowing from ``src`` to ``dst``: ``bytes`` per sample."""

    src: str
    dst: str
    bytes: int
    tensor: str | None = None
    """Which tensor the edge carries ("<producer>:<index>"): edges naming one tensor are one
    tensor sent to several consumers, counted once per stage by the cost model; None: its own."""
    requires_grad: bool = True
    """The tensor requires grad when sent: its sending stage keeps gradient receive buffers for
    it (torch runtime). False for constants (T5's zero position bias, Llama's rotary cos/sin)."""
    saved: bool | None = None
    """``dst`` saves the tensor for backward; None: unknown (graphs written before the field:
    every received tensor is taken as a saved input)."""
    charged: bool = False
    """``dst``'s ``activation_bytes`` count the tensor's storage (the profiler charges a storage
    to the first layer that saves it)."""
    src_charged: bool = False
    """``src``'s ``activation_bytes`` count the tensor's storage (the producer saved it first)."""


_EDGE_DEFAULTS = {"requires_grad": True, "charged": False, "src_charged": False}


@dataclass(kw_only=True)
class LayerGraph:
    """A validated layer graph. ``layers`` are in topological order; ``edges`` are explicit
    (a chain graph gets its implied edges filled in)."""

    model: str
    layers: list[Layer]
    edges: list[Edge]
    meta: dict[str, Any] = field(default_factory=dict)
    edges_given: bool = False
    """Whether the file listed edges (kept so that saving round-trips)."""
    source: str = "<memory>"
    """Where the graph came from, for error messages."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def index(self) -> dict[str, int]:
        """Layer name -> position in topological order."""
        return {layer.name: i for i, layer in enumerate(self.layers)}

    @property
    def is_chain(self) -> bool:
        """True when the edges are exactly layer i -> layer i+1 in list order."""
        position = self.index()
        pairs = sorted((position[e.src], position[e.dst]) for e in self.edges)
        return pairs == [(i, i + 1) for i in range(self.num_layers - 1)]

    def to_networkx(self) -> nx.DiGraph:
        """Nodes carry the layer fields as attributes; edges carry ``bytes`` (summed over the
        tensors a pair of layers passes)."""
        graph = nx.DiGraph(model=self.model, meta=self.meta)
        for layer in self.layers:
            graph.add_node(layer.name, **asdict(layer))
        for edge in self.edges:  # two tensors between one pair: one edge, their bytes summed
            earlier = graph.get_edge_data(edge.src, edge.dst, default={"bytes": 0})["bytes"]
            graph.add_edge(edge.src, edge.dst, bytes=earlier + edge.bytes)
        return graph

    def to_dict(self) -> dict[str, Any]:
        """The v1 JSON document (defaults omitted)."""
        defaults = {
            f: getattr(Layer(name="", params=0, activation_bytes=0, output_bytes=0), f)
            for f in Layer.__dataclass_fields__
        }
        # every field is a scalar: read them, no deep copy (asdict takes seconds at 10^5 layers)
        layers = [
            {k: v for k, v in vars(layer).items() if k == "name" or v != defaults[k]}
            | {k: getattr(layer, k) for k in ("params", "activation_bytes", "output_bytes")}
            for layer in self.layers
        ]
        for item in layers:  # JSON arrays (the schema's type), not tuples
            for key in ("backward_grad_moments", "weight_step_moments"):
                if item.get(key) is not None:
                    item[key] = [list(p) for p in item[key]]
            if item.get("weight_step_end") is not None:
                item["weight_step_end"] = list(item["weight_step_end"])
        document: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "model": self.model,
        }
        if self.meta:
            document["meta"] = self.meta
        document["layers"] = layers
        if self.edges_given:
            document["edges"] = [
                {
                    key: value
                    for key, value in vars(edge).items()
                    if value is not None and value != _EDGE_DEFAULTS.get(key)
                }
                for edge in self.edges
            ]
        return document

    def save(self, path: str | Path) -> None:
        """Write ``to_dict()`` as JSON by the one writing path (solver.files.output_file)."""
        from solver.files.output_file import write_json_file

        write_json_file(path, self.to_dict())

    def sha256(self) -> str:
        """Hex SHA-256 of the v1 document (:meth:`to_dict`) as canonical JSON (sorted keys, no
        spaces): equal for equal graphs whatever the file's formatting (plans record it)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def path(self) -> str | None:
        """The file the graph was loaded from (``source``), None for a graph built in memory."""
        return None if self.source.startswith("<") else self.source


def timing_of(graph: LayerGraph) -> dict[str, Any] | None:
    """``meta.timing`` (checked by the schema): how the layer times were measured, with
    ``threads`` (``torch.get_num_threads()`` then) and ``device``, and the step-time terms a real
    profile measured with them (``profiling.trace.time_terms``): ``optimizer_step_ns_per_param``
    (one Adam step, ns per parameter element; float) and ``microbatch_overhead_ns`` (ns per
    micro-batch per pipeline stage beyond the layer times, >= 0; float; absent when it could not
    be measured). None when the graph does not say (a fake-tensor profile, a hand-written or
    older graph); a graph profiled before these terms existed has ``meta.timing`` without them."""
    timing = graph.meta.get("timing")
    return dict(timing) if isinstance(timing, dict) else None


@cache
def schema() -> dict[str, Any]:
    """The v1 JSON Schema (``solver/layer_graph.schema.json``)."""
    text = resources.files("solver").joinpath("layer_graph.schema.json").read_text()
    return json.loads(text)


def load_graph(
    source: str | Path | dict[str, Any], *, deadline: Deadline | None = None
) -> LayerGraph:
    """Load and validate a layer graph from a JSON file path or an already-parsed dict.

    Raises :class:`InputError` with one line naming the file, the field and the fix, and
    NoSolutionError (exit 4) when ``deadline`` passes first (checked every
    ``deadline.CHECK_EVERY`` layers of each pass).
    """
    if isinstance(source, dict):
        return graph_from_dict(source, origin="<dict>", deadline=deadline)
    fix = "pass the path of a layer-graph JSON file"
    document = read_json(source, kind="layer-graph", fix=fix, deadline=deadline)
    return graph_from_dict(document, origin=str(source), deadline=deadline)


def graph_from_dict(
    document: Any, *, origin: str = "<dict>", deadline: Deadline | None = None
) -> LayerGraph:
    """Validate a parsed v1 document and build the :class:`LayerGraph` (``deadline``: as
    :func:`load_graph`'s)."""
    _check_schema(document, origin, deadline)
    _check_numbers(document, origin, deadline)
    check_name(document["model"], f"{origin}: $.model", what="model name")
    items = document["layers"]
    layers = [
        _layer_from_dict(item)
        for item in checked(items, deadline, _reading(origin, "building layer", len(items)))
    ]
    _check_layers(layers, origin, deadline)
    position = {layer.name: i for i, layer in enumerate(layers)}
    _check_tied(layers, position, origin)
    edges_given = "edges" in document
    if edges_given:
        given = document["edges"]
        edges = [
            Edge(
                src=e["src"],
                dst=e["dst"],
                bytes=int(e["bytes"]),
                tensor=e.get("tensor"),
                requires_grad=e.get("requires_grad", True),
                saved=e.get("saved"),
                charged=e.get("charged", False),
                src_charged=e.get("src_charged", False),
            )
            for e in checked(given, deadline, _reading(origin, "building edge", len(given)))
        ]
        _check_edges(edges, position, origin)
    else:
        edges = [Edge(src=a.name, dst=b.name, bytes=a.output_bytes) for a, b in pairwise(layers)]
    return LayerGraph(
        model=document["model"],
        layers=layers,
        edges=edges,
        meta=dict(document.get("meta", {})),
        edges_given=edges_given,
        source=origin,
    )


DRAFT_7_KEYWORDS = frozenset(
    {
        "$defs", "$id", "$ref", "$schema", "additionalProperties", "const", "description",
        "enum", "exclusiveMinimum", "items", "maxItems", "maxLength", "maximum", "minItems",
        "minLength", "minimum", "properties", "required", "title", "type",
    }
)  # fmt: skip
"""Keywords that mean the same in draft 7 (the newest fastjsonschema compiles) as in the
schema's draft 2020-12 ("items" with one schema, "$ref" to a JSON pointer; a "$ref"'s sibling
"description" only annotates)."""


def _keywords(node: Any) -> set[str]:
    """Every keyword of a schema (the keys of its schema objects, not of "properties")."""
    if not isinstance(node, dict):
        return set()
    found = set(node)
    for key, value in node.items():
        if key in ("properties", "$defs"):
            found |= set().union(*map(_keywords, value.values()))
        elif key in ("items", "additionalProperties"):
            found |= _keywords(value)
    return found


@cache
def _fast_check() -> Callable[[Any], Any] | None:
    """fastjsonschema's compiled check of the schema (generated Python: about 0.8 ms for 200
    layers where jsonschema takes 15-40 ms), or None when the schema uses a keyword outside
    :data:`DRAFT_7_KEYWORDS`."""
    if not _keywords(schema()) <= DRAFT_7_KEYWORDS:
        return None
    return fastjsonschema.compile(schema())


def _reading(origin: str, what: str, total: int) -> Callable[[int], str]:
    """What a pass over a graph's items was doing, for ``deadline.checked``."""
    return lambda count: f"reading the graph {origin} ({what} {count} of {total})"


SCHEMA_CHUNK = 8192
"""Layers (or edges) one schema check takes at a time: a large graph is checked in parts of this
many, each a document of its own, with a look at the deadline between them."""


def _check_schema(document: Any, origin: str, deadline: Deadline | None = None) -> None:
    """The document is schema-valid, or InputError naming the field (the best match of the
    part that fails). A document with more than ``SCHEMA_CHUNK`` layers or edges is checked in
    parts, the deadline looked at between them: first with each such list cut to its first
    ``SCHEMA_CHUNK`` items (the top-level fields with them), then each further part of a list
    alone (every item is checked on its own: the parts together are the whole)."""
    long = {
        key: items
        for key in ("layers", "edges")
        if isinstance(document, dict)
        and isinstance(items := document.get(key), list)
        and len(items) > SCHEMA_CHUNK
    }
    if not long:
        _check_schema_part(document, origin)
        return
    _check_schema_part(document | {k: v[:SCHEMA_CHUNK] for k, v in long.items()}, origin)
    least = {"layers": document["layers"][:1]} | ({"edges": []} if "edges" in document else {})
    for key, items in long.items():
        doing = _reading(origin, f"checking {key[:-1]}", len(items))
        starts = range(SCHEMA_CHUNK, len(items), SCHEMA_CHUNK)
        for start in checked(starts, deadline, lambda n, at=doing: at((n + 1) * SCHEMA_CHUNK)):
            part = document | least | {key: items[start : start + SCHEMA_CHUNK]}
            _check_schema_part(part, origin, offset=(key, start))


def _check_schema_part(document: Any, origin: str, offset: tuple[str, int] = ("", 0)) -> None:
    """``_check_schema`` of one document (a part: ``offset`` is its list's key and the index of
    its first item in the whole document, which the error's path takes).
    A document the compiled check passes is valid; jsonschema decides, and names the error,
    only for the others."""
    fast = _fast_check()
    if fast is not None:
        try:
            fast(document)
            return
        except Exception:  # noqa: BLE001  an invalid document, or a value it cannot check
            pass
    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    if not errors:
        return
    error = jsonschema.exceptions.best_match(errors)
    where = error.json_path
    key, first = offset
    if first and where.startswith(f"$.{key}["):  # the item's index in the whole document
        index, _, rest = where[len(key) + 3 :].partition("]")
        where = f"$.{key}[{int(index) + first}]{rest}"
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        hint = f"remove it; allowed keys: {', '.join(allowed)}"
    elif error.validator == "required":
        hint = "add the missing field (see docs/layer-graph.md)"
    elif error.validator == "const":
        hint = f"set it to {json.dumps(error.validator_value)}"
    elif error.validator in ("minimum", "type", "minLength", "minItems", "enum"):
        hint = "see docs/layer-graph.md for the field's type and range"
    else:
        hint = "see docs/layer-graph.md"
    raise InputError(f"{origin}: {where}: {schema_message(error)}; {hint}")


def _check_numbers(document: dict[str, Any], origin: str, deadline: Deadline | None = None) -> None:
    """Every number of the (schema-valid) document finite and at most its field's limit."""
    items = document["layers"]
    doing = _reading(origin, "checking the numbers of layer", len(items))
    for i, item in checked(enumerate(items), deadline, doing):
        for owner, value in (item.get("tied_params") or {}).items():
            if value > MAX_COUNT:
                raise InputError(
                    f"{origin}: $.layers[{i}].tied_params.{owner}: {_number(value)} for layer "
                    f"{quote(item['name'], 40)} {_beyond('params')}"
                )
        for key, value in item.items():
            if key in LIMITS and not (math.isfinite(value) and abs(value) <= LIMITS[key]):
                raise InputError(
                    f"{origin}: $.layers[{i}].{key}: {_number(value)} for layer "
                    f"{quote(item['name'], 40)} {_beyond(key)}"
                )
    for i, edge in enumerate(document.get("edges", [])):
        if not (math.isfinite(edge["bytes"]) and edge["bytes"] <= MAX_COUNT):
            raise InputError(f"{origin}: $.edges[{i}].bytes: {_number(edge['bytes'])} {_beyond()}")


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) and abs(value) < 10**15 else f"{value:.3g}"


def _beyond(key: str = "bytes") -> str:
    """Why a value is refused: not finite, or over the field's limit."""
    limit = LIMITS.get(key, MAX_COUNT)
    if key.endswith("_flops"):
        return f"exceeds the limit {limit:.0e} FLOPs per sample; check the unit (FLOPs per sample)"
    if key.endswith("_ms"):
        return f"exceeds the limit {limit:.0e} ms per sample; check the unit (milliseconds)"
    return (
        "exceeds the limit 2^48 (256 TiB or 2.8e14 parameters per layer and sample), beyond "
        "which the cost model's integer sums could overflow; check the unit (docs/layer-graph.md)"
    )


def _layer_from_dict(item: dict[str, Any]) -> Layer:
    values = {key: (int(value) if key in INTEGER_FIELDS else value) for key, value in item.items()}
    for key in (*OPTIONAL_INTEGER_FIELDS, *UNBATCHED_FIELDS, "mem_isolated", "mem_added"):
        if values.get(key) is not None:
            values[key] = int(values[key])
    for key in ("fwd_flops", "bwd_flops", "fwd_ms", "bwd_ms"):
        if values.get(key) is not None:
            values[key] = float(values[key])
    if values.get("tied_params") is not None:
        values["tied_params"] = {k: int(v) for k, v in values["tied_params"].items()}
    for key in ("backward_grad_moments", "weight_step_moments"):
        if values.get(key) is not None:
            values[key] = [tuple(int(v) for v in point) for point in values[key]]
    if values.get("weight_step_end") is not None:
        values["weight_step_end"] = tuple(int(v) for v in values["weight_step_end"])
    return Layer(**values)


def _check_layers(layers: list[Layer], origin: str, deadline: Deadline | None = None) -> None:
    memory = ("params", "activation_bytes", "output_bytes", "transient_bytes", "mem_isolated")
    if not any(getattr(layer, key) for layer in layers for key in memory):
        raise InputError(
            f"{origin}: $.layers: every layer has params, activation_bytes, output_bytes and "
            "transient_bytes 0: the graph holds no memory to plan (a placeholder?); give the "
            "layers their sizes"
        )
    seen: dict[str, int] = {}
    doing = _reading(origin, "checking layer", len(layers))
    for i, layer in checked(enumerate(layers), deadline, doing):
        check_name(layer.name, f"{origin}: $.layers[{i}].name", what="layer name")
        if layer.name in seen:
            raise InputError(
                f"{origin}: $.layers[{i}].name: duplicate layer name {quote(layer.name)} "
                f"(also $.layers[{seen[layer.name]}]); give every layer a unique name"
            )
        seen[layer.name] = i
        for part, total in (
            ("tp_params", "params"),
            ("tp_activation_bytes", "activation_bytes"),
            ("sp_gathered_bytes", "activation_bytes"),
            ("vocab_params", "params"),
            ("vocab_activation_bytes", "activation_bytes"),
        ):
            if getattr(layer, part) > getattr(layer, total):
                raise InputError(
                    f"{origin}: $.layers[{i}].{part}: {getattr(layer, part)} exceeds "
                    f"{total} ({getattr(layer, total)}) of layer {quote(layer.name)}; "
                    f"{part} counts the part of {total} split across TP ranks"
                )
        for tp_part, expert_part, total in (
            ("tp_params", "expert_params", "params"),
            ("tp_activation_bytes", "expert_activation_bytes", "activation_bytes"),
        ):
            both = getattr(layer, tp_part) + getattr(layer, expert_part)
            if getattr(layer, expert_part) and both > getattr(layer, total):
                raise InputError(
                    f"{origin}: $.layers[{i}].{expert_part}: {getattr(layer, expert_part)} plus "
                    f"{tp_part} ({getattr(layer, tp_part)}) exceeds {total} "
                    f"({getattr(layer, total)}) of layer {quote(layer.name)}; the expert part "
                    f"and the TP-split part are disjoint parts of {total}"
                )
        for part, total in (
            ("largest_param", layer.params - layer.tp_params),
            ("largest_tp_param", layer.tp_params),
        ):
            if getattr(layer, part) > total:
                raise InputError(
                    f"{origin}: $.layers[{i}].{part}: {getattr(layer, part)} exceeds the "
                    f"{'split' if 'tp' in part else 'unsplit'} parameters ({total}) of layer "
                    f"{quote(layer.name)}; it is the size of one parameter tensor of the layer"
                )
        check_vocab(layer, f"{origin}: $.layers[{i}]")
        check_grad_moments(layer, f"{origin}: $.layers[{i}]")
        check_param_tensors(layer, f"{origin}: $.layers[{i}]")
        at_weight_grad = layer.weight_grad_transient_bytes
        if at_weight_grad is not None and at_weight_grad > layer.transient_bytes:
            raise InputError(
                f"{origin}: $.layers[{i}].weight_grad_transient_bytes: {at_weight_grad} exceeds "
                f"transient_bytes ({layer.transient_bytes}) of layer {quote(layer.name)}; it is "
                "the layer's transient at one moment of its run, at most its peak"
            )
        check_unbatched(layer, f"{origin}: $.layers[{i}]")
        at_backward = layer.attention_backward_transient_bytes
        if at_backward is not None and at_backward > layer.transient_bytes:
            raise InputError(
                f"{origin}: $.layers[{i}].attention_backward_transient_bytes: {at_backward} "
                f"exceeds transient_bytes ({layer.transient_bytes}) of layer "
                f"{quote(layer.name)}; it is the layer's transient in its backward, at most its "
                "peak"
            )
        if (layer.mem_isolated is None) != (layer.mem_added is None):
            raise InputError(
                f"{origin}: $.layers[{i}]: layer {quote(layer.name)} has only one of "
                "mem_isolated/mem_added; give both empirical statistics or neither"
            )
        if layer.mem_isolated is not None and layer.mem_isolated < layer.mem_added:
            raise InputError(
                f"{origin}: $.layers[{i}].mem_isolated: {layer.mem_isolated} is below mem_added "
                f"({layer.mem_added}) of layer {quote(layer.name)}; a stage's first layer holds at "
                "least what the layer adds to a stage"
            )
        if (layer.fwd_ms is None) != (layer.bwd_ms is None):
            raise InputError(
                f"{origin}: $.layers[{i}]: layer {quote(layer.name)} has only one of "
                "fwd_ms/bwd_ms; give both measured times or neither"
            )


def _check_tied(layers: list[Layer], position: dict[str, int], origin: str) -> None:
    """Every ``tied_params`` entry names another layer and at most that layer's parameters."""
    for i, layer in enumerate(layers):
        for owner, count in (layer.tied_params or {}).items():
            where = f"{origin}: $.layers[{i}].tied_params"
            if owner not in position or owner == layer.name:
                what = "the layer itself" if owner == layer.name else "no layer of the graph"
                raise InputError(
                    f"{where}: {quote(owner)} is {what}; name the layer whose params count the "
                    f"shared parameter (the owner), not {quote(layer.name)}"
                )
            owned = layers[position[owner]].params
            if count > owned:
                raise InputError(
                    f"{where}.{owner}: {count} exceeds the params ({owned}) "
                    f"of {quote(owner)}; it counts elements of that layer's parameters that "
                    f"{quote(layer.name)} uses too"
                )


def _check_edges(edges: list[Edge], position: dict[str, int], origin: str) -> None:
    seen_pairs: dict[tuple[str, str], list[str | None]] = {}
    tensors: dict[str, tuple[int, Edge]] = {}
    for i, edge in enumerate(edges):
        for end in ("src", "dst"):
            name = getattr(edge, end)
            if name not in position:
                raise InputError(
                    f"{origin}: $.edges[{i}].{end}: unknown layer {quote(name)}; "
                    "edge endpoints must be names listed in $.layers"
                )
        if edge.src == edge.dst:
            raise InputError(
                f"{origin}: $.edges[{i}]: self-loop on {quote(edge.src)}; remove the edge"
            )
        # one pair may pass several tensors, each edge naming its own
        named = seen_pairs.setdefault((edge.src, edge.dst), [])
        if named and (edge.tensor is None or None in named or edge.tensor in named):
            raise InputError(
                f"{origin}: $.edges[{i}]: duplicate edge {quote(edge.src)} -> {quote(edge.dst)}; "
                "merge them into one edge with the summed bytes, or name the tensor each carries"
            )
        named.append(edge.tensor)
        if edge.charged and not edge.saved:
            raise InputError(
                f"{origin}: $.edges[{i}].charged: true needs saved: true (a layer's saved bytes "
                "count only tensors it saves); set saved, or remove charged"
            )
        if edge.tensor is not None:
            first = tensors.setdefault(edge.tensor, (i, edge))
            if (first[1].src, first[1].bytes, first[1].requires_grad, first[1].src_charged) != (
                edge.src,
                edge.bytes,
                edge.requires_grad,
                edge.src_charged,
            ):
                raise InputError(
                    f"{origin}: $.edges[{i}].tensor: {quote(edge.tensor)} also names "
                    f"$.edges[{first[0]}], from {quote(first[1].src)} with {first[1].bytes} "
                    f"bytes (requires_grad {first[1].requires_grad}, src_charged "
                    f"{first[1].src_charged}); a tensor has one producer, one size, one "
                    "requires_grad and one src_charged (rename one of them)"
                )
    graph = nx.DiGraph((e.src, e.dst) for e in edges)
    if not nx.is_directed_acyclic_graph(graph):
        cycle = " -> ".join(quote(u, 40) for u, _ in nx.find_cycle(graph)[:8])
        raise InputError(f"{origin}: $.edges: the graph has a cycle ({cycle}); remove an edge")
    for i, edge in enumerate(edges):
        if position[edge.src] > position[edge.dst]:
            raise InputError(
                f"{origin}: $.layers: not in topological order: edge $.edges[{i}] goes from "
                f"{quote(edge.src)} (layer {position[edge.src]}) back to {quote(edge.dst)} "
                f"(layer {position[edge.dst]}); list every layer after the layers it reads from"
            )
