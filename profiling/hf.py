"""HuggingFace ``transformers`` models built from a bundled config (offline, no weights).

``hf:gpt2`` reads ``profiling/hf_configs/gpt2.json`` (a copy of the hub's config.json), builds the
architecture it names with ``transformers`` on the caller's default device (``meta`` for a fake
profile: no memory, no download) and wraps it so that ``forward(*inputs)`` returns the training
loss that the model computes itself. Any other config.json can be given as
``hf:path/to/config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from solver.errors import InputError

CONFIG_DIR = Path(__file__).with_name("hf_configs")


def bundled_configs() -> list[str]:
    return sorted(path.stem for path in CONFIG_DIR.glob("*.json"))


def load_config(name: str) -> dict[str, Any]:
    """The config dict of ``name`` (a bundled name or a path to a config.json)."""
    path = Path(name) if name.endswith(".json") else CONFIG_DIR / f"{name}.json"
    if not path.exists():
        raise InputError(
            f"hf:{name}: no such bundled config; bundled: "
            f"{', '.join(bundled_configs())} (or give hf:path/to/config.json)"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise InputError(f"{path}: not valid JSON ({error.msg}, line {error.lineno})") from None
    for key in ("model_type", "architectures"):
        if key not in config:
            raise InputError(
                f"{path}: missing {key!r}; a transformers config.json names its "
                "model_type and architectures"
            )
    return config


def hf_spec(name: str, overrides: dict[str, Any] | None = None):
    """A models.ModelSpec for a transformers architecture built from its config."""
    import torch

    from models.registry import ModelSpec

    try:
        import transformers
    except ImportError:
        raise InputError(
            "hf: models need the transformers package: pip install -e '.[profiling]'"
        ) from None
    raw = load_config(name)
    architecture = raw["architectures"][0]
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    # Eager attention stores the softmax output like a GPU run without flash attention; the SDPA
    # default would take PyTorch's CPU math fallback under fake tensors, which keeps extra fp32
    # copies no GPU kernel keeps. --set attn_implementation=sdpa restores the default.
    fields["attn_implementation"] = "eager"
    fields.update(overrides or {})
    try:
        config = transformers.AutoConfig.for_model(raw["model_type"], **fields)
        model_class = getattr(transformers, architecture)
    except (ValueError, AttributeError) as error:
        raise InputError(f"hf:{name}: transformers cannot build {architecture}: {error}") from None
    task = _task(architecture)

    def forward(self, *inputs):
        """forward(*inputs) -> the loss the model computes itself."""
        arguments = dict(zip(task["inputs"], inputs, strict=True))
        return model_class.forward(self, **arguments).loss

    # same class name: transformers picks the loss function from it (e.g. ForCausalLMLoss)
    TrainingLoss = type(architecture, (model_class,), {"forward": forward})

    def example_inputs(batch: int, seq: int | None):
        seq = seq or task["default_seq"](config)
        if task["kind"] == "image":
            size = config.image_size
            return (
                torch.randn(batch, config.num_channels, size, size),
                torch.randint(config.num_labels, (batch,)),
            )
        ids = torch.randint(config.vocab_size, (batch, seq))
        if task["kind"] == "seq2seq":
            return ids, torch.randint(config.vocab_size, (batch, seq))
        return ids, ids.clone()

    return ModelSpec(
        name=f"hf:{name}",
        config=config,
        build=lambda: TrainingLoss(config),
        example_inputs=example_inputs,
        layers=None,
        seq_len=None if task["kind"] == "image" else task["default_seq"](config),
    )


def _task(architecture: str) -> dict[str, Any]:
    """Forward argument names and input kind of an architecture class name."""

    def positions(config):
        for key in ("max_position_embeddings", "n_positions"):
            if getattr(config, key, None):
                return min(getattr(config, key), 2048)
        return 512

    if architecture.endswith("ForImageClassification"):
        return {"kind": "image", "inputs": ("pixel_values", "labels"), "default_seq": positions}
    if architecture.endswith("ForConditionalGeneration"):
        return {"kind": "seq2seq", "inputs": ("input_ids", "labels"), "default_seq": positions}
    return {"kind": "text", "inputs": ("input_ids", "labels"), "default_seq": positions}
