"""The plan as torch.distributed.pipelining settings (``plan.exports["torch_pipelining"]``):
``split_spec`` for ``torch.distributed.pipelining.pipeline``, the schedule, and how to add tensor,
sequence, context and data parallelism around the pipeline (DeviceMesh, ``parallelize_module``,
``context_parallel``, ``fully_shard``).

Pure functions: no I/O, no torch. Facts about torch, and where they come from, are in the comments
next to the code that relies on them.
"""

from __future__ import annotations

from typing import Any

from solver.parallel import TORCH_MESH_ORDER, export_name, stage_ranks
from solver.specs import ParallelConfig

SPLIT_BACKWARD_CLASSES = {
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""torch.distributed.pipelining's class of each split-backward schedule (torch 2.13)."""


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
    schedule = SPLIT_BACKWARD_CLASSES.get(config.schedule, schedule)
    return {
        "split_spec": {stage[0]: "BEGINNING" for stage in stages[1:]},
        "schedule": schedule,
        "n_microbatches": config.num_microbatches,
        "stage_ranks": stage_ranks(config.schedule, config.pp, config.virtual_stages),
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
    mesh_dims = tuple(export_name("torch", key) for key in TORCH_MESH_ORDER)
    mesh_shape = config.dims.mesh_shape(TORCH_MESH_ORDER)
    return {
        "degree": config.cp,
        "mesh_dims": list(mesh_dims),
        "mesh_shape": mesh_shape,
        "snippet": (
            "from torch.distributed.device_mesh import init_device_mesh; "
            "from torch.distributed.tensor.experimental import context_parallel; "
            f"mesh = init_device_mesh('cuda', ({', '.join(map(str, mesh_shape))}), "
            f"mesh_dim_names={mesh_dims!r}); "
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
