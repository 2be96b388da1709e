"""The parallel dimensions in one place (as torchtitan's ``ParallelDims``): the degrees of a
layout, their limits and validation, their product, the groups derived from them, the
divisibility rules the engines impose, and the name each export gives each dimension.

A layout runs pp x tp x cp x dp GPUs (:attr:`ParallelDims.num_gpus`); ep shards the routed
experts within the data-parallel ranks, v = ``virtual_stages`` puts v model chunks on each
pipeline rank, sp splits over the tensor-parallel ranks, and ZeRO shards over dp x cp.
Megatron-LM orders ranks tp fastest, then cp, ep, dp, pp (``--rank-order tp-cp-ep-dp-pp``).

The rules, each with why it holds and the function that checks it:

- pp * tp * cp * dp = GPUs: every GPU runs one rank of the layout
  (:meth:`ParallelDims.check_gpus`, ``check_pinned_degrees``).
- tp | gpus_per_node: tensor parallelism stays inside a node (``tensor_parallel_fits``,
  ``check_pinned_degrees``).
- ep | dp: the experts are sharded within the data-parallel ranks, Megatron's
  expert-data-parallel group (``check_dims``, ``check_pinned_expert_degrees``).
- ep | E, the graph's routed experts: each expert-parallel rank holds E / ep
  (``check_expert_degree``).
- cp | seq_len: each cp rank keeps s / cp tokens of every sequence (``check_context_parallel``).
- sp needs tp > 1: SP splits over the tensor-parallel ranks (``check_dims``,
  ``check_sequence_parallel_choice``).
- v > 1: pp >= 2, pp v <= layers and pp | micro-batches, Megatron-core's interleaved schedule
  runs micro-batch groups of p (``interleaving_fits``).

What the engines refuse given the model (heads, KV heads, experts and sequence vs tp, ep, cp) and
which ZeRO stages each runs with pipeline parallelism is ``solver.engine_rules``' table: a layout
no engine of the runtime runs is never proposed, and an engine that refuses it gets
``{"refused": ...}`` as its export section. What an engine runs differently (megatron-core and MoE
with tp > 1 and no sp) stays a warning of its export (``solver.exports``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from solver.checks import check_integer, count_text, is_int, require
from solver.errors import InputError, quote
from solver.graph import LayerGraph

MAX_DEGREE = 2**24
"""Pipeline, tensor- and data-parallel degrees and micro-batch counts."""
MAX_VIRTUAL_STAGES = 1024

DEGREES = ("pp", "tp", "cp", "dp", "ep")
"""The degrees of a layout, in the order labels and messages show them."""

TENSOR_PARALLEL_IN_NODE = "tensor parallelism stays inside a node"
EXPERTS_WITHIN_DP = "the experts are sharded within the data-parallel ranks"
DENSE_GRAPH = (
    "the graph has no routed experts (expert_params 0 on every layer); re-export it or drop --ep"
)
"""The fix for an expert-parallel degree above 1 on a dense graph."""


@dataclass(frozen=True)
class Dimension:
    """One parallel dimension and the name each engine's export gives it (None: the export
    has no setting for it; its notes or warnings say what to do)."""

    key: str
    """The field of :class:`ParallelDims` (and ``specs.ParallelConfig``, plan JSON)."""
    meaning: str
    megatron: str | None
    """Megatron-LM's command-line flag (megatron/training/arguments.py)."""
    deepspeed: str | None
    """DeepSpeed's ``PipeModelDataParallelTopology`` argument or config key."""
    torch: str | None
    """The DeviceMesh dimension of the torch export (``mesh_dim_names``)."""
    torchtitan: str | None
    """torchtitan's ``[parallelism]`` field (job config 0.2, ``--parallelism.*`` in 0.3)."""


DIMENSIONS = (
    Dimension(
        key="pp",
        meaning="pipeline stages p",
        megatron="--pipeline-model-parallel-size",
        deepspeed="num_pp",
        torch="pp",
        torchtitan="pipeline_parallel_degree",
    ),
    Dimension(
        key="tp",
        meaning="tensor-parallel degree t",
        megatron="--tensor-model-parallel-size",
        deepspeed="num_mp",
        torch="tp",
        torchtitan="tensor_parallel_degree",
    ),
    Dimension(
        key="cp",
        meaning="context-parallel degree c (ring attention over s / c tokens per GPU)",
        megatron="--context-parallel-size",
        deepspeed=None,  # no ring attention in PipelineEngine
        torch="cp",
        torchtitan="context_parallel_degree",
    ),
    Dimension(
        key="dp",
        meaning="data-parallel degree d",
        megatron=None,  # derived: world / (tp cp pp)
        deepspeed="num_dp",
        torch="dp",
        torchtitan="data_parallel_shard_degree",  # or data_parallel_replicate_degree (DDP)
    ),
    Dimension(
        key="dp_replicate",
        meaning="data-parallel replicas without sharding (DDP; torchtitan only)",
        megatron=None,
        deepspeed=None,
        torch=None,
        torchtitan="data_parallel_replicate_degree",
    ),
    Dimension(
        key="ep",
        meaning="expert-parallel degree e (routed experts over e of the dp ranks)",
        megatron="--expert-model-parallel-size",
        deepspeed=None,
        torch=None,
        torchtitan="expert_parallel_degree",
    ),
    Dimension(
        key="etp",
        meaning="tensor-parallel degree of the experts (= tp)",
        megatron=None,  # --expert-tensor-parallel-size defaults to tp
        deepspeed=None,
        torch=None,
        torchtitan="expert_tensor_parallel_degree",
    ),
    Dimension(
        key="virtual_stages",
        meaning="model chunks per pipeline rank v (interleaved 1F1B)",
        megatron="--num-virtual-stages-per-pipeline-rank",
        deepspeed=None,  # one contiguous stage per rank
        torch=None,  # ScheduleInterleaved1F1B takes a rank's stages
        torchtitan=None,  # pipeline_parallel_schedule Interleaved1F1B
    ),
    Dimension(
        key="sp",
        meaning="sequence parallelism over the tp ranks (a flag)",
        megatron="--sequence-parallel",
        deepspeed=None,  # Megatron-DeepSpeed's --sequence-parallel
        torch=None,  # a tensor-parallel plan ('tensor_parallel' of the torch export)
        torchtitan="enable_sequence_parallel",  # 0.3; always on with tp in 0.2
    ),
)
"""Every dimension and its names per engine: the one table the exports read."""

ENGINES = ("megatron", "deepspeed", "torch", "torchtitan")
_BY_KEY = {dimension.key: dimension for dimension in DIMENSIONS}


def export_name(engine: str, key: str) -> str:
    """The name ``engine`` gives dimension ``key`` (``DIMENSIONS``); KeyError when it has none."""
    name = getattr(_BY_KEY[key], engine)
    if name is None:
        raise KeyError(f"{engine} has no setting for {key}")
    return name


TORCH_MESH_ORDER = ("pp", "dp", "cp", "tp")
"""The torch export's DeviceMesh dimensions, outermost first (tp innermost: one node's GPUs)."""


class Degrees(Protocol):
    """What the rules read: a :class:`ParallelDims` or a ``specs.ParallelConfig``."""

    pp: int
    tp: int
    cp: int
    dp: int
    ep: int
    sp: bool


@dataclass(kw_only=True, frozen=True)
class ParallelDims:
    """The degrees of one layout, validated when made (``check_degree``, ``check_dims``)."""

    pp: int
    """Pipeline stages p."""
    tp: int = 1
    """Tensor-parallel degree t."""
    cp: int = 1
    """Context-parallel degree c."""
    dp: int = 1
    """Data-parallel degree d."""
    ep: int = 1
    """Expert-parallel degree e (divides d)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank v."""
    sp: bool = False
    """Sequence parallelism over the t ranks (needs t > 1)."""

    def __post_init__(self) -> None:
        for name in (*DEGREES, "virtual_stages"):
            check_degree(name, getattr(self, name))
        check_dims(self)

    @property
    def num_gpus(self) -> int:
        """GPUs the layout uses: p t c d."""
        return self.pp * self.tp * self.cp * self.dp

    @property
    def stage_gpus(self) -> int:
        """GPUs of one pipeline stage: t c d."""
        return self.tp * self.cp * self.dp

    @property
    def num_virtual_stages(self) -> int:
        """Stages of the pipeline, p v (p with no interleaving)."""
        return self.pp * self.virtual_stages

    @property
    def sharding_degree(self) -> int:
        """GPUs that hold the same parameters of a stage and sum their gradients: d c (the cp
        ranks keep full copies; Megatron-LM syncs gradients and shards its distributed
        optimizer over the data-parallel group *with* context parallelism), so ZeRO stages and
        the gradient sync span d c ranks."""
        return self.dp * self.cp

    @property
    def expert_data_parallel_degree(self) -> int:
        """Ranks holding the same routed experts: d c / e (Megatron's expert-data-parallel
        group, world / (p t e) ranks)."""
        return self.sharding_degree // self.ep

    @property
    def sequence_split(self) -> int:
        """Parts a tensor laid out [s, b, h] is split into along the sequence: c (context
        parallelism), times t with sequence parallelism."""
        return self.cp * (self.tp if self.sp else 1)

    def product_text(self) -> str:
        """'pp(4) * tp(2) * cp(1) * dp(2)': the product as messages show it."""
        return f"pp({self.pp}) * tp({self.tp}) * cp({self.cp}) * dp({self.dp})"

    def check_gpus(self, num_gpus: int, *, where: str = "") -> None:
        """InputError 'pp(4) * tp(2) * cp(1) * dp(2) = 16 != gpus(8)' (then ``where``) unless
        the layout uses exactly ``num_gpus`` GPUs."""
        if self.num_gpus != num_gpus:
            raise InputError(f"{self.product_text()} = {self.num_gpus} != gpus({num_gpus}){where}")

    def mesh_shape(self, order: tuple[str, ...] = TORCH_MESH_ORDER) -> list[int]:
        """The degrees in ``order`` (a DeviceMesh's shape)."""
        return [getattr(self, key) for key in order]


def check_degree(name: str, value: Any) -> None:
    """InputError unless ``value`` is a positive Python int within the limit of ``name``
    (``MAX_VIRTUAL_STAGES`` for virtual_stages, ``MAX_DEGREE`` for a degree or a micro-batch
    count)."""
    high = MAX_VIRTUAL_STAGES if name == "virtual_stages" else MAX_DEGREE
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= high:
        return  # the common case, without formatting a message
    require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        f"{name} must be a positive integer, got {quote(value)}",
    )
    check_integer(name, value, 1, high)


def check_dims(dims: Degrees) -> None:
    """The relations between a layout's degrees: sp a bool and only with tp > 1, ep | dp."""
    if not isinstance(dims.sp, bool):
        raise InputError(f"sp must be true or false, got {quote(dims.sp)}")
    require(
        not dims.sp or dims.tp > 1,
        f"--sequence-parallel on with tp({dims.tp}): sequence parallelism splits over the "
        "tensor-parallel ranks; use tp > 1 or --sequence-parallel off",
    )
    require(
        dims.dp % dims.ep == 0,
        f"ep({dims.ep}) does not divide dp({dims.dp}): {EXPERTS_WITHIN_DP}; pick an --ep that "
        "divides the data-parallel degree",
    )


# -- the search space's degrees (TrainingConfig's candidate lists and pins) --------------------


def check_degree_choices(name: str, values: Any) -> None:
    """InputError unless ``values`` is a non-empty list of candidate degrees within the limit of
    ``name`` (``check_degree``)."""
    high = MAX_VIRTUAL_STAGES if name == "virtual_stages" else MAX_DEGREE
    require(
        bool(values) and all(is_int(v) and 1 <= v <= high for v in values),
        f"{name} must be integers in 1..{count_text(high)}, got {quote(values)}",
    )


def check_expert_choices(values: Any) -> None:
    """InputError unless the candidate expert-parallel degrees are None (auto) or a non-empty
    tuple of degrees."""
    require(
        values is None
        or (
            isinstance(values, tuple)
            and bool(values)
            and all(is_int(e) and 1 <= e <= MAX_DEGREE for e in values)
        ),
        f"ep must be None (auto) or integers in 1..{count_text(MAX_DEGREE)}, got {quote(values)}",
    )


def check_pins(pins: dict[str, Any]) -> None:
    """InputError unless every pinned degree (None: not pinned) is within 1..MAX_DEGREE."""
    for name, value in pins.items():
        if value is not None:
            check_integer(name, value, 1, MAX_DEGREE)


def check_sequence_parallel_choice(choice: str, pinned_tp: int | None) -> None:
    """ "on" asks SP of every candidate, so a pinned tp of 1 is an error (auto skips it)."""
    require(
        choice != "on" or pinned_tp != 1,
        "--sequence-parallel on with pinned tp(1): sequence parallelism splits over the "
        "tensor-parallel ranks; pin --tp > 1 or use --sequence-parallel auto or off",
    )


def uses_sequence_parallel(choice: str, tp: int) -> bool:
    """Whether a candidate with tensor-parallel degree ``tp`` runs SP under the option
    ``choice``: with "on" or "auto" exactly when tp > 1, with "off" never."""
    return choice != "off" and tp > 1


def check_pinned_degrees(pins: dict[str, int | None], num_gpus: int, gpus_per_node: int) -> None:
    """Explain, with the numbers, why pinned degrees (name -> value, None: free; pp, tp and dp
    all pinned fix the product) cannot work on ``num_gpus`` GPUs of ``gpus_per_node`` per
    node."""
    given = {name: value for name, value in pins.items() if value is not None}
    all_pinned = all(pins[name] is not None for name in ("pp", "tp", "dp"))
    product = math.prod(given.values())
    text = " * ".join(f"{name}({value})" for name, value in given.items())
    if all_pinned and product != num_gpus:
        raise InputError(
            f"pinned config {text} = {product} != gpus({num_gpus}); "
            "pin degrees whose product is the GPU count, or pin fewer of them"
        )
    if given and num_gpus % product:
        raise InputError(f"pinned {text} = {product} does not divide gpus({num_gpus})")
    tp = given.get("tp")
    if tp is not None and not tensor_parallel_fits(tp, gpus_per_node):
        raise InputError(
            f"pinned tp({tp}) does not divide gpus_per_node"
            f"({gpus_per_node}); {TENSOR_PARALLEL_IN_NODE}"
        )


def check_pinned_expert_degrees(ep_choices: tuple[int, ...] | None, dp: int | None) -> None:
    """With dp pinned, at least one requested ep must divide it (``EXPERTS_WITHIN_DP``)."""
    if ep_choices is None or dp is None:
        return
    if all(dp % e for e in ep_choices):
        asked = ",".join(map(str, ep_choices))
        raise InputError(
            f"--ep {asked} does not divide the pinned dp({dp}): {EXPERTS_WITHIN_DP}; "
            "pick an --ep that divides --dp"
        )


# -- the rules that need the cluster or the graph -----------------------------------------------


def tensor_parallel_fits(tp: int, gpus_per_node: int) -> bool:
    """tp | gpus_per_node: tensor parallelism stays inside a node."""
    return gpus_per_node % tp == 0


def interleaving_fits(num_layers: int, pp: int, num_microbatches: int, virtual: int) -> bool:
    """Interleaved 1F1B with v chunks per rank: at least two ranks, a layer per virtual stage
    (p v <= layers) and m a multiple of p (Megatron-core's default micro-batch group of p
    must divide m: ``forward_backward_pipelining_with_interleaving``)."""
    return pp >= 2 and pp * virtual <= num_layers and num_microbatches % pp == 0


def check_context_parallel(graph: LayerGraph, cp: int, memory_model: str = "analytic") -> None:
    """InputError (one line, with the fix) unless the graph can be planned with context-parallel
    degree ``cp`` > 1: the analytic memory model, cp dividing the graph's sequence length
    (``meta["seq_len"]``, what ``profiling.export`` records; not checked when absent) and an
    ``attention_kv_bytes`` on some layer (graphs exported before the field lack it: without it
    the K/V exchange would silently cost nothing)."""
    if cp == 1:
        return
    if memory_model == "empirical":
        raise InputError(
            f"memory model empirical with cp({cp}): the statistics are measured on whole "
            "sequences of one pipeline; use --cp 1 or --memory-model analytic"
        )
    seq_len = graph.meta.get("seq_len")
    if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len % cp:
        raise InputError(
            f"{graph.source}: cp({cp}) does not divide the sequence length {seq_len} "
            "($.meta.seq_len); context parallelism gives each GPU s/cp tokens: pick a --cp that "
            "divides it or re-export with --seq a multiple of it"
        )
    if not any(layer.attention_kv_bytes for layer in graph.layers):
        raise InputError(
            f"{graph.source}: cp({cp}) needs attention_kv_bytes, which no layer has (a graph "
            "exported before the field); re-export the graph with this version's "
            "python -m profiling.export, or use --cp 1"
        )


def check_expert_degree(
    ep: int, num_experts: int | None, source: str, *, flag: str = "--ep"
) -> None:
    """InputError unless expert-parallel degree ``ep`` fits a graph (``source``) with
    ``num_experts`` routed experts (None: a dense graph): 1 on any graph; above 1 only with
    routed experts, and dividing their number (each rank holds E / ep)."""
    if ep == 1:
        return
    if num_experts is None:
        raise InputError(f"{flag} {ep}: {source}: {DENSE_GRAPH}")
    if num_experts % ep:
        raise InputError(
            f"{flag} {ep}: does not divide the {num_experts} routed experts of "
            f"{source} (each expert-parallel rank holds E / ep of them); pick an {flag} "
            f"that divides {num_experts}"
        )


ZERO_BUBBLE_SCHEDULES = ("interleaved-zb", "zbv", "dualpipev")
"""Split-backward schedules (torch's ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``): a layout may name them (``ParallelConfig``, ``solver.evaluate``), the cost
model times and replays them (``solver.costs.schedule_orders``), the planner searches them
(``searched_schedules``, ``schedule_refusal``)."""
V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that place a rank's two chunks in a V (virtual stages r and 2p - 1 - r)."""


ALL_SCHEDULES = ("1f1b", "gpipe", *ZERO_BUBBLE_SCHEDULES)
"""Every schedule the planner searches; ``--schedule auto`` is all of them."""


def searched_schedules(text: str) -> tuple[str, ...]:
    """The schedules of a ``--schedule`` value: one name, a comma list (order kept, repeats
    dropped) or ``auto`` (``ALL_SCHEDULES``); InputError (one line) for anything else."""
    if text.strip() == "auto":
        return ALL_SCHEDULES
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",")))
    unknown = [name for name in names if name not in ALL_SCHEDULES]
    if unknown or not names:
        raise InputError(
            f"schedule must be one of {', '.join(ALL_SCHEDULES)}, a comma list of them or "
            f"auto, got {text!r}"
        )
    return names


def check_searched(schedule: str) -> None:
    """InputError (one line) unless ``schedule`` is a ``--schedule`` value the planner, its
    Pareto front and every study search (``searched_schedules``)."""
    searched_schedules(schedule)


def schedule_refusal(
    schedule: str, num_layers: int, pp: int, num_microbatches: int, virtual: int
) -> str | None:
    """Why ``schedule`` cannot run with (pp, v, m) on ``num_layers`` layers, one line with the
    fix (None: it can): interleaving (v > 1) needs 1f1b's ``interleaving_fits`` or a
    split-backward schedule; GPipe runs one chunk; the split-backward schedules need two ranks,
    a layer per virtual stage and torch's own rules (``check_zero_bubble``)."""
    p, m, v = pp, num_microbatches, virtual
    if schedule == "gpipe":
        return None if v == 1 else f"schedule gpipe runs one chunk per rank, got {v}"
    if schedule == "1f1b":
        if v == 1 or interleaving_fits(num_layers, p, m, v):
            return None
        return (
            f"interleaved 1F1B with pp({p}) and {v} virtual stages per rank needs pp >= 2, "
            f"pp * v <= layers ({num_layers}) and pp | micro-batches ({m})"
        )
    if p < 2 or p * v > num_layers:
        return (
            f"schedule {schedule} needs pp >= 2 and a layer per virtual stage: pp({p}) * "
            f"virtual stages({v}) <= layers ({num_layers})"
        )
    try:
        check_zero_bubble(schedule, m, p, v)
    except InputError as error:
        return str(error)
    return None


def stage_ranks(schedule: str, num_ranks: int, num_chunks: int) -> list[int]:
    """The rank of each virtual stage: j mod p (loop placement), or the V of
    ``generate_stage_to_rank_mapping(style="v")``: rank j for j < p, 2p - 1 - j after."""
    p, n = num_ranks, num_ranks * num_chunks
    if schedule not in V_SCHEDULES:
        return [j % p for j in range(n)]
    return [j % p if (j // p) % 2 == 0 else p - 1 - j % p for j in range(n)]


def rank_stages(schedule: str, num_ranks: int, num_chunks: int, rank: int) -> list[int]:
    """Virtual stages of rank r, chunk order (ascending): r, r + p, ... with loop placement;
    r, 2p - 1 - r in a V."""
    # directly, not by scanning stage_ranks: callers ask for every rank, which made the
    # simulation of a 20,002-stage split O(p^2) (minutes; past its --time-limit)
    p = num_ranks  # block c (stages c p .. c p + p - 1) holds one stage of each rank
    if schedule not in V_SCHEDULES:
        return [c * p + rank for c in range(num_chunks)]
    return [c * p + (rank if c % 2 == 0 else p - 1 - rank) for c in range(num_chunks)]


def chunk_places(schedule: str, num_ranks: int, num_chunks: int) -> list[tuple[int, int]]:
    """(rank, chunk) of each virtual stage in pipeline order: chunk c of rank r is the rank's
    c-th virtual stage in ascending order (``rank_stages``): (j mod p, j // p) with loop
    placement; in a V (zbv, dualpipev) stage j < p is chunk 0 of rank j, stage j >= p chunk 1 of
    rank 2p - 1 - j."""
    ranks = stage_ranks(schedule, num_ranks, num_chunks)
    return [(rank, j // num_ranks) for j, rank in enumerate(ranks)]  # block j // p: one per rank


def check_zero_bubble(schedule: str, num_microbatches: int, num_ranks: int, num_chunks: int):
    """InputError (the rule, the numbers and the fix) for a (p, m, v) torch's schedule refuses."""
    p, m, v = num_ranks, num_microbatches, num_chunks
    if schedule not in ZERO_BUBBLE_SCHEDULES:
        raise InputError(f"schedule {schedule!r} has no zero-bubble action list")
    if schedule in V_SCHEDULES and v != 2:
        raise InputError(
            f"schedule {schedule} places exactly 2 chunks per rank in a V (torch's "
            f"{'ScheduleZBVZeroBubble' if schedule == 'zbv' else 'ScheduleDualPipeV'}), got "
            f"virtual stages {v}: give --virtual-stages 2"
        )
    if schedule == "dualpipev" and m < 2 * p:
        raise InputError(
            f"schedule dualpipev needs at least as many micro-batches as stages (torch's "
            f"ScheduleDualPipeV): m = {m} < 2 pp = {2 * p}; give a larger --global-batch or "
            f"a smaller --micro-batch"
        )
    rounds = max(1, m // p)
    if schedule == "interleaved-zb" and m % rounds:
        raise InputError(
            f"schedule interleaved-zb needs the micro-batches to be a multiple of its rounds "
            f"max(1, m // pp) = {rounds} (torch's ScheduleInterleavedZeroBubble), got m = {m}"
        )
