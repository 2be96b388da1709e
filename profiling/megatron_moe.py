"""Mixture of experts on the megatron engine: the export's MoE flags read back as Megatron-LM
reads them, checked against the zoo preset, and turned into megatron-core's MoE settings.

A plan for a zoo MoE preset (``GPTConfig.num_experts`` > 0) is run as megatron-core 0.16.1's
``MoELayer`` built from the local layer spec (``get_gpt_layer_local_spec(num_experts=...)``):
a ``TopKRouter`` (softmax scores, no auxiliary loss unless the export asks for one), the
all-to-all token dispatcher over the expert-parallel group, ``SequentialMLP`` experts
(``moe_grouped_gemm=False``: one MLP per local expert, E/ep of them on each rank) and, for
shared experts, one ``SharedExpertMLP`` as wide as all of the preset's shared experts together.
The capacity factor comes with ``--moe-pad-expert-input-to-capacity``: every expert receives
exactly ``ceil(capacity_factor * tokens * top_k / num_experts)`` tokens of each micro-batch
(Megatron's ``get_capacity``), so every tensor's shape, and the memory, is the same whatever the
routing. Dense first blocks (``dense_layers``) are ``--moe-layer-freq``'s zeros.

Structural differences from the zoo's MoE block that remain (parameter counts per layer are
equal otherwise; tests/test_megatron_moe.py):

- Megatron's router has a bias of ``num_experts`` elements when the linear layers have biases
  (``add_bias_linear``), and its shared experts are one fused MLP, so with biases its second
  linear has one bias of ``hidden`` elements where ``shared_experts`` separate MLPs have one
  each.
- Megatron multiplies each token's routing weight into the expert's activation (before the
  second linear: ``MLP.forward(per_token_scale=...)``) rather than into its output; the same
  result, and the saved activation is the scaled one, of the same shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import models
from solver.errors import InputError

CAPACITY_FIX = (
    "plan the MoE model with a capacity factor (Megatron-LM --moe-expert-capacity-factor C "
    "--moe-pad-expert-input-to-capacity): re-create the plan with python -m solver.plan"
)


@dataclass(frozen=True, kw_only=True)
class MoeSettings:
    """Megatron-LM's MoE arguments in the export (megatron/training/arguments.py)."""

    num_experts: int
    """--num-experts: routed experts per MoE layer."""
    router_topk: int
    """--moe-router-topk (Megatron-LM's default 2)."""
    expert_parallel: int
    """--expert-model-parallel-size (default 1)."""
    capacity_factor: float | None
    """--moe-expert-capacity-factor (None: dropless)."""
    pad_to_capacity: bool
    """--moe-pad-expert-input-to-capacity: every expert gets exactly its capacity of tokens."""
    router_pre_softmax: bool
    """--moe-router-pre-softmax: softmax over all experts before the top-k (weights not
    renormalised, DeepSeek-MoE); without it the top-k logits are softmaxed (Mixtral)."""
    ffn_hidden: int | None
    """--moe-ffn-hidden-size (None: Megatron-LM takes --ffn-hidden-size)."""
    shared_expert_hidden: int | None
    """--moe-shared-expert-intermediate-size (None: no shared experts)."""
    layer_freq: list[int] | None
    """--moe-layer-freq as one 0/1 per block (None: every block is a MoE block)."""
    aux_loss_coeff: float
    """--moe-aux-loss-coeff (Megatron-LM's default 0: no load-balancing loss)."""


def moe_settings(args: dict[str, str | None]) -> MoeSettings | None:
    """The export's MoE flags (``--flag value`` pairs), or None without ``--num-experts``."""
    if "--num-experts" not in args:
        return None

    def number(flag: str, kind=int):
        value = args.get(flag)
        return kind(value) if value is not None else None

    layers = number("--num-layers") or 0
    freq = args.get("--moe-layer-freq")
    return MoeSettings(
        num_experts=number("--num-experts"),
        router_topk=number("--moe-router-topk") or 2,
        expert_parallel=number("--expert-model-parallel-size") or 1,
        capacity_factor=number("--moe-expert-capacity-factor", float),
        pad_to_capacity="--moe-pad-expert-input-to-capacity" in args,
        router_pre_softmax="--moe-router-pre-softmax" in args,
        ffn_hidden=number("--moe-ffn-hidden-size"),
        shared_expert_hidden=number("--moe-shared-expert-intermediate-size"),
        layer_freq=parse_layer_freq(freq, layers) if freq is not None else None,
        aux_loss_coeff=number("--moe-aux-loss-coeff", float) or 0.0,
    )


_FREQ_TERM = re.compile(r"^\[([01](?:,[01])*)\](?:\*(\d+))?$")


def parse_layer_freq(text: str, num_layers: int) -> list[int]:
    """``--moe-layer-freq`` as one 0 (dense) or 1 (MoE) per block: an integer N (every N-th
    block, from the first) or a list expression such as ``([0]*1+[1]*3)`` or ``[0,1,1,1]``,
    the two forms Megatron-LM's ``moe_freq_type`` accepts."""
    compact = text.replace(" ", "").removeprefix("(").removesuffix(")")
    if compact.isdigit() and int(compact) > 0:
        return [1 if i % int(compact) == 0 else 0 for i in range(num_layers)]
    pattern: list[int] = []
    for term in compact.split("+"):
        match = _FREQ_TERM.match(term)
        if not match:
            raise InputError(
                f"exports.megatron: --moe-layer-freq {text!r}: not an integer or a list such as "
                "([0]*1+[1]*3); re-create the plan with python -m solver.plan"
            )
        values = [int(v) for v in match.group(1).split(",")]
        pattern += values * int(match.group(2) or 1)
    if len(pattern) != num_layers:
        raise InputError(
            f"exports.megatron: --moe-layer-freq {text!r} gives {len(pattern)} blocks, "
            f"--num-layers is {num_layers}; re-create the plan with python -m solver.plan"
        )
    return pattern


def check_moe(spec: models.ModelSpec, settings) -> None:
    """InputError unless the export's MoE flags (``settings.moe``) describe the preset's
    experts (count, top-k, widths, dense blocks, capacity) and megatron-core can run them here:
    ep dividing the experts, a capacity with padding, sequence parallelism with tp > 1."""
    config: models.gpt.GPTConfig = spec.config
    moe = settings.moe
    if moe is None:
        if config.num_experts:
            raise InputError(
                f"exports.megatron: model {spec.name} has {config.num_experts} experts per MoE "
                "block and the export no --num-experts: Megatron-LM would build dense MLPs; "
                "re-create the plan from the MoE model's graph with python -m solver.plan"
            )
        return
    expected: dict[str, Any] = {
        "--num-experts": (moe.num_experts, config.num_experts),
        "--moe-router-topk": (moe.router_topk, config.top_k),
        "--moe-ffn-hidden-size": (moe.ffn_hidden or config.ffn_width, config.expert_ffn_width),
        "--moe-shared-expert-intermediate-size": (
            moe.shared_expert_hidden or 0,
            config.shared_experts * config.expert_ffn_width,
        ),
        "--moe-layer-freq": (moe_layer_pattern(moe, config.layers), dense_pattern(config)),
        "--moe-router-pre-softmax": (moe.router_pre_softmax, config.router_pre_softmax),
    }
    for flag, (exported, model) in expected.items():
        if exported != model:
            raise InputError(
                f"exports.megatron: {flag} gives {exported}, model {spec.name} has {model}; "
                "the plan was made for another model: re-create it from this model's graph"
            )
    problems = (
        (
            moe.num_experts % moe.expert_parallel != 0,
            f"--expert-model-parallel-size {moe.expert_parallel} does not divide --num-experts "
            f"{moe.num_experts}; plan with an ep that divides the experts",
        ),
        (
            moe.capacity_factor is None or not moe.pad_to_capacity,
            f"--moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity missing (the "
            f"run's shapes would depend on the routing); {CAPACITY_FIX}",
        ),
        (
            moe.capacity_factor is not None and moe.capacity_factor != config.capacity_factor,
            f"--moe-expert-capacity-factor {moe.capacity_factor} and the model's "
            f"capacity_factor {config.capacity_factor} differ; re-create the plan from this "
            "model's graph",
        ),
        (
            moe.capacity_factor is not None
            and moe.capacity_factor * moe.router_topk > moe.num_experts,
            f"capacity factor {moe.capacity_factor} x top-k {moe.router_topk} > "
            f"{moe.num_experts} experts: each expert's capacity would exceed the micro-batch's "
            "tokens, which megatron-core's padded dispatch cannot fill; plan with a capacity "
            "factor of at most num_experts / top_k",
        ),
        (
            settings.tp > 1 and not settings.sequence_parallel,
            f"tp {settings.tp} without --sequence-parallel: megatron-core trains MoE layers "
            "with tp > 1 only with sequence parallelism; plan with --sequence-parallel on",
        ),
    )
    for failed, problem in problems:
        if failed:
            raise InputError(f"exports.megatron: {problem}")


def dense_pattern(config: models.gpt.GPTConfig) -> list[int]:
    """One 0 (dense MLP) or 1 (MoE) per block of the preset."""
    return [int(config.is_moe_block(i)) for i in range(config.layers)]


def moe_layer_pattern(moe: MoeSettings, num_layers: int) -> list[int]:
    """The export's pattern (every block a MoE block without ``--moe-layer-freq``)."""
    return moe.layer_freq if moe.layer_freq is not None else [1] * num_layers


def moe_config_kwargs(spec: models.ModelSpec, moe: MoeSettings | None) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` arguments of the MoE layers (none for a dense
    model): the all-to-all dispatcher, SequentialMLP experts, the capacity with padding, and
    the auxiliary load-balancing loss only when the export asks for one."""
    if moe is None:
        return {}
    config = spec.config
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=config.expert_ffn_width,
        moe_shared_expert_intermediate_size=moe.shared_expert_hidden,
        moe_layer_freq=moe_layer_pattern(moe, config.layers),
        expert_model_parallel_size=moe.expert_parallel,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_router_pre_softmax=moe.router_pre_softmax,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_pad_expert_input_to_capacity=moe.pad_to_capacity,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
    )
