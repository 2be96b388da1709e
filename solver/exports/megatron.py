"""Turn a plan (config + the layers of each stage) into settings for four training runtimes.

:func:`build_exports` returns a JSON-serialisable dict with one section per runtime:

- ``torch_pipelining``: ``split_spec`` for ``torch.distributed.pipelining.pipeline``, the schedule.
- ``megatron``: Megatron-LM command-line arguments, including the uneven split as
  ``--decoder-first/last-pipeline-num-layers`` or ``--pipeline-model-parallel-layout``.
- ``deepspeed``: ``PipelineModule`` layer counts and ``parts`` boundaries, and the config keys.
- ``torchtitan``: the job-config sections (:mod:`solver.exports.torchtitan`).

Pure functions: no I/O, no torch. Facts about the runtimes, and where they come from, are in the
comments next to the code that relies on them.
"""

from __future__ import annotations

from typing import Any

from solver.costs.moe import routed_experts
from solver.errors import InputError
from solver.exports.torchtitan import torchtitan_export
from solver.graph import LayerGraph
from solver.specs import MOE_DROPLESS, ParallelConfig

# Megatron layout letters (megatron/core/transformer/pipeline_parallel_layer_layout.py,
# PipelineParallelLayerLayout.parse_str_to_list): E = embedding, t = transformer (decoder) layer,
# L = loss (final norm + output layer + loss), m = MTP layer; "|" separates stages.
MEGATRON_LETTER = {"embedding": "E", "block": "t", "head": "L"}


def build_exports(
    graph: LayerGraph,
    config: ParallelConfig,
    stage_layers: list[list[str]],
    *,
    recomputed: list[list[str]] | None = None,
    moe_capacity_factor: float | str = 1.0,
) -> dict[str, Any]:
    """Settings for torch pipelining, Megatron-LM and DeepSpeed that reproduce the plan.

    ``stage_layers[s]`` holds the names of the layers of stage ``s``; ``recomputed[s]`` those of
    them that are recomputed (selective recomputation). With interleaving (``virtual_stages`` v >
    1) the stages are the p v virtual stages in pipeline order, virtual stage j on rank j mod p.
    Raises :class:`InputError` when the stages do not partition the graph's layers into p v
    non-empty stages with every edge going to the same or a later stage.
    """
    stages = _stages_in_list_order(graph, config, stage_layers)
    contiguous = [name for stage in stages for name in stage] == graph.names
    selected = _recomputed_in_list_order(config, stages, recomputed)
    return {
        "torch_pipelining": torch_pipelining_export(
            config, stages, contiguous=contiguous, recomputed=selected
        ),
        "megatron": megatron_export(
            graph, config, stages, recomputed=selected, moe_capacity_factor=moe_capacity_factor
        ),
        "deepspeed": deepspeed_export(config, stages, contiguous=contiguous, recomputed=selected),
        "torchtitan": torchtitan_export(graph, config, stages, recomputed=selected),
    }


def _recomputed_in_list_order(
    config: ParallelConfig, stages: list[list[str]], recomputed: list[list[str]] | None
) -> list[list[str]] | None:
    """Each stage's recomputed layers in graph list order; None unless recompute is selective."""
    if config.recompute != "selective":
        return None
    recomputed = recomputed or [[] for _ in stages]
    if len(recomputed) != len(stages):
        raise InputError(f"export: {len(recomputed)} recompute lists for {len(stages)} stages")
    result = []
    for s, (stage, names) in enumerate(zip(stages, recomputed, strict=True)):
        unknown = sorted(set(names) - set(stage))
        if unknown:
            raise InputError(f"export: recomputed layer {unknown[0]} is not on stage {s}")
        result.append([name for name in stage if name in set(names)])
    return result


def torch_pipelining_export(
    config: ParallelConfig,
    stages: list[list[str]],
    *,
    contiguous: bool,
    recomputed: list[list[str]] | None = None,
) -> dict[str, Any]:
    """``split_spec`` (first layer of every stage but the first -> "BEGINNING") and schedule."""
    schedule = "ScheduleGPipe" if config.schedule == "gpipe" else "Schedule1F1B"
    if config.virtual_stages > 1:
        schedule = "ScheduleInterleaved1F1B"  # takes the rank's stages
    return {
        "split_spec": {stage[0]: "BEGINNING" for stage in stages[1:]},
        "schedule": schedule,
        "n_microbatches": config.num_microbatches,
        "stage_ranks": [j % config.pp for j in range(len(stages))],
        "contiguous": contiguous,
        "stages": stages,
        **(
            {}
            if recomputed is None
            else {"checkpoint_modules": [name for names in recomputed for name in names]}
        ),
        **({"tensor_parallel": _torch_sequence_parallel_plan()} if config.sp else {}),
        **({"context_parallel": _torch_context_parallel(config)} if config.cp > 1 else {}),
        "note": _torch_pipelining_note(
            config, schedule, contiguous=contiguous, recomputed=recomputed
        ),
        "memory_note": _torch_pipelining_memory_note(config),
    }


def _torch_pipelining_note(
    config: ParallelConfig,
    schedule: str,
    *,
    contiguous: bool,
    recomputed: list[list[str]] | None,
) -> str:
    """How to build the pipeline and its schedule from the export, and what pipelining leaves
    to the user (tensor and data parallelism, recomputation, a split that is not contiguous)."""
    m, p, v = config.num_microbatches, config.pp, config.virtual_stages
    build = "stage = pipe.build_stage(pp_rank, device); "
    if v > 1:
        # PipelineStage indices are global and the "loop" placement puts stage j on rank j mod p
        # (pipelining's stage_index_to_group_rank)
        build = f"stage = [pipe.build_stage(j, device) for j in range(pp_rank, {p * v}, {p})]; "
    note = (
        "from torch.distributed.pipelining import SplitPoint, pipeline, "
        f"{schedule}; pipe = pipeline(module, mb_args=(example_microbatch,), "
        "split_spec={name: SplitPoint.BEGINNING for name in split_spec}); "
        f"{build}"
        f"schedule = {schedule}(stage, n_microbatches={m}, loss_fn=loss_fn). "
        "The keys are module names (FQNs): they match when the layer names are module paths "
        f"such as 'layers.3'. example_microbatch holds {config.micro_batch} sample(s). "
        "Pipelining covers only the pipeline axis: apply tensor parallelism "
        f"(tp={config.tp}) and data parallelism (dp={config.dp}, ZeRO {config.zero}) to each "
        "stage separately (DeviceMesh, parallelize_module, fully_shard)."
    )
    if config.cp > 1:
        note += (
            f" Context parallelism (cp={config.cp}): run each step inside context_parallel "
            "on the mesh's cp dimension ('context_parallel' below)."
        )
    if config.sp:
        note += (
            " Sequence parallelism: in the tensor-parallel plan give the norms "
            "SequenceParallel(), gather the sequence in front of attention and MLP "
            "(PrepareModuleInput, Shard(1) -> Replicate()) and reduce-scatter the row-parallel "
            "outputs (output_layouts=Shard(1)), as torchtitan's Llama does ('tensor_parallel' "
            f"below, 'snippet' as code), and send [b, s/{config.tp}, h] between stages "
            "(PipelineStage input_args/output_args). Eager torch saves each column-parallel "
            "Linear's all-gathered [b, s, h] input where Megatron saves its shard and gathers "
            "it again in the backward: plan with --runtime torch to count it."
        )
    if config.recompute == "full":
        note += (
            " Full recomputation is not a pipelining option: wrap every layer in "
            "torch.utils.checkpoint (e.g. checkpoint_wrapper)."
        )
    if recomputed is not None:
        note += (
            " Selective recomputation: wrap the modules of 'checkpoint_modules' (and only them) "
            "with torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper "
            "(apply_activation_checkpointing(module, check_fn=lambda m: m in those modules))."
        )
    if not contiguous:
        note += (
            " NOT CONTIGUOUS: some stage is not a consecutive run of the graph's layer order, "
            "and pipeline() splits the traced program in execution order, so these split "
            "points give the planned stages only if the forward runs the layers in the order "
            "of 'stages' (stage 0's layers, then stage 1's, ...; that order is topological). "
            "Otherwise build each PipelineStage by hand from the module lists in 'stages'."
        )
    return note


def _torch_context_parallel(config: ParallelConfig) -> dict[str, Any]:
    """Context parallelism on torch: ``torch.distributed.tensor.experimental.context_parallel``
    (torch 2.13: ``context_parallel(mesh, *, buffers, buffer_seq_dims, no_restore_buffers)``)
    patches ``F.scaled_dot_product_attention`` with ring attention over the mesh it is given
    and shards the listed buffers along their sequence dimension in place, for the forward and
    backward run inside it."""
    return {
        "degree": config.cp,
        "mesh_dims": ["pp", "dp", "cp", "tp"],
        "mesh_shape": [config.pp, config.dp, config.cp, config.tp],
        "snippet": (
            "from torch.distributed.device_mesh import init_device_mesh; "
            "from torch.distributed.tensor.experimental import context_parallel; "
            f"mesh = init_device_mesh('cuda', ({config.pp}, {config.dp}, {config.cp}, "
            f"{config.tp}), mesh_dim_names=('pp', 'dp', 'cp', 'tp')); "
            "with context_parallel(mesh['cp'], buffers=[input_ids, labels], "
            "buffer_seq_dims=[1, 1], no_restore_buffers={input_ids, labels}): "
            "loss = stage_or_model(input_ids, labels); loss.backward()"
        ),
        "note": (
            f"Each of the {config.cp} cp ranks of a stage keeps s/{config.cp} of every sequence "
            "(the buffers sharded along dim 1, batch-first) and ring attention exchanges the "
            "keys and values; the model must call F.scaled_dot_product_attention (attention="
            "sdpa, HF attn_implementation='sdpa'). Data-parallel gradient sync and FSDP shard "
            "over the dp and cp dimensions together (mesh['dp', 'cp']._flatten()), as the plan "
            "counts. Pipeline stages send [b, s/cp, h]."
        ),
    }


def _torch_sequence_parallel_plan() -> dict[str, Any]:
    """The styles of torch.distributed.tensor.parallel (``parallelize_module``) that add
    sequence parallelism to Megatron's split: activations between the blocks' Linears are
    Shard(1) (batch-first [b, s, h], split along the sequence) instead of replicated.

    ``snippet`` is the plan as code, written as torchtitan's Llama ``apply_tp``
    (torchtitan/models/llama3/infra/parallelize.py) writes it: SequenceParallel on the norms,
    PrepareModuleInput gathering the sequence in front of attention and MLP, row-parallel
    outputs reduce-scattered to Shard(1); the module names are the model zoo's
    (:mod:`profiling.executors.parallelize` applies the same plan)."""
    return {
        "sequence_parallel": True,
        "norms": "SequenceParallel()",
        "attention_and_mlp_inputs": (
            "PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))"
        ),
        "column_parallel": "ColwiseParallel()",
        "row_parallel": "RowwiseParallel(output_layouts=Shard(1))",
        "embedding": "RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))",
        "lm_head": (
            "ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), "
            "use_local_output=False)"
        ),
        "snippet": TORCH_SEQUENCE_PARALLEL_SNIPPET,
    }


TORCH_SEQUENCE_PARALLEL_SNIPPET = """\
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

# Block names of the model zoo (models/gpt.py); torchtitan's Llama calls them attention_norm,
# attention (wq, wk, wv, wo), ffn_norm, feed_forward (w1, w3 column-parallel, w2 row-parallel).
gather_sequence = PrepareModuleInput(
    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
)
block_plan = {
    "norm1": SequenceParallel(),
    "attn": gather_sequence,
    "attn.qkv": ColwiseParallel(),
    "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
    "norm2": SequenceParallel(),
    "mlp": gather_sequence,
    "mlp.fc1": ColwiseParallel(),
    "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
}
for block in model.layers:
    parallelize_module(block, tp_mesh, block_plan)
parallelize_module(
    model,
    tp_mesh,
    {
        # a position table added after the token embedding needs the output's sequence
        # shard: reduce-scatter after the sum instead (Shard(1) on the embedding layer's output)
        "embed.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "head.norm": SequenceParallel(),
        "head.lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    },
)
# the logits stay sharded over the vocabulary: compute the loss (and its backward) under
# loss_parallel(); pipeline stages send [b, s / tp, h]
"""


def _torch_pipelining_memory_note(config: ParallelConfig) -> str:
    """The receive buffers pipelining keeps, and how to avoid two leaks. Measured
    (../shared/reference/runtime-memory-facts.md, benchmarks/bench_accuracy.md)."""
    m, v = config.num_microbatches, config.virtual_stages
    note = (
        f"torch.distributed.pipelining keeps {m} activation receive buffers on every "
        f"non-first stage and {m} gradient receive buffers on every non-last stage (the "
        "planner's buffers term counts them); pass static input_args/output_args to "
        "PipelineStage and return_outputs=False to schedule.step, or the first stage keeps "
        "part of a shape-inference graph and the last stage every micro-batch's output."
    )
    if v > 1:
        note += (
            f" With {v} stages per rank, each of them keeps its own receive buffers (plan with "
            "--runtime torch to count them)."
        )
    return note


def megatron_export(
    graph: LayerGraph,
    config: ParallelConfig,
    stages: list[list[str]],
    *,
    recomputed: list[list[str]] | None = None,
    moe_capacity_factor: float | str = 1.0,
) -> dict[str, Any]:
    """Megatron-LM arguments for the plan (``moe_capacity_factor``: the plan's
    ``TrainingConfig.moe_capacity_factor``, for a mixture-of-experts graph's router flags).

    Layer roles become layout letters: embedding -> E, block -> t, head -> L. A layer of kind
    ``other`` gets no letter: Megatron builds only E, t, L (and m) modules, so such a layer (a
    separate final norm, a position embedding, a pooler) is taken to be part of the module Megatron
    builds next to it; counting it as a ``t`` would change ``--num-layers``.
    """
    roles = {layer.name: layer.role for layer in graph.layers}
    stage_letters = ["".join(MEGATRON_LETTER.get(roles[n], "") for n in s) for s in stages]
    layout = "|".join(stage_letters)
    blocks = [letters.count("t") for letters in stage_letters]
    num_layers = sum(blocks)
    warnings = _megatron_warnings(graph, config, roles, stage_letters)
    layout_valid = not any(w.startswith("layout:") for w in warnings)
    method, first, last = _megatron_split_method(
        config, blocks, stage_letters, layout_valid=layout_valid
    )
    args = [
        "--pipeline-model-parallel-size",
        str(config.pp),
        "--tensor-model-parallel-size",
        str(config.tp),
        "--num-layers",
        str(num_layers),
        "--micro-batch-size",
        str(config.micro_batch),
        "--global-batch-size",
        str(config.global_batch),
    ]
    args += _megatron_split_args(config, method, first, last, layout)
    recompute_args, warning = _megatron_recompute_args(config, roles, stages, recomputed)
    args += recompute_args
    if warning is not None:
        warnings.append(warning)
    if config.zero >= 1:
        args.append("--use-distributed-optimizer")
    if config.sp:
        # megatron/training/arguments.py: "Enable sequence parallel optimization"; it needs
        # --tensor-model-parallel-size > 1
        args.append("--sequence-parallel")
    if config.cp > 1:
        # megatron/training/arguments.py: "Degree of context parallelism"; Megatron's data
        # parallel size is world / (tp cp pp), and its distributed optimizer and gradient
        # all-reduce span dp x cp (the cost model's sharding_degree)
        args += ["--context-parallel-size", str(config.cp)]
    expert_args, expert_warning = _megatron_expert_args(graph, config, moe_capacity_factor)
    args += expert_args
    if expert_warning is not None:
        warnings.append(expert_warning)
    return {
        "args": args,
        "layout": layout,
        "layout_compact": _compact_layout(stage_letters),
        "decoder_first_pipeline_num_layers": first,
        "decoder_last_pipeline_num_layers": last,
        "split_method": method,
        "num_layers": num_layers,
        "blocks_per_stage": blocks,
        "warnings": warnings,
        "note": (
            f"Run on pp*tp*cp*dp = {config.num_gpus} GPUs (Megatron derives the data-parallel size "
            f"{config.dp} from the world size). split_method 'even' needs no split flag; "
            "'first_last' uses --decoder-first/last-pipeline-num-layers; 'layout' uses "
            "--pipeline-model-parallel-layout (experimental in Megatron-Core), which states "
            "every stage: E embedding, t transformer layer, L final norm + output layer + loss. "
            "With bf16 Megatron keeps fp32 gradients (18 bytes per parameter, 6 + 12/d with the "
            "distributed optimizer), what the megatron runtime's default bytes per parameter "
            "2,4,12 count; other precisions: docs/cost-model.md."
        ),
    }


def _megatron_expert_args(
    graph: LayerGraph, config: ParallelConfig, capacity_factor: float | str
) -> tuple[list[str], str | None]:
    """Megatron's mixture-of-experts flags for a graph with routed experts (megatron/training/
    arguments.py): ``--num-experts E --moe-router-topk k --expert-model-parallel-size ep`` and
    ``--moe-token-dispatcher-type alltoall`` (the all-to-all the cost model times; Megatron's
    default is allgather); a capacity factor c > 1 adds ``--moe-expert-capacity-factor c
    --moe-pad-expert-input-to-capacity`` (padded to capacity: what the planner counts). At
    c = 1 (a balanced routing) and dropless no capacity is set: Megatron's router is then
    dropless, and at 1 a warning says the plan assumed balanced routing. Shared experts
    (``--moe-shared-expert-intermediate-size``) need the model's widths: left to the model's
    own arguments. ([], None) for a dense graph; no flags and a warning for tp > 1 without
    sequence parallelism, which megatron-core refuses for MoE layers."""
    experts = routed_experts(graph)
    if experts is None:
        return [], None
    if config.tp > 1 and not config.sp:
        # megatron/core/transformer/moe/moe_layer.py, MoELayer.forward: "performance may degrade
        # if MoE and tensor parallelism are enabled without also enabling sequence parallelism"
        # is a ValueError in training
        return [], (
            "moe: megatron-core refuses to train MoE layers with tensor parallelism but without "
            "sequence parallelism (MoELayer.forward raises); plan with --sequence-parallel auto"
        )
    args = [
        "--num-experts",
        str(experts.num_experts),
        "--moe-router-topk",
        str(experts.top_k),
        "--expert-model-parallel-size",
        str(config.ep),
        "--moe-token-dispatcher-type",
        "alltoall",
    ]
    if capacity_factor == MOE_DROPLESS:
        return args, None
    if capacity_factor > 1:
        args += [
            "--moe-expert-capacity-factor",
            f"{capacity_factor:g}",
            "--moe-pad-expert-input-to-capacity",
        ]
        return args, None
    return args, (
        "moe: the plan assumes a balanced routing (each expert gets tokens x top_k / experts); "
        "Megatron's dropless router can send a GPU more. Bound it with "
        "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity, or plan with "
        "--moe-capacity-factor dropless for the worst case"
    )


def _megatron_split_method(
    config: ParallelConfig, blocks: list[int], stage_letters: list[str], *, layout_valid: bool
) -> tuple[str, int | None, int | None]:
    """How Megatron is told the split: "even" (its default), "first_last" (with those block
    counts) or "layout"; returns (method, first, last)."""
    first, last = (None, None)
    if layout_valid and config.virtual_stages == 1:
        first, last = _first_last_counts(blocks, stage_letters)
    ends_in_place = "E" in stage_letters[0] and "L" in stage_letters[-1]
    if config.pp == 1 or (len(set(blocks)) == 1 and layout_valid and ends_in_place):
        # Megatron's default: an even split of the blocks, E on the first stage, L on the last
        # (of every virtual stage with interleaving).
        return "even", first, last
    if first is not None or last is not None:
        return "first_last", first, last
    # with interleaving the layout lists the p v virtual stages in order and Megatron takes
    # the virtual pipeline size from it: len(layout) // p (PipelineParallelLayerLayout)
    return "layout", first, last


def _megatron_split_args(
    config: ParallelConfig, method: str, first: int | None, last: int | None, layout: str
) -> list[str]:
    """The flags that give Megatron the split (none for its default even split)."""
    args = []
    # --decoder-first/last-pipeline-num-layers (megatron/training/arguments.py): "The number of
    # transformer layers on the first (last) pipeline stage of the decoder. Default None is even
    # split". TransformerConfig.__post_init__ requires each to be > 0 and the layers left to divide
    # evenly over the middle stages; pipeline_model_parallel_layout, when set, takes precedence.
    if method == "first_last":
        if first is not None:
            args += ["--decoder-first-pipeline-num-layers", str(first)]
        if last is not None:
            args += ["--decoder-last-pipeline-num-layers", str(last)]
    elif method == "layout":
        args += ["--pipeline-model-parallel-layout", layout]
    if config.virtual_stages > 1 and method == "even":
        # megatron/training/arguments.py: "Number of virtual pipeline stages per pipeline
        # parallelism rank"
        args += ["--num-virtual-stages-per-pipeline-rank", str(config.virtual_stages)]
    return args


def _megatron_recompute_args(
    config: ParallelConfig,
    roles: dict[str, str],
    stages: list[list[str]],
    recomputed: list[list[str]] | None,
) -> tuple[list[str], str | None]:
    """Recomputation flags: every layer (full), or the chosen layers (selective) when Megatron
    can express them, else no flag and a warning that lists them."""
    args = []
    if config.recompute == "full":
        args += [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ]
    if recomputed is None:
        return args, None
    blocks_recomputed = _megatron_block_recompute(roles, stages, recomputed)
    if blocks_recomputed is None:
        return args, (
            "recompute: the recomputed layers are not the first N transformer layers of "
            "every stage, which is all --recompute-method block expresses; recompute these "
            "by hand (e.g. checkpoint_wrapper): "
            + "; ".join(
                f"stage {s}: {', '.join(names)}" for s, names in enumerate(recomputed) if names
            )
        )
    if not blocks_recomputed:
        return args, None
    # megatron/training/arguments.py: with --recompute-method block, "the first N
    # transformer layers of each pipeline stage are recomputed"
    return args + [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        str(blocks_recomputed),
    ], None


def deepspeed_export(
    config: ParallelConfig,
    stages: list[list[str]],
    *,
    contiguous: bool,
    recomputed: list[list[str]] | None = None,
) -> dict[str, Any]:
    """``PipelineModule`` layer counts, its ``parts`` boundaries and the DeepSpeed config keys."""
    counts = [len(stage) for stage in stages]
    parts = [0]
    for count in counts:
        parts.append(parts[-1] + count)
    warnings = _deepspeed_warnings(config, contiguous=contiguous, recomputed=recomputed)
    return {
        "layer_counts": counts,
        "parts": parts,
        "stages": stages,
        "num_stages": config.pp,
        "partition_method_note": (
            "PipelineModule(partition_method=...) accepts only 'uniform', 'parameters' and "
            "'type:REGEX' (deepspeed/runtime/pipe/module.py, _partition_layers); none takes "
            "explicit counts. Apply these counts by subclassing PipelineModule and overriding "
            "_partition_layers(self, method) to set self.parts = PARTS and call "
            "self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1]) with "
            "stage_id = self._topo.get_coord(self.global_rank).pipe. The layer list must have one "
            "entry (LayerSpec) per graph layer, in graph order."
        ),
        "zero_optimization": {"stage": config.zero},
        "train_micro_batch_size_per_gpu": config.micro_batch,
        "gradient_accumulation_steps": config.num_microbatches,
        # PipelineEngine asserts train_batch_size == micro batch * micro-batches * dp.
        "train_batch_size": config.global_batch,
        "activation_checkpoint_interval": 1 if config.recompute == "full" else 0,
        "warnings": warnings,
    }


def _deepspeed_warnings(
    config: ParallelConfig, *, contiguous: bool, recomputed: list[list[str]] | None
) -> list[str]:
    """What DeepSpeed's PipelineEngine cannot run as planned, or needs done by hand."""
    warnings = []
    # deepspeed/runtime/pipe/engine.py, PipelineEngine.__init__: assert zero_optimization_stage()
    # < ZeroStageEnum.gradients, "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism".
    if config.zero >= 2 and config.pp > 1:
        warnings.append(
            f"ZeRO stage {config.zero} with {config.pp} pipeline stages: DeepSpeed's "
            "PipelineEngine rejects ZeRO-2 and ZeRO-3 ('ZeRO-2 and ZeRO-3 are incompatible "
            "with pipeline parallelism'); use stage 1 (the plan's memory then rises) or another "
            "runtime."
        )
    if not contiguous:
        warnings.append(
            "Not contiguous: PipelineModule gives stage s the slice parts[s]:parts[s+1] of its "
            "layer list; build that list in the order of 'stages' (a valid topological order) "
            "so that the slices hold the planned layers."
        )
    if recomputed is not None and any(recomputed):
        warnings.append(
            "Selective recomputation: activation_checkpoint_interval checkpoints every k-th "
            "layer only; wrap the recomputed layers with deepspeed.checkpointing.checkpoint in "
            "their forward instead: " + ", ".join(name for names in recomputed for name in names)
        )
    if config.virtual_stages > 1:
        warnings.append(
            f"Interleaving ({config.virtual_stages} stages per rank): DeepSpeed's PipelineEngine "
            "runs one contiguous stage per rank (TrainSchedule, 1F1B) and cannot run this plan; "
            "the counts below are per virtual stage. Use Megatron-LM or torch pipelining."
        )
    if config.tp > 1:
        warnings.append(
            f"tp={config.tp}: PipelineModule does not split layers itself; use tensor-parallel "
            "layers (e.g. Megatron-DeepSpeed) and pass topology=PipeModelDataParallelTopology("
            f"num_pp={config.pp}, num_mp={config.tp}, num_dp={config.dp})"
            + (", with Megatron-DeepSpeed's --sequence-parallel." if config.sp else ".")
        )
    if config.cp > 1:
        warnings.append(
            f"cp={config.cp}: DeepSpeed's PipelineEngine has no ring-attention context "
            "parallelism (DeepSpeed-Ulysses is all-to-all sequence parallelism, another memory "
            "and time model); run this plan with Megatron-LM (--context-parallel-size) or torch "
            "(context_parallel)."
        )
    return warnings


def _megatron_block_recompute(
    roles: dict[str, str], stages: list[list[str]], recomputed: list[list[str]]
) -> int | None:
    """N when every stage recomputes exactly its first N transformer layers (N may be 0), else
    None (Megatron's block method cannot express the set)."""
    counts = set()
    for stage, names in zip(stages, recomputed, strict=True):
        blocks = [name for name in stage if roles[name] == "block"]
        count = len(names)
        if blocks[:count] != names:
            return None
        counts.add(count)
    return counts.pop() if len(counts) == 1 else None


def _stages_in_list_order(
    graph: LayerGraph, config: ParallelConfig, stage_layers: list[list[str]]
) -> list[list[str]]:
    """Check that the stages partition the layers; each stage's names in graph list order."""
    num_stages = config.pp * config.virtual_stages
    if len(stage_layers) != num_stages:
        per = "" if config.virtual_stages == 1 else f" x {config.virtual_stages} virtual stages"
        raise InputError(
            f"export: {len(stage_layers)} stages given but the config has pp={config.pp}{per}; "
            "give one list of layer names per (virtual) pipeline stage"
        )
    position = graph.index()
    stage_of: dict[str, int] = {}
    for s, names in enumerate(stage_layers):
        if not names:
            raise InputError(f"export: stage {s} is empty; every stage needs at least one layer")
        for name in names:
            if name not in position:
                raise InputError(f"export: stage {s} names unknown layer {name!r}")
            if name in stage_of:
                raise InputError(
                    f"export: layer {name!r} is in stage {stage_of[name]} and in stage {s}; "
                    "give every layer exactly one stage"
                )
            stage_of[name] = s
    missing = [name for name in graph.names if name not in stage_of]
    if missing:
        raise InputError(
            f"export: {len(missing)} layer(s) in no stage (first: {missing[0]!r}); "
            "every layer needs a stage"
        )
    for edge in graph.edges:
        if stage_of[edge.src] > stage_of[edge.dst]:
            raise InputError(
                f"export: edge {edge.src!r} (stage {stage_of[edge.src]}) -> {edge.dst!r} "
                f"(stage {stage_of[edge.dst]}) goes backwards; a pipeline only sends forward"
            )
    return [sorted(names, key=position.__getitem__) for names in stage_layers]


def _megatron_warnings(
    graph: LayerGraph, config: ParallelConfig, roles: dict[str, str], stage_letters: list[str]
) -> list[str]:
    """What keeps the plan from running in Megatron as is; layout errors start with 'layout:'."""
    warnings = []
    flat = "".join(stage_letters)
    # PipelineParallelLayerLayout.validate_layer_layout: the first layer must be the embedding,
    # the last the loss, each exactly once.
    if (
        flat.count("E") != 1
        or flat.count("L") != 1
        or not flat.startswith("E")
        or not flat.endswith("L")
    ):
        warnings.append(
            f"layout: Megatron needs exactly one E (first) and one L (last); this plan has "
            f"{flat.count('E')} E and {flat.count('L')} L (set Layer.kind to fix roles). "
            "Megatron's layout also does not support encoder-decoder models."
        )
    others = [name for name, role in roles.items() if role == "other"]
    if others:
        warnings.append(
            f"{len(others)} layer(s) of kind 'other' have no Megatron letter and are taken to "
            f"belong to the neighbouring Megatron module: {', '.join(others[:5])}"
            + (" ..." if len(others) > 5 else "")
        )
    # Megatron docs (distrib_optimizer.md): bytes per parameter with the distributed optimizer
    # are 6 + 12/d for bf16 params with fp32 grads: the gradient buffer is not sharded.
    if config.zero >= 2:
        warnings.append(
            f"ZeRO {config.zero}: --use-distributed-optimizer shards only the optimizer state "
            "(6 + 12/d bytes per parameter with bf16 weights and fp32 gradients: ZeRO-1 memory); "
            "sharded gradients/parameters need Megatron-FSDP (--use-megatron-fsdp "
            "--data-parallel-sharding-strategy optim_grads or optim_grads_params), not checked "
            "here with pipeline parallelism."
        )
    if not graph.is_chain:
        warnings.append(
            "The graph is not a chain: Megatron's GPT model passes one hidden state between "
            "stages, so skip connections across stages need model changes."
        )
    return warnings


def _first_last_counts(
    blocks: list[int], stage_letters: list[str]
) -> tuple[int | None, int | None]:
    """(first, last) block counts when only the first and/or last stage differ from the middle.

    Megatron accepts them only when each is > 0, the middle stages hold equal counts, E is on the
    first stage and L on the last. (None, None) when the split is even or not of that shape.
    """
    p = len(blocks)
    if p == 1 or len(set(blocks)) == 1:
        return None, None
    if "E" not in stage_letters[0] or "L" not in stage_letters[-1]:
        return None, None
    if p == 2:
        # No middle stage: the first count fixes the split (the last stage takes the rest).
        if blocks[0] > 0 and blocks[1] > 0:
            return blocks[0], None
        return None, None
    middle = set(blocks[1:-1])
    if len(middle) != 1 or middle == {0}:
        return None, None
    even = middle.pop()
    first = blocks[0] if blocks[0] != even else None
    last = blocks[-1] if blocks[-1] != even else None
    if first == 0 or last == 0:
        return None, None
    return first, last


def _compact_layout(stage_letters: list[str]) -> str:
    """The layout with runs of t written t*N (Megatron unrolls ``(.)\\*(\\d+)``; same meaning)."""
    compact = []
    for letters in stage_letters:
        out, i = [], 0
        while i < len(letters):
            j = i
            while j < len(letters) and letters[j] == letters[i]:
                j += 1
            run = j - i
            out.append(f"{letters[i]}*{run}" if letters[i] == "t" and run > 2 else letters[i] * run)
            i = j
        compact.append("".join(out))
    return "|".join(compact)
