"""Mixture of experts on the megatron engine: the export's MoE flags read back as Megatron-LM
reads them, checked against the zoo preset, and turned into megatron-core's MoE settings.

A plan for a zoo MoE preset (``GPTConfig.num_experts`` > 0) is run as megatron-core 0.16.1's
``MoELayer`` built from the local layer spec (``get_gpt_layer_local_spec(num_experts=...)``):
a ``TopKRouter`` (softmax scores, no auxiliary loss unless the export asks for one), the
all-to-all token dispatcher over the expert-parallel group, ``SequentialMLP`` experts
(``moe_grouped_gemm=False``: one MLP per local expert, E/ep of them on each rank) and, for
shared experts, one ``SharedExpertMLP`` as wide as all of the preset's shared experts together
(as the zoo's). Dense first blocks (``dense_layers``) are ``moe_layer_freq``'s zeros.

Which flags say what: the export states the experts, top-k, ep and the routing capacity
(``--num-experts --moe-router-topk --expert-model-parallel-size --moe-expert-capacity-factor
--moe-pad-expert-input-to-capacity``), which must agree with the preset and the plan. The
expert width, the shared experts, the dense blocks and the router's softmax are the model's
shape, as ``--hidden-size`` is: the preset's, and checked when the export states them
(``--moe-ffn-hidden-size --moe-shared-expert-intermediate-size --moe-layer-freq
--moe-router-pre-softmax``).

Routing capacity: with ``--moe-expert-capacity-factor c --moe-pad-expert-input-to-capacity``
every expert receives exactly ``ceil(c * tokens * top_k / num_experts)`` tokens of each
micro-batch (Megatron's ``get_capacity``; the zoo block's drop-and-pad dispatch), so every
tensor's shape, and the memory, is the same whatever the routing. Without a capacity factor
Megatron's router is dropless: each expert receives the tokens routed to it, and the memory of
a run depends on how balanced its routing is (the zoo block is the padded one; the two agree
at a balanced routing).

Structural difference from the zoo's MoE block (parameter counts per layer are equal
otherwise; tests/test_megatron_moe.py): with biases (``add_bias_linear``) Megatron's router
has a bias of ``num_experts`` elements, the zoo's none (the MoE presets have no biases).
Megatron multiplies each token's routing weight into the expert's activation (before the
second linear: ``MLP.forward(per_token_scale=...)``) rather than into its output: the same
result, and the saved activation is the scaled one, of the same shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import models
from solver.errors import InputError


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
    router_pre_softmax: bool | None
    """--moe-router-pre-softmax: softmax over all experts before the top-k (weights not
    renormalised, DeepSeek-MoE), else the top-k logits are softmaxed (Mixtral); None: not in
    the export (the model's)."""
    ffn_hidden: int | None
    """--moe-ffn-hidden-size (None: not in the export, the model's expert width)."""
    shared_expert_hidden: int | None
    """--moe-shared-expert-intermediate-size (None: not in the export, the model's)."""
    layer_freq: list[int] | None
    """--moe-layer-freq as one 0/1 per block (None: not in the export, the model's)."""
    dispatcher: str | None
    """--moe-token-dispatcher-type (None: not in the export; the engine runs alltoall)."""
    aux_loss_coeff: float
    """--moe-aux-loss-coeff (Megatron-LM's default 0: no load-balancing loss)."""


def moe_settings(args: dict[str, str | None]) -> MoeSettings | None:
    """The export's MoE flags (``--flag value`` pairs), or None without ``--num-experts``."""
    if "--num-experts" not in args:
        return None

    def number(flag: str, kind=int):
        value = args.get(flag)
        if value is None:
            return None
        try:
            return kind(value)
        except ValueError:
            raise InputError(
                f"exports.megatron: {flag} {value!r} is not a number; re-create the plan with "
                "python -m solver.plan"
            ) from None

    layers = number("--num-layers") or 0
    freq = args.get("--moe-layer-freq")
    return MoeSettings(
        num_experts=number("--num-experts"),
        router_topk=number("--moe-router-topk") or 2,
        expert_parallel=number("--expert-model-parallel-size") or 1,
        capacity_factor=number("--moe-expert-capacity-factor", float),
        pad_to_capacity="--moe-pad-expert-input-to-capacity" in args,
        router_pre_softmax=True if "--moe-router-pre-softmax" in args else None,
        ffn_hidden=number("--moe-ffn-hidden-size"),
        shared_expert_hidden=number("--moe-shared-expert-intermediate-size"),
        layer_freq=parse_layer_freq(freq, layers) if freq is not None else None,
        aux_loss_coeff=number("--moe-aux-loss-coeff", float) or 0.0,
        dispatcher=args.get("--moe-token-dispatcher-type"),
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
    experts and megatron-core can run them here: ep dividing the experts, the all-to-all
    dispatcher, a padded capacity the micro-batch can fill, sequence parallelism with tp > 1.
    The expert width, shared experts, dense blocks and router kind are the model's shape, as
    ``--hidden-size`` is: taken from the preset when the export does not state them, and
    checked against it when it does."""
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
    shape = model_moe_shape(config)
    stated: dict[str, Any] = {
        "--num-experts": (moe.num_experts, config.num_experts),
        "--moe-router-topk": (moe.router_topk, config.top_k),
        "--moe-ffn-hidden-size": (moe.ffn_hidden, shape["moe_ffn_hidden_size"]),
        "--moe-shared-expert-intermediate-size": (
            moe.shared_expert_hidden,
            shape["moe_shared_expert_intermediate_size"],
        ),
        "--moe-layer-freq": (moe.layer_freq, shape["moe_layer_freq"]),
        "--moe-router-pre-softmax": (moe.router_pre_softmax, shape["moe_router_pre_softmax"]),
    }
    for flag, (exported, model) in stated.items():
        if exported is not None and exported != model:
            raise InputError(
                f"exports.megatron: {flag} gives {exported}, model {spec.name} has {model}; "
                "the plan was made for another model: re-create it from this model's graph"
            )
    padded = moe.capacity_factor is not None and moe.pad_to_capacity
    problems = (
        (
            moe.num_experts % moe.expert_parallel != 0,
            f"--expert-model-parallel-size {moe.expert_parallel} does not divide --num-experts "
            f"{moe.num_experts}; plan with an ep that divides the experts",
        ),
        (
            moe.dispatcher not in (None, "alltoall"),
            f"--moe-token-dispatcher-type {moe.dispatcher}: the engine runs the alltoall "
            "dispatcher (the all-to-all the plan counts); re-create the plan with python -m "
            "solver.plan",
        ),
        (
            moe.capacity_factor is not None and not moe.pad_to_capacity,
            f"--moe-expert-capacity-factor {moe.capacity_factor} without "
            "--moe-pad-expert-input-to-capacity: the dropped tokens, and the memory, would "
            "depend on the routing; add the flag (what the plan counts)",
        ),
        (
            padded and moe.capacity_factor * moe.router_topk > moe.num_experts,
            f"capacity factor {moe.capacity_factor} x top-k {moe.router_topk} > "
            f"{moe.num_experts} experts: each expert's capacity would exceed the micro-batch's "
            "tokens, which megatron-core's padded dispatch cannot fill; plan with a capacity "
            "factor of at most num_experts / top_k",
        ),
        (
            config.expert_ffn_width % settings.tp != 0,
            f"tp {settings.tp} does not divide the expert width ({config.expert_ffn_width}) of "
            f"{spec.name}: megatron-core splits every expert over tp; plan with a tp that "
            "divides it",
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


def model_moe_shape(config: models.gpt.GPTConfig) -> dict[str, Any]:
    """megatron-core's settings of the preset's MoE shape: expert width, the shared experts as
    one MLP (None: none), one 0 (dense) or 1 (MoE) per block, the router's softmax."""
    shared = config.shared_experts * config.expert_ffn_width
    return dict(
        moe_ffn_hidden_size=config.expert_ffn_width,
        moe_shared_expert_intermediate_size=shared or None,
        moe_layer_freq=[int(config.is_moe_block(i)) for i in range(config.layers)],
        moe_router_pre_softmax=config.router_pre_softmax,
    )


def moe_config_kwargs(spec: models.ModelSpec, moe: MoeSettings | None) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` arguments of the MoE layers (none for a dense
    model): the preset's shape, the export's experts, top-k, ep and capacity (padded, or
    dropless without one), the all-to-all dispatcher, SequentialMLP experts, and the auxiliary
    load-balancing loss only when the export asks for one (Megatron-LM's default coefficient
    is 0)."""
    if moe is None:
        return {}
    return dict(
        **model_moe_shape(spec.config),
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        expert_model_parallel_size=moe.expert_parallel,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_pad_expert_input_to_capacity=moe.pad_to_capacity,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
    )
