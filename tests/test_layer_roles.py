"""Layer roles of profiled models and the engine exports built on them: every HF and zoo model's
Megatron ``--num-layers`` is its transformer blocks, torchtitan's module names are modules the
model has, and a pinned Megatron-LM release's own argument code builds exactly the plan
(``scripts/check_megatron_args.py``; skipped without a Megatron-LM checkout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from solver.exports import build_exports
from solver.specs import ParallelConfig

pytest.importorskip("transformers", reason="hf: models need transformers")

from profiling.export import export_graph, resolve_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _two_stages(graph) -> list[list[str]]:
    half = len(graph.names) // 2
    return [graph.names[:half], graph.names[half:]]


def _exports(graph, **overrides):
    values = {"pp": 2, "tp": 2, "dp": 1, "micro_batch": 1, "num_microbatches": 4, "sp": True}
    return build_exports(graph, ParallelConfig(**(values | overrides)), _two_stages(graph))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "blocks", "embeddings", "heads", "titan"),
    [
        ("hf:llama-2-7b", 32, ["model.embed_tokens"], ["model.norm", "lm_head"], "llama3"),
        (
            "hf:gpt2",
            12,
            ["transformer.wte", "transformer.wpe"],
            ["transformer.ln_f", "lm_head"],
            None,
        ),
        ("hf:qwen1.5-moe-a2.7b", 24, ["model.embed_tokens"], ["model.norm", "lm_head"], None),
        ("gpt3-xl", 24, ["embed"], ["head"], None),
        ("llama2-7b", 32, ["embed"], ["head"], "llama3"),
    ],
)
def test_roles_and_exports_name_the_models_blocks(name, blocks, embeddings, heads, titan):
    """The profiler's kinds: the model's blocks, what comes before (embedding) and after (head,
    the final norm included); Megatron's --num-layers is the block count; torchtitan names only
    modules of its model, or none where it has no model; every graph layer is a module of the
    model (what torch pipelining's split_spec names)."""
    graph = export_graph(name, seq=64)
    kinds = [layer.kind for layer in graph.layers]
    assert kinds.count("block") == blocks and "other" not in kinds
    assert [x.name for x in graph.layers if x.kind == "embedding"] == embeddings
    assert [x.name for x in graph.layers if x.kind == "head"] == heads
    exports = _exports(graph)
    megatron = exports["megatron"]
    assert megatron["num_layers"] == blocks == sum(megatron["blocks_per_stage"])
    torchtitan = exports["torchtitan"]
    assert torchtitan["model"]["0.2"] == titan
    parts = torchtitan["parallelism"].get("module_fqns_per_model_part")
    if titan is None:
        assert parts is None
    else:
        modules = {"tok_embeddings", "norm", "output", *(f"layers.{i}" for i in range(blocks))}
        assert {fqn for part in parts for fqn in part} == modules
    import torch

    with torch.device("meta"):
        module_names = dict(resolve_spec(name, {}).build().named_modules())
    assert set(graph.names) <= set(module_names)


@pytest.mark.slow
def test_encoder_decoder_parts_are_other_and_megatron_says_so():
    """T5: the encoder's final norm and the decoder's embedding lie between the two block
    stacks (kind other); the Megatron export, whose arguments are pretrain_gpt.py's, refuses
    the encoder-decoder (and, for a graph without its HF class, says its GPT layout cannot
    hold the parts between the stacks)."""
    graph = export_graph("hf:t5-base", seq=64, overrides={"num_layers": 2, "num_decoder_layers": 2})
    kinds = {layer.name: layer.kind for layer in graph.layers}
    assert kinds["encoder.final_layer_norm"] == "other" == kinds["decoder.embed_tokens"]
    assert kinds["decoder.final_layer_norm"] == "head" == kinds["lm_head"]
    megatron = _exports(graph, tp=1, sp=False)["megatron"]
    assert "args" not in megatron and "not a decoder-only" in megatron["refused"]
    del graph.meta["hf_class"]
    megatron = _exports(graph, tp=1, sp=False)["megatron"]
    assert megatron["num_layers"] == 4
    assert any(
        w.startswith("layout:") and "encoder.final_layer_norm" in w for w in megatron["warnings"]
    )


@pytest.mark.slow
def test_moe_widths_and_shared_experts_reach_megatron():
    """Qwen1.5-MoE-A2.7B: experts 1408 wide, one shared MLP of 5632 (4 x 1408), every block MoE."""
    graph = export_graph("hf:qwen1.5-moe-a2.7b", seq=64, overrides={"num_hidden_layers": 2})
    moe = graph.meta["moe"]
    assert (moe["expert_ffn_hidden"], moe["shared_expert_ffn_hidden"]) == (1408, 5632)
    args = _exports(graph, tp=1, sp=False, dp=2, ep=2)["megatron"]["args"]
    assert args[args.index("--moe-shared-expert-intermediate-size") + 1] == "5632"
    assert args[args.index("--moe-ffn-hidden-size") + 1] == "1408"
    assert "--moe-layer-freq" not in args


MEGATRON_GIT = os.environ.get("MEGATRON_LM_GIT")
"""A Megatron-LM git directory (e.g. a clone's .git); the check runs its core_v0.16.1 tag, or
MEGATRON_LM_REF."""


@pytest.mark.slow
@pytest.mark.skipif(
    not MEGATRON_GIT,
    reason="set MEGATRON_LM_GIT to a Megatron-LM git directory to run its parse_args/"
    "validate_args on exported plans (scripts/check_megatron_args.py)",
)
def test_megatron_lm_builds_exactly_the_plan(tmp_path):
    """Megatron-LM's own parse_args, validate_args, TransformerConfig and
    get_num_layers_to_build accept every exported plan of three graphs and build the plan."""
    ref = os.environ.get("MEGATRON_LM_REF", "core_v0.16.1")
    command = [sys.executable, "scripts/check_megatron_args.py", "--quick", "--seq", "512"]
    command += ["--megatron-git", MEGATRON_GIT, "--ref", ref, "--out", str(tmp_path)]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    report = (tmp_path / "megatron_args.md").read_text()
    assert done.returncode == 0, report + done.stderr[-2000:]
    assert "12 of 12 plans build exactly the plan." in report


@pytest.mark.slow
def test_inexact_recompute_says_the_realised_peaks():
    """GPT-3 XL, pp 4 x tp 2, selective: the planner recomputes 4, 6, 5, 4 blocks; Megatron's
    block method runs N = 6 on every stage (5, 6, 6, 5 of its blocks), and the export gives
    each stage's peak under those flags, never above the plan's."""
    from solver import Cluster, TrainingConfig, plan

    graph = export_graph("gpt3-xl")
    training = TrainingConfig(
        global_batch=8, micro_batch_sizes=(1,), recompute="selective", pp=4, tp=2, dp=1
    )
    result = plan(graph, Cluster(num_gpus=8, gpu_memory_bytes=2**40), training, time_limit_s=30)
    record = result.exports["megatron"]["recompute"]
    assert record["exact"] is False and record["method"] == "block"
    exported = [len(names) for names in record["exported_per_stage"]]
    planned = [len(names) for names in record["planned_per_stage"]]
    assert all(e >= p for e, p in zip(exported, planned, strict=True)) and exported != planned
    realised = record["realised_peak_bytes"]
    assert all(r <= s.peak_bytes for r, s in zip(realised, result.stages, strict=True))
