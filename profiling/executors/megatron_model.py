"""The zoo's GPT and Llama presets as megatron-core ``GPTModel`` chunks, set up from a plan's own
Megatron export (``plan.exports["megatron"]``, :mod:`solver.exports.megatron`).

``megatron_settings`` reads the export's Megatron-LM arguments the way Megatron-LM's argument
parsing does (``--pipeline-model-parallel-layout``, ``--decoder-first/last-pipeline-num-layers``,
``--num-virtual-stages-per-pipeline-rank``, ``--recompute-*``, ``--use-distributed-optimizer``,
``--sequence-parallel``) and ``transformer_config`` turns them, with the preset's shape, into a
``TransformerConfig``: nothing is translated a second time, so a run checks the export itself.
``build_chunks`` builds a rank's chunks with the local layer spec (no TransformerEngine) and
``chunk_layers`` names the zoo layers each holds, which the rank compares with the plan's stages.

Norms (:class:`TorchNorm`): the local spec's ``WrappedTorchNorm`` refuses sequence parallelism
(apex and TransformerEngine norms are the ones Megatron marks for it), so every norm of the
layers and the final norm is torch's LayerNorm or RMSNorm built the same way, with its
parameters marked ``sequence_parallel`` as TransformerEngine's and apex's norms mark theirs:
that attribute is how ``finalize_model_grads`` knows to all-reduce their gradients over tp
(each rank saw only its part of the sequence). Bypass 7 of :mod:`profiling.executors.megatron_cpu`.

Layer names: ``embedding`` is the zoo's ``embed``, ``decoder.layers.i`` (global layer number
n = i + 1 on the first chunk) is ``layers.{n-1}``, and ``decoder.final_layernorm`` plus
``output_layer`` (and the loss) are ``head``: Megatron's layout letters E, t and L.

Weights (``init_weights``): every parameter is drawn from a generator seeded by the run's seed and
the parameter's global name, in the single-GPU (tp = 1) shape, and each tensor-parallel rank keeps
its partition of it, so that every run of a preset, whatever its layout, trains the same model
(the tests compare gradients with a single-process run). A routed expert's global name carries
its global index, so each expert-parallel rank draws the values of the experts it holds.

Mixture of experts (``--num-experts`` in the export): :mod:`profiling.executors.megatron_moe`.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import models
from profiling.executors.megatron_moe import MoeSettings, check_moe, moe_config_kwargs, moe_settings
from solver.engine_rules import padded_vocab_size
from solver.errors import InputError
from solver.files.plan_file import PlanFile

INSTALL_HINT = 'pip install -e ".[megatron]"'


def require_megatron() -> None:
    """InputError (one line) unless megatron-core imports."""
    from profiling.executors.megatron_cpu import quiet_fallback_warnings

    quiet_fallback_warnings()
    try:
        import megatron.core  # noqa: F401
    except ImportError as error:
        raise InputError(
            f"engine megatron: megatron-core is not installed ({error}); install it with "
            f"{INSTALL_HINT}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class MegatronSettings:
    """What a plan's Megatron export tells Megatron-LM, read back from its arguments."""

    pp: int
    tp: int
    num_layers: int
    micro_batch: int
    global_batch: int
    layout: str | None
    """--pipeline-model-parallel-layout (None: the first/last counts or an even split)."""
    first_stage_layers: int | None
    last_stage_layers: int | None
    virtual_stages: int | None
    """--num-virtual-stages-per-pipeline-rank (None: none, or the layout's own)."""
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    distributed_optimizer: bool
    sequence_parallel: bool = False
    """--sequence-parallel (the plan's ``config.sp``)."""
    moe: MoeSettings | None = None
    """The mixture-of-experts flags (None: a dense model, no ``--num-experts``)."""


def megatron_settings(plan: PlanFile) -> MegatronSettings:
    """The plan's Megatron-LM arguments (``exports.megatron.args``); InputError when the plan
    has no Megatron export or Megatron cannot run its layout."""
    export = (plan.exports or {}).get("megatron")
    if not export:
        raise InputError(
            f"{plan.source}: no Megatron export (an evaluation document has none); run a plan "
            "from python -m solver.plan --json"
        )
    if export.get("refused"):  # a refused section, or a plan Megatron cannot run
        raise InputError(f"{plan.source}: exports.megatron: {export['refused']}")
    layout_errors = [w for w in export.get("warnings", []) if w.startswith("layout:")]
    if layout_errors:
        raise InputError(f"{plan.source}: exports.megatron: {layout_errors[0]}")
    args = _parse_args(export["args"])
    moe = moe_settings(args)
    exported_ep = moe.expert_parallel if moe is not None else 1
    if exported_ep != plan.config.ep:
        raise InputError(
            f"{plan.source}: exports.megatron: --expert-model-parallel-size {exported_ep} and "
            f"config.ep {plan.config.ep} differ; re-create the plan with python -m solver.plan"
        )

    def number(flag: str) -> int | None:
        return int(args[flag]) if flag in args else None

    return MegatronSettings(
        pp=number("--pipeline-model-parallel-size") or 1,
        tp=number("--tensor-model-parallel-size") or 1,
        num_layers=number("--num-layers") or 0,
        micro_batch=number("--micro-batch-size") or 1,
        global_batch=number("--global-batch-size") or 1,
        layout=args.get("--pipeline-model-parallel-layout"),
        first_stage_layers=number("--decoder-first-pipeline-num-layers"),
        last_stage_layers=number("--decoder-last-pipeline-num-layers"),
        virtual_stages=number("--num-virtual-stages-per-pipeline-rank"),
        recompute_granularity=args.get("--recompute-granularity"),
        recompute_method=args.get("--recompute-method"),
        recompute_num_layers=number("--recompute-num-layers"),
        distributed_optimizer="--use-distributed-optimizer" in args,
        sequence_parallel="--sequence-parallel" in args,
        moe=moe,
    )


def _parse_args(argv: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs and bare ``--flag`` switches (the last value of a repeated flag
    wins, as with argparse)."""
    parsed: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        parsed[flag] = value
        i += 2 if value is not None else 1
    return parsed


def check_model(spec: models.ModelSpec, tp: int, *, sequence_parallel: bool = False) -> None:
    """InputError unless megatron-core's GPTModel (local spec) can build ``spec`` with ``tp``
    (and sequence parallelism, which splits the sequence over the tp ranks)."""
    config = spec.config
    if not isinstance(config, models.gpt.GPTConfig):
        raise InputError(
            f"engine megatron: model {spec.name} is not a GPT/Llama preset; megatron-core's "
            "GPTModel runs the gpt and llama presets (use --engine torch for others)"
        )
    if config.norm == "layernorm" and not config.bias:
        raise InputError(
            f"engine megatron: model {spec.name}: Megatron's LayerNorm always has a bias; "
            "set bias=true or norm=rmsnorm"
        )
    if sequence_parallel and config.seq_len % tp:
        raise InputError(
            f"engine megatron: --sequence-parallel with tp {tp} splits the sequence, and tp does "
            f"not divide seq_len ({config.seq_len}) of {spec.name}; set seq_len to a multiple"
        )
    for name, value in (
        ("heads", config.heads),
        ("kv_heads", config.num_kv_heads),
        ("ffn_hidden", config.ffn_width),
    ):
        if value % tp:
            raise InputError(
                f"engine megatron: tp {tp} does not divide {name} ({value}) of {spec.name}; "
                f"plan with a tp that divides it"
            )


def transformer_config(
    spec: models.ModelSpec,
    settings: MegatronSettings,
    *,
    dtype: torch.dtype,
    deallocate_pipeline_outputs: bool,
):
    """megatron-core's TransformerConfig for ``spec`` with the export's settings."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_moe(spec, settings)
    config = spec.config
    activation = {"gelu": F.gelu, "swiglu": F.silu, "relu": F.relu}[config.mlp]
    recompute = {}
    if settings.recompute_granularity:
        recompute = dict(
            recompute_granularity=settings.recompute_granularity,
            recompute_method=settings.recompute_method,
            recompute_num_layers=settings.recompute_num_layers,
        )
    split: dict[str, Any] = {}
    if settings.layout is not None:
        split["pipeline_model_parallel_layout"] = settings.layout
    else:
        split["num_layers_in_first_pipeline_stage"] = settings.first_stage_layers
        split["num_layers_in_last_pipeline_stage"] = settings.last_stage_layers
        split["virtual_pipeline_model_parallel_size"] = settings.virtual_stages
    hf = spec.meta.get("megatron", {}).get("transformer", {})  # an hf: model's (megatron_hf)
    return TransformerConfig(
        num_layers=config.layers,
        hidden_size=config.hidden,
        num_attention_heads=config.heads,
        num_query_groups=config.num_kv_heads,
        ffn_hidden_size=config.ffn_width,
        kv_channels=config.hidden // config.heads,
        normalization="RMSNorm" if config.norm == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=config.norm_eps,
        gated_linear_unit=config.mlp == "swiglu",
        activation_func=activation,
        add_bias_linear=config.bias,
        add_qkv_bias=hf.get("add_qkv_bias", config.bias),
        hidden_dropout=config.dropout,
        attention_dropout=config.dropout,
        tensor_model_parallel_size=settings.tp,
        pipeline_model_parallel_size=settings.pp,
        sequence_parallel=settings.sequence_parallel,
        use_cpu_initialization=True,  # (its initialisation also sets the TP attributes that
        # init_weights reads; init_weights then sets every value)
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Megatron-LM's default (--attention-softmax-in-fp32 is off; TransformerConfig's default
        # is on): the local attention's softmax runs in the weights' dtype, as the zoo's does
        attention_softmax_in_fp32=False,
        # Megatron-LM's --bias-swiglu-fusion (on by default): the fused SwiGLU keeps only its
        # input, as the zoo's does (profiling/executors/megatron_cpu.py runs it uncompiled). GeLU
        # stays unfused: the same saved bytes as the fused bias-GeLU, and one backward temporary as
        # a fused GPU kernel, where the uncompiled tanh formula would make six
        bias_activation_fusion=config.mlp == "swiglu",
        deallocate_pipeline_outputs=deallocate_pipeline_outputs,
        # gloo: batched p2p (batch_isend_irecv) pairs same-shaped tensors between two ranks in
        # posting order, and with pp 2 a rank's previous and next stage are one rank, so the
        # interleaved schedule's sends and receives would cross; Megatron's ordered p2p pairs
        # them by rank parity
        batch_p2p_comm=False,
        **split,
        **recompute,
        **moe_config_kwargs(spec, settings.moe),
    )


def sdpa_core_attention():
    """A megatron-core core attention (``DotProductAttention``'s interface) that runs
    ``F.scaled_dot_product_attention``: on a GPU TransformerEngine's flash/fused attention takes
    this place; here torch's CPU flash kernel keeps what CUDA's flash kernel keeps (q, k, v, the
    output and the fp32 log-sum-exp), as the zoo's ``attention="sdpa"`` does."""
    import torch.nn.functional as F
    from megatron.core.transformer.module import MegatronModule

    class SdpaAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, **_):
            super().__init__(config=config)
            self.dropout_p = config.attention_dropout

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, **_):
            """[s, b, heads, d] query and [s, b, groups, d] key/value -> [s, b, heads * d]."""
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=True,
                enable_gqa=k.shape[1] != q.shape[1],
            )
            s, b = query.shape[:2]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SdpaAttention


class TorchNorm:
    """megatron-core's ``WrappedTorchNorm`` (torch's LayerNorm or RMSNorm by
    ``config.normalization``) without its refusal of sequence parallelism: the norm's
    parameters carry ``sequence_parallel = config.sequence_parallel``, so that
    ``finalize_model_grads`` all-reduces their gradients over the tensor-parallel group (as
    Megatron's TransformerEngine and apex norms are marked)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> nn.Module:
        for name in ("layernorm_zero_centered_gamma", "persist_layer_norm"):
            assert not getattr(config, name), f"{name} is not supported by torch norms"
        norm_class = {"LayerNorm": nn.LayerNorm, "RMSNorm": nn.RMSNorm}[config.normalization]
        norm = norm_class(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def block_spec(model_config, config, vp_stage: int):
    """The TransformerBlock spec of one chunk: megatron-core's GPT decoder block spec on the
    local layer spec (the layers Megatron builds on this rank and virtual stage, dense or MoE by
    ``moe_layer_freq``), with :class:`TorchNorm` as every layer's norms and the final norm and,
    for ``attention="sdpa"``, :func:`sdpa_core_attention` as the core attention (Megatron's own
    explicit ``DotProductAttention`` otherwise)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=config.normalization, vp_stage=vp_stage
    )
    for layer_spec in {id(spec): spec for spec in block.layer_specs}.values():
        layer_spec.submodules.input_layernorm = TorchNorm
        layer_spec.submodules.pre_mlp_layernorm = TorchNorm
        if model_config.attention == "sdpa":
            layer_spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention()
    block.layer_norm = TorchNorm
    return block


def build_chunks(spec: models.ModelSpec, config) -> list[nn.Module]:
    """This rank's GPTModel chunks (one per virtual stage it runs), local layer spec with
    :class:`TorchNorm` norms (:func:`block_spec`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    model_config = spec.config
    chunks = []
    for vp_stage in range(config.virtual_pipeline_model_parallel_size or 1):
        chunks.append(
            GPTModel(
                config,
                block_spec(model_config, config, vp_stage),
                # as Megatron-LM builds it: padded to a multiple of 128 tp (the cost model's too)
                vocab_size=padded_vocab_size(
                    model_config.vocab_size, config.tensor_model_parallel_size, "megatron"
                ),
                max_sequence_length=model_config.seq_len,
                pre_process=parallel_state.is_pipeline_first_stage(
                    ignore_virtual=False, vp_stage=vp_stage
                ),
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=vp_stage
                ),
                share_embeddings_and_output_weights=model_config.tied_embeddings,
                position_embedding_type=(
                    "rope" if model_config.positions == "rotary" else "learned_absolute"
                ),
                rotary_base=int(model_config.rope_theta),
                vp_stage=vp_stage,
                **spec.meta.get("megatron", {}).get("gpt_model", {}),
            )
        )
    return chunks


def chunk_layers(chunk: nn.Module, hf_names: dict[str, list[str]] | None = None) -> list[str]:
    """The zoo layer names a GPTModel chunk holds, in order (E, t..., L); with ``hf_names``
    (an hf: model's, :func:`profiling.executors.megatron_hf.hf_layer_names`) the graph's HF
    layers of each."""
    names = ["embed"] if getattr(chunk, "pre_process", False) else []
    names += [f"layers.{layer.layer_number - 1}" for layer in chunk.decoder.layers]
    if getattr(chunk, "post_process", False):
        names.append("head")
    if hf_names is None:
        return names
    return [hf for name in names for hf in hf_names[name]]


_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")


def global_name(chunk: nn.Module, local: str) -> str:
    """A chunk's parameter name in the single-GPU model: local layer i -> its global index, and
    a routed expert's local index on this expert-parallel rank -> its global index (expert j of
    rank r is expert r * E/ep + j, ``MoELayer.local_expert_indices``)."""
    match = _LOCAL_LAYER.match(local)
    if not match:
        return local
    layer = chunk.decoder.layers[int(match.group(1))]
    rest = local[match.end() :]
    expert = _LOCAL_EXPERT.match(rest)
    if expert:
        index = layer.mlp.local_expert_indices[int(expert.group(1))]
        rest = f"mlp.experts.local_experts.{index}.{rest[expert.end() :]}"
    return f"decoder.layers.{layer.layer_number - 1}.{rest}"


def _full_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The single-GPU value of parameter ``name``: norms' weights 1, biases 0, others N(0, 0.02)
    from a generator seeded by ``seed`` and the name."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if re.search(r"(layernorm|norm)\.weight$", name):
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * 0.02


def partition(
    name: str, full: torch.Tensor, param: nn.Parameter, tp: int, tp_rank: int, *, gated: bool
) -> torch.Tensor:
    """This tensor-parallel rank's part of a single-GPU tensor: Megatron's partition of
    ``param`` along ``partition_dim``; a gated MLP's fc1 ([gate; up]; the dense MLP's, every
    expert's and the shared experts') is split per half, so that each rank holds [gate_r; up_r]
    as Megatron's own checkpoint conversion does."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if gated and ".linear_fc1." in name:
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim)[tp_rank], up.chunk(tp, dim)[tp_rank]], dim)
    return full.chunk(tp, dim=dim)[tp_rank]


def full_shape(param: nn.Parameter, tp: int) -> torch.Size:
    """The single-GPU shape of a (tensor-parallel) parameter."""
    shape = list(param.shape)
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return torch.Size(shape)


def init_weights(chunks: list[nn.Module], *, seed: int, tp: int, tp_rank: int, gated: bool):
    """Set every parameter of the chunks from its global name (see the module docstring). A
    tied output layer takes the word embedding's value."""
    with torch.no_grad():
        for chunk in chunks:
            for local, param in chunk.named_parameters():
                name = global_name(chunk, local)
                if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
                    name = "embedding.word_embeddings.weight"
                full = _full_value(name, full_shape(param, tp), seed)
                param.copy_(partition(name, full, param, tp, tp_rank, gated=gated))
