"""Exports for torch pipelining, Megatron-LM and DeepSpeed, on hand-made graphs and the examples."""

from __future__ import annotations

import json
import re

import pytest

from solver.errors import InputError
from solver.exports import build_exports
from solver.graph import LayerGraph, graph_from_dict, load_graph
from solver.specs import ParallelConfig
from tests.conftest import EXAMPLES, GPT_1_3B, T5_DAG, gpt_chain


def config(pp: int, **overrides) -> ParallelConfig:
    values = {"pp": pp, "tp": 2, "dp": 2, "micro_batch": 1, "num_microbatches": 8} | overrides
    return ParallelConfig(**values)


def split(graph: LayerGraph, counts: list[int]) -> list[list[str]]:
    names, stages, start = graph.names, [], 0
    for count in counts:
        stages.append(names[start : start + count])
        start += count
    assert start == len(names)
    return stages


def unroll(layout: str) -> str:
    """Megatron's parse_str_to_list unrolling (commas dropped, (..)*n and x*n expanded)."""
    layout = layout.replace(",", "")
    layout = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
    return re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# --- torch.distributed.pipelining --------------------------------------------------------------


def test_split_points_are_the_first_layer_of_every_later_stage():
    graph = gpt_chain(8)  # embed b0..b7 head: 10 layers
    out = build_exports(graph, config(3), split(graph, [4, 3, 3]))["torch_pipelining"]
    assert out["split_spec"] == {"b3": "BEGINNING", "b6": "BEGINNING"}
    assert out["schedule"] == "Schedule1F1B"
    assert out["n_microbatches"] == 8
    assert out["contiguous"] is True
    assert "SplitPoint.BEGINNING" in out["note"]


def test_gpipe_schedule_and_single_stage():
    graph = gpt_chain(4)
    out = build_exports(graph, config(1, schedule="gpipe", num_microbatches=3), [graph.names])[
        "torch_pipelining"
    ]
    assert out["split_spec"] == {}
    assert out["schedule"] == "ScheduleGPipe"
    assert out["n_microbatches"] == 3


def diamond() -> LayerGraph:
    """a -> b, a -> c, b -> d, c -> d, listed a, b, c, d."""
    layers = [{"name": n, "params": 1, "activation_bytes": 1, "output_bytes": 1} for n in "abcd"]
    edges = [{"src": u, "dst": v, "bytes": 1} for u, v in ("ab", "ac", "bd", "cd")]
    return graph_from_dict(
        {
            "format": "layer-graph",
            "version": 1,
            "model": "diamond",
            "layers": layers,
            "edges": edges,
        }
    )


def test_dag_stage_that_is_not_a_run_of_the_list_order_is_flagged():
    graph = diamond()
    # stage 0 = {a, c} skips b: every edge still goes forward (a->b 0->1, c->d 0->1).
    exports = build_exports(graph, config(2), [["c", "a"], ["d", "b"]])
    torch = exports["torch_pipelining"]
    assert torch["contiguous"] is False
    assert torch["split_spec"] == {"b": "BEGINNING"}  # first of stage 1 in list order
    assert torch["stages"] == [["a", "c"], ["b", "d"]]
    assert "NOT CONTIGUOUS" in torch["note"]
    assert any("Not contiguous" in w for w in exports["deepspeed"]["warnings"])


def test_contiguous_dag_split_is_not_flagged():
    graph = diamond()
    exports = build_exports(graph, config(2), [["a", "b"], ["c", "d"]])
    assert exports["torch_pipelining"]["contiguous"] is True
    assert exports["torch_pipelining"]["split_spec"] == {"c": "BEGINNING"}
    assert not any("Not contiguous" in w for w in exports["deepspeed"]["warnings"])


# --- Megatron-LM -------------------------------------------------------------------------------


def test_layout_letters_follow_layer_roles():
    graph = gpt_chain(8)
    out = build_exports(graph, config(3), split(graph, [4, 3, 3]))["megatron"]
    assert out["layout"] == "Ettt|ttt|ttL"
    assert out["layout"].count("t") == out["num_layers"] == 8
    assert out["blocks_per_stage"] == [3, 3, 2]
    assert unroll(out["layout_compact"]) == out["layout"]
    assert flag(out["args"], "--num-layers") == "8"
    assert flag(out["args"], "--pipeline-model-parallel-size") == "3"
    assert flag(out["args"], "--tensor-model-parallel-size") == "2"
    assert flag(out["args"], "--micro-batch-size") == "1"
    assert flag(out["args"], "--global-batch-size") == str(2 * 1 * 8)


def test_only_last_stage_differs():
    graph = gpt_chain(8)
    out = build_exports(graph, config(3), split(graph, [4, 3, 3]))["megatron"]
    assert (out["decoder_first_pipeline_num_layers"], out["decoder_last_pipeline_num_layers"]) == (
        None,
        2,
    )
    assert out["split_method"] == "first_last"
    assert flag(out["args"], "--decoder-last-pipeline-num-layers") == "2"
    assert "--decoder-first-pipeline-num-layers" not in out["args"]
    assert "--pipeline-model-parallel-layout" not in out["args"]


def test_first_and_last_stages_differ():
    graph = gpt_chain(10)  # blocks per stage 2 | 3 | 3 | 2
    out = build_exports(graph, config(4), split(graph, [3, 3, 3, 3]))["megatron"]
    assert out["blocks_per_stage"] == [2, 3, 3, 2]
    assert out["decoder_first_pipeline_num_layers"] == 2
    assert out["decoder_last_pipeline_num_layers"] == 2
    assert flag(out["args"], "--decoder-first-pipeline-num-layers") == "2"


def test_even_split_needs_no_split_flag():
    graph = gpt_chain(6)
    out = build_exports(graph, config(3), split(graph, [3, 2, 3]))["megatron"]
    assert out["blocks_per_stage"] == [2, 2, 2]
    assert out["split_method"] == "even"
    assert out["decoder_first_pipeline_num_layers"] is None
    assert out["decoder_last_pipeline_num_layers"] is None
    assert not any("pipeline-num-layers" in a or "layout" in a for a in out["args"])


def test_uneven_middle_stages_use_the_layout():
    graph = gpt_chain(9)  # blocks 2 | 3 | 2 | 2
    out = build_exports(graph, config(4), split(graph, [3, 3, 2, 3]))["megatron"]
    assert out["blocks_per_stage"] == [2, 3, 2, 2]
    assert out["decoder_first_pipeline_num_layers"] is None
    assert out["decoder_last_pipeline_num_layers"] is None
    assert out["split_method"] == "layout"
    assert flag(out["args"], "--pipeline-model-parallel-layout") == "Ett|ttt|tt|ttL"


def test_embedding_alone_on_first_stage_needs_the_layout():
    # Megatron rejects --decoder-first-pipeline-num-layers 0 ("must be larger than 0").
    graph = gpt_chain(8)
    out = build_exports(graph, config(3), split(graph, [1, 4, 5]))["megatron"]
    assert out["blocks_per_stage"] == [0, 4, 4]
    assert out["split_method"] == "layout"
    assert out["layout"] == "E|tttt|ttttL"


def test_two_stages_give_the_first_count():
    graph = gpt_chain(8)
    out = build_exports(graph, config(2), split(graph, [4, 6]))["megatron"]
    assert out["blocks_per_stage"] == [3, 5]
    assert out["decoder_first_pipeline_num_layers"] == 3
    assert out["decoder_last_pipeline_num_layers"] is None


def test_other_layers_get_no_letter():
    graph = gpt_chain(4, extra={2: "adapter"})
    out = build_exports(graph, config(2), split(graph, [3, 4]))["megatron"]
    assert out["layout"] == "Ett|ttL"
    assert out["num_layers"] == 4
    assert any("adapter" in w for w in out["warnings"])


@pytest.mark.parametrize(("recompute", "zero"), [("none", 0), ("full", 1)])
def test_recompute_and_distributed_optimizer_flags(recompute, zero):
    graph = gpt_chain(4)
    args = build_exports(graph, config(2, recompute=recompute, zero=zero), split(graph, [3, 3]))[
        "megatron"
    ]["args"]
    assert ("--recompute-granularity" in args) == (recompute == "full")
    if recompute == "full":
        assert flag(args, "--recompute-granularity") == "full"
        assert flag(args, "--recompute-method") == "uniform"
        assert flag(args, "--recompute-num-layers") == "1"
    assert ("--use-distributed-optimizer" in args) == (zero >= 1)


@pytest.mark.parametrize("sp", [False, True])
def test_sequence_parallelism_in_every_export(sp):
    graph = gpt_chain(4)
    exports = build_exports(graph, config(2, sp=sp), split(graph, [3, 3]))
    assert ("--sequence-parallel" in exports["megatron"]["args"]) == sp
    torch = exports["torch_pipelining"]
    assert ("tensor_parallel" in torch) == sp and ("SequenceParallel" in torch["note"]) == sp
    if sp:
        assert torch["tensor_parallel"]["norms"] == "SequenceParallel()"
        assert "Shard(1)" in torch["tensor_parallel"]["row_parallel"]
    assert any("--sequence-parallel" in w for w in exports["deepspeed"]["warnings"]) == sp


# --- DeepSpeed ---------------------------------------------------------------------------------


def test_deepspeed_counts_and_parts():
    graph = gpt_chain(8)
    out = build_exports(graph, config(3), split(graph, [4, 3, 3]))["deepspeed"]
    assert out["layer_counts"] == [4, 3, 3]
    assert sum(out["layer_counts"]) == graph.num_layers
    assert out["parts"] == [0, 4, 7, 10]
    assert out["train_micro_batch_size_per_gpu"] == 1
    assert out["gradient_accumulation_steps"] == 8
    assert out["train_batch_size"] == 16
    assert out["zero_optimization"] == {"stage": 0}
    assert "_partition_layers" in out["partition_method_note"]


@pytest.mark.parametrize(
    ("pp", "zero", "warned"), [(2, 2, True), (2, 3, True), (2, 1, False), (1, 3, False)]
)
def test_deepspeed_warns_about_zero2_with_pipeline(pp, zero, warned):
    graph = gpt_chain(4)
    out = build_exports(
        graph, config(pp, zero=zero, tp=1), split(graph, [3, 3] if pp == 2 else [6])
    )["deepspeed"]
    assert out["zero_optimization"] == {"stage": zero}
    assert any("ZeRO-2 and ZeRO-3" in w for w in out["warnings"]) == warned


# --- input checks and examples -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([["a", "b"], ["c"]], "no stage"),
        ([["a", "b"], ["b", "c", "d"]], "exactly one stage"),
        ([["a", "b", "c", "d"], []], "empty"),
        ([["a", "b", "c", "x"], ["d"]], "unknown layer"),
        ([["a", "b", "c", "d"]], "pp=2"),
        ([["a", "b", "d"], ["c"]], "backwards"),
    ],
)
def test_bad_stages_are_rejected(stages, message):
    with pytest.raises(InputError, match=message):
        build_exports(diamond(), config(2), stages)


def test_exports_are_json_serialisable():
    graph = diamond()
    exports = build_exports(graph, config(2), [["a", "c"], ["b", "d"]])
    assert json.loads(json.dumps(exports)) == exports


def test_examples_load_and_have_the_documented_shape():
    sizes = {}
    for path in sorted(EXAMPLES.glob("*.json")):
        graph = load_graph(path)
        sizes[path.name] = graph.num_layers
        assert graph.meta["profiled_by"].startswith("scripts/make_examples.py")
    assert sizes == {
        "gpt-1.3b.json": 26,
        "gpt3-175b.json": 98,
        "t5-dag.json": 16,
        "resnet-skip-dag.json": 26,
    }
    gpt = load_graph(GPT_1_3B)
    assert gpt.is_chain and not gpt.edges_given
    t5 = load_graph(T5_DAG)
    readers = {e.dst for e in t5.edges if e.src == "enc_final_norm"}
    assert readers == {f"decoder.{i}" for i in range(6)}
    resnet = load_graph(EXAMPLES / "resnet-skip-dag.json")
    assert not resnet.is_chain
    assert {e.src for e in resnet.edges if e.dst == "head"} == {"conv5.2", "conv3.3"}


def test_gpt_example_exports_match_megatron_rules():
    graph = load_graph(GPT_1_3B)
    exports = build_exports(graph, config(4), split(graph, [7, 6, 6, 7]))
    megatron = exports["megatron"]
    assert megatron["blocks_per_stage"] == [6, 6, 6, 6]
    assert megatron["split_method"] == "even" and megatron["warnings"] == []
    assert unroll(megatron["layout_compact"]) == megatron["layout"]


def test_t5_example_is_flagged_for_megatron():
    graph = load_graph(T5_DAG)
    stages = split(graph, [8, 8])
    megatron = build_exports(graph, config(2), stages)["megatron"]
    assert megatron["num_layers"] == 12
    assert any(w.startswith("layout:") and "enc_final_norm" in w for w in megatron["warnings"])
