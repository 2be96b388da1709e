"""Model zoo: plain PyTorch definitions buildable at any size, and named presets.

    import models, torch
    spec = models.get("llama2-70b")            # or models.get("gpt3-175b", layers=4)
    with torch.device("meta"):
        model = spec.build()                   # seconds, no memory
    loss = model(*spec.example_inputs(1, None))

Families: ``gpt`` (GPT-2/3 and Llama-style decoders), ``bert``, ``t5`` (encoder-decoder DAG),
``vit``, ``resnet``; shared blocks in ``common`` (its docstring gives the module-name convention
for tensor-parallel roles). ``presets()`` lists the names.
"""

from models.registry import LossOutside, ModelSpec, get, presets

__all__ = ["LossOutside", "ModelSpec", "get", "presets"]
