"""Megatron-LM flags beyond the split (``solver.exports.megatron``): precision, recomputation,
the distributed optimizer and the mixture-of-experts layers. Each function returns the flags and
what they do not express exactly (a warning, or a record the export carries).

Pure functions: no I/O, no torch. Facts about Megatron-LM (``megatron/training/arguments.py``,
``megatron/core/transformer/transformer_config.py`` of core_v0.16.1, unchanged in core_v0.19.0)
are in the comments next to the code that relies on them.
"""

from __future__ import annotations

from typing import Any

from solver.costs.moe import routed_experts
from solver.graph import LayerGraph
from solver.parallel import export_name
from solver.precision import DEFAULT_PRECISION, bytes_per_param
from solver.specs import MOE_DROPLESS, ParallelConfig

PRECISION_FLAGS = {
    "bf16-mixed": ["--bf16"],
    "fp16-mixed": ["--fp16"],
    "fp32": [],
    "bf16": ["--bf16"],
}
"""Megatron-LM's flag per precision word (``solver.precision.PRECISIONS``). Without --bf16 or
--fp16 Megatron-LM trains in fp32 (``args.params_dtype = torch.float``). Megatron-LM has no pure
bf16 training (no fp32 master copy): ``bf16`` runs as --bf16, which keeps one (a warning)."""


def precision_args(
    precision: str | None, optimizer: str, plan_bytes: tuple[int, int, int] | None
) -> tuple[list[str], str | None]:
    """The precision flag, and a warning when Megatron-LM then holds other bytes per parameter
    (weights, gradients, optimizer states) than the plan counts (``solver.precision``'s table
    for the megatron runtime: --bf16 with Adam 2 + 4 + 12, --fp16 2 + 2 + 12, fp32 4 + 4 + 8)."""
    precision = precision or DEFAULT_PRECISION
    flags = PRECISION_FLAGS[precision]
    held = bytes_per_param(
        "bf16-mixed" if precision == "bf16" else precision, optimizer, "megatron"
    )
    if plan_bytes is None or tuple(plan_bytes) == tuple(held):
        return list(flags), None
    run = " ".join(flags) or "no precision flag (fp32)"
    return list(flags), (
        f"precision: the plan counts {'+'.join(map(str, plan_bytes))} bytes per parameter "
        f"(weights+gradients+optimizer states, precision {precision}); Megatron-LM with {run} "
        f"and {optimizer} holds {'+'.join(map(str, held))}: plan with --precision "
        f"{'bf16-mixed' if precision == 'bf16' else precision} and without --bytes-per-param "
        "to count what it runs"
    )


MEGATRON_FSDP_STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}
"""ZeRO stage -> Megatron-FSDP's ``--data-parallel-sharding-strategy``."""


def zero_args(config: ParallelConfig) -> tuple[list[str], str | None]:
    """``--use-distributed-optimizer`` for ZeRO 1 (Megatron's distributed optimizer shards the
    optimizer states over dp x cp: ZeRO-1); nothing for 0. ZeRO 2 and 3 at pp 1 are
    Megatron-FSDP (``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads`` or
    ``optim_grads_params``, which its validate_args allows only with ``--ckpt-format
    fsdp_dtensor``; the engine rules take them at pp 1 only, ``solver.engine_rules``). With
    pipeline parallelism: no flag, and the reason returned, which the export carries as
    ``refused``."""
    if config.zero == 1:
        return ["--use-distributed-optimizer"], None
    if config.zero == 0:
        return [], None
    if config.pp == 1:
        strategy = MEGATRON_FSDP_STRATEGY[config.zero]
        flags = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
        return flags + ["--ckpt-format", "fsdp_dtensor"], None
    return [], (
        f"ZeRO {config.zero} with pp {config.pp}: Megatron-LM's distributed optimizer "
        "(--use-distributed-optimizer) is ZeRO-1, and Megatron-FSDP (--use-megatron-fsdp), "
        "which shards gradients and parameters, runs at pp 1 only: plan with --zero 0 or 1, "
        "or --pp 1"
    )


RECOMPUTE_FULL = [
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
]
"""Every transformer layer recomputed: ``uniform`` with 1 layer per recompute unit (Megatron's
``TransformerBlock._checkpointed_forward`` checkpoints each chunk of N layers; N = 1 keeps each
layer's input only, what the cost model counts)."""


def recompute_args(
    config: ParallelConfig,
    roles: dict[str, str],
    stages: list[list[str]],
    recomputed: list[list[str]] | None,
) -> tuple[list[str], dict[str, Any] | None, str | None]:
    """(flags, the export's ``recompute`` record, a warning) for the plan's recomputation.

    Megatron-LM recomputes whole transformer layers with ``--recompute-granularity full`` and
    ``--recompute-method uniform`` (every layer, in units of N) or ``block`` (the first N
    transformer layers of every pipeline stage, the same N on every stage). Its ``selective``
    granularity recomputes parts of every layer (core attention), not a set of layers, so it
    expresses no plan here. A plan whose per-stage choice is "the first N blocks" (N the same,
    or all of a stage's blocks where it has fewer) is exported exactly; any other choice is
    realised with ``block`` and N = the most blocks a stage recomputes, so every stage
    recomputes at least as many blocks as planned (the record lists both, per stage, and
    ``exact`` is false; the planner adds the peak those flags give, ``realised_peak_bytes``).
    """
    if config.recompute == "full":
        return list(RECOMPUTE_FULL), {"exact": True, "method": "uniform", "num_layers": 1}, None
    if recomputed is None or not any(recomputed):
        return [], None, None
    blocks = [[name for name in stage if roles[name] == "block"] for stage in stages]
    chosen = [[name for name in names if roles[name] == "block"] for names in recomputed]
    others = [name for names in recomputed for name in names if roles[name] != "block"]
    count = max(len(names) for names in chosen)
    realised = [stage[:count] for stage in blocks]
    exact = not others and realised == [list(names) for names in chosen]
    args = [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        str(count),
    ]
    record: dict[str, Any] = {
        "exact": exact,
        "method": "block",
        "num_layers": count,
        "planned_per_stage": [list(names) for names in recomputed],
        "exported_per_stage": realised,
    }
    if exact:
        return args, record, None
    detail = "; ".join(
        f"stage {s}: {len(realised[s])} instead of {names}"
        for s, names in enumerate(recomputed)
        if realised[s] != names
    )
    warning = (
        "recompute: Megatron-LM recomputes the same first N transformer layers on every stage "
        f"(--recompute-method block); the plan's per-stage choice is not that, so the export "
        f"runs N = {count}: every stage recomputes at least as many blocks as planned (more "
        f"time), its first ones ({detail}). exports.megatron.recompute lists both per stage"
    )
    if others:
        warning += (
            f"; {', '.join(others[:5])} are not transformer layers, which Megatron-LM never "
            "recomputes (plan with --runtime megatron)"
        )
    return args, record, warning


def expert_args(
    graph: LayerGraph, config: ParallelConfig, capacity_factor: float | str, blocks: list[str]
) -> tuple[list[str], str | None]:
    """Megatron's mixture-of-experts flags for a graph with routed experts (megatron/training/
    arguments.py): ``--num-experts E --moe-router-topk k --expert-model-parallel-size ep`` and
    ``--moe-token-dispatcher-type alltoall`` (the all-to-all the cost model times; Megatron's
    default is allgather); the experts' width ``--moe-ffn-hidden-size`` and the shared experts
    ``--moe-shared-expert-intermediate-size`` when the graph's ``meta.moe`` records them
    (``expert_ffn_hidden``, ``shared_expert_ffn_hidden``: without the flag Megatron builds no
    shared expert, and experts as wide as the dense MLP); ``--moe-layer-freq`` when some blocks
    are dense (no expert parameters; DeepSeek's first_k_dense_replace, Qwen-MoE's
    mlp_only_layers): without it every layer is MoE. A capacity factor c > 1 adds
    ``--moe-expert-capacity-factor c --moe-pad-expert-input-to-capacity`` (padded to capacity:
    what the planner counts). At c = 1 (a balanced routing) and dropless no capacity is set:
    Megatron's router is then dropless, and at 1 a warning says the plan assumed balanced
    routing. ([], None) for a dense graph; no flags and a warning for tp > 1 without sequence
    parallelism, which megatron-core refuses for MoE layers. ``blocks``: the transformer
    layers' names in order."""
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
        export_name("megatron", "ep"),
        str(config.ep),
        "--moe-token-dispatcher-type",
        "alltoall",
    ]
    args += _moe_shape_args(graph, blocks)
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


def _moe_shape_args(graph: LayerGraph, blocks: list[str]) -> list[str]:
    """The MoE shape flags the graph knows: expert width, shared experts, dense blocks."""
    moe = graph.meta.get("moe") or {}
    args = []
    width = moe.get("expert_ffn_hidden")
    if isinstance(width, int) and not isinstance(width, bool) and width > 0:
        args += ["--moe-ffn-hidden-size", str(width)]
    shared = moe.get("shared_expert_ffn_hidden")
    if isinstance(shared, int) and not isinstance(shared, bool) and shared > 0:
        args += ["--moe-shared-expert-intermediate-size", str(shared)]
    by_name = {layer.name: layer for layer in graph.layers}
    pattern = [1 if by_name[name].expert_params > 0 else 0 for name in blocks]
    if pattern and not all(pattern):
        args += ["--moe-layer-freq", layer_freq(pattern)]
    return args


def layer_freq(pattern: list[int]) -> str:
    """``--moe-layer-freq`` for one 0 (dense) or 1 (MoE) per block, as Megatron-LM's
    ``moe_freq_type`` evaluates it: the shortest repeating unit times its count when the
    pattern repeats (``([0,1]*12)``), else runs (``([0]*1+[1]*23)``)."""
    n = len(pattern)
    for period in range(1, n // 2 + 1):
        if n % period == 0 and pattern == pattern[:period] * (n // period):
            unit = ",".join(map(str, pattern[:period]))
            return f"([{unit}]*{n // period})"
    runs: list[list[int]] = []
    for value in pattern:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return "(" + "+".join(f"[{value}]*{count}" for value, count in runs) + ")"
