"""HuggingFace models that megatron-core's ``GPTModel`` expresses, as the megatron engine's
model: ``megatron_hf_spec`` maps an ``hf:NAME`` config onto the zoo's
:class:`models.gpt.GPTConfig` (the settings :mod:`profiling.executors.megatron_model` turns
into a ``TransformerConfig`` and a ``GPTModel``) plus what the zoo config does not carry
(``spec.meta["megatron"]``: Qwen2's q/k/v-only bias, Llama 3's rope scaling, the HF layer
names of each Megatron module and the HF model's parameters per layer).

Families (``model_type``): ``llama``, ``qwen2``, ``mistral`` and ``mixtral``: RMSNorm,
SwiGLU, rotary positions (``rope_theta``), GQA, tied or untied embeddings, Qwen2's q/k/v
bias (``add_qkv_bias``), Mixtral's routed experts (``num_moe_experts``, ``moe_router_topk``;
top-k of the logits then softmax, which is Mixtral's softmax, top-k and renormalisation). Any
other family, and any feature of these that GPTModel does not express (a sliding window shorter
than the sequence, another rope scaling, another activation, biases elsewhere, a head_dim other
than hidden / heads), is one line naming it.

Layers: Megatron's ``embedding`` is the graph's ``model.embed_tokens``, decoder layer i its
``model.layers.i``, and ``decoder.final_layernorm`` with ``output_layer`` (E, t, L) its
``model.norm`` and ``lm_head``. Data: the torch engine's (``spec.example_inputs``: token ids,
and labels equal to them, which the HF loss shifts); the megatron engine shifts the labels
itself and masks the last position (``hf_batch``), so that both losses average the same tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import models
from profiling.architecture import architecture_meta
from solver.errors import InputError
from solver.graph import LayerGraph

FAMILIES = ("llama", "qwen2", "mistral", "mixtral")
"""The HF ``model_type`` values mapped onto GPTModel."""

_NOT_EXPRESSIBLE = {
    "deepseek_v2": "multi-head latent attention (MLA) and shared experts with a dense first layer",
    "deepseek_v3": "multi-head latent attention (MLA) and shared experts with a dense first layer",
    "gemma2": "attention and final-logit soft-capping, and sliding windows on alternate layers",
    "gemma3": "attention soft-capping or QK norms, and sliding windows on alternate layers",
    "gpt_neox": "partial rotary embeddings (rotary_pct) and a parallel residual",
    "gpt2": "Conv1D projections with gelu_new and learned positions in a different layout",
    "phi3": "fused qkv and gate_up projections",
    "olmo2": "QK norms and post-norms",
    "starcoder2": "a sliding window, biases on every linear and a GeLU MLP",
}
"""Why GPTModel (local spec) does not run these families as the graph profiled them."""

MEGATRON_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
ORIGINAL_CONTEXT = 8192
"""megatron-core 0.16's Llama 3 rope scaling (``RotaryEmbedding._apply_scaling``) has these
fixed; only its factor is a setting."""


def _refuse(name: str, what: str) -> InputError:
    return InputError(
        f"engine megatron: {name}: {what}, which megatron-core's GPTModel does not express; "
        "run it with --engine torch"
    )


def _rope_parameters(config) -> dict[str, Any]:
    """The config's rope settings (transformers 5's ``rope_parameters``, which holds
    ``rope_theta`` too, or ``rope_scaling``)."""
    return dict(getattr(config, "rope_parameters", None) or config.rope_scaling or {})


def _rope_scaling(name: str, config) -> dict[str, Any]:
    """GPTModel's rope-scaling arguments for the config's ``rope_scaling`` (none or Llama 3's
    with Megatron's fixed frequencies)."""
    scaling = _rope_parameters(config)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {}
    fixed = {**MEGATRON_ROPE_SCALING, "original_max_position_embeddings": ORIGINAL_CONTEXT}
    if kind != "llama3":
        raise _refuse(name, f"rope_scaling of type {kind} (GPTModel's is Llama 3's)")
    for key, value in fixed.items():
        if scaling.get(key) != value:
            raise _refuse(
                name,
                f"Llama 3 rope_scaling with {key} {scaling.get(key)} (megatron-core fixes it "
                f"at {value:g})",
            )
    return {"rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}


def _check_features(name: str, config, seq: int) -> None:
    """InputError naming the first feature of a Llama-style config GPTModel does not express."""
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    window = getattr(config, "sliding_window", None)
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = None
    problems = (
        (config.hidden_act != "silu", f"hidden_act {config.hidden_act} (GPTModel's SwiGLU: silu)"),
        (head_dim * heads != hidden, f"head_dim {head_dim} x {heads} heads != hidden {hidden}"),
        (getattr(config, "mlp_bias", False), "mlp_bias (biases on the MLP only)"),
        (
            float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0,
            f"attention_dropout {config.attention_dropout} (GPTModel's dropout also drops the "
            "hidden states, which this family does not)",
        ),
        (
            config.model_type != "qwen2" and getattr(config, "attention_bias", False),
            "attention_bias (biases on q, k, v and o)",
        ),
        (
            window is not None and window < seq,
            f"sliding_window {window} shorter than the sequence ({seq}) (megatron-core's "
            "window_size runs on the local spec only in its explicit attention, not in the "
            "flash-semantics attention the graph was profiled with)",
        ),
    )
    for failed, what in problems:
        if failed:
            raise _refuse(name, what)


def _gpt_config(config, seq: int) -> models.gpt.GPTConfig:
    """The zoo config of the Llama-style HF config (dropout 0 as the torch engine's runs)."""
    experts = getattr(config, "num_local_experts", 0) if config.model_type == "mixtral" else 0
    return models.gpt.GPTConfig(
        vocab_size=config.vocab_size,
        seq_len=seq,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        ffn_hidden=config.intermediate_size,
        norm="rmsnorm",
        norm_eps=config.rms_norm_eps,
        mlp="swiglu",
        bias=False,
        qkv_bias=config.model_type == "qwen2",
        positions="rotary",
        rope_theta=float(
            _rope_parameters(config).get("rope_theta")
            or getattr(config, "rope_theta", None)
            or 10000.0
        ),
        dropout=0.0,  # (attention_dropout > 0 is refused: _check_features)
        attention="sdpa",
        tied_embeddings=bool(config.tie_word_embeddings),
        num_experts=experts,
        top_k=config.num_experts_per_tok if experts else 2,
        expert_ffn_hidden=config.intermediate_size if experts else None,
    )


def hf_layer_names(layers: int) -> dict[str, list[str]]:
    """The graph's HF layers of each Megatron module (zoo names ``embed``, ``layers.i``,
    ``head``)."""
    names = {"embed": ["model.embed_tokens"]}
    names.update({f"layers.{i}": [f"model.layers.{i}"] for i in range(layers)})
    names["head"] = ["model.norm", "lm_head"]
    return names


def _layer_params(spec: models.ModelSpec, names: dict[str, list[str]]) -> dict[str, int]:
    """Parameters of each HF layer of the model (built on the meta device), a tied head's
    weight counted once, on the embedding."""
    with torch.device("meta"):
        model = spec.build()
    modules = dict(model.named_modules())
    seen: set[int] = set()
    counts = {}
    for layer in [name for group in names.values() for name in group]:
        params = [p for p in modules[layer].parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        counts[layer] = sum(p.numel() for p in params)
    return counts


def megatron_hf_spec(
    spec: models.ModelSpec, seq: int | None = None, implementation: str = "transformers"
) -> models.ModelSpec:
    """The megatron engine's spec of an ``hf:`` model: its GPTConfig and ``meta["megatron"]``
    (see the module docstring); InputError (one line) for a model GPTModel does not express.
    ``implementation``: whose layers the plan's graph has (:func:`plan_implementation`): HF's
    (the default), or Megatron's own ``embed``, ``layers.i``, ``head`` (a graph of
    ``profiling.export --implementation megatron``), which the chunks are then checked against
    as they are."""
    config = spec.config
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        if kind in _NOT_EXPRESSIBLE:
            raise _refuse(spec.name, f"model_type {kind} has {_NOT_EXPRESSIBLE[kind]}")
        raise InputError(
            f"engine megatron: {spec.name}: model_type {kind} is not mapped onto megatron-core's "
            f"GPTModel (mapped: {', '.join(FAMILIES)}); run it with --engine torch"
        )
    seq = seq or spec.seq_len
    _check_features(spec.name, config, seq)
    names = hf_layer_names(config.num_hidden_layers)
    megatron = {
        "transformer": {"add_qkv_bias": kind == "qwen2"},
        "gpt_model": _rope_scaling(spec.name, config),
        "layer_names": names,
        "layer_params": _layer_params(spec, names),
        "implementation": implementation,
    }
    layers = list(names) if implementation == "megatron" else sum(names.values(), [])
    return models.ModelSpec(
        name=spec.name,
        config=_gpt_config(config, seq),
        build=spec.build,
        example_inputs=spec.example_inputs,
        layers=layers,
        seq_len=seq,
        meta={**spec.meta, "megatron": megatron},
    )


def plan_implementation(layers: list[str]) -> str:
    """Whose layers a plan of an hf: model names: ``megatron`` when they are Megatron's
    (``embed``, ``layers.i``, ``head``: a graph of ``--implementation megatron``), else
    ``transformers``."""
    return (
        "megatron" if layers and layers[0] == "embed" and layers[-1] == "head" else "transformers"
    )


def megatron_profile_spec(spec: models.ModelSpec, seq: int | None = None) -> models.ModelSpec:
    """What ``profiling.export --implementation megatron`` profiles of an ``hf:`` model: the
    zoo's GPT (:mod:`models.gpt`) of the GPTConfig :func:`megatron_hf_spec` maps the config onto,
    whose modules save what megatron-core's local-spec GPTModel saves (one fused QKV output, rope
    tables per layer, the fused SwiGLU's input only, the in-place vocab-parallel cross-entropy,
    Megatron's MoE; validated against megatron-core by the zoo's megatron runs), in Megatron's
    layers E, t, L: ``embed``, ``layers.i``, ``head`` (final norm, output layer and loss). Its
    parameters per layer equal the HF model's (InputError naming the layer otherwise); meta: the
    HF model's (its architecture facts read from the HF config) and ``implementation``. Values
    that change no tensor's size (Llama 3's rope scaling) are not modelled."""
    mapped = megatron_hf_spec(spec, seq)
    config = mapped.config
    layers = models.gpt.layer_paths(config)
    _check_profiled_params(mapped, lambda: models.gpt.GPT(config), layers)
    # a tied output layer is profiled as its own copy (Megatron's at pp > 1, :func:`tie_head`)
    copy = dataclasses.replace(config, tied_embeddings=False)
    return models.ModelSpec(
        name=spec.name,
        config=config,
        build=lambda: models.gpt.GPT(copy),
        example_inputs=lambda batch, seq=None: models.gpt.example_inputs(config, batch, seq),
        layers=layers,
        seq_len=mapped.seq_len,
        meta={**spec.meta, **architecture_meta(spec.config), "implementation": "megatron"},
    )


def tie_head(graph: LayerGraph, config: models.gpt.GPTConfig) -> LayerGraph:
    """The graph of a tied model profiled with its output layer's own copy of the word
    embeddings (:func:`megatron_profile_spec`), with the tie recorded as a tied profile records
    it: the copy's V h elements counted in ``embed`` only (``head.tied_params``, meta
    ``shared_params``), the head's largest parameter its norm's. Its bytes stay the copy's:
    Megatron's last stage (pp > 1) makes the output layer's weight gradient into its own
    gradient buffer, where a shared tensor would keep it beside the embedding's until both are
    summed (+V h x 4 B on the head's transient in the small qwen2). ``graph`` when untied."""
    if not config.tied_embeddings:
        return graph
    elements = config.vocab_size * config.hidden
    layers = []
    for layer in graph.layers:
        if layer.name == "head":
            changes = {"params": layer.params - elements, "tied_params": {"embed": elements}}
            changes |= {"largest_param": config.hidden, "vocab_params": 0}
            if layer.tp_params >= elements:  # the copy was profiled vocabulary-parallel
                changes |= {"tp_params": layer.tp_params - elements, "largest_tp_param": 0}
            changes["backward_grad_moments"] = _own_moments(
                layer.backward_grad_moments,
                changes["params"],
                changes.get("tp_params", layer.tp_params),
            )
            layer = dataclasses.replace(layer, **changes)
        layers.append(layer)
    shared = [
        {"param": "embed.tok.weight", "numel": elements, "counted_in": "embed"}
        | {"shared_with": ["head"]}
    ]
    return dataclasses.replace(graph, layers=layers, meta={**graph.meta, "shared_params": shared})


def _own_moments(moments, params: int, tp_params: int):
    """``backward_grad_moments`` of a head whose copy of the table became a tied copy: each
    point's gradients capped at the head's own parameters (the cost model adds the copy's
    gradient at every point, ``solver.costs.own_grads``)."""
    if moments is None:
        return None
    return [
        (min(made, params), min(split, tp_params, made, params), nbytes)
        for made, split, nbytes in moments
    ]


def _check_profiled_params(mapped: models.ModelSpec, build, layers: list[str]) -> None:
    """InputError unless each zoo layer of ``build()`` has the parameters of the HF layers it
    stands for (a tied head's weight counted once, on the embedding, in both)."""
    megatron = mapped.meta["megatron"]
    names, expected = megatron["layer_names"], megatron["layer_params"]
    with torch.device("meta"):
        model = build()
    modules = dict(model.named_modules())
    seen: set[int] = set()
    for layer in layers:
        params = [p for p in modules[layer].parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        built, graph = sum(p.numel() for p in params), sum(expected[hf] for hf in names[layer])
        if built != graph:
            raise InputError(
                f"--implementation megatron: {mapped.name}: Megatron's {layer} has {built:,} "
                f"parameters, the HF layers {', '.join(names[layer])} {graph:,}: the mapping "
                "onto GPTModel is wrong for this model; export it with --implementation "
                "transformers"
            )


def hf_batch(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, loss mask) for Megatron of an HF batch's token ids: the next token at each
    position, the last position masked (the HF loss shifts its labels and ignores it)."""
    labels = torch.roll(ids, -1, dims=1)
    mask = torch.ones(ids.shape, dtype=torch.float32)
    mask[:, -1] = 0.0
    return labels, mask


def _module_params(chunk, name: str, tp: int, ep: int, vocab: int) -> int:
    """Single-GPU parameters of one Megatron module of a chunk (zoo name), vocabulary rows
    unpadded to ``vocab``, a tied output layer not counted (the HF graph counts it once, on
    the embedding)."""
    from profiling.executors.megatron_model import full_shape

    if name == "embed":
        weight = chunk.embedding.word_embeddings.weight
        return vocab * full_shape(weight, tp)[1]
    if name == "head":
        count = sum(p.numel() for p in chunk.decoder.final_layernorm.parameters())
        if not chunk.share_embeddings_and_output_weights:
            count += vocab * full_shape(chunk.output_layer.weight, tp)[1]
        return count
    index = int(name.split(".")[1])
    layer = next(layer for layer in chunk.decoder.layers if layer.layer_number - 1 == index)
    return sum(
        full_shape(param, tp).numel() * (ep if ".local_experts." in local else 1)
        for local, param in layer.named_parameters()
    )


def check_layer_params(chunks, spec: models.ModelSpec, *, tp: int, ep: int) -> None:
    """InputError unless every Megatron module of the chunks has the parameters of the graph's
    HF layers it stands for (``meta["megatron"]["layer_params"]``)."""
    from profiling.executors.megatron_model import chunk_layers

    megatron = spec.meta["megatron"]
    names, expected = megatron["layer_names"], megatron["layer_params"]
    for chunk in chunks:
        for name in chunk_layers(chunk):
            built = _module_params(chunk, name, tp, ep, spec.config.vocab_size)
            graph = sum(expected[hf] for hf in names[name])
            if built != graph:
                raise InputError(
                    f"engine megatron: {spec.name}: GPTModel's {name} has {built:,} parameters, "
                    f"the HF layers {', '.join(names[name])} {graph:,}: the mapping onto "
                    "GPTModel is wrong for this model; run it with --engine torch"
                )
