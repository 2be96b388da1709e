"""hf: models: where the config comes from, built as trained, quiet, and the loss-outside split.

Offline throughout (``tests/conftest.py`` sets ``HF_HUB_OFFLINE=1``): configs come from
``save_pretrained`` directories, a hand-made HF cache and the bundled configs.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from profiling.export import export_graph, main  # noqa: E402
from profiling.hf.models import hf_spec  # noqa: E402
from solver.graph import load_graph  # noqa: E402
from tests.conftest import slow_params  # noqa: E402
from tests.processes import run_export  # noqa: E402

TINY = {
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 96, "n_positions": 32},
    "llama-2-7b": {  # GQA: 4 query heads share 2 K/V heads
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
        "max_position_embeddings": 32,
    },
    "t5-base": {
        "num_layers": 2,
        "num_decoder_layers": 2,
        "d_model": 32,
        "d_ff": 64,
        "d_kv": 8,
        "num_heads": 4,
        "vocab_size": 96,
    },
}
"""Bundled configs shrunk by size overrides only, as a user would (dropout stays on)."""

LOSS_CASES = {
    **TINY,
    "bert-base-uncased": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 96,
        "max_position_embeddings": 32,
    },
    "vit-base-patch16-224": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "image_size": 32,
        "patch_size": 8,
    },
}
"""TINY plus an encoder (BERT's inline cross-entropy) and an image classifier (ViT's
loss_function(labels, logits, config))."""


def _tiny_llama_config():
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def _num_params(config) -> int:
    """Parameters of the model transformers builds from ``config`` (tied ones once)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(param.numel() for param in model.parameters())


# -- where the config comes from ------------------------------------------------------------


@pytest.mark.slow
def test_save_pretrained_directory_exports_offline_and_quietly(tmp_path):
    config = _tiny_llama_config()
    config.save_pretrained(tmp_path / "my-llama")  # writes use_cache: true, no architectures
    done = run_export("hf:./my-llama", "--seq", "16", "--out", "g.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no transformers warning (bos/eos ids, loss_type, ...)
    graph = load_graph(tmp_path / "g.json")
    assert graph.meta["hf_source"] == os.path.join("my-llama", "config.json")
    assert graph.meta["hf_class"] == "LlamaForCausalLM"
    assert graph.meta["training_settings"]["use_cache"] is False
    # embed 128h + 2 x (q, o: h^2; k, v: h^2/2; MLP 3 x 2h^2; 2 norms 2h) + norm h + head 128h
    assert sum(layer.params for layer in graph.layers) == _num_params(config) == 90_432
    assert [layer.name for layer in graph.layers] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]


def _hf_cache(root, repo_id: str, config) -> None:
    """An HF cache as ``hf download`` leaves it: models--ORG--NAME/{refs/main, snapshots/SHA}."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    config.save_pretrained(repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)


@pytest.mark.slow
def test_hub_name_exports_from_the_hf_cache_offline(tmp_path):
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    _hf_cache(tmp_path / "hub", "acme/tiny-gpt2", config)
    done = run_export(
        "hf:acme/tiny-gpt2",
        "--seq",
        "16",
        "--out",
        "g.json",
        cwd=tmp_path,
        HF_HUB_CACHE=str(tmp_path / "hub"),
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    graph = load_graph(tmp_path / "g.json")
    assert graph.meta["hf_source"] == "HF cache acme/tiny-gpt2"
    assert graph.meta["hf_class"] == "GPT2LMHeadModel"
    h = 64  # blocks 12h^2 + 13h, wte 128h (tied with lm_head), wpe 64h, ln_f 2h
    assert sum(layer.params for layer in graph.layers) == _num_params(config) == 112_384
    assert 2 * (12 * h * h + 13 * h) + 128 * h + 64 * h + 2 * h == 112_384


@pytest.mark.parametrize(
    ("model_type", "sizes", "expected"),
    [
        ("gpt2", {"n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 64}, "GPT2LMHeadModel"),
        (
            "bert",
            {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4},
            "BertForMaskedLM",  # an encoder: masked LM, not BertLMHeadModel
        ),
        (
            "t5",
            {"num_layers": 1, "d_model": 32, "d_kv": 8, "num_heads": 4, "d_ff": 64},
            "T5ForConditionalGeneration",
        ),
    ],
)
def test_config_without_architectures_is_built_from_model_type(
    tmp_path, model_type, sizes, expected
):
    raw = {"model_type": model_type, "vocab_size": 64, "decoder_start_token_id": 0, **sizes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec = hf_spec(str(tmp_path / "config.json"))
    assert spec.meta["hf_class"] == expected
    model = spec.build()
    assert type(model).__name__ == expected and model.training
    torch.manual_seed(0)
    loss = model(*spec.example_inputs(2, 8))
    assert loss.ndim == 0 and 3.0 < loss.item() < 5.5  # ln(64) = 4.16 at initialisation


def test_build_and_forward_of_a_shrunk_config_print_nothing(capfd):
    """A vocabulary of 96 puts GPT-2's bos/eos id 50256 outside it and GPT2LMHeadModel names no
    loss_type: transformers warns about both unless hf: keeps it quiet."""
    level = transformers.logging.get_verbosity()
    spec = hf_spec("gpt2", TINY["gpt2"])
    model = spec.build()
    model(*spec.example_inputs(1, 8)).backward()
    assert capfd.readouterr().err == ""
    assert transformers.logging.get_verbosity() == level  # restored after the build


# -- as trained ------------------------------------------------------------------------------


@pytest.mark.slow
def test_gpt2_blocks_lose_the_kv_copies_of_the_cache():
    """With use_cache=True each GPT-2 block keeps K and V a second time: the cache's torch.cat
    copies (K and V alone are views of c_attn's output, saved anyway), saved by the attention
    matmuls. Without it: 2 x seq x hidden x 4 bytes (fp32) less per block and sample."""
    seq, hidden = 16, TINY["gpt2"]["n_embd"]
    trained = export_graph("hf:gpt2", seq=seq, dtype="fp32", overrides=TINY["gpt2"])
    cached = export_graph(
        "hf:gpt2", seq=seq, dtype="fp32", overrides={**TINY["gpt2"], "use_cache": True}
    )
    settings = trained.meta["training_settings"]
    assert settings["use_cache"] is False and settings["set_by_user"] == []
    assert settings["train_mode"] is True and settings["return_dict"] is True
    assert cached.meta["training_settings"]["use_cache"] is True
    assert cached.meta["training_settings"]["set_by_user"] == ["use_cache"]
    assert trained.names == cached.names
    extra = {
        a.name: b.activation_bytes - a.activation_bytes
        for a, b in zip(trained.layers, cached.layers, strict=True)
    }
    assert extra == {
        "transformer.wte": 0,
        "transformer.wpe": 0,
        "transformer.h.0": 2 * seq * hidden * 4,  # 4,096 bytes
        "transformer.h.1": 2 * seq * hidden * 4,
        "transformer.ln_f": 0,
        "lm_head": 0,
    }


@pytest.mark.parametrize("name", slow_params(sorted(TINY), "t5-base"))
def test_size_overrides_build_no_kv_cache(name, monkeypatch):
    """No DynamicCache is made in the profiled forward (Llama with GQA under eager attention
    saves repeat_kv's copies of K/V either way, so its bytes alone would not show a cache)."""
    import transformers.cache_utils

    made = []
    init = transformers.cache_utils.DynamicCache.__init__

    def counting_init(self, *args, **kwargs):
        made.append(type(self).__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(transformers.cache_utils.DynamicCache, "__init__", counting_init)
    graph = export_graph(f"hf:{name}", seq=16, dtype="fp32", overrides=TINY[name])
    assert graph.meta["training_settings"]["use_cache"] is False
    assert made == []
    export_graph(f"hf:{name}", seq=16, dtype="fp32", overrides={**TINY[name], "use_cache": True})
    assert made  # the spy sees the cache when asked for one


# -- bad input -------------------------------------------------------------------------------


def _bad_inputs(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.json").write_text('{"model_type": "gpt2",\n')
    (tmp_path / "alien.json").write_text('{"model_type": "no-such-arch"}')
    (tmp_path / "typeless.json").write_text('{"vocab_size": 10}')
    return [
        (["hf:acme/not-cached"], ["not in the HF cache", "HF_HUB_OFFLINE=1"]),
        ([f"hf:{tmp_path / 'empty'}"], ["has no config.json", "save_pretrained"]),
        ([f"hf:{tmp_path / 'broken.json'}"], ["not valid JSON", "line 2"]),
        ([f"hf:{tmp_path / 'alien.json'}"], ["model_type 'no-such-arch' is unknown"]),
        ([f"hf:{tmp_path / 'typeless.json'}"], ["no 'model_type'"]),
        ([f"hf:{tmp_path / 'nowhere.json'}"], ["no such file or directory"]),
        (["hf:gpt2", "--set", "n_layr=2"], ["no field 'n_layr'; did you mean n_layer"]),
    ]


def test_bad_input_is_one_line_exit_2(tmp_path, run_cli):
    for argv, patterns in _bad_inputs(tmp_path):
        code, _, err = run_cli(main, *argv, "--no-progress")
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err, err
        for pattern in patterns:
            assert pattern in err, (argv, err)


def test_unknown_hub_name_offline_names_the_cache(tmp_path, monkeypatch, run_cli):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, _, err = run_cli(main, "hf:acme/nothing", "--no-progress")
    assert code == 2
    assert f"not in the HF cache {tmp_path / 'hub'} (HF_HUB_OFFLINE=1: no download)" in err


# -- the loss outside the model (torch.distributed.pipelining's loss_fn) ---------------------


@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_loss_outside_equals_the_training_forward(name):
    spec = hf_spec(name, LOSS_CASES[name])
    torch.manual_seed(0)
    model = spec.build()  # dropout on (train mode): both runs draw the same masks
    example = spec.example_inputs(2, None if name.startswith("vit") else 16)

    torch.manual_seed(1)
    inside = model(*example)
    inside.backward()
    grads = {path: param.grad.clone() for path, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    split = spec.loss_outside(model)
    assert [path for path, _ in split.module.named_parameters()] == list(grads)
    assert all(a is b for a, b in zip(split.module.parameters(), model.parameters(), strict=True))
    torch.manual_seed(1)
    output = split.module(*split.model_inputs(example))
    image = name.startswith("vit")
    assert output.shape == ((2, spec.config.num_labels) if image else (2, 16, 96))  # logits
    outside = split.loss_fn(output, split.target(example))
    outside.backward()

    assert torch.equal(outside, inside)  # bitwise: the same ops on the same tensors
    for path, param in model.named_parameters():
        assert torch.equal(param.grad, grads[path]), path
    assert type(model).forward is not type(split.module).forward  # the model is unchanged
