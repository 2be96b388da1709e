"""The torchtitan export (solver.exports.torchtitan): degrees, the FSDP2 mapping of ZeRO, the
per-stage module names, batches, activation checkpointing, and the TOML and CLI forms checked
against torchtitan's own config fields.

torchtitan does not install in the test environment (0.2.2 imports triton at package import,
0.3.0 needs tyro and a newer config layout), so the TOML is parsed with tomllib and every key is
checked against the fields of the dataclasses read from the wheels: torchtitan 0.2.2
``torchtitan/config/job_config.py`` (``Parallelism``, ``Training``, ``ActivationCheckpoint``)
and 0.3.0 ``torchtitan/config/configs.py`` (``ParallelismConfig``, ``TrainingConfig``,
``CompileConfig``). Where torchtitan imports, the TOML also goes through its ``ConfigManager``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from solver.exports import build_exports
from solver.graph import load_graph
from solver.specs import ParallelConfig

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # 3.10: tomli, where installed
    tomllib = pytest.importorskip("tomli")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# torchtitan 0.2.2, torchtitan/config/job_config.py (the last release with TOML job files)
FIELDS_0_2 = {
    "parallelism": {
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
        "fsdp_reshard_after_forward",
        "tensor_parallel_degree",
        "disable_loss_parallel",
        "enable_async_tensor_parallel",
        "pipeline_parallel_degree",
        "module_fqns_per_model_part",
        "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_microbatch_size",
        "pipeline_parallel_expert_parallel_overlap",
        "context_parallel_degree",
        "context_parallel_load_balancer",
        "context_parallel_rotate_method",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
        "expert_parallel_comm_backend",
    },
    "training": {
        "dataset",
        "dataset_path",
        "local_batch_size",
        "global_batch_size",
        "seq_len",
        "max_norm",
        "steps",
        "enable_cpu_offload",
        "dtype",
        "mixed_precision_param",
        "mixed_precision_reduce",
        "gc_freq",
        "gc_debug",
        "dataloader",
    },
    "activation_checkpoint": {
        "mode",
        "selective_ac_option",
        "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "early_stop",
        "memory_budget",
        "visualize_memory_budget_pareto",
        "preserve_rng_state",
        "determinism_check",
        "debug",
    },
}
# torchtitan 0.3.0, torchtitan/config/configs.py: the fields of the sections the args set
FIELDS_0_3 = {
    "parallelism": {
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
        "fsdp_reshard_after_forward",
        "enable_fsdp_symm_mem",
        "tensor_parallel_degree",
        "enable_sequence_parallel",
        "spmd_backend",
        "pipeline_parallel_degree",
        "module_fqns_per_model_part",
        "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_microbatch_size",
        "context_parallel_degree",
        "context_parallel_load_balancer",
        "context_parallel_ptrr_mask_key",
        "expert_parallel_degree",
    },
    "training": {
        "local_batch_size",
        "global_batch_size",
        "seq_len",
        "max_norm",
        "steps",
        "enable_cpu_offload",
        "disable_cuda_graphs",
        "dtype",
        "mixed_precision_param",
        "mixed_precision_reduce",
        "gc_freq",
        "gc_debug",
    },
    "compile": {"enable", "enable_async_tensor_parallel", "components", "backend"},
}


@pytest.fixture(scope="module")
def graph():
    """GPT-3 XL's shape (embed, layers.0..23, head; seq_len 2048) recorded as a Llama
    architecture (``meta.hf_class``), which torchtitan's llama3 model builds."""
    graph = load_graph(EXAMPLES / "gpt-1.3b.json")
    graph.meta["hf_class"] = "LlamaForCausalLM"
    return graph


def _even_stages(graph, parts: int) -> list[list[str]]:
    """The layer list cut into ``parts`` runs: the embedding and head with the first and last."""
    names = graph.names
    blocks = names[1:-1]
    per = len(blocks) // parts
    cuts = [blocks[i * per : (i + 1) * per] for i in range(parts)]
    cuts[-1] += blocks[parts * per :]
    cuts[0].insert(0, names[0])
    cuts[-1].append(names[-1])
    return cuts


def _export(graph, config: ParallelConfig, stages=None, recomputed=None) -> dict:
    stages = stages or _even_stages(graph, config.pp * config.virtual_stages)
    return build_exports(graph, config, stages, recomputed=recomputed)["torchtitan"]


def _check_fields(export: dict) -> dict:
    """Parse the TOML and the 0.3 args; every key must be a torchtitan field."""
    document = tomllib.loads(export["toml"])
    for section, values in document.items():
        unknown = set(values) - FIELDS_0_2[section]
        assert not unknown, f"[{section}] keys not in torchtitan 0.2.2: {unknown}"
    for arg in export["args"]:
        if arg.startswith("--"):
            section, key = arg[2:].split(".", 1)
            key = key.removeprefix("no_")
            assert key in FIELDS_0_3[section], f"{arg} not a torchtitan 0.3.0 field"
    return document


def _args(export: dict) -> dict[str, list[str]]:
    """The 0.3 args as {flag: values}."""
    parsed: dict[str, list[str]] = {}
    flag = None
    for arg in export["args"]:
        if arg.startswith("--"):
            flag = arg
            parsed[flag] = []
        else:
            parsed[flag].append(arg)
    return parsed


def test_pipeline_tensor_parallel_plan(graph):
    """pp 2 x tp 4 with sp, uneven split 13 + 14 layers: degrees, module names in torchtitan's
    FQNs (the head is norm + output), the local batch holds all 8 micro-batches of 2."""
    config = ParallelConfig(pp=2, tp=4, dp=1, micro_batch=2, num_microbatches=8, sp=True)
    names = graph.names
    stages = [names[:11], names[11:]]  # embed + layers.0..9 | layers.10..23 + head
    export = _export(graph, config, stages)
    document = _check_fields(export)
    parallelism = document["parallelism"]
    assert parallelism["pipeline_parallel_degree"] == 2
    assert parallelism["tensor_parallel_degree"] == 4
    assert parallelism["context_parallel_degree"] == 1
    assert parallelism["expert_parallel_degree"] == 1
    assert parallelism["data_parallel_shard_degree"] == 1
    assert parallelism["data_parallel_replicate_degree"] == 1
    assert parallelism["enable_async_tensor_parallel"] is False
    assert parallelism["pipeline_parallel_schedule"] == "1F1B"
    assert parallelism["pipeline_parallel_microbatch_size"] == 2
    parts = parallelism["module_fqns_per_model_part"]
    assert parts[0] == ["tok_embeddings"] + [f"layers.{i}" for i in range(10)]
    assert parts[1] == [f"layers.{i}" for i in range(10, 24)] + ["norm", "output"]
    assert document["training"] == {
        "local_batch_size": 16,
        "global_batch_size": 16,
        "seq_len": 2048,
    }
    assert document["activation_checkpoint"] == {"mode": "none"}
    args = _args(export)
    # 0.3 names the output layer lm_head (models/common/decoder.py)
    assert args["--parallelism.module_fqns_per_model_part"] == [
        ",".join(parts[0]),
        ",".join(parts[1][:-1] + ["lm_head"]),
    ]
    assert export["model"] == {"0.2": "llama3", "0.3": "llama3"}
    assert "--parallelism.enable_sequence_parallel" in args
    assert args["--training.local_batch_size"] == ["16"]
    assert export["warnings"] == []


@pytest.mark.parametrize(
    ("zero", "pp", "replicate", "shard", "reshard"),
    [
        (0, 1, 8, 1, None),  # DDP: data parallelism is the only axis
        (0, 2, 1, 8, "never"),  # DDP cannot run with pp: FSDP2 as ZeRO-2 (its memory)
        (1, 1, 1, 8, "never"),  # no optimizer-only sharding in torchtitan
        (2, 2, 1, 8, "never"),
        (3, 2, 1, 8, "always"),  # ZeRO-3 also under pipelining
    ],
)
def test_data_parallel_mapping(graph, zero, pp, replicate, shard, reshard):
    """ZeRO stage and dp -> replicate/shard degrees and fsdp_reshard_after_forward."""
    config = ParallelConfig(pp=pp, tp=1, dp=8, micro_batch=1, num_microbatches=4, zero=zero)
    export = _export(graph, config)
    parallelism = _check_fields(export)["parallelism"]
    assert parallelism["data_parallel_replicate_degree"] == replicate
    assert parallelism["data_parallel_shard_degree"] == shard
    assert parallelism.get("fsdp_reshard_after_forward") == reshard
    assert any("less memory than planned" in w for w in export["warnings"]) == (
        zero < 2 and shard > 1 and pp == 1
    )
    # under pipelining FSDP2 holds unsharded weights and gradients all step: ZeRO-2's memory
    assert any("this layout's ZeRO-2 plan" in w for w in export["warnings"]) == (
        zero < 2 and shard > 1 and pp > 1
    )
    # without pipelining the local batch is one micro-batch; torchtitan accumulates 4 of them
    expected_local = 4 if pp > 1 else 1
    assert _check_fields(export)["training"]["local_batch_size"] == expected_local
    assert _check_fields(export)["training"]["global_batch_size"] == 32


def test_context_and_expert_parallel_degrees(graph):
    """cp 2 and ep 4 over dp 4 (ep | dp): the experts keep tp as their TP degree (0.2), EP
    forces FSDP over the data-parallel ranks, and the 0.3 args drop the 0.2-only field."""
    config = ParallelConfig(pp=2, tp=2, cp=2, dp=4, ep=4, micro_batch=1, num_microbatches=4)
    export = _export(graph, config)
    parallelism = _check_fields(export)["parallelism"]
    assert parallelism["context_parallel_degree"] == 2
    assert parallelism["expert_parallel_degree"] == 4
    assert parallelism["expert_tensor_parallel_degree"] == 2
    assert parallelism["data_parallel_shard_degree"] == 4
    args = _args(export)
    assert args["--parallelism.context_parallel_degree"] == ["2"]
    assert args["--parallelism.expert_parallel_degree"] == ["4"]
    assert "--parallelism.expert_tensor_parallel_degree" not in args
    # tp > 1 without sp: 0.2 cannot turn SP off; 0.3 can
    assert "--parallelism.no_enable_sequence_parallel" in args
    assert any(w.startswith("sp off with tp=2") for w in export["warnings"])


def test_interleaved_and_gpipe_schedules(graph):
    """v = 2 on pp 2 -> Interleaved1F1B with 4 model parts in pipeline order; GPipe by name."""
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4, virtual_stages=2)
    parallelism = _check_fields(_export(graph, config))["parallelism"]
    assert parallelism["pipeline_parallel_schedule"] == "Interleaved1F1B"
    parts = parallelism["module_fqns_per_model_part"]
    assert len(parts) == 4
    assert parts[0][0] == "tok_embeddings" and parts[3][-2:] == ["norm", "output"]
    assert [fqn for part in parts for fqn in part][1:-2] == [f"layers.{i}" for i in range(24)]
    gpipe = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4, schedule="gpipe")
    assert _check_fields(_export(graph, gpipe))["parallelism"]["pipeline_parallel_schedule"] == (
        "GPipe"
    )


def test_activation_checkpoint_modes(graph):
    """full -> full; a per-layer selection is not expressible: full, with a comment naming it."""
    full = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4, recompute="full")
    assert _check_fields(_export(graph, full))["activation_checkpoint"] == {"mode": "full"}
    selective = ParallelConfig(
        pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4, recompute="selective"
    )
    stages = _even_stages(graph, 2)
    export = _export(graph, selective, stages, recomputed=[["layers.0", "layers.1"], []])
    assert _check_fields(export)["activation_checkpoint"] == {"mode": "full"}
    assert "# the plan recomputes chosen layers (layers.0, layers.1)" in export["toml"]
    nothing = _export(graph, selective, stages, recomputed=[[], []])
    assert _check_fields(nothing)["activation_checkpoint"] == {"mode": "none"}


def test_pp1_has_no_module_lists(graph):
    """Without pipelining torchtitan needs no model parts."""
    config = ParallelConfig(pp=1, tp=2, dp=1, micro_batch=1, num_microbatches=2, sp=True)
    parallelism = _check_fields(_export(graph, config, [graph.names]))["parallelism"]
    assert "module_fqns_per_model_part" not in parallelism


def test_torchtitan_config_manager_parses_the_toml(graph, tmp_path):
    """With torchtitan 0.2 importable, its ConfigManager reads the fragment to the same
    degrees (checked by hand with 0.2.2 from the wheel; skipped where it does not import)."""
    manager = pytest.importorskip("torchtitan.config.manager")
    config = ParallelConfig(pp=2, tp=2, dp=2, micro_batch=1, num_microbatches=4, sp=True, zero=3)
    path = tmp_path / "job.toml"
    path.write_text(_export(graph, config)["toml"])
    job = manager.ConfigManager().parse_args([f"--job.config_file={path}"])
    assert job.parallelism.pipeline_parallel_degree == 2
    assert job.parallelism.tensor_parallel_degree == 2
    assert job.parallelism.data_parallel_shard_degree == 2
    assert job.parallelism.fsdp_reshard_after_forward == "always"
    assert job.training.local_batch_size == 4


@pytest.mark.parametrize(
    ("schedule", "virtual_stages", "torch_class"),
    [
        ("1f1b", 1, "Schedule1F1B"),
        ("gpipe", 1, "ScheduleGPipe"),
        ("1f1b", 2, "ScheduleInterleaved1F1B"),
    ],
)
def test_schedule_names_resolve_in_torch(graph, schedule, virtual_stages, torch_class):
    """torchtitan looks the schedule name up with torch's get_schedule_class: the exported names
    resolve to the schedule the plan was made for."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    config = ParallelConfig(
        pp=2,
        tp=1,
        dp=1,
        micro_batch=1,
        num_microbatches=4,
        schedule=schedule,
        virtual_stages=virtual_stages,
    )
    name = _check_fields(_export(graph, config))["parallelism"]["pipeline_parallel_schedule"]
    assert schedules.get_schedule_class(name).__name__ == torch_class


def test_no_torchtitan_model_names_no_modules():
    """GPT-3 (learned positions, LayerNorm, GeLU) is no torchtitan model: no module list, the
    model null and one warning that says so, in the TOML and the 0.3 args alike."""
    graph = load_graph(EXAMPLES / "gpt-1.3b.json")
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4)
    export = _export(graph, config)
    assert export["model"] == {"0.2": None, "0.3": None}
    assert "module_fqns_per_model_part" not in _check_fields(export)["parallelism"]
    assert "--parallelism.module_fqns_per_model_part" not in export["args"]
    (warning,) = [w for w in export["warnings"] if w.startswith("module names:")]
    assert "torchtitan has no model for" in warning


def test_hf_head_norm_and_output_are_torchtitans():
    """A HuggingFace Llama graph: model.embed_tokens, model.layers.<i>, model.norm (head) and
    lm_head (head) -> tok_embeddings, layers.<i>, norm, output / lm_head; every FQN is a
    module of torchtitan's Decoder (tok_embeddings, layers.0..n-1, norm, output or lm_head)."""
    from solver.graph import graph_from_dict

    names = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(6)), "model.norm"]
    layers = [{"name": n, "params": 1, "activation_bytes": 1, "output_bytes": 1} for n in names]
    layers.append({"name": "lm_head", "params": 1, "activation_bytes": 1, "output_bytes": 1})
    graph = graph_from_dict(
        {
            "format": "layer-graph",
            "version": 1,
            "model": "llama",
            "meta": {"hf_class": "LlamaForCausalLM"},
            "layers": layers,
        }
    )
    config = ParallelConfig(pp=3, tp=1, dp=1, micro_batch=1, num_microbatches=6)
    stages = [graph.names[:3], graph.names[3:6], graph.names[6:]]
    export = _export(graph, config, stages)
    parts = export["parallelism"]["module_fqns_per_model_part"]
    assert parts == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "layers.4"],
        ["layers.5", "norm", "output"],
    ]
    modules = {"tok_embeddings", "norm", "output", "lm_head", *(f"layers.{i}" for i in range(6))}
    assert {fqn for part in parts for fqn in part} <= modules
    assert _args(export)["--parallelism.module_fqns_per_model_part"][-1] == "layers.5,norm,lm_head"
    assert export["warnings"] == []
