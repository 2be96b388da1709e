"""``python -m profiling.export hf:DIR --implementation megatron``: an hf: model profiled as
megatron-core runs it (``profiling.executors.megatron_hf.megatron_profile_spec``), and the one
line ``solver.plan`` / ``solver.evaluate`` print when a graph's implementation is not the
runtime's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from profiling.export import main as export_main
from solver.cli.evaluate import evaluate_main
from solver.cli.plan import plan_main
from tests.hf_small import SEQ, write_config

EXPORT = ["--seq", str(SEQ), "--dtype", "fp32", "--no-progress"]
PLAN = ["--gpus", "2", "--pp", "2", "--global-batch", "8", "--micro-batch", "1", "--zero", "0"]


def _export(run_cli, tmp_path: Path, family: str, *flags: str) -> tuple[int, str, dict]:
    model = f"hf:{write_config(tmp_path, family)}"
    out = tmp_path / f"{family}{'-'.join(flags)}.json"
    code, _, err = run_cli(export_main, model, *EXPORT, *flags, "--out", str(out))
    return code, err, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.slow
def test_megatron_layers_with_transformers_parameters(tmp_path, run_cli):
    code, err, hf = _export(run_cli, tmp_path, "qwen2")
    assert code == 0, err
    code, err, megatron = _export(run_cli, tmp_path, "qwen2", "--implementation", "megatron")
    assert code == 0, err
    names = [layer["name"] for layer in megatron["layers"]]
    assert names == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert megatron["meta"]["implementation"] == "megatron"
    assert hf["meta"]["implementation"] == "transformers"
    assert megatron["meta"]["architecture"] == hf["meta"]["architecture"]
    params = {layer["name"]: layer["params"] for layer in hf["layers"]}
    grouped = {"embed": params["model.embed_tokens"], "head": params["model.norm"]}
    grouped |= {f"layers.{i}": params[f"model.layers.{i}"] for i in range(4)}
    assert {layer["name"]: layer["params"] for layer in megatron["layers"]} == grouped
    # the tie recorded as transformers' profile records it, on Megatron's layers
    head = megatron["layers"][-1]
    assert head["tied_params"] == {"embed": 32768} and head["largest_param"] == 64
    # Megatron's bytes: the in-place cross-entropy (no [s, V] fp32 log-softmax and its
    # gradient) and the output layer's own weight-gradient buffer (no tie accumulation)
    assert head["transient_bytes"] < hf["layers"][-1]["transient_bytes"] / 10
    assert megatron["layers"][0].get("weight_grad_transient_bytes", 0) == 0


def test_a_family_gptmodel_does_not_express_is_one_line(tmp_path, run_cli):
    code, err, graph = _export(run_cli, tmp_path, "gemma2", "--implementation", "megatron")
    assert code == 2 and not graph
    assert err.startswith("error: --implementation megatron: hf:")
    assert err.rstrip().endswith("export it with --implementation transformers"), err
    assert err.count("\n") == 1


def test_a_zoo_preset_has_no_other_implementation(tmp_path, run_cli):
    out = tmp_path / "g.json"
    code, _, err = run_cli(
        export_main, "gpt-tiny", "--implementation", "megatron", "--out", str(out), "--no-progress"
    )
    assert code == 2 and not out.exists()
    assert err == (
        "error: --implementation megatron: gpt-tiny is not an hf: model; only hf: models have "
        "another implementation (zoo presets are profiled as megatron-core runs them)\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "runtime", "warned"),
    [
        ((), "megatron", "transformers"),
        (("--implementation", "megatron"), "torch", "megatron"),
        (("--implementation", "megatron"), "megatron", None),
        ((), "torch", None),
    ],
)
def test_plan_and_evaluate_warn_when_the_runtime_runs_other_modules(
    tmp_path, run_cli, flags, runtime, warned
):
    code, err, graph = _export(run_cli, tmp_path, "qwen2", *flags)
    assert code == 0, err
    path = next(tmp_path.glob("qwen2*.json"))
    plan = tmp_path / "plan.json"
    code, _, err = run_cli(
        plan_main, str(path), *PLAN, "--runtime", runtime, "--precision", "fp32", "--quiet",
        "--json", str(plan),
    )  # fmt: skip
    assert code == 0, err
    wanted = "megatron" if runtime == "megatron" else "transformers"
    line = (
        f"warning: {path} profiles {warned} modules (meta.implementation) and --runtime "
        f"{runtime} runs {wanted} modules, which keep other tensors; re-export with python -m "
        f"profiling.export hf:... --implementation {wanted}\n"
    )
    assert err == (line if warned else "")
    code, _, err = run_cli(evaluate_main, "--plan", str(plan), "--quiet")
    assert code == 0, err
    assert err == (line if warned else "")


@pytest.mark.slow
def test_no_warning_where_megatron_core_cannot_run_the_model(tmp_path, run_cli):
    """gemma2 (soft-capping, no megatron-core profile to re-export to): plans for the megatron
    runtime say nothing about implementations; the graph records why."""
    code, err, graph = _export(run_cli, tmp_path, "gemma2")
    assert code == 0, err
    path = next(tmp_path.glob("gemma2*.json"))
    meta = json.loads(path.read_text())["meta"]
    assert meta["implementation"] == "transformers" and meta["megatron_expressible"] is False
    code, _, err = run_cli(
        plan_main, str(path), *PLAN, "--runtime", "megatron", "--precision", "fp32", "--quiet"
    )
    assert code == 0 and err == ""
