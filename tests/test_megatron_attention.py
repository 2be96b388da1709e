"""Megatron's own explicit attention on ``--runtime megatron`` (solver/costs/megatron_attention.py):
the score buffer and the in-place mask's backward clone, the layer field that sizes them
(``attention_score_bytes``), and its bad input."""

from __future__ import annotations

import json

import pytest

from solver.cli import plan_main
from solver.evaluation import evaluate
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig

SCORES = 3_000
"""attention_score_bytes of the block: bytes per sample of its [heads, s, s] scores."""


def chain(scores: int) -> dict:
    """embed -> block (explicit attention when ``scores`` > 0) -> head, one stage."""
    layers = [
        {"name": "embed", "kind": "embedding", "params": 64, "activation_bytes": 8,
         "output_bytes": 100, "transient_bytes": 10},
        {"name": "block", "kind": "block", "params": 96, "activation_bytes": 5_000,
         "output_bytes": 100, "transient_bytes": 4_000, "attention_score_bytes": scores},
        {"name": "head", "kind": "head", "params": 64, "activation_bytes": 400,
         "output_bytes": 4, "transient_bytes": 50},
    ]  # fmt: skip
    return {"format": "layer-graph", "version": 1, "model": "m", "layers": layers}


def stage(document: dict, runtime: str, *, tp: int = 1, sp: bool = False, split=(3,)):
    config = ParallelConfig(pp=len(split), tp=tp, dp=1, micro_batch=2, num_microbatches=2, sp=sp)
    training = TrainingConfig(
        global_batch=4,
        micro_batch_sizes=(2,),
        runtime=runtime,
        precision="fp32",
        sequence_parallel="on" if sp else "off",
        max_slowdown=None,
    )
    cluster = Cluster(num_gpus=tp * len(split))
    return evaluate(
        graph_from_dict(document), config, list(split), cluster=cluster, training=training
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_adds_the_score_buffer_and_the_mask_backward_clone(tp):
    """trans += ceil(b S / t) (CopySlices' clone) + b O (the output's gradient, 2 x 100) + the
    kept buffer max ceil(b S / t): 2 b S / t + b O per GPU at the block's moment; nothing on the
    torch runtime or without explicit attention."""
    extra = -(-2 * SCORES // tp)
    explicit = stage(chain(SCORES), "megatron", tp=tp).stages[0]
    flash = stage(chain(0), "megatron", tp=tp).stages[0]
    assert explicit.transient_bytes - flash.transient_bytes == 2 * extra + 200
    assert explicit.peak_bytes - flash.peak_bytes == 2 * extra + 200
    torch_explicit = stage(chain(SCORES), "torch", tp=tp).stages[0]
    assert torch_explicit.peak_bytes == stage(chain(0), "torch", tp=tp).stages[0].peak_bytes


def test_the_backward_transient_takes_the_clone_and_the_forward_copy_goes():
    """With ``attention_backward_transient_bytes`` (B): trans = max(b T, b B + b S + b O) where
    the clone is made; the zoo's forward copy (in T) stays an upper bound of Megatron's forward.
    The zoo's batch-independent part of B is not Megatron's: b B whatever it says."""
    flash = stage(chain(0), "megatron").stages[0].transient_bytes
    for backward, expected in ((2_500, 2 * (2_500 + SCORES + 100)), (500, 2 * 4_000)):
        document = chain(SCORES)
        document["layers"][1]["attention_backward_transient_bytes"] = backward
        explicit = stage(document, "megatron").stages[0]
        # the block's moment: its transient + the kept score buffer b S
        assert explicit.transient_bytes == expected + 2 * SCORES
        assert explicit.transient_bytes > flash
        document["layers"][1]["unbatched_attention_backward_transient_bytes"] = backward // 2
        assert stage(document, "megatron").stages[0].transient_bytes == expected + 2 * SCORES


def test_a_stage_without_attention_keeps_no_score_buffer():
    """An embedding-only first stage (Megatron allocates the buffer at an attention's first
    forward): its peak equals the flash model's; beside attention the buffer is charged once,
    at the attention's moment, and a leading layer with the larger transient keeps it."""
    explicit = stage(chain(SCORES), "megatron", split=(1, 2)).stages
    flash = stage(chain(0), "megatron", split=(1, 2)).stages
    assert explicit[0].peak_bytes == flash[0].peak_bytes
    assert explicit[1].peak_bytes - flash[1].peak_bytes == 4 * SCORES + 200
    document = chain(SCORES)
    document["layers"][0]["transient_bytes"] = 20_000  # above the block's moment
    heavy = stage(document, "megatron", split=(1, 2)).stages[0]
    document["layers"][1]["attention_score_bytes"] = 0
    heavy_flash = stage(document, "megatron", split=(1, 2)).stages[0]
    assert heavy.peak_bytes - heavy_flash.peak_bytes == 2 * SCORES


def test_attention_backward_transient_above_the_transient_is_one_line_exit_2(run_cli, tmp_path):
    document = chain(SCORES)
    document["layers"][1]["attention_backward_transient_bytes"] = 4_001
    path = tmp_path / "g.json"
    path.write_text(json.dumps(document))
    before = path.read_text()
    code, _, err = run_cli(plan_main, str(path), "--gpus", "1", "--global-batch", "4")
    assert code == 2, err
    assert "attention_backward_transient_bytes" in err and "transient_bytes (4000)" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert path.read_text() == before


def test_sequence_parallel_shares_the_buffer_with_the_all_gather():
    """One "mpu" buffer: the larger of SP's gathered input and the scores, not both."""
    document = chain(SCORES)
    document["layers"][1]["sp_gathered_bytes"] = 1_000  # b * 1000 < b * S / t
    without = chain(SCORES)
    with_sp = stage(document, "megatron", tp=2, sp=True).stages[0]
    plain = stage(without, "megatron", tp=2, sp=True).stages[0]
    assert with_sp.transient_bytes == plain.transient_bytes


def test_negative_attention_score_bytes_is_one_line_exit_2(run_cli, tmp_path):
    document = chain(-5)
    path = tmp_path / "g.json"
    path.write_text(json.dumps(document))
    before = path.read_text()
    code, _, err = run_cli(plan_main, str(path), "--gpus", "1", "--global-batch", "4")
    assert code == 2, err
    assert "attention_score_bytes" in err and err.count("\n") == 1 and "Traceback" not in err
    assert path.read_text() == before


@pytest.mark.slow
def test_the_profiler_records_explicit_attention_scores_only():
    """gpt-tiny: a block's [heads, s, s] fp32 scores per sample; SDPA (flash) makes none."""
    from profiling.export import export_graph

    overrides = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab_size": 96}
    for attention, expected in (("explicit", 4 * 16 * 16 * 4), ("sdpa", 0)):
        graph = export_graph(
            "gpt-tiny", dtype="fp32", overrides={**overrides, "attention": attention}
        )
        blocks = [layer for layer in graph.layers if layer.name.startswith("layers.")]
        assert [layer.attention_score_bytes for layer in blocks] == [expected] * 2
        for layer in blocks:  # the backward's own peak, where the explicit attention runs
            if expected:
                assert 0 < layer.attention_backward_transient_bytes <= layer.transient_bytes
            else:
                assert layer.attention_backward_transient_bytes is None
        others = [layer for layer in graph.layers if not layer.name.startswith("layers.")]
        assert all(layer.attention_score_bytes == 0 for layer in others)
        assert json.loads(json.dumps(graph.to_dict()))  # the field round-trips
