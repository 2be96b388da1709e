"""Model zoo: tiny presets train on CPU, layer paths follow execution, parameter counts match the
closed form of scripts/make_examples.py and published totals, overrides and errors."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import models

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import make_examples  # noqa: E402

TINY = [name for name in models.presets() if name.endswith("-tiny")]
REQUIRED = [
    *("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"),
    *("gpt3-xl", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b"),
    *("llama2-7b", "llama2-13b", "llama2-70b", "bert-base", "bert-large", "t5-base", "t5-11b"),
    *("vit-b16", "vit-h14", "resnet-50", "resnet-152"),
    *("gpt-tiny", "llama-tiny", "bert-tiny", "t5-tiny", "vit-tiny", "resnet-tiny"),
]


def meta_model(name: str, **overrides):
    spec = models.get(name, **overrides)
    with torch.device("meta"):
        return spec, spec.build()


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_presets_complete():
    assert set(REQUIRED) <= set(models.presets())


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward_and_layer_order(name):
    spec = models.get(name)
    torch.manual_seed(0)
    model = spec.build()
    order: list[str] = []
    for path in spec.layers:  # get_submodule raises for a path that is not a real module
        module = model.get_submodule(path)
        module.register_forward_pre_hook(lambda _m, _a, path=path: order.append(path))
    loss = model(*spec.example_inputs(2, None))
    loss.backward()
    assert loss.dim() == 0 and loss.dtype == torch.float32 and math.isfinite(loss.item())
    assert order == spec.layers
    assert all(p.grad is not None for p in model.parameters()), "every parameter is used"


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "bert-tiny", "t5-tiny", "vit-tiny"])
def test_sdpa_matches_explicit_attention(name):
    torch.manual_seed(0)
    explicit = models.get(name).build().eval()
    spec = models.get(name, attention="sdpa")
    fused = spec.build().eval()
    fused.load_state_dict(explicit.state_dict())
    inputs = spec.example_inputs(2, None)
    torch.testing.assert_close(fused(*inputs), explicit(*inputs))


def test_example_inputs_dtypes_and_seq():
    ids, targets = models.get("gpt-tiny").example_inputs(3, 8)
    assert ids.shape == targets.shape == (3, 8) and ids.dtype == torch.int64
    ids, *_ = models.get("t5-tiny").example_inputs(1, None)
    assert ids.shape == (1, 16)
    images, labels = models.get("vit-tiny").example_inputs(2, None)
    assert images.shape == (2, 3, 32, 32) and images.is_floating_point()
    assert labels.dtype == torch.int64
    with pytest.raises(ValueError, match="image_size"):
        models.get("resnet-tiny").example_inputs(1, 128)
    with pytest.raises(ValueError, match="seq_len=64"):
        models.get("gpt-tiny").example_inputs(1, 64)  # past the learned position table
    assert models.get("llama-tiny").example_inputs(1, 64)[0].shape == (1, 64)  # rotary: any length
    with torch.device("meta"):
        assert models.get("gpt3-175b").example_inputs(8, None)[0].device.type == "meta"


@pytest.mark.parametrize(
    "name, overrides",
    [("gpt3-175b", {}), ("gpt3-xl", {}), ("gpt2-small", {"tied_embeddings": False})],
)
def test_gpt_params_equal_closed_form(name, overrides):
    spec, model = meta_model(name, **overrides)
    c = spec.config
    s, h, vocab = c.seq_len, c.hidden, c.vocab_size
    expected = {"embed": vocab * h + s * h, "head": h * vocab + 2 * h}
    expected |= {f"layers.{i}": 12 * h * h + 13 * h for i in range(c.layers)}
    actual = {path: numel(model.get_submodule(path)) for path in spec.layers}
    assert actual == expected
    graph = make_examples.gpt(name, layers=c.layers, s=s, h=h, a=c.heads, vocab=vocab)
    assert [layer.name for layer in graph.layers] == spec.layers
    assert {layer.name: layer.params for layer in graph.layers} == actual
    assert numel(model) == sum(expected.values())


def test_gpt3_175b_shape():
    spec, model = meta_model("gpt3-175b")
    c = spec.config
    assert (c.layers, c.hidden, c.heads, c.seq_len, c.vocab_size) == (96, 12288, 96, 2048, 50257)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert numel(model) == 175_221_817_344


@pytest.mark.parametrize(
    "name, total",
    [
        ("llama2-7b", 6_738_415_616),  # Touvron et al. 2023 / Meta's checkpoint
        ("llama2-13b", 13_015_864_320),
        ("llama2-70b", 68_976_648_192),
        ("gpt2-small", 124_439_808),  # tied embeddings
        ("bert-base", 109_514_298),  # Hugging Face BertForMaskedLM
        ("t5-base", 222_903_552 - 2 * 32 * 12),  # Hugging Face, less the relative position bias
        ("vit-b16", 86_567_656),  # timm vit_base_patch16_224
        ("resnet-50", 25_557_032),  # torchvision
        ("resnet-152", 60_192_808),
    ],
)
def test_published_parameter_counts(name, total):
    assert numel(meta_model(name)[1]) == total


def test_llama2_70b_shape():
    spec, model = meta_model("llama2-70b")
    attn = model.layers[0].attn
    assert (attn.heads, attn.kv_heads, attn.head_dim) == (64, 8, 128)
    assert model.layers[0].attn.qkv.weight.shape == (8192 + 2 * 8 * 128, 8192)
    assert model.layers[0].mlp.fc1.weight.shape == (2 * 28672, 8192)  # fused gate + up
    assert isinstance(model.head.norm, torch.nn.RMSNorm)
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert spec.seq_len == 4096


@pytest.mark.slow
def test_every_preset_builds_on_meta():
    for name in models.presets():
        spec, model = meta_model(name)
        for path in spec.layers:
            model.get_submodule(path)
        assert numel(model) > 0


def test_tied_embeddings_share_one_parameter():
    _, tied = meta_model("gpt2-small")
    assert tied.head.lm_head.weight is tied.embed.tok.weight
    _, untied = meta_model("gpt2-small", tied_embeddings=False)
    assert untied.head.lm_head.weight is not untied.embed.tok.weight
    assert numel(untied) - numel(tied) == 50257 * 768
    _, t5 = meta_model("t5-base")
    shared = t5.encoder.embed.tok.weight
    assert t5.decoder.embed.tok.weight is shared and t5.head.lm_head.weight is shared
    _, bert = meta_model("bert-base")
    assert bert.head.decoder.weight is bert.embed.tok.weight


def test_tied_gradient_flows_to_one_parameter():
    model = models.get("gpt-tiny", tied_embeddings=True).build()
    spec = models.get("gpt-tiny")
    model(*spec.example_inputs(2, None)).backward()
    assert model.embed.tok.weight.grad is model.head.lm_head.weight.grad


def test_overrides():
    spec = models.get("gpt3-175b", layers=4)
    assert spec.config.layers == 4 and spec.config.hidden == 12288
    assert spec.layers == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert models.get("gpt3-175b").config.layers == 96  # presets are not mutated
    spec = models.get("llama2-70b", layers=2, seq_len=8192)
    assert spec.seq_len == 8192 and spec.config.kv_heads == 8
    spec = models.get("resnet-50", blocks=[1, 2])
    assert spec.layers == ["stem", "stages.0.0", "stages.1.0", "stages.1.1", "head"]
    spec = models.get("t5-tiny", decoder_layers=3)
    assert spec.layers[-4:] == ["decoder.layers.0", "decoder.layers.1", "decoder.layers.2", "head"]
    assert models.get("vit-b16", image_size=384).build is not None


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'") as error:
        models.get("gpt5")
    assert all(name in str(error.value) for name in REQUIRED)
    assert "\n" not in str(error.value)


def test_unknown_field_lists_valid_fields():
    with pytest.raises(ValueError, match="num_layers") as error:
        models.get("gpt3-175b", num_layers=4)
    message = str(error.value)
    assert "valid fields:" in message and "layers" in message and "kv_heads" in message
    with pytest.raises(ValueError, match="blocks"):
        models.get("resnet-50", layers=4)


@pytest.mark.parametrize(
    "name, overrides, match",
    [
        ("gpt3-175b", {"hidden": 1000}, r"hidden \(1000\) % heads \(96\)"),
        ("llama2-70b", {"kv_heads": 7}, r"heads \(64\) % kv_heads \(7\)"),
        ("gpt-tiny", {"norm": "batchnorm"}, "layernorm, rmsnorm"),
        ("gpt-tiny", {"layers": 0}, "layers = 0"),
        ("gpt-tiny", {"dropout": 1.5}, "dropout"),
        ("vit-tiny", {"patch_size": 5}, "patch_size"),
        ("resnet-tiny", {"blocks": ()}, "blocks"),
    ],
)
def test_invalid_values(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        models.get(name, **overrides)


def test_t5_decoder_blocks_read_encoder_output():
    spec = models.get("t5-tiny")
    model = spec.build()
    seen: dict[str, torch.Tensor] = {}
    model.encoder.final_norm.register_forward_hook(
        lambda _m, _a, out: seen.__setitem__("memory", out)
    )
    memories = []
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda _m, args: memories.append(args[1]))
    model(*spec.example_inputs(2, None))
    assert len(memories) == 2 and all(m is seen["memory"] for m in memories)


def test_resnet_is_heterogeneous():
    spec, model = meta_model("resnet-50")
    params = {path: numel(model.get_submodule(path)) for path in spec.layers}
    assert params["stages.3.2"] > 10 * params["stages.0.1"]  # parameter-heavy late
    # Activation-heavy early: stage 0 outputs 56x56x256 elements, stage 3 only 7x7x2048.
    with torch.device("meta"):
        x = model.stem(spec.example_inputs(1, None)[0])
        early = model.stages[0](x)
        late = model.stages[3](model.stages[2](model.stages[1](early)))
    assert early.numel() == 8 * late.numel()


def saved_bytes(fn, exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves while running ``fn`` (real tensors)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values())


def test_gpt_block_saves_korthikanti_activations():
    """Explicit attention saves exactly 34sh + 5as^2 bytes per sample (bf16, Korthikanti et al.
    2022 section 4.1), plus two batch-independent or tiny extras: the (s, s) bool causal mask and
    the LayerNorms' per-token mean and rstd (2 norms x 2 x 2 bytes)."""
    s, h, a, b = 64, 128, 4, 3
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = models.get("gpt-tiny", hidden=h, heads=a, seq_len=s, layers=1).build()
        block = model.layers[0]
        x = torch.randn(b, s, h, requires_grad=True)
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        measured = saved_bytes(lambda: block(x), params)
    finally:
        torch.set_default_dtype(previous)
    assert measured == b * (34 * s * h + 5 * a * s * s) + s * s + 8 * b * s


def test_dropout_saves_a_bool_mask():
    from models.common import dropout

    x = torch.ones(1000, dtype=torch.bfloat16, requires_grad=True)
    dtypes = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: dtypes.append(t.dtype) or t, lambda t: t
    ):
        y = dropout(x, 0.25)
    assert dtypes == [torch.bool]
    kept = y[y != 0].float()
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / 0.75), rtol=1e-2, atol=0)
    assert 600 < kept.numel() < 900
    assert dropout(x, 0.25, training=False) is x
