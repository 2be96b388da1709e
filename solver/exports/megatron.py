"""The plan as Megatron-LM arguments (``plan.exports["megatron"]``): the degrees, the uneven split
as ``--decoder-first/last-pipeline-num-layers`` or ``--pipeline-model-parallel-layout``,
recomputation and the mixture-of-experts flags, with what keeps the plan from running as is.

Pure functions: no I/O, no torch. Facts about Megatron-LM, and where they come from, are in the
comments next to the code that relies on them.
"""

from __future__ import annotations

from typing import Any

from solver.costs.graph_inputs import layer_roles
from solver.costs.moe import routed_experts
from solver.graph import LayerGraph
from solver.parallel import export_name
from solver.specs import MOE_DROPLESS, ParallelConfig

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
) -> dict[str, Any]:
    """Megatron-LM arguments for the plan (``moe_capacity_factor``: the plan's
    ``TrainingConfig.moe_capacity_factor``, for a mixture-of-experts graph's router flags).

    Layer roles become layout letters: embedding -> E, block -> t, head -> L. A layer of kind
    ``other`` gets no letter: Megatron builds only E, t, L (and m) modules, so such a layer (a
    separate final norm, a position embedding, a pooler) is taken to be part of the module Megatron
    builds next to it; counting it as a ``t`` would change ``--num-layers``.
    """
    roles = dict(zip(graph.names, layer_roles(graph), strict=True))
    stage_letters = ["".join(MEGATRON_LETTER.get(roles[n], "") for n in s) for s in stages]
    layout = "|".join(stage_letters)
    blocks = [letters.count("t") for letters in stage_letters]
    num_layers = sum(blocks)
    warnings = _megatron_warnings(graph, config, roles, stage_letters, stages)
    layout_valid = not any(w.startswith("layout:") for w in warnings)
    method, first, last = _megatron_split_method(
        config, blocks, stage_letters, layout_valid=layout_valid
    )
    args = [
        _flag("pp"),
        str(config.pp),
        _flag("tp"),
        str(config.tp),
        "--num-layers",
        str(num_layers),
        "--micro-batch-size",
        str(config.micro_batch),
        "--global-batch-size",
        str(config.global_batch),
    ]
    args += _megatron_split_args(config, method, first, last, layout)
    recompute_args, warning = _megatron_recompute_args(config, roles, stages, recomputed)
    args += recompute_args
    if warning is not None:
        warnings.append(warning)
    if config.zero >= 1:
        args.append("--use-distributed-optimizer")
    if config.sp:
        # megatron/training/arguments.py: "Enable sequence parallel optimization"; it needs
        # --tensor-model-parallel-size > 1
        args.append(_flag("sp"))
    if config.cp > 1:
        # megatron/training/arguments.py: "Degree of context parallelism"; Megatron's data
        # parallel size is world / (tp cp pp), and its distributed optimizer and gradient
        # all-reduce span dp x cp (the cost model's sharding_degree)
        args += [_flag("cp"), str(config.cp)]
    expert_args, expert_warning = _megatron_expert_args(graph, config, moe_capacity_factor)
    args += expert_args
    if expert_warning is not None:
        warnings.append(expert_warning)
    return {
        "args": args,
        "layout": layout,
        "layout_compact": _compact_layout(stage_letters),
        "decoder_first_pipeline_num_layers": first,
        "decoder_last_pipeline_num_layers": last,
        "split_method": method,
        "num_layers": num_layers,
        "blocks_per_stage": blocks,
        "warnings": warnings,
        "note": (
            f"Run on pp*tp*cp*dp = {config.num_gpus} GPUs (Megatron derives the data-parallel size "
            f"{config.dp} from the world size). split_method 'even' needs no split flag; "
            "'first_last' uses --decoder-first/last-pipeline-num-layers; 'layout' uses "
            "--pipeline-model-parallel-layout (experimental in Megatron-Core), which states "
            "every stage: E embedding, t transformer layer, L final norm + output layer + loss. "
            "With bf16 Megatron keeps fp32 gradients (18 bytes per parameter, 6 + 12/d with the "
            "distributed optimizer), what the megatron runtime's default bytes per parameter "
            "2,4,12 count; other precisions: docs/cost-model.md."
        ),
    }


def _megatron_expert_args(
    graph: LayerGraph, config: ParallelConfig, capacity_factor: float | str
) -> tuple[list[str], str | None]:
    """Megatron's mixture-of-experts flags for a graph with routed experts (megatron/training/
    arguments.py): ``--num-experts E --moe-router-topk k --expert-model-parallel-size ep`` and
    ``--moe-token-dispatcher-type alltoall`` (the all-to-all the cost model times; Megatron's
    default is allgather); a capacity factor c > 1 adds ``--moe-expert-capacity-factor c
    --moe-pad-expert-input-to-capacity`` (padded to capacity: what the planner counts). At
    c = 1 (a balanced routing) and dropless no capacity is set: Megatron's router is then
    dropless, and at 1 a warning says the plan assumed balanced routing. Shared experts
    (``--moe-shared-expert-intermediate-size``) need the model's widths: left to the model's
    own arguments. ([], None) for a dense graph; no flags and a warning for tp > 1 without
    sequence parallelism, which megatron-core refuses for MoE layers."""
    experts = routed_experts(graph)
    if experts is None:
        return [], None
    if config.tp > 1 and not config.sp:
        # megatron/core/transformer/moe/moe_layer.py, MoELayer.forward: "performance may degrade
        # if MoE and tensor parallelism are enabled without also enabling sequence parallelism"
        # is a ValueError in training
        return [], (
            "moe: megatron-core refuses to train MoE layers with tensor parallelism but without "
            "sequence parallelism (MoELayer.forward raises); plan with --sequence-parallel auto"
        )
    args = [
        "--num-experts",
        str(experts.num_experts),
        "--moe-router-topk",
        str(experts.top_k),
        _flag("ep"),
        str(config.ep),
        "--moe-token-dispatcher-type",
        "alltoall",
    ]
    if capacity_factor == MOE_DROPLESS:
        return args, None
    if capacity_factor > 1:
        args += [
            "--moe-expert-capacity-factor",
            f"{capacity_factor:g}",
            "--moe-pad-expert-input-to-capacity",
        ]
        return args, None
    return args, (
        "moe: the plan assumes a balanced routing (each expert gets tokens x top_k / experts); "
        "Megatron's dropless router can send a GPU more. Bound it with "
        "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity, or plan with "
        "--moe-capacity-factor dropless for the worst case"
    )


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


def _megatron_recompute_args(
    config: ParallelConfig,
    roles: dict[str, str],
    stages: list[list[str]],
    recomputed: list[list[str]] | None,
) -> tuple[list[str], str | None]:
    """Recomputation flags: every layer (full), or the chosen layers (selective) when Megatron
    can express them, else no flag and a warning that lists them."""
    args = []
    if config.recompute == "full":
        args += [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ]
    if recomputed is None:
        return args, None
    blocks_recomputed = _megatron_block_recompute(roles, stages, recomputed)
    if blocks_recomputed is None:
        return args, (
            "recompute: the recomputed layers are not the first N transformer layers of "
            "every stage, which is all --recompute-method block expresses; recompute these "
            "by hand (e.g. checkpoint_wrapper): "
            + "; ".join(
                f"stage {s}: {', '.join(names)}" for s, names in enumerate(recomputed) if names
            )
        )
    if not blocks_recomputed:
        return args, None
    # megatron/training/arguments.py: with --recompute-method block, "the first N
    # transformer layers of each pipeline stage are recomputed"
    return args + [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        str(blocks_recomputed),
    ], None


def _megatron_block_recompute(
    roles: dict[str, str], stages: list[list[str]], recomputed: list[list[str]]
) -> int | None:
    """N when every stage recomputes exactly its first N transformer layers (N may be 0), else
    None (Megatron's block method cannot express the set)."""
    counts = set()
    for stage, names in zip(stages, recomputed, strict=True):
        blocks = [name for name in stage if roles[name] == "block"]
        count = len(names)
        if blocks[:count] != names:
            return None
        counts.add(count)
    return counts.pop() if len(counts) == 1 else None


def _megatron_warnings(
    graph: LayerGraph,
    config: ParallelConfig,
    roles: dict[str, str],
    stage_letters: list[str],
    stages: list[list[str]],
) -> list[str]:
    """What keeps the plan from running in Megatron as is; layout errors start with 'layout:'."""
    warnings = []
    flat = "".join(stage_letters)
    # PipelineParallelLayerLayout.validate_layer_layout: the first layer must be the embedding,
    # the last the loss, each exactly once.
    if (
        flat.count("E") != 1
        or flat.count("L") != 1
        or not flat.startswith("E")
        or not flat.endswith("L")
    ):
        warnings.append(
            f"layout: Megatron needs exactly one E (first) and one L (last); this plan has "
            f"{flat.count('E')} E and {flat.count('L')} L (set Layer.kind to fix roles). "
            "Megatron's layout also does not support encoder-decoder models."
        )
    others = [name for name, role in roles.items() if role == "other"]
    if others:
        warnings.append(
            f"{len(others)} layer(s) of kind 'other' have no Megatron letter and are taken to "
            f"belong to the neighbouring Megatron module: {', '.join(others[:5])}"
            + (" ..." if len(others) > 5 else "")
        )
    # Megatron docs (distrib_optimizer.md): bytes per parameter with the distributed optimizer
    # are 6 + 12/d for bf16 params with fp32 grads: the gradient buffer is not sharded.
    if config.zero >= 2:
        warnings.append(
            f"ZeRO {config.zero}: --use-distributed-optimizer shards only the optimizer state "
            "(6 + 12/d bytes per parameter with bf16 weights and fp32 gradients: ZeRO-1 memory); "
            "sharded gradients/parameters need Megatron-FSDP (--use-megatron-fsdp "
            "--data-parallel-sharding-strategy optim_grads or optim_grads_params), not checked "
            "here with pipeline parallelism."
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
