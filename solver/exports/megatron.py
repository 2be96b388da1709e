"""The plan as Megatron-LM arguments (``plan.exports["megatron"]``): the degrees, ``--num-layers``
(the model's transformer blocks), the uneven split as ``--decoder-first/last-pipeline-num-layers``
or ``--pipeline-model-parallel-layout``, precision, recomputation, the distributed optimizer and
the mixture-of-experts flags (``solver.exports.megatron_flags``), with what keeps the plan from
running as is. ``scripts/check_megatron_args.py`` runs exports through Megatron-LM's own
``parse_args``/``validate_args`` and layer assignment.

Pure functions: no I/O, no torch. Facts about Megatron-LM, and where they come from, are in the
comments next to the code that relies on them.
"""

from __future__ import annotations

from typing import Any

from solver.costs.graph_inputs import layer_roles
from solver.exports.megatron_flags import expert_args, precision_args, recompute_args, zero_args
from solver.graph import LayerGraph
from solver.parallel import export_name
from solver.precision import DEFAULT_PRECISION
from solver.specs import ParallelConfig

# Megatron layout letters (megatron/core/transformer/pipeline_parallel_layer_layout.py,
# PipelineParallelLayerLayout.parse_str_to_list): E = embedding, t = transformer (decoder) layer,
# L = loss (final norm + output layer + loss), m = MTP layer; "|" separates stages.
MEGATRON_LETTER = {"embedding": "E", "block": "t", "head": "L"}


def _flag(key: str) -> str:
    """Megatron-LM's flag for parallel dimension ``key`` (``solver.parallel.DIMENSIONS``)."""
    return export_name("megatron", key)


def megatron_export(
    graph: LayerGraph,
    config: ParallelConfig,
    stages: list[list[str]],
    *,
    recomputed: list[list[str]] | None = None,
    moe_capacity_factor: float | str = 1.0,
    precision: str | None = None,
    optimizer: str = "adam",
    bytes_per_param: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    """Megatron-LM arguments for the plan (``moe_capacity_factor``: the plan's
    ``TrainingConfig.moe_capacity_factor``, for a mixture-of-experts graph's router flags;
    ``precision``, ``optimizer`` and ``bytes_per_param`` (weights, gradients, optimizer states):
    the plan's, for ``--bf16``/``--fp16`` and a warning when Megatron-LM holds other bytes;
    None: bf16-mixed, the planner's default).

    Layer roles become layout letters (:func:`stage_letters`): the transformer blocks are ``t``
    and ``--num-layers`` counts them; the graph's first embedding layer is ``E`` and its last
    head layer ``L`` (Megatron's loss: final norm, output layer, loss). Other embedding and head
    layers (a position embedding, the final norm) belong to those modules in Megatron; a layer
    of kind ``other`` gets no letter.
    """
    roles = dict(zip(graph.names, layer_roles(graph), strict=True))
    letters, placement = stage_letters(graph, roles, stages)
    layout = "|".join(letters)
    blocks = [stage.count("t") for stage in letters]
    warnings = _megatron_warnings(graph, roles, letters, stages) + placement
    layout_valid = not any(w.startswith("layout:") for w in warnings)
    method, first, last = _megatron_split_method(config, blocks, letters, layout_valid=layout_valid)
    args = [
        _flag("pp"),
        str(config.pp),
        _flag("tp"),
        str(config.tp),
        "--num-layers",
        str(sum(blocks)),
        "--micro-batch-size",
        str(config.micro_batch),
        "--global-batch-size",
        str(config.global_batch),
    ]
    args += _megatron_split_args(config, method, first, last, layout)
    flags, warning = precision_args(precision, optimizer, bytes_per_param)
    args += flags
    warnings += [warning] if warning else []
    flags, recompute, warning = recompute_args(config, roles, stages, recomputed)
    args += flags
    warnings += [warning] if warning else []
    flags, refused = zero_args(config)
    args += flags
    warnings += [refused] if refused else []
    if config.sp:
        # megatron/training/arguments.py: "Enable sequence parallel optimization"; it needs
        # --tensor-model-parallel-size > 1
        args.append(_flag("sp"))
    if config.cp > 1:
        # megatron/training/arguments.py: "Degree of context parallelism"; Megatron's data
        # parallel size is world / (tp cp pp), and its distributed optimizer and gradient
        # all-reduce span dp x cp (the cost model's sharding_degree)
        args += [_flag("cp"), str(config.cp)]
    block_names = [name for stage in stages for name in stage if roles[name] == "block"]
    flags, warning = expert_args(graph, config, moe_capacity_factor, block_names)
    args += flags
    warnings += [warning] if warning else []
    return {
        "args": args,
        "layout": layout,
        "layout_compact": _compact_layout(letters),
        "decoder_first_pipeline_num_layers": first,
        "decoder_last_pipeline_num_layers": last,
        "split_method": method,
        "num_layers": sum(blocks),
        "blocks_per_stage": blocks,
        "precision": precision or DEFAULT_PRECISION,
        "recompute": recompute,
        "refused": refused,
        "warnings": warnings,
        "note": (
            f"Run on pp*tp*cp*dp = {config.num_gpus} GPUs (Megatron derives the data-parallel size "
            f"{config.dp} from the world size). Add the model's own arguments (--hidden-size, "
            "--num-attention-heads, --ffn-hidden-size, ...); --num-layers is its transformer "
            "blocks. split_method 'even' needs no split flag; 'first_last' uses "
            "--decoder-first/last-pipeline-num-layers; 'layout' uses "
            "--pipeline-model-parallel-layout, which states every stage: E embedding, t "
            "transformer layer, L final norm + output layer + loss. 'recompute' (null: none) "
            "says which layers the recompute flags recompute per stage; 'refused' (null: none) "
            "why Megatron-LM cannot run the plan as planned."
            + (
                " Megatron-FSDP (ZeRO 2/3) asserts CUDA_DEVICE_MAX_CONNECTIONS is not 1."
                if config.zero >= 2 and not refused
                else ""
            )
        ),
    }


def stage_letters(
    graph: LayerGraph, roles: dict[str, str], stages: list[list[str]]
) -> tuple[list[str], list[str]]:
    """Each stage's Megatron layout letters, and warnings for embedding or head layers that the
    plan puts on another stage than Megatron builds them on (with the E or the L)."""
    embeddings = [name for name in graph.names if roles[name] == "embedding"]
    heads = [name for name in graph.names if roles[name] == "head"]
    anchors = {
        "E": embeddings[0] if embeddings else None,
        "L": heads[-1] if heads else None,
    }
    letters, stage_of = [], {}
    for s, stage in enumerate(stages):
        out = []
        for name in stage:
            stage_of[name] = s
            if name == anchors["E"]:
                out.append("E")
            elif roles[name] == "block":
                out.append("t")
            elif name == anchors["L"]:
                out.append("L")
        letters.append("".join(out))
    warnings = []
    for names, letter, module in (
        (embeddings, "E", "embedding (E)"),
        (heads, "L", "final norm and output layer (L)"),
    ):
        apart = [name for name in names if stage_of[name] != stage_of[anchors[letter]]]
        if apart:
            warnings.append(
                f"placement: Megatron builds the {module} on stage {stage_of[anchors[letter]]}, "
                f"with {anchors[letter]}; the plan puts {', '.join(apart[:5])} on stage(s) "
                f"{sorted({stage_of[n] for n in apart})}: those stages' memory differs from the "
                "plan"
            )
    return letters, warnings


def _megatron_warnings(
    graph: LayerGraph, roles: dict[str, str], letters: list[str], stages: list[list[str]]
) -> list[str]:
    """What keeps the plan from running in Megatron as is; layout errors start with 'layout:'."""
    warnings = []
    flat = "".join(letters)
    # PipelineParallelLayerLayout.validate_layer_layout: the first layer must be the embedding,
    # the last the loss, each exactly once.
    if flat.count("E") != 1 or flat.count("L") != 1 or flat[:1] != "E" or flat[-1:] != "L":
        warnings.append(
            f"layout: Megatron needs exactly one E (first) and one L (last); this plan has "
            f"{flat.count('E')} E and {flat.count('L')} L (set Layer.kind to fix roles). "
            "Megatron's layout also does not support encoder-decoder models."
        )
    blocks = [i for i, name in enumerate(graph.names) if roles[name] == "block"]
    inside = (
        [n for n in graph.names[blocks[0] : blocks[-1]] if roles[n] != "block"] if blocks else []
    )
    if inside:
        # Megatron's GPT model is one decoder stack: embedding, transformer layers, loss
        warnings.append(
            f"layout: {len(inside)} layer(s) that are not transformer blocks lie between the "
            f"blocks ({', '.join(inside[:3])}): Megatron's GPT model is one stack of transformer "
            "layers (an encoder-decoder model needs Megatron's T5 model, which the layout "
            "does not support)"
        )
    others = [name for name, role in roles.items() if role == "other"]
    if others:
        warnings.append(
            f"{len(others)} layer(s) of kind 'other' have no Megatron letter and are taken to "
            f"belong to the neighbouring Megatron module: {', '.join(others[:5])}"
            + (" ..." if len(others) > 5 else "")
        )
    skips = cut_skip_edges(graph, stages)
    if skips:
        shown = ", ".join(f"{edge.src} -> {edge.dst}" for edge in skips[:3])
        warnings.append(
            f"{len(skips)} skip connection(s) needing gradients cross stages ({shown}"
            f"{' ...' if len(skips) > 3 else ''}): Megatron's GPT model passes one hidden state "
            "between stages, so they need model changes."
        )
    return warnings


def cut_skip_edges(graph: LayerGraph, stages: list[list[str]]) -> list:
    """The edges a plan's stage boundaries cut that Megatron cannot pass: data needing a gradient
    (``Edge.requires_grad``) sent past the next layer to another stage. Constants (rotary cos/sin,
    a zero position bias), which each stage can make itself, and everything at pp 1 are not."""
    stage_of = {name: i for i, names in enumerate(stages) for name in names}
    position = graph.index()
    return [
        edge
        for edge in graph.edges
        if edge.requires_grad
        and position[edge.dst] != position[edge.src] + 1
        and stage_of.get(edge.src) != stage_of.get(edge.dst)
    ]


def _megatron_split_method(
    config: ParallelConfig, blocks: list[int], stage_letters: list[str], *, layout_valid: bool
) -> tuple[str, int | None, int | None]:
    """How Megatron is told the split: "even" (its default), "first_last" (with those block
    counts) or "layout"; returns (method, first, last)."""
    first, last = (None, None)
    if layout_valid and config.virtual_stages == 1:
        first, last = _first_last_counts(blocks, stage_letters)
    ends_in_place = "E" in stage_letters[0] and "L" in stage_letters[-1]
    if config.pp == 1 or (len(set(blocks)) == 1 and layout_valid and ends_in_place):
        # Megatron's default: an even split of the blocks, E on the first stage, L on the last
        # (of every virtual stage with interleaving).
        return "even", first, last
    if first is not None or last is not None:
        return "first_last", first, last
    # with interleaving the layout lists the p v virtual stages in order and Megatron takes
    # the virtual pipeline size from it: len(layout) // p (PipelineParallelLayerLayout)
    return "layout", first, last


def _megatron_split_args(
    config: ParallelConfig, method: str, first: int | None, last: int | None, layout: str
) -> list[str]:
    """The flags that give Megatron the split (none for its default even split)."""
    args = []
    # --decoder-first/last-pipeline-num-layers (megatron/training/arguments.py): "The number of
    # transformer layers on the first (last) pipeline stage of the decoder. Default None is even
    # split". TransformerConfig.__post_init__ requires each to be > 0 and the layers left to divide
    # evenly over the middle stages; pipeline_model_parallel_layout, when set, takes precedence.
    if method == "first_last":
        if first is not None:
            args += ["--decoder-first-pipeline-num-layers", str(first)]
        if last is not None:
            args += ["--decoder-last-pipeline-num-layers", str(last)]
    elif method == "layout":
        args += ["--pipeline-model-parallel-layout", layout]
    if config.virtual_stages > 1 and method == "even":
        # megatron/training/arguments.py: "Number of virtual pipeline stages per pipeline
        # parallelism rank"
        args += [_flag("virtual_stages"), str(config.virtual_stages)]
    return args


def _first_last_counts(
    blocks: list[int], stage_letters: list[str]
) -> tuple[int | None, int | None]:
    """(first, last) block counts when only the first and/or last stage differ from the middle.

    Megatron accepts them only when each is > 0, the middle stages hold equal counts, E is on the
    first stage and L on the last. (None, None) when the split is even or not of that shape.
    """
    p = len(blocks)
    if p == 1 or len(set(blocks)) == 1:
        return None, None
    if "E" not in stage_letters[0] or "L" not in stage_letters[-1]:
        return None, None
    if p == 2:
        # No middle stage: the first count fixes the split (the last stage takes the rest).
        if blocks[0] > 0 and blocks[1] > 0:
            return blocks[0], None
        return None, None
    middle = set(blocks[1:-1])
    if len(middle) != 1 or middle == {0}:
        return None, None
    even = middle.pop()
    first = blocks[0] if blocks[0] != even else None
    last = blocks[-1] if blocks[-1] != even else None
    if first == 0 or last == 0:
        return None, None
    return first, last


def _compact_layout(stage_letters: list[str]) -> str:
    """The layout with runs of t written t*N (Megatron unrolls ``(.)\\*(\\d+)``; same meaning)."""
    compact = []
    for letters in stage_letters:
        out, i = [], 0
        while i < len(letters):
            j = i
            while j < len(letters) and letters[j] == letters[i]:
                j += 1
            run = j - i
            out.append(f"{letters[i]}*{run}" if letters[i] == "t" and run > 2 else letters[i] * run)
            i = j
        compact.append("".join(out))
    return "|".join(compact)
