"""HuggingFace ``transformers`` models built from a config, as they are trained (no weights).

``hf:NAME`` finds a config.json (``profiling.hf.config``: a local directory or file, a bundled
config, the HF cache, the Hub), builds the architecture it names with ``transformers`` on the
caller's default device (``meta`` for a fake profile: no memory, no download of weights) and
wraps it so that ``forward(*inputs)`` returns the training loss the model computes itself.

**As trained.** A config.json is written for inference: ``use_cache=True`` makes the training
forward build a KV cache, whose ``torch.cat`` keeps K and V copies alive through the backward
(two K/V-sized tensors per block per sample that no training run has). The model is built as
transformers' ``Trainer`` trains it: ``config.use_cache = args.use_cache`` (``TrainingArguments``
default False; ``Trainer.__init__`` step 11), ``model.train()`` (dropout at the config's rates),
outputs as a ``ModelOutput`` (``return_dict=True``, ``Trainer.compute_loss`` reads
``outputs["loss"]``). No gradient checkpointing: recomputation is the planner's choice. These
settings and the attention implementation are recorded in the graph's
``meta["training_settings"]``; an explicit ``--set use_cache=true`` still wins (and is recorded).

**Which head.** ``architectures[0]`` when the config names a transformers class whose forward
takes ``labels``; otherwise (no ``architectures``, or a base model such as ``BertModel``) the
head is picked from ``model_type`` with transformers' auto mappings, in this order:
encoder-decoder configs -> ``AutoModelForSeq2SeqLM``; encoders (a masked-LM head and not
``is_decoder``) -> ``AutoModelForMaskedLM`` (the pre-training objective; its vocabulary-sized
logits are what a fine-tuning head's memory is not); decoders -> ``AutoModelForCausalLM``;
images -> ``AutoModelForImageClassification``.

**Quiet.** Building a resized config makes transformers log warnings that say nothing about the
profile (a ``bos_token_id`` outside a shrunk vocabulary, an unrecognised ``loss_type``). They are
silenced while the config is found and the model built (``quiet_transformers``); our own errors
are exceptions and pass through.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any

from profiling.guard import short_message
from profiling.hf import vision_text
from profiling.hf._transformers_compat import use_capacity_experts
from profiling.hf.attention import choose_attention
from profiling.hf.checks import check_config
from profiling.hf.config import CONFIG_DIR, bundled_configs, find_config
from solver.errors import InputError, quote

__all__ = ["CONFIG_DIR", "bundled_configs", "hf_spec", "load_config", "quiet_transformers"]


@dataclass(frozen=True)
class _Task:
    kind: str
    """text (causal or masked LM), seq2seq, image or classification (sequence labels)."""
    inputs: tuple[str, ...]
    """Forward argument names of the training call, labels last."""
    output_inputs: tuple[str, ...]
    """Forward argument names when the loss is computed outside (``LossOutside.module``)."""


_TASKS = {
    "text": _Task("text", ("input_ids", "labels"), ("input_ids",)),
    "seq2seq": _Task("seq2seq", ("input_ids", "labels"), ("input_ids", "decoder_input_ids")),
    "image": _Task("image", ("pixel_values", "labels"), ("pixel_values",)),
    "classification": _Task("classification", ("input_ids", "labels"), ("input_ids",)),
    "vision-text": _Task("vision-text", vision_text.TASK_INPUTS, vision_text.TASK_INPUTS[:-1]),
}


def load_config(name: str) -> dict[str, Any]:
    """The config dict of ``hf:NAME`` (``profiling.hf.config.find_config``)."""
    with quiet_transformers():
        return find_config(name).raw


@contextlib.contextmanager
def quiet_transformers():
    """transformers' and huggingface_hub's log records below ERROR and their Python warnings
    dropped for the duration; the previous verbosity comes back afterwards."""
    import huggingface_hub.utils.logging as hub_logging
    import transformers

    levels = transformers.logging.get_verbosity(), hub_logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    hub_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"(transformers|huggingface_hub)(\.|$)")
            yield
    finally:
        transformers.logging.set_verbosity(levels[0])
        hub_logging.set_verbosity(levels[1])


def hf_spec(name: str, overrides: dict[str, Any] | None = None):
    """A models.ModelSpec for the transformers model of ``hf:NAME``, built as trained.

    ``overrides`` are config fields (``--set``); an unknown one is an InputError naming the
    closest field. ``spec.meta`` holds the source, class and training settings for the graph.
    """
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise InputError(
            "hf: models need the transformers package: pip install -e '.[profiling]'"
        ) from None
    overrides = dict(overrides or {})
    with quiet_transformers():
        found = find_config(name)
        config, settings = _training_config(found.raw, overrides, source=found.source)
        model_class, task = _model_class(config, found.raw, source=found.source)
        settings["attn_implementation"] = choose_attention(
            config, model_class, overrides, source=found.source
        )
        image = None
        if task.kind == "vision-text":
            image = vision_text.image_inputs(config, model_class, source=found.source)
    if use_capacity_experts(config, model_class):
        # MoE experts through the static-shape capacity dispatch (fake tensors refuse the
        # data-dependent eager loop): profiling/_transformers_compat.capacity_experts_forward
        settings["experts_implementation"] = "capacity (drop-and-pad, capacity factor 1.0)"
    return _spec(name, found.source, config, settings, model_class, task, image)


def _training_config(raw: dict[str, Any], overrides: dict[str, Any], *, source: str):
    """(transformers config as trained, the training settings recorded in the graph)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise InputError(
            f"{source}: no 'model_type'; a transformers config.json names it, "
            'e.g. "model_type": "llama"'
        )
    if model_type not in CONFIG_MAPPING:
        raise InputError(
            f"{source}: model_type {model_type!r} is unknown to transformers "
            f"{transformers.__version__}; a newer transformers may know it, and models that "
            "need their own code (trust_remote_code) are not built by hf:"
        )
    _check_fields(CONFIG_MAPPING[model_type], raw, overrides, source=source)
    named = raw.get("architectures")
    if named is not None and not (
        isinstance(named, list) and named and all(isinstance(item, str) for item in named)
    ):
        raise InputError(
            f"{source}: architectures: {quote(named, 40)} is not a list of class names; write "
            'e.g. "architectures": ["GPT2LMHeadModel"], or remove it to build from model_type'
        )
    check_config(CONFIG_MAPPING[model_type], raw, overrides, source=source)
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    fields["use_cache"] = False
    fields["return_dict"] = True
    # the attention implementation is chosen once the class is known (profiling/hf/attention.py)
    fields.update(overrides)
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as error:  # noqa: BLE001 - any of transformers' own checks: one line
        raise InputError(
            f"{source}: transformers rejects the config: {type(error).__name__}: "
            f"{short_message(error)}"
        ) from None
    settings = {
        "use_cache": bool(getattr(config, "use_cache", False)),  # ViT has no cache at all
        "return_dict": bool(config.return_dict),
        "attn_implementation": fields.get("attn_implementation"),
        "train_mode": True,
        "gradient_checkpointing": False,
        "set_by_user": sorted(
            key for key in ("use_cache", "return_dict", "attn_implementation") if key in overrides
        ),
    }
    return config, settings


_EXTRA_FIELDS = {"attn_implementation", "experts_implementation", "dtype", "torch_dtype"}
"""Config arguments that are not attributes of a default config."""


def _check_fields(config_class, raw: dict[str, Any], overrides: dict[str, Any], *, source: str):
    """Each --set field must be one the config knows: its own or an alias, one in config.json,
    or a generation field a model may read from its config (T5's decoder_start_token_id)."""
    from transformers import GenerationConfig

    try:
        default, generation = config_class(), GenerationConfig()
    except (ValueError, TypeError):  # a config without defaults: transformers checks it later
        return
    for key in overrides:
        known = hasattr(default, key) or hasattr(generation, key)
        if known or key in raw or key in _EXTRA_FIELDS:
            continue
        known = sorted({*default.to_dict(), *config_class.attribute_map})
        close = difflib.get_close_matches(key, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise InputError(
            f"{source}: --set {key}: {config_class.__name__} has no field {key!r}{hint}"
        )


def _model_class(config, raw: dict[str, Any], *, source: str):
    """(the transformers class to build, its task) by the rules in the module docstring."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    named = raw.get("architectures") or []
    if named:
        model_class = getattr(transformers, str(named[0]), None)
        if model_class is None:
            raise InputError(
                f"{source}: architectures names {named[0]!r}, which transformers "
                f"{transformers.__version__} does not have; remove 'architectures' to build "
                "from model_type"
            )
        if "labels" in inspect.signature(model_class.forward).parameters:
            return model_class, _task_of(model_class, config, source=source)
    model_type = config.model_type
    heads = []
    if getattr(config, "is_encoder_decoder", False):
        heads.append(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    if not getattr(config, "is_decoder", False):
        heads.append(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    heads += [
        auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
        getattr(auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {}),  # LLaVA, Qwen2-VL
    ]
    for mapping in heads:
        class_name = mapping.get(model_type)
        if isinstance(class_name, str) and hasattr(transformers, class_name):
            model_class = getattr(transformers, class_name)
            return model_class, _task_of(model_class, config, source=source)
    raise InputError(
        f"{source}: transformers has no causal-LM, seq2seq, masked-LM, image-classification or "
        f"image-text-to-text head for model_type {model_type!r}; name one in 'architectures'"
    )


def _task_of(model_class, config, *, source: str) -> _Task:
    name = model_class.__name__
    if name.endswith("ForImageClassification"):
        task = _TASKS["image"]
    elif name.endswith("ForSequenceClassification"):
        task = _TASKS["classification"]
    elif vision_text.is_vision_text(config, model_class):
        task = _TASKS["vision-text"]
    elif getattr(config, "is_encoder_decoder", False):
        task = _TASKS["seq2seq"]
    else:
        task = _TASKS["text"]
    if task.kind == "seq2seq" and getattr(config, "decoder_start_token_id", None) is None:
        raise InputError(
            f"{source}: no decoder_start_token_id; {name} starts the decoder inputs (the labels "
            "shifted right) with it: add it to config.json or --set decoder_start_token_id=0 "
            "(T5's, its pad id)"
        )
    accepted = inspect.signature(model_class.forward).parameters
    missing = [arg for arg in task.inputs if arg not in accepted]
    if missing:
        raise InputError(
            f"{source}: {name}.forward takes no {', '.join(missing)}; hf: trains text, "
            "seq2seq and image-classification models"
        )
    return task


def _spec(name: str, source: str, config, settings: dict, model_class, task: _Task, image=None):
    import torch

    from models.registry import ModelSpec
    from profiling.hf.loss import loss_outside_of

    def forward(self, *inputs):
        """forward(*inputs) -> the loss the model computes itself."""
        arguments = dict(zip(task.inputs, inputs, strict=True))
        return model_class.forward(self, **arguments).loss

    # same class name: transformers picks the loss function from it (e.g. ForCausalLMLoss)
    TrainingLoss = type(model_class.__name__, (model_class,), {"forward": forward})

    def build():
        """The model in training mode on the current default device."""
        with quiet_transformers():
            model = TrainingLoss(config)
        if task.kind == "text" and model.loss_type is None and _calls_loss_function(model_class):
            # GPT2LMHeadModel's name matches no loss: transformers warns at every forward and
            # falls back to ForCausalLM. Naming that same loss here keeps the forward quiet.
            model.loss_type = "ForCausalLM"
        return model.train()

    def example_inputs(batch: int, seq: int | None):
        """The training call's arguments, made as real CPU tensors (the profiler turns them
        into fake ones); ValueError when they would hold over MAX_INPUT_ELEMENTS."""
        seq = seq or default_seq(config)[0]
        if task.kind == "image":
            size = config.image_size
            height, width = (size, size) if isinstance(size, int) else tuple(size)
            _check_input_size((batch, config.num_channels, height, width), "pixel_values")
            return (
                torch.randn(batch, config.num_channels, height, width),
                torch.randint(config.num_labels, (batch,)),
            )
        _check_input_size((batch, seq), "input_ids")
        if image is not None:  # a vision-language model: one image per sample
            _check_input_size((batch, *image.pixel_shape), "pixel_values")
            return vision_text.example_inputs(image, batch, seq)
        ids = torch.randint(config.vocab_size, (batch, seq))
        if task.kind == "classification":
            return ids, torch.randint(config.num_labels, (batch,))
        if task.kind == "seq2seq":
            return ids, torch.randint(config.vocab_size, (batch, seq))
        return ids, ids.clone()

    return ModelSpec(
        name=f"hf:{name}",
        config=config,
        build=build,
        example_inputs=example_inputs,
        layers=None,
        seq_len=None if task.kind == "image" else default_seq(config)[0],
        loss_outside=loss_outside_of(model_class, task.kind, task.output_inputs, config),
        meta={
            **({} if task.kind == "image" else {"seq_len_source": default_seq(config)[1]}),
            "hf_source": source,
            "hf_class": model_class.__name__,
            "training_settings": settings,
        },
    )


MAX_INPUT_ELEMENTS = 2**28
"""Most elements of one example input (made in memory, 1-2 GiB): 2^28 tokens is 64 x 4M."""


def _check_input_size(shape: tuple[int, ...], what: str) -> None:
    elements = math.prod(shape)
    if elements > MAX_INPUT_ELEMENTS:
        raise ValueError(
            f"the example {what} of shape {tuple(shape)} holds {elements:,} elements, over "
            f"{MAX_INPUT_ELEMENTS:,} (2^28; made in memory before profiling): give a smaller "
            "--batch, --seq or image_size"
        )


def _calls_loss_function(model_class) -> bool:
    """Whether ``model_class.forward`` computes its loss with ``self.loss_function``."""
    return "loss_function" in inspect.unwrap(model_class.forward).__code__.co_names


DEFAULT_SEQ_CAP = 2048
"""Most tokens profiled without ``--seq`` (the model's context length when shorter)."""


def default_seq(config) -> tuple[int, str]:
    """(tokens profiled without ``--seq``, where the number comes from): the model's context
    length capped at :data:`DEFAULT_SEQ_CAP`, 512 when the config gives none."""
    text = config.get_text_config()  # a vision-language model's language model
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(text, key, None)
        if value:
            return min(value, DEFAULT_SEQ_CAP), f"min({key} {value}, {DEFAULT_SEQ_CAP})"
    return 512, "the config gives no max_position_embeddings or n_positions"
