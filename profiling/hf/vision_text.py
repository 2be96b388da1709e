"""Vision-language ``hf:`` models (a config with ``vision_config``), profiled with one image.

A model such as ``LlavaForConditionalGeneration`` trains on images and text: its vision tower
(a ViT of 300M parameters for LLaVA-1.5) encodes ``pixel_values``, a projector maps the patch
features into the language model's embedding space, and they replace the image tokens of
``input_ids``. Profiled text-only, the tower would hold no activations and no FLOPs. Here each
sample gets one dummy image of the vision config's size (``vision_config.image_size``, its
``num_channels``, default 3) and as many image tokens (the config's ``image_token_id`` or
``image_token_index``) at the start of the sequence as the model makes features from that
image, counted by running ``get_image_features`` on the meta device (no memory, no compute):
LLaVA-1.5 at 336 px with 14 px patches makes 576. The labels of the image tokens are -100
(ignored by the loss, as trainers mask them). The tower then runs first in the forward with
its real activations and FLOPs.

A model whose image features need more than such pixels (``image_sizes`` of LLaVA-NeXT's tiles,
``image_grid_thw`` of Qwen2-VL's flattened patches) is refused with one line (InputError).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from profiling.guard import short_message
from solver.errors import InputError

TASK_INPUTS = ("input_ids", "pixel_values", "labels")
"""Forward argument names of a vision-language training call, labels last."""
IGNORE_INDEX = -100
"""The label of an image token: ignored by transformers' cross-entropy."""


@dataclass(frozen=True)
class ImageInputs:
    """What one sample's image looks like to the model."""

    pixel_shape: tuple[int, int, int]
    """(channels, height, width) of ``pixel_values`` per image."""
    image_tokens: int
    """Image tokens the model's ``get_image_features`` makes from one image."""
    image_token_id: int
    vocab_size: int
    """The language model's vocabulary (text tokens are drawn below it)."""


def is_vision_text(config, model_class) -> bool:
    """A config with a ``vision_config`` whose class trains on input_ids, pixel_values, labels."""
    if getattr(config, "vision_config", None) is None:
        return False
    accepted = inspect.signature(model_class.forward).parameters
    return all(name in accepted for name in TASK_INPUTS)


def image_inputs(config, model_class, *, source: str) -> ImageInputs:
    """The image a sample gets (module docstring); InputError when the model needs more."""
    import torch

    vision = config.vision_config
    name = model_class.__name__
    size = getattr(vision, "image_size", None)
    token_id = getattr(config, "image_token_id", None)
    if token_id is None:
        token_id = getattr(config, "image_token_index", None)
    if size is None or token_id is None:
        missing = "vision_config.image_size" if size is None else "image_token_id"
        raise InputError(
            f"{source}: {name}: a vision-language model without {missing} is not supported "
            "(hf: profiles one image of the vision config's size); profile its language model "
            "alone from text_config"
        )
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    pixel_shape = (getattr(vision, "num_channels", 3), height, width)
    try:
        with torch.device("meta"):
            model = model_class(config)
            features = model.get_image_features(pixel_values=torch.zeros(1, *pixel_shape))
    except Exception as error:  # noqa: BLE001 - any of the model's own refusals: one line
        raise InputError(
            f"{source}: {name}: vision-language model not supported: its image features need "
            f"more than pixel_values of vision_config.image_size ({type(error).__name__}: "
            f"{short_message(error)}); profile its language model alone from text_config"
        ) from None
    pooled = getattr(features, "pooler_output", features)
    rows = pooled[0] if isinstance(pooled, list | tuple) else pooled
    tokens = rows.numel() // rows.shape[-1]
    return ImageInputs(
        pixel_shape=pixel_shape,
        image_tokens=int(tokens),
        image_token_id=int(token_id),
        vocab_size=int(config.get_text_config().vocab_size),
    )


def example_inputs(image: ImageInputs, batch: int, seq: int):
    """(input_ids, pixel_values, labels) for ``batch`` samples of ``seq`` tokens each, the first
    ``image.image_tokens`` of them the image's; ValueError when ``seq`` leaves no text."""
    import torch

    if seq <= image.image_tokens:
        raise ValueError(
            f"--seq {seq} holds no text after the {image.image_tokens} image tokens of one "
            f"image; give --seq above {image.image_tokens}"
        )
    ids = torch.randint(image.vocab_size, (batch, seq))
    ids[ids == image.image_token_id] = 0
    ids[:, : image.image_tokens] = image.image_token_id
    labels = ids.clone()
    labels[:, : image.image_tokens] = IGNORE_INDEX
    return ids, torch.randn(batch, *image.pixel_shape), labels
