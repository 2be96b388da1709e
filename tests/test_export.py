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
def test_deepspeed_refuses_zero2_with_pipeline(pp, zero, warned):
    """DeepSpeed's PipelineEngine asserts ZeRO < 2 (solver.engine_rules): its section carries the
    refusal instead of settings; at pp 1 the plain engine runs ZeRO-3."""
    graph = gpt_chain(4)
    out = build_exports(
        graph, config(pp, zero=zero, tp=1), split(graph, [3, 3] if pp == 2 else [6])
    )["deepspeed"]
    if warned:
        assert set(out) == {"refused"} and "ZeRO-2 and ZeRO-3" in out["refused"]
    else:
        assert out["zero_optimization"] == {"stage": zero}


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


# --- Megatron-LM's own rules, re-stated (scripts/check_megatron_args.py runs the real ones) ----


def megatron_builds(args: list[str]) -> list[int]:
    """Transformer layers per (virtual) stage as Megatron-LM core_v0.16.1 assigns them from
    ``args``, raising AssertionError where it refuses: ``TransformerConfig.__post_init__`` (the
    uneven first/last rules, the layout's validate_layer_layout) and ``get_num_layers_to_build``."""
    p = int(flag(args, "--pipeline-model-parallel-size"))
    num_layers = int(flag(args, "--num-layers"))
    layout = flag(args, "--pipeline-model-parallel-layout")
    v = int(flag(args, "--num-virtual-stages-per-pipeline-rank") or 1)
    first = flag(args, "--decoder-first-pipeline-num-layers")
    last = flag(args, "--decoder-last-pipeline-num-layers")
    if layout is not None:
        stages = unroll(layout).split("|")
        assert len(stages) % p == 0
        flat = "".join(stages)
        assert flat[0] == "E" and flat[-1] == "L" and flat.count("E") == flat.count("L") == 1
        assert flat.count("t") == num_layers
        return [stage.count("t") for stage in stages]
    if first is None and last is None:
        assert num_layers % (p * v) == 0
        return [num_layers // (p * v)] * (p * v)
    assert v == 1
    ends = [int(x) for x in (first, last) if x is not None]
    assert all(x > 0 for x in ends)
    middle_stages = p - len(ends)
    middle = num_layers - sum(ends)
    assert bool(middle) == bool(middle_stages), "Mismatch: middle layers and middle stages"
    if middle_stages:
        assert middle % middle_stages == 0, "middle layers must divide over the middle stages"
    each = middle // middle_stages if middle_stages else 0
    counts = [each] * p
    if first is not None:
        counts[0] = int(first)
    if last is not None:
        counts[-1] = int(last)
    return counts


def random_splits(seed: int, count: int):
    """(blocks, pp, v, layer counts per virtual stage) of random contiguous splits of
    embed, b0..b{n-1}, head into p v non-empty stages."""
    import random

    rng = random.Random(seed)
    for _ in range(count):
        p, v = rng.randint(2, 6), rng.choice([1, 1, 2])
        n = rng.randint(p * v, 40)
        cuts = sorted(rng.sample(range(1, n + 2), p * v - 1))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, n + 2], strict=True)]
        yield n, p, v, counts


def test_megatron_builds_exactly_the_planned_blocks_on_random_splits():
    """120 random splits: Megatron's own rules accept every export, --num-layers is the block
    count, and each (virtual) stage builds the plan's blocks; first/last counts add up."""
    methods = set()
    even = [(8, 4, 1, [3, 2, 2, 3]), (8, 2, 2, [3, 2, 2, 3])]  # Megatron's default split
    for n, p, v, counts in [*random_splits(7, 120), *even]:
        graph = gpt_chain(n)
        out = build_exports(graph, config(p, virtual_stages=v), split(graph, counts))["megatron"]
        planned = [sum(name.startswith("b") for name in stage) for stage in split(graph, counts)]
        assert out["num_layers"] == n == int(flag(out["args"], "--num-layers"))
        assert megatron_builds(out["args"]) == planned == out["blocks_per_stage"]
        methods.add(out["split_method"])
        if out["split_method"] == "first_last":
            assert sum(megatron_builds(out["args"])) == n
    assert methods == {"even", "first_last", "layout"}


def test_hf_final_norm_is_not_a_transformer_layer():
    """A HuggingFace Llama graph without kinds (an older export): model.norm is the head's, so
    --num-layers is the 4 blocks and a 2 + 2 split needs no layout."""
    names = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "model.norm"]
    layers = [{"name": n, "params": 1, "activation_bytes": 1, "output_bytes": 1} for n in names]
    layers.append({"name": "lm_head", "params": 1, "activation_bytes": 1, "output_bytes": 1})
    graph = graph_from_dict({"format": "layer-graph", "version": 1, "model": "m", "layers": layers})
    out = build_exports(graph, config(2), split(graph, [3, 4]))["megatron"]
    assert out["num_layers"] == 4 and out["layout"] == "Ett|ttL"
    assert (
        out["split_method"] == "even" and "--decoder-first-pipeline-num-layers" not in out["args"]
    )
    # the norm on another stage than the output layer: said, not silently moved
    apart = build_exports(graph, config(2), split(graph, [6, 1]))["megatron"]
    assert apart["layout"] == "Etttt|L"
    assert any(w.startswith("placement:") and "model.norm" in w for w in apart["warnings"])


@pytest.mark.parametrize(
    ("name", "role"),
    [
        ("model.norm", "head"),
        ("transformer.ln_f", "head"),
        ("gpt_neox.final_layer_norm", "head"),
        ("model.final_layernorm", "head"),
        ("model.layers.3.input_layernorm", "block"),
        ("model.layers.3", "block"),
        ("transformer.wpe", "embedding"),
    ],
)
def test_name_rule_reads_final_norms_as_head(name, role):
    from solver.graph import Layer

    assert Layer(name=name, params=1, activation_bytes=1, output_bytes=1).role == role


@pytest.mark.parametrize(
    ("precision", "flags", "warned"),
    [
        (None, ["--bf16"], False),
        ("bf16-mixed", ["--bf16"], False),
        ("fp16-mixed", ["--fp16"], False),
        ("fp32", [], False),
        ("bf16", ["--bf16"], True),  # Megatron keeps an fp32 master copy: more than planned
    ],
)
def test_precision_flag(precision, flags, warned):
    from solver.precision import bytes_per_param

    graph = gpt_chain(4)
    held = bytes_per_param(precision or "bf16-mixed", "adam", "megatron")
    out = build_exports(
        graph, config(2), split(graph, [3, 3]), precision=precision, bytes_per_param=held
    )["megatron"]
    assert [a for a in out["args"] if a in ("--bf16", "--fp16")] == flags
    assert any(w.startswith("precision:") for w in out["warnings"]) == warned
    assert out["precision"] == (precision or "bf16-mixed")


def test_bytes_per_param_override_is_said():
    graph = gpt_chain(4)
    out = build_exports(graph, config(2), split(graph, [3, 3]), bytes_per_param=(4, 4, 8))
    (warning,) = [w for w in out["megatron"]["warnings"] if w.startswith("precision:")]
    assert "4+4+8" in warning and "2+4+12" in warning


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_distributed_optimizer_only_for_zero_1(zero):
    """ZeRO 1 is Megatron's distributed optimizer; ZeRO 2/3 are Megatron-FSDP at pp 1 (its
    sharding strategy and checkpoint format) and refused with pp > 1 (solver.engine_rules)."""
    graph = gpt_chain(4)
    out = build_exports(graph, config(2, zero=zero), split(graph, [3, 3]))["megatron"]
    if zero >= 2:
        assert "args" not in out and "Megatron-FSDP" in out["refused"]
    else:
        assert ("--use-distributed-optimizer" in out["args"]) == (zero == 1)
        assert out["refused"] is None and "--use-megatron-fsdp" not in out["args"]
    single = build_exports(graph, config(1, zero=zero), [graph.names])["megatron"]
    strategy = {2: "optim_grads", 3: "optim_grads_params"}.get(zero)
    assert single["refused"] is None
    assert ("--use-distributed-optimizer" in single["args"]) == (zero == 1)
    if strategy:
        args = single["args"]
        assert args[args.index("--data-parallel-sharding-strategy") + 1] == strategy
        assert "--use-megatron-fsdp" in args and "fsdp_dtensor" in args


def moe_chain(pattern: list[int], **moe) -> LayerGraph:
    """embed, one block per pattern entry (1: with routed experts), head; meta.moe."""
    layers = [
        {
            "name": "embed",
            "kind": "embedding",
            "params": 10,
            "activation_bytes": 1,
            "output_bytes": 1,
        }
    ]
    for i, routed in enumerate(pattern):
        layers.append(
            {
                "name": f"b{i}",
                "kind": "block",
                "params": 10,
                "activation_bytes": 1,
                "output_bytes": 1,
                "expert_params": 8 * routed,
            }
        )
    layers.append(
        {"name": "head", "kind": "head", "params": 10, "activation_bytes": 1, "output_bytes": 1}
    )
    meta = {"moe": {"num_experts": 4, "top_k": 2, **moe}}
    return graph_from_dict(
        {"format": "layer-graph", "version": 1, "model": "moe", "meta": meta, "layers": layers}
    )


def test_moe_dense_first_blocks_and_shared_experts_are_exported():
    """DeepSeek's first dense blocks and shared experts, from the graph: --moe-layer-freq and
    --moe-shared-expert-intermediate-size, and the experts' width."""
    graph = moe_chain([0, 1, 1, 1], expert_ffn_hidden=1408, shared_expert_ffn_hidden=5632)
    args = build_exports(graph, config(2, tp=1, ep=2), split(graph, [3, 3]))["megatron"]["args"]
    assert flag(args, "--moe-layer-freq") == "([0]*1+[1]*3)"
    assert flag(args, "--moe-shared-expert-intermediate-size") == "5632"
    assert flag(args, "--moe-ffn-hidden-size") == "1408"
    every = moe_chain([1, 1, 1, 1])
    args = build_exports(every, config(2, tp=1, ep=2), split(every, [3, 3]))["megatron"]["args"]
    assert "--moe-layer-freq" not in args and "--moe-shared-expert-intermediate-size" not in args


@pytest.mark.parametrize(
    ("pattern", "text"),
    [
        ([0, 1, 1, 1], "([0]*1+[1]*3)"),
        ([0, 1] * 4, "([0,1]*4)"),
        ([0, 0, 1, 0, 1], "([0]*2+[1]*1+[0]*1+[1]*1)"),
    ],
)
def test_layer_freq_is_what_megatron_evaluates(pattern, text):
    from solver.exports.megatron_flags import layer_freq

    assert layer_freq(pattern) == text
    assert eval(text) == pattern  # Megatron-LM evaluates the expression (_eval_pattern)
