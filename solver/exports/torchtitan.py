"""The plan as a torchtitan job configuration (``plan.exports["torchtitan"]``).

torchtitan 0.1 and 0.2 read a TOML job file (``--job.config_file``; the dataclasses of
``torchtitan/config/job_config.py``, read from 0.2.2's wheel); 0.3.0 dropped job files for Python
config functions (``--module M --config C``) with ``--section.field value`` overrides checked
by tyro against ``torchtitan/config/configs.py``. The export gives both: ``toml`` (the fragment
for 0.2) and ``args`` (the overrides for 0.3), from one set of values.

Data parallelism in torchtitan is FSDP2 (``fully_shard``): DDP (``data_parallel_replicate_degree``
alone) runs only when data parallelism is the only axis (llama3 ``parallelize``: "DDP has not
supported > 1D parallelism"), and there is no ZeRO-1 (optimizer-only sharding). The mapping:

==========================  ==============================================================
plan                        torchtitan
==========================  ==============================================================
dp = 1                      shard 1, replicate 1
zero 3                      shard dp, ``fsdp_reshard_after_forward = "always"`` (ZeRO-3; the
                            default keeps a stage's parameters gathered under pipelining)
zero 0, dp the only axis    replicate dp (DDP), when ep = 1
otherwise (zero 0, 1, 2)    shard dp, ``"never"``: parameters stay gathered from forward to
                            backward, gradients and optimizer states sharded (ZeRO-2 memory,
                            no more than planned at pp 1)
==========================  ==============================================================

Under pipelining (pp > 1) torchtitan hands each FSDP2 model chunk to ``PipelineStage``
(distributed/pipeline_parallel.py:625), which runs every micro-batch's backward without gradient
sync or resharding and reduce-scatters once per step (torch 2.13 pipelining/stage.py:844-847,
1164-1190): every layer's unsharded gradients and weights stay to the step's end, with
"never" (torchtitan's "default" under PP: ``get_fsdp_reshard_after_forward_policy`` returns
``not pp_enabled``, distributed/fsdp.py:112-137 at b5bcd76, 2026-08-21) and with "always"
alike. The cost model plans exactly that (``solver.costs.states.reduces_per_step``): ZeRO 2 and
3 the same memory there, ZeRO 3's gathers at each forward on top; a ZeRO 0/1 plan exported
as "never" gets that ZeRO-2 memory, which the warning says.

Pure functions, no torch; facts about torchtitan sit next to the code that uses them.
"""

from __future__ import annotations

from typing import Any

from solver.costs.graph_inputs import layer_roles
from solver.graph import LayerGraph
from solver.parallel import V_SCHEDULES, export_name
from solver.specs import ParallelConfig

# torchtitan's pipelining schedules are torch's, named without "Schedule"
# (torch.distributed.pipelining.schedules.get_schedule_class); the split-backward ones place their
# stages by the class: a V for ZBVZeroBubble and DualPipeV (torchtitan's pipeline_module_split,
# style "v": rank r builds stages r and 2 pp - 1 - r), the loop for InterleavedZeroBubble.
SCHEDULE = {
    "1f1b": "1F1B",
    "gpipe": "GPipe",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
    "interleaved-zb": "InterleavedZeroBubble",
}

# torchtitan's decoder models name their modules tok_embeddings, layers.<i> (a ModuleDict keyed
# by str(i)), norm and the output layer: "output" up to 0.2.2 (models/llama3/model/model.py,
# pipeline_parallel.generate_llm_fqn_per_model_part), "lm_head" since April 2026 (commit
# 786e26f8e, in 0.3: models/common/decoder.py, _generate_llm_fqn_per_model_part). Its
# _split_module keeps the named children of each stage and sets every other child to None, so a
# name that is no module is silently ignored and the module it should have named is dropped.
EMBEDDING_FQN, NORM_FQN = "tok_embeddings", "norm"
OUTPUT_FQN = {"0.2": "output", "0.3": "lm_head"}

TORCHTITAN_MODELS = {
    "LlamaForCausalLM": ("llama3", "llama3"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
    "Qwen3MoeForCausalLM": ("qwen3", "qwen3"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "deepseek_v3"),
    "GptOssForCausalLM": ("gpt_oss", "gpt_oss"),
    "Llama4ForConditionalGeneration": ("llama4", None),
}
"""HuggingFace architecture -> torchtitan model (0.2, 0.3; None: not in that release): the
models whose state-dict adapters map that architecture's checkpoints (torchtitan/models/<name>/
state_dict_adapter.py, 0.2.2 and main of 2026-08; llama4 left main before 0.3). A zoo preset
named llama* is the llama3 model's architecture (RMSNorm, SwiGLU, rotary, GQA)."""


def torchtitan_export(
    graph: LayerGraph,
    config: ParallelConfig,
    stages: list[list[str]],
    *,
    recomputed: list[list[str]] | None = None,
) -> dict[str, Any]:
    """torchtitan settings for the plan: the values per section, the TOML fragment (0.2), the
    CLI overrides (0.3), the per-stage module names, warnings and a note.

    ``stages`` are the (virtual) stages in pipeline order, each in graph list order, as
    :func:`solver.exports.build_exports` checked them.
    """
    warnings: list[str] = []
    parallelism = _parallelism(config, warnings)
    models = torchtitan_model(graph)
    parts = {version: None for version in OUTPUT_FQN}
    if config.pp > 1:
        parts, problem = _module_fqns(graph, stages, models)
        if problem:
            warnings.append(problem)
    if parts["0.2"] is not None:
        parallelism["module_fqns_per_model_part"] = parts["0.2"]
    training = _training(graph, config)
    checkpoint, comment = _activation_checkpoint(config, recomputed)
    sections = {
        "parallelism": parallelism,
        "training": training,
        "activation_checkpoint": checkpoint,
    }
    if config.tp > 1 and not config.sp:
        warnings.append(
            f"sp off with tp={config.tp}: torchtitan 0.2's tensor parallelism always adds "
            "sequence parallelism (models/llama3/infra/parallelize.py, apply_tp), which the "
            "TOML cannot turn off; 0.3 takes --parallelism.enable_sequence_parallel false"
        )
    comments = {"activation_checkpoint": comment} if comment else {}
    if config.tp > 1:
        comments["parallelism"] = (
            "sequence parallelism comes with tensor parallelism (SequenceParallel on the norms)"
        )
    args = _args_0_3(sections, config)
    if parts["0.3"] is not None and parts["0.2"] is None:
        args += ["--parallelism.module_fqns_per_model_part", *(",".join(p) for p in parts["0.3"])]
    elif parts["0.3"] is not None:
        at = args.index("--parallelism.module_fqns_per_model_part") + 1
        args[at : at + len(parts["0.3"])] = [",".join(p) for p in parts["0.3"]]
    elif parts["0.2"] is not None:
        at = args.index("--parallelism.module_fqns_per_model_part")
        del args[at : at + 1 + len(parts["0.2"])]
    return {
        **sections,
        "model": {"0.2": models[0], "0.3": models[1]},
        "toml": to_toml(sections, comments=comments),
        "args": args,
        "warnings": warnings,
        "note": _note(config),
    }


def torchtitan_model(graph: LayerGraph) -> tuple[str | None, str | None]:
    """The torchtitan model (0.2, 0.3) that builds the graph's architecture: from the
    HuggingFace class the profiler recorded (``meta.hf_class``), or llama3 for a zoo llama
    preset; (None, None) when torchtitan has none."""
    hf_class = graph.meta.get("hf_class")
    if isinstance(hf_class, str):
        return TORCHTITAN_MODELS.get(hf_class, (None, None))
    preset = graph.meta.get("preset")
    if isinstance(preset, str) and preset.startswith("llama"):
        return "llama3", "llama3"
    return None, None


def _key(dimension: str) -> str:
    """torchtitan's ``[parallelism]`` field for a parallel dimension (``solver.parallel``)."""
    return export_name("torchtitan", dimension)


def _parallelism(config: ParallelConfig, warnings: list[str]) -> dict[str, Any]:
    """The ``[parallelism]`` values: degrees, data-parallel mapping (module docstring), schedule."""
    dp, ep, cp = config.dp, config.ep, config.cp
    only_dp = config.pp == config.tp == cp == 1
    replicate, shard, reshard = 1, 1, None
    if dp > 1 and config.zero == 0 and only_dp and ep == 1:
        replicate = dp
    elif dp > 1 and config.zero == 3:
        shard, reshard = dp, "always"
    elif dp > 1:
        shard, reshard = dp, "never"
        if config.zero < 2 and config.pp == 1:
            warnings.append(
                f"ZeRO {config.zero}: torchtitan's data parallelism is FSDP2 (DDP only without "
                "other axes, no optimizer-only sharding); fully_shard with "
                "reshard_after_forward never shards gradients and optimizer states over "
                f"dp={dp}, less memory than planned"
            )
        elif config.zero < 2:
            warnings.append(
                f"ZeRO {config.zero}: torchtitan's data parallelism is FSDP2 (DDP only without "
                "other axes, no optimizer-only sharding); under pipelining fully_shard keeps "
                "every layer's unsharded weights and gradients all step beside the weight "
                "shards (PipelineStage reduces once per step) and shards the optimizer states "
                f"over dp={dp}: the memory of this layout's ZeRO-2 plan, not this one's; plan "
                "with --zero 2 for torchtitan"
            )
    elif cp > 1:
        # fully_shard runs over dp_shard x cp whenever cp > 1 (ParallelDims.fsdp_enabled)
        reshard = "always" if config.zero == 3 else "never"
    values: dict[str, Any] = {
        _key("pp"): config.pp,
        _key("tp"): config.tp,
        _key("cp"): cp,
        _key("ep"): ep,
        _key("dp_replicate"): replicate,
        _key("dp"): shard,
    }
    if reshard is not None:
        values["fsdp_reshard_after_forward"] = reshard
    if ep > 1:
        # ParallelDims._validate (0.2): etp is tp or 1; etp = tp keeps the experts split over
        # tp as Megatron does (expert_tensor_parallel_size defaults to tp), and then ep must
        # divide dp_shard * cp, which ep | dp gives.
        values[_key("etp")] = config.tp
    values["enable_async_tensor_parallel"] = False
    values["pipeline_parallel_schedule"] = (
        "Interleaved1F1B"
        if config.virtual_stages > 1 and config.schedule == "1f1b"
        else SCHEDULE[config.schedule]
    )
    if config.schedule == "interleaved-zb" and config.virtual_stages == 1:
        # torchtitan's generate_llm_fqn_per_model_part: "Number of stages per rank (1) must
        # be >= 2 for multi-stage schedules"
        warnings.append(
            "InterleavedZeroBubble with 1 stage per rank: torchtitan refuses multi-stage "
            "schedules with fewer than 2 stages per rank; plan with --virtual-stages 2"
        )
    values["pipeline_parallel_microbatch_size"] = config.micro_batch
    return values


def _training(graph: LayerGraph, config: ParallelConfig) -> dict[str, Any]:
    """``[training]``: the batch per data-parallel rank and step, the global batch, seq_len.

    With pipelining torchtitan splits ``local_batch_size`` into local_batch_size /
    pipeline_parallel_microbatch_size micro-batches (pipeline_parallel.build_pipeline_schedule),
    so one step holds the plan's m micro-batches; without it a forward takes the whole local
    batch, so the local batch is the micro-batch and torchtitan accumulates global / (b dp) = m
    of them (its gradient accumulation steps).
    """
    local = config.micro_batch * (config.num_microbatches if config.pp > 1 else 1)
    values = {"local_batch_size": local, "global_batch_size": config.global_batch}
    seq_len = graph.meta.get("seq_len")
    if isinstance(seq_len, int) and seq_len > 0:
        values["seq_len"] = seq_len
    return values


def _activation_checkpoint(
    config: ParallelConfig, recomputed: list[list[str]] | None
) -> tuple[dict[str, Any], str | None]:
    """``[activation_checkpoint]`` mode and, for a per-layer selection, the comment saying why
    it is "full".

    torchtitan's "selective" is per op (``selective_ac_option = "op"``) or every n-th block
    (an integer); neither names the layers the plan chose, so a selective plan runs "full":
    every block recomputed, no more memory than planned and more time (a selection of no
    layer runs "none").
    """
    if config.recompute == "none":
        return {"mode": "none"}, None
    if config.recompute == "full":
        return {"mode": "full"}, None
    chosen = [name for names in recomputed or [] for name in names]
    if not chosen:
        return {"mode": "none"}, None
    comment = (
        "the plan recomputes chosen layers ("
        + ", ".join(chosen[:8])
        + (" ..." if len(chosen) > 8 else "")
        + "); torchtitan's selective mode is per op or every n-th block, so this runs full"
    )
    return {"mode": "full"}, comment


def _module_fqns(
    graph: LayerGraph, stages: list[list[str]], models: tuple[str | None, str | None]
) -> tuple[dict[str, list[list[str]] | None], str | None]:
    """Per torchtitan version ("0.2", "0.3") the module names each (virtual) stage keeps
    (``module_fqns_per_model_part``; None where torchtitan has no model for the graph or the
    layers are not one embedding, the blocks and the head), and a warning when some are None.

    The graph's embedding, blocks and head become ``tok_embeddings``, ``layers.<k>`` (k the
    block's position among the blocks) and the final norm and output layer: two head layers
    (HuggingFace's ``model.norm``, ``lm_head``) are ``norm`` and the output, one (a zoo head)
    both; a final norm of kind "other" after the last block (older graphs) is ``norm``.
    """
    roles = layer_roles(graph)
    blocks = [i for i, role in enumerate(roles) if role == "block"]
    tail = roles[1 + len(blocks) :]
    shape_ok = (
        roles[:1] == ["embedding"]
        and blocks == list(range(1, 1 + len(blocks)))
        and tail[-1:] == ["head"]
        and len(tail) <= 2
        and all(role in ("head", "other") for role in tail)
    )
    known = [version for version, model in zip(OUTPUT_FQN, models, strict=True) if model]
    result: dict[str, list[list[str]] | None] = dict.fromkeys(OUTPUT_FQN)
    if not shape_ok or not known:
        what = graph.meta.get("hf_class") or graph.meta.get("preset") or graph.model
        why = (
            f"torchtitan has no model for {what} (its decoder models: llama3, qwen3, "
            "deepseek_v3, gpt_oss; llama4 in 0.2)"
            if not known
            else "the layers are not one embedding, the blocks and the head in this order"
        )
        return result, (
            f"module names: {why}, so module_fqns_per_model_part is left out (torchtitan would "
            "split its own model evenly); port the model to a torchtitan decoder, whose "
            "modules are tok_embeddings, layers.<i>, norm and output (0.2) / lm_head (0.3)"
        )
    for version in known:
        names: dict[str, list[str]] = {graph.layers[0].name: [EMBEDDING_FQN]}
        for k, i in enumerate(blocks):
            names[graph.layers[i].name] = [f"layers.{k}"]
        if len(tail) == 2:
            names[graph.layers[-2].name] = [NORM_FQN]
            names[graph.layers[-1].name] = [OUTPUT_FQN[version]]
        else:
            names[graph.layers[-1].name] = [NORM_FQN, OUTPUT_FQN[version]]
        result[version] = [[fqn for name in stage for fqn in names[name]] for stage in stages]
    missing = [version for version in OUTPUT_FQN if result[version] is None]
    return result, (
        f"module names: torchtitan {', '.join(missing)} has no {models[0]} model: "
        "module_fqns_per_model_part is given for the other release only"
        if missing
        else None
    )


def _args_0_3(sections: dict[str, dict[str, Any]], config: ParallelConfig) -> list[str]:
    """The same values as torchtitan 0.3 CLI overrides, as its tyro parser reads them
    (``ConfigManager``): ``--section.field value``, a boolean as ``--section.field`` or
    ``--section.no_field``, a list of module lists as one comma-joined token per stage.

    0.3 renamed nothing in these sections but moved ``enable_async_tensor_parallel`` to
    ``[compile]``, dropped ``expert_tensor_parallel_degree`` (EP borrows from FSDP and TP,
    ParallelismConfig.expert_parallel_degree) and added ``enable_sequence_parallel``;
    activation checkpointing became part of the model's Python config, so it is not here.
    """
    values = {
        f"{section}.{key}": value
        for section in ("parallelism", "training")
        for key, value in sections[section].items()
        if key not in ("enable_async_tensor_parallel", _key("etp"))
    }
    if config.tp > 1:
        values[f"parallelism.{_key('sp')}"] = config.sp
    values["compile.enable_async_tensor_parallel"] = False
    args = []
    for name, value in values.items():
        if isinstance(value, bool):
            section, key = name.split(".")
            args.append(f"--{name}" if value else f"--{section}.no_{key}")
        elif isinstance(value, list):
            args += [f"--{name}", *(",".join(part) for part in value)]
        else:
            args += [f"--{name}", str(value)]
    return args


def to_toml(sections: dict[str, dict[str, Any]], *, comments: dict[str, str] | None = None) -> str:
    """A TOML document of the sections (ints, bools, strings, lists of them), with a comment
    line at the head of a section where ``comments`` has one."""
    lines = []
    for section, values in sections.items():
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        if comments and section in comments:
            lines.append(f"# {comments[section]}")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    """One TOML value: bool, int or str (basic string, escaped), or a list of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _placement(config: ParallelConfig) -> str:
    """Where torchtitan puts virtual stage j, as the plan does."""
    if config.schedule in V_SCHEDULES:
        return (
            f"{SCHEDULE[config.schedule]} places them in a V, as the plan does: pipeline rank r "
            f"builds virtual stages r and {2 * config.pp - 1} - r, so rank 0 holds the first "
            "and the last"
        )
    return "torchtitan places virtual stage j on pipeline rank j mod pp, the plan's order"


def _note(config: ParallelConfig) -> str:
    """How to run the export, and what torchtitan adds that the plan does not count."""
    return (
        "torchtitan 0.2: save 'toml' and merge it into the model's job file (or pass the keys as "
        "--section.key overrides with --job.config_file); 0.3: append 'args' to "
        "'--module M --config C'. Run on pp*tp*cp*dp = "
        f"{config.num_gpus} GPUs. module_fqns_per_model_part gives each (virtual) stage its "
        f"modules ({_placement(config)}). Data parallelism maps to FSDP2 as the "
        "torchtitan_export docstring says. "
        "Eager tensor parallelism with sequence parallelism saves each column-parallel "
        "Linear's all-gathered [b, s, h] input (plan with --runtime torch to count it)."
    )
