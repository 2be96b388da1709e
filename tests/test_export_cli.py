"""profiling.export end to end: every tiny preset profiles, loads in the planner and plans; fake
mode equals a real CPU run; HF models build offline from bundled configs; bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import models
from profiling.export import export_graph, main
from profiling.trace.profile import profile_module
from solver import Cluster, TrainingConfig, load_graph, plan
from solver.cli import plan_main
from tests.conftest import ROOT

TINY = [name for name in models.presets() if name.endswith("-tiny")]


@pytest.mark.parametrize("preset", TINY)
def test_tiny_preset_exports_and_plans(preset, tmp_path, capsys):
    out = tmp_path / "graph.json"
    assert main([preset, "--batch", "2", "--out", str(out), "--no-progress"]) == 0
    graph = load_graph(out)
    spec = models.get(preset)
    with torch.device("meta"):
        total = sum(p.numel() for p in spec.build().parameters())
    assert sum(layer.params for layer in graph.layers) == total  # tied weights counted once
    assert graph.meta["batch"] == 2 and graph.meta["preset"] == preset
    result = plan(
        graph,
        Cluster(num_gpus=4, gpus_per_node=2, gpu_memory_bytes=2**30),
        TrainingConfig(global_batch=8),
    )
    # t5-tiny's stages take a few ns, less than their transfers, which the solvers' bound
    # leaves out: the simulated schedule can miss the budget and the plan then says so
    proven = result.solver.status == "OPTIMAL"
    assert proven or any("simulated schedule" in note for note in result.solver.notes)
    assert result.peak_bytes > 0 and result.evaluation.iteration_ns <= result.iteration_budget_ns
    assert plan_main([str(out), "--gpus", "2", "--global-batch", "4", "--quiet"]) == 0


@pytest.mark.slow  # runs every tiny preset for real (test_tiny_preset_exports_and_plans stays)
@pytest.mark.parametrize("preset", TINY)
def test_fake_mode_equals_a_real_cpu_run(preset):
    spec = models.get(preset)
    torch.manual_seed(0)
    module = spec.build()
    inputs = spec.example_inputs(2, None)
    fake = profile_module(module, inputs, spec.layers, mode="fake")
    real = profile_module(module, inputs, spec.layers, mode="real")
    for a, b in zip(fake.layers, real.layers, strict=True):
        assert (a.name, a.params, a.activation_bytes, a.output_bytes) == (
            b.name,
            b.params,
            b.activation_bytes,
            b.output_bytes,
        )
        assert a.tp_activation_bytes == b.tp_activation_bytes
        assert b.fwd_ms is not None and b.bwd_ms is not None  # real runs are timed
    assert fake.edges == real.edges


@pytest.mark.slow
def test_dag_models_come_out_as_dags():
    t5 = export_graph("t5-tiny")
    assert not t5.is_chain
    encoder_out = [e for e in t5.edges if e.src == "encoder.final_norm"]
    assert {e.dst for e in encoder_out} >= {"decoder.layers.0", "decoder.layers.1"}
    assert export_graph("gpt-tiny").is_chain
    # a residual block split into its convolutions: the shortcut is a branch around them
    block = "stages.0.0"
    fine = export_graph(
        "resnet-tiny",
        layers=[
            "stem",
            f"{block}.conv1",
            f"{block}.bn1",
            f"{block}.conv2",
            f"{block}.bn2",
            f"{block}.conv3",
            f"{block}.bn3",
            f"{block}.shortcut",
            "stages.1.0",
            "stages.2.0",
            "stages.3.0",
            "head",
        ],
    )
    assert not fine.is_chain
    pairs = {(e.src, e.dst) for e in fine.edges}
    assert ("stem", f"{block}.shortcut") in pairs and ("stem", f"{block}.conv1") in pairs
    # relu(bn3 + shortcut) is glue run after the shortcut, on its stage (as pipeline() splits
    # it): bn3's output goes to the shortcut's stage, the sum from there to the next block
    assert {(f"{block}.bn3", f"{block}.shortcut"), (f"{block}.shortcut", "stages.1.0")} <= pairs
    assert (f"{block}.bn3", "stages.1.0") not in pairs


def test_gpt_parameters_match_the_closed_form():
    graph = export_graph("gpt3-175b", overrides={"layers": 2}, seq=64)
    h, vocab, s = 12288, 50257, 2048
    block = next(layer for layer in graph.layers if layer.name == "layers.0")
    assert block.params == 12 * h * h + 13 * h
    assert block.tp_params == 12 * h * h + 7 * h
    embed = graph.layers[0]
    assert embed.params == vocab * h + s * h and embed.tp_params == vocab * h
    assert graph.layers[-1].params == h * vocab + 2 * h


@pytest.mark.slow
def test_hf_model_from_bundled_config(tmp_path):
    out = tmp_path / "gpt2.json"
    assert (
        main(["hf:gpt2", "--config-only", "--seq", "64", "--out", str(out), "--no-progress"]) == 0
    )
    graph = load_graph(out)
    assert sum(layer.params for layer in graph.layers) == 124_439_808  # GPT-2 small, tied
    assert [layer.name for layer in graph.layers][:3] == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
    ]
    assert graph.layers[-1].name == "lm_head" and graph.layers[-1].transient_bytes > 0
    block, h = graph.layers[2], 768
    assert block.tp_params == 12 * h * h + 7 * h  # GPT-2's Conv1D is split like nn.Linear


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["no-such-model"], "unknown model preset 'no-such-model'; valid presets: gpt2-small"),
        (["gpt-tiny", "--set", "layerz=2"], "layerz"),
        (["gpt-tiny", "--layers", "embed,layers.9"], "unknown layer path 'layers.9'"),
        (["hf:nope"], "no such bundled config"),
        (["gpt-tiny", "--seq", "100000"], "seq 100000 > seq_len 16"),
        (["tests.factories:data_dependent_spec"], "--device cpu"),
        (["tests.factories:nothing"], "cannot import nothing from tests.factories"),
        (["models:registry"], "models:registry: registry is a module, not a function"),
        (["models.registry:_PRESETS"], "_PRESETS is dict, not a function"),
        (["models:presets"], "presets() returned list, not a models.ModelSpec"),
        (["json:dumps"], "dumps() cannot be called with the --set fields given"),
        (["gpt-tiny", "--set", "layers=NaN"], "--set 'layers=NaN': not a value"),
        (["gpt-tiny", "--set", "bad"], "write FIELD=VALUE"),
        (["gpt-tiny", "--out", "/no/such/folder/g.json"], "does not exist"),
        (["gpt-tiny", "--batch", "0"], "must be >= 1"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, pattern, run_cli):
    code, _, err = run_cli(main, *argv, "--no-progress")
    assert code == 2
    assert pattern in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_factory_that_fails_under_fake_tensors_runs_with_real_ones(tmp_path):
    out = tmp_path / "g.json"
    assert (
        main(
            [
                "tests.factories:data_dependent_spec",
                "--device",
                "cpu",
                "--batch",
                "2",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    graph = load_graph(out)
    assert [layer.name for layer in graph.layers] == ["first", "second"]
    assert all(layer.fwd_ms is not None for layer in graph.layers)


@pytest.mark.slow
def test_cli_module_entry_point(tmp_path):
    out = tmp_path / "g.json"
    result = subprocess.run(
        [sys.executable, "-m", "profiling.export", "t5-tiny", "--summary", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "TOTAL" in result.stdout and "(DAG)" in result.stdout
    assert json.loads(out.read_text())["format"] == "layer-graph"
