"""Small HF families run on megatron-core (``python -m profiling.validate --engine megatron``,
``profiling/executors/megatron_hf.py``): the families GPTModel expresses are mapped onto it and
measured against a plan made with ``--runtime megatron``; the others are one line, exit 2.

Measured (tests/hf_small.py's MEGATRON_RUNS, exported with ``--implementation megatron``: the
layers megatron-core runs; error % per rank, + = over-predicted): llama pp2 -0.38 / +0.86,
qwen2 tied pp2 -0.38 / +0.86, llama pp2 x tp2 sp vocab 1000 +1.08 x 2 / -0.58 x 2, mixtral pp2
-0.40 / +0.42: median 0.58%, max 1.08%, worst under -0.58%. Profiled from transformers' modules
(the default export) the same runs were median 3.3%, max 4.3% (HF's loss, attention, SwiGLU
and experts save other tensors than Megatron's: benchmarks/bench_accuracy_hf_megatron.md).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from profiling.executors.megatron_hf import megatron_hf_spec
from profiling.export import main as export_main
from profiling.hf.models import hf_spec
from profiling.validate import main as validate_main
from solver.cli.plan import plan_main
from solver.errors import InputError
from tests.hf_small import MEGATRON_RUNS, SEQ, WINDOW, validate_megatron, write_config

pytest.importorskip("megatron.core")

MEDIAN_PCT, MAX_PCT, UNDER_PCT = 1.0, 3.0, 1.0
"""Issue 28's targets: median |error| over the ranks, largest |error|, largest under-prediction."""


def _refusal(tmp_path: Path, family: str, **changes) -> str:
    spec = hf_spec(str(write_config(tmp_path, family, **changes)))
    with pytest.raises(InputError) as error:
        megatron_hf_spec(spec, SEQ)
    return str(error.value).replace(str(tmp_path), "DIR")


@pytest.mark.parametrize(
    ("family", "what"),
    [
        ("deepseek_v2", "model_type deepseek_v2 has multi-head latent attention (MLA)"),
        ("gemma2", "model_type gemma2 has attention and final-logit soft-capping"),
        ("gpt_neox", "model_type gpt_neox has partial rotary embeddings (rotary_pct)"),
    ],
)
def test_a_family_gptmodel_does_not_express_is_one_line(tmp_path, family, what):
    message = _refusal(tmp_path, family)
    assert message.startswith(f"engine megatron: hf:DIR/{family}: {what}"), message
    assert message.endswith("which megatron-core's GPTModel does not express; run it with "
                            "--engine torch")  # fmt: skip
    assert "\n" not in message


def test_a_sliding_window_shorter_than_the_sequence_is_refused(tmp_path):
    message = _refusal(tmp_path, "mistral")
    assert f"sliding_window {WINDOW} shorter than the sequence ({SEQ})" in message, message


def test_attention_dropout_is_refused_as_gptmodel_drops_hidden_states_too(tmp_path):
    message = _refusal(tmp_path, "qwen2", attention_dropout=0.1)
    assert "attention_dropout 0.1 (GPTModel's dropout also drops the hidden states" in message


def test_llama3_rope_scaling_other_than_megatrons_is_refused(tmp_path):
    message = _refusal(tmp_path, "llama")  # original_max_position_embeddings 64
    expected = (
        "Llama 3 rope_scaling with original_max_position_embeddings 64 (megatron-core fixes it "
        "at 8192)"
    )
    assert expected in message, message


def test_mapped_families_take_their_features(tmp_path):
    qwen2 = megatron_hf_spec(hf_spec(str(write_config(tmp_path, "qwen2"))), SEQ)
    assert qwen2.config.tied_embeddings and qwen2.meta["megatron"]["transformer"] == {
        "add_qkv_bias": True
    }
    assert qwen2.layers[0] == "model.embed_tokens" and qwen2.layers[-2:] == [
        "model.norm",
        "lm_head",
    ]
    mixtral = megatron_hf_spec(hf_spec(str(write_config(tmp_path, "mixtral"))), SEQ)
    assert (mixtral.config.num_experts, mixtral.config.top_k) == (4, 2)
    assert mixtral.config.num_kv_heads == 2 and not mixtral.config.tied_embeddings
    window = write_config(tmp_path / "w", "mistral", sliding_window=SEQ)  # not shorter: runs
    assert megatron_hf_spec(hf_spec(str(window)), SEQ).config.attention == "sdpa"


@pytest.mark.slow
def test_the_cli_refuses_an_inexpressible_family_in_one_line(tmp_path, run_cli):
    model = f"hf:{write_config(tmp_path, 'mistral')}"
    graph, plan = str(tmp_path / "g.json"), str(tmp_path / "p.json")
    code, _, err = run_cli(export_main, model, "--seq", str(SEQ), "--out", graph, "--no-progress")
    assert code == 0, err
    code, _, err = run_cli(
        plan_main, graph, "--gpus", "2", "--pp", "2", "--global-batch", "8", "--micro-batch", "1",
        "--zero", "0", "--runtime", "megatron", "--precision", "fp32", "--json", plan,
    )  # fmt: skip
    assert code == 0, err
    code, out, err = run_cli(validate_main, plan, "--model", model, "--engine", "megatron")
    assert code == 2 and out == ""
    assert err.startswith(f"error: engine megatron: {model}: sliding_window {WINDOW} shorter")
    assert err.count("\n") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["g.json", "mistral", "p.json"]


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> dict[str, list[float]]:
    """Each megatron run's per-rank errors (%), every run once for the module (~100 s)."""
    folder = tmp_path_factory.mktemp("hf-megatron")
    return {
        run: [row["error_pct"] for row in validate_megatron(folder, run)] for run in MEGATRON_RUNS
    }


@pytest.mark.slow
@pytest.mark.parametrize("run", list(MEGATRON_RUNS))
def test_no_rank_is_under_predicted_by_more_than_1_percent(errors, run):
    assert errors[run], "no rank reported"
    assert min(errors[run]) >= -UNDER_PCT, errors[run]
    assert max(abs(e) for e in errors[run]) <= MAX_PCT, errors[run]


@pytest.mark.slow
def test_every_rank_within_3_percent_and_median_within_1(errors):
    ranks = [e for run in MEGATRON_RUNS for e in errors[run]]
    assert max(abs(e) for e in ranks) <= MAX_PCT, errors
    assert statistics.median([abs(e) for e in ranks]) <= MEDIAN_PCT, errors
