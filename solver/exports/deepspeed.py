"""The plan as DeepSpeed settings (``plan.exports["deepspeed"]``): ``PipelineModule`` layer
counts and ``parts`` boundaries, the config keys, and what DeepSpeed's PipelineEngine cannot run
as planned.

Pure functions: no I/O, no torch. Facts about DeepSpeed, and where they come from, are in the
comments next to the code that relies on them.
"""

from __future__ import annotations

from typing import Any

from solver.parallel import export_name
from solver.specs import ParallelConfig

TOPOLOGY = ("pp", "tp", "dp")
"""The degrees ``PipeModelDataParallelTopology`` takes, in its argument order."""


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
        names = {key: export_name("deepspeed", key) for key in TOPOLOGY}
        topology = ", ".join(f"{names[key]}={getattr(config, key)}" for key in TOPOLOGY)
        warnings.append(
            f"tp={config.tp}: PipelineModule does not split layers itself; use tensor-parallel "
            f"layers (e.g. Megatron-DeepSpeed) and pass topology=PipeModelDataParallelTopology("
            f"{topology})"
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
