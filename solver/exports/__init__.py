"""A plan as the settings of the engines people train with, one module each: torch
pipelining (:mod:`solver.exports.torch_pipelining`), Megatron-LM (:mod:`solver.exports.megatron`),
DeepSpeed (:mod:`solver.exports.deepspeed`) and torchtitan (:mod:`solver.exports.torchtitan`).

:func:`build_exports` checks the plan's stages once and returns ``plan.exports``, a
JSON-serialisable dict with one section per engine:

- ``torch_pipelining``: ``split_spec`` for ``torch.distributed.pipelining.pipeline``, the schedule.
- ``megatron``: Megatron-LM command-line arguments, including the uneven split as
  ``--decoder-first/last-pipeline-num-layers`` or ``--pipeline-model-parallel-layout``.
- ``deepspeed``: ``PipelineModule`` layer counts and ``parts`` boundaries, and the config keys.
- ``torchtitan``: the job-config sections.

The names each engine gives the parallel degrees are :data:`solver.parallel.DIMENSIONS`'s.
Pure functions: no I/O, no torch.
"""

from __future__ import annotations

from typing import Any

from solver.engine_rules import ModelFacts, refuse_export_sections
from solver.errors import InputError
from solver.exports.deepspeed import deepspeed_export
from solver.exports.megatron import megatron_export
from solver.exports.torch_pipelining import torch_pipelining_export
from solver.exports.torchtitan import torchtitan_export
from solver.graph import LayerGraph
from solver.parallel import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from solver.specs import ParallelConfig


def build_exports(
    graph: LayerGraph,
    config: ParallelConfig,
    stage_layers: list[list[str]],
    *,
    recomputed: list[list[str]] | None = None,
    moe_capacity_factor: float | str = 1.0,
    precision: str | None = None,
    optimizer: str = "adam",
    bytes_per_param: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    """Settings for torch pipelining, Megatron-LM and DeepSpeed that reproduce the plan.
    ``precision``, ``optimizer`` and ``bytes_per_param``: the plan's training settings
    (``TrainingConfig``), for Megatron-LM's precision flag (None: bf16-mixed).

    ``stage_layers[s]`` holds the names of the layers of stage ``s``; ``recomputed[s]`` those of
    them that are recomputed (selective recomputation). With interleaving (``virtual_stages`` v >
    1) the stages are the p v virtual stages in pipeline order, virtual stage j on rank j mod p
    (zbv and dualpipev: in a V, ``solver.parallel.stage_ranks``).
    Raises :class:`InputError` when the stages do not partition the graph's layers into p v
    non-empty stages with every edge going to the same or a later stage. The section of an
    engine whose rules refuse the config (``solver.engine_rules``) is ``{"refused": why}``.
    """
    stages = _stages_in_list_order(graph, config, stage_layers)
    contiguous = [name for stage in stages for name in stage] == graph.names
    selected = _recomputed_in_list_order(config, stages, recomputed)
    sections = {
        "torch_pipelining": torch_pipelining_export(
            config, stages, contiguous=contiguous, recomputed=selected
        ),
        "megatron": megatron_export(
            graph,
            config,
            stages,
            recomputed=selected,
            moe_capacity_factor=moe_capacity_factor,
            precision=precision,
            optimizer=optimizer,
            bytes_per_param=bytes_per_param,
        ),
        "deepspeed": deepspeed_export(config, stages, contiguous=contiguous, recomputed=selected),
        "torchtitan": torchtitan_export(graph, config, stages, recomputed=selected),
    }
    not_gpt = megatron_model_refusal(graph)
    if not_gpt:
        sections["megatron"] = {"refused": not_gpt}
    if config.schedule in ZERO_BUBBLE_SCHEDULES:
        sections = split_backward_sections(sections, config)
    # an engine that refuses the layout (solver.engine_rules) gets the reason, not settings
    return refuse_export_sections(sections, config, ModelFacts.of_graph(graph))


def split_backward_sections(sections: dict[str, Any], config: ParallelConfig) -> dict[str, Any]:
    """The Megatron-LM and DeepSpeed sections of a split-backward plan (zbv, dualpipev,
    interleaved-zb), which neither engine runs: Megatron-LM runs 1F1B and interleaved 1F1B,
    DeepSpeed's PipelineEngine 1F1B (TrainSchedule). A V plan's Megatron section is refused
    (Megatron places virtual stage j on rank j mod pp: its layout would put other layers on
    each rank); otherwise each section keeps its arguments, which run the same layers per
    rank under 1F1B, with a warning that the schedule, and so the memory, differ."""
    name = config.schedule
    result = dict(sections)
    if name in V_SCHEDULES and not result["megatron"].get("refused"):
        result["megatron"] = {
            "refused": (
                f"schedule {name} has no Megatron-LM equivalent: Megatron-LM runs 1F1B and "
                "interleaved 1F1B, which place virtual stage j on rank j mod pp, not in a V; "
                "use the torch_pipelining or torchtitan section"
            )
        }
    for section, engine, runs in (
        ("megatron", "Megatron-LM", "1F1B (interleaved 1F1B with --virtual-stages)"),
        ("deepspeed", "DeepSpeed", "1F1B (PipelineEngine's TrainSchedule)"),
    ):
        if result[section].get("refused"):
            continue
        result[section] = {
            **result[section],
            "warnings": [
                *result[section].get("warnings", []),
                f"schedule {name} has no {engine} equivalent: these arguments run the same "
                f"layers per rank under {runs}, which keeps no pending weight-gradient steps "
                "and holds other micro-batches in flight, so the peaks differ from the plan's; "
                "use the torch_pipelining or torchtitan section to run the planned schedule",
            ],
        }
    return result


CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
"""How transformers names its decoder-only language-model classes (LlamaForCausalLM,
GPT2LMHeadModel)."""


def megatron_model_refusal(graph: LayerGraph) -> str | None:
    """Why the Megatron export cannot describe the graph's model, or None: its arguments are
    ``pretrain_gpt.py``'s (GPTModel: decoder-only language models), so a HuggingFace model of
    another kind (``meta.hf_class`` not a causal LM class, ``...ForCausalLM`` or
    ``...LMHeadModel``: an encoder, an encoder-decoder, an image classifier, a vision-language
    model) would be built as something else."""
    hf_class = graph.meta.get("hf_class")
    if not isinstance(hf_class, str) or hf_class.endswith(CAUSAL_LM_SUFFIXES):
        return None
    return (
        f"{hf_class} is not a decoder-only language model: Megatron-LM's pretrain_gpt.py "
        "(GPTModel), whose arguments this export writes, would build another model; its other "
        "entry points (pretrain_bert.py, pretrain_t5.py, pretrain_vlm.py) take arguments this "
        "export does not write (use the torch_pipelining, DeepSpeed or torchtitan section)"
    )


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
