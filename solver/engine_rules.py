"""The engines' rules in one table (:data:`RULES`): what each training engine refuses of a layout
given the model's architecture, and which ZeRO stages it runs with pipeline parallelism. Candidate
configs (``search.candidates``), pinned flags, ``solver.evaluate`` and the exports
(``solver.exports``) all read it. Pure Python, no torch.

Each rule names the engines it binds, the degrees and the model facts it reads (a rule whose
degree or fact is unknown is skipped: a graph without ``meta.architecture`` is not checked on
heads), and where the engine enforces it. Sources, read in the engines' releases:

Megatron-LM core_v0.19.0 (5be9626, 2026-08-19; the same checks in core_v0.16.1):

- heads: ``num_attention_heads % tensor_model_parallel_size`` raises
  (megatron/core/transformer/transformer_config.py:1323-1327).
- KV heads (query groups): a multiple *or a divisor* of tp (transformer_config.py:1338-1345);
  with fewer groups than tp each rank keeps one replicated group (transformer/attention.py:353-366).
- experts: ``assert num_moe_experts % ep_size == 0`` (transformer/moe/moe_layer.py:185).
- cp: the sequence is cut into 2 cp chunks (load-balanced zigzag), so seq % (2 cp) == 0
  (megatron/core/utils.py:2456-2506, ``get_batch_on_this_cp_rank``).
- sp: ``scatter_to_sequence_parallel_region`` splits the s / cp tokens of a rank over tp and
  asserts the division (megatron/core/tensor_parallel/mappings.py:60-74).
- vocabulary: padded to a multiple of ``--make-vocab-size-divisible-by`` (128) x tp, a padding
  not a refusal (megatron/training/vocab_utils.py:45-58; arguments.py:2358): ``padded_vocab_size``.
- ZeRO: ``--use-distributed-optimizer`` shards the optimizer state only (ZeRO-1; arguments.py:2997).
  Gradients and parameters are sharded by Megatron-FSDP (``--use-megatron-fsdp
  --data-parallel-sharding-strategy optim_grads|optim_grads_params``, arguments.py:3023;
  docs/user-guide/features/megatron_fsdp.md:426). Its validate_args does not refuse pp > 1
  (arguments.py:1100-1165; only ``--use-torch-fsdp2`` does, :1000), but Megatron documents,
  ships and tests it at pp 1 only (examples/megatron_fsdp/README.md:58 "PP=1", every
  functional test case with --use-megatron-fsdp has pipeline size 1) and this project's Megatron
  executor cannot run it (profiling/run.py: ZeRO 0 or 1): ZeRO 2/3 with pp > 1 is refused here.

DeepSpeed v0.19.5: ``PipelineEngine.__init__`` asserts ``zero_optimization_stage() <
ZeroStageEnum.gradients`` "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
(deepspeed/runtime/pipe/engine.py:76-77), for every PipelineModule; at pp 1 the plain
``DeepSpeedEngine`` (no PipelineModule) runs ZeRO 1-3. The PipelineEngine has no ring-attention
context parallelism and runs one contiguous stage per rank.
Its tensor parallelism is the user's layers (Megatron-DeepSpeed): whole heads per rank assumed.

torchtitan v0.2.2: seq % (tp * 2 cp) == 0, asserted in every model's parallelize
(models/llama3/infra/parallelize.py:70; distributed/parallel_dims.py:365-372); column-parallel
wq/wk/wv (parallelize.py:229-230) viewed as whole heads (model/model.py:256). Data parallelism
is FSDP2 with PP allowed (parallelize.py:125-139): ``fsdp_reshard_after_forward`` "always" is
ZeRO-3, "never" keeps parameters gathered from forward to backward (ZeRO-2-like; the default
with PP, :327); no ZeRO-1, DDP only as the sole parallelism (:151). The export runs ZeRO 0/1
as FSDP2 "never" (at pp 1 less memory than planned; under PP the ZeRO-2 memory below, which
its warning says), so torchtitan refuses no ZeRO stage.

torch pipelining (``profiling.run``): whole heads and KV heads per TP rank
(profiling/executors/parallelize.py:77); ZeRO 0-3 with PP (DDP, ZeroRedundancyOptimizer, FSDP2).
FSDP2 under PP, in torchtitan and ``profiling.run`` alike, is handed to ``PipelineStage``, which
reduce-scatters once per step (torch 2.13 pipelining/stage.py:844-847, 1164-1190): every layer's
unsharded weights and gradients stay all step, so ZeRO 2 and 3 are the same memory there
(ZeRO 3 adds a gather at each forward). The cost model plans that
(``solver.costs.states.reduces_per_step``), so no rule refuses them and the plan says so.

A runtime runs a layout when one of its engines does (``RUNTIME_ENGINES``): ``--runtime
megatron`` is Megatron-LM or DeepSpeed, ``--runtime torch`` torch pipelining or torchtitan. So
``--zero auto`` searches ZeRO 0..3 on both, with ZeRO 2/3 only at pp 1 on megatron; a pinned
``--zero 3 --pp 2 --runtime megatron`` exits 2 naming the rule. An export section of an engine
that refuses the plan's layout carries the refusal instead of settings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ENGINE_NAMES = {
    "megatron": "Megatron-LM",
    "deepspeed": "DeepSpeed",
    "torch": "torch pipelining",
    "torchtitan": "torchtitan",
}
"""Each engine (``solver.parallel.ENGINES``) as messages name it."""

RUNTIME_ENGINES = {"megatron": ("megatron", "deepspeed"), "torch": ("torch", "torchtitan")}
"""The engines of each ``--runtime``; a layout runs on a runtime when one of them runs it."""

EXPORT_ENGINE = {
    "torch_pipelining": "torch",
    "megatron": "megatron",
    "deepspeed": "deepspeed",
    "torchtitan": "torchtitan",
}
"""The engine of each ``plan.exports`` section."""

MEGATRON_VOCAB_MULTIPLE = 128
"""Megatron-LM's ``--make-vocab-size-divisible-by`` default (arguments.py:2358)."""

FACTS = ("attention_heads", "kv_heads", "vocab_size", "hidden_size", "num_experts", "layers")
"""The fields of a graph's ``meta.architecture``."""


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the rules read of a model: ``meta.architecture`` and ``meta.seq_len`` of its graph
    (None: unknown, the rules that need it are skipped)."""

    attention_heads: int | None = None
    kv_heads: int | None = None
    """Key/value heads (Megatron's query groups); equal to the heads without GQA/MQA."""
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_experts: int | None = None
    """Routed experts E of a MoE layer (None: dense)."""
    layers: int | None = None
    seq_len: int | None = None
    """Tokens per sequence s."""

    @classmethod
    def of_graph(cls, graph: Any) -> ModelFacts:
        """The facts a layer graph records; the routed experts also from its MoE layers."""
        meta = graph.meta if isinstance(graph.meta, dict) else {}
        given = meta.get("architecture")
        given = given if isinstance(given, dict) else {}
        facts = {name: _count(given.get(name)) for name in FACTS}
        from solver.costs.moe import num_routed_experts  # the experts the cost model splits

        facts["num_experts"] = num_routed_experts(graph) or facts["num_experts"]
        return cls(**facts, seq_len=_count(meta.get("seq_len")))


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True)
class Rule:
    """One rule of one or more engines: ``allows(degrees, facts)`` with every degree of
    ``degrees`` and fact of ``facts`` known; ``explain`` says what it needs, with the numbers."""

    key: str
    engines: tuple[str, ...]
    degrees: tuple[str, ...]
    facts: tuple[str, ...]
    allows: Callable[[Mapping[str, Any], ModelFacts], bool]
    explain: Callable[[Mapping[str, Any], ModelFacts], str]
    source: str


def _heads(d, f) -> str:
    return f"attention heads ({f.attention_heads}) divisible by tp ({d['tp']})"


RULES: tuple[Rule, ...] = (
    Rule(
        key="attention-heads",
        engines=("megatron", "deepspeed", "torch", "torchtitan"),
        degrees=("tp",),
        facts=("attention_heads",),
        allows=lambda d, f: f.attention_heads % d["tp"] == 0,
        explain=lambda d, f: f"tensor parallelism splits whole heads: needs {_heads(d, f)}",
        source="Megatron-LM transformer_config.py:1323; torchtitan model.py:256; "
        "profiling/executors/parallelize.py:77",
    ),
    Rule(
        key="kv-heads",
        engines=("megatron",),
        degrees=("tp",),
        facts=("kv_heads",),
        allows=lambda d, f: f.kv_heads % d["tp"] == 0 or d["tp"] % f.kv_heads == 0,
        explain=lambda d, f: (
            f"Megatron-core needs KV heads ({f.kv_heads}) a multiple or divisor of tp ({d['tp']})"
        ),
        source="Megatron-LM transformer_config.py:1338-1345, attention.py:353-366",
    ),
    Rule(
        key="kv-heads-whole",
        engines=("deepspeed", "torch", "torchtitan"),
        degrees=("tp",),
        facts=("kv_heads",),
        allows=lambda d, f: f.kv_heads % d["tp"] == 0,
        explain=lambda d, f: f"needs KV heads ({f.kv_heads}) divisible by tp ({d['tp']})",
        source="torchtitan parallelize.py:229-230, model.py:256; profiling/executors/"
        "parallelize.py:77",
    ),
    Rule(
        key="experts",
        engines=("megatron", "deepspeed", "torch", "torchtitan"),
        degrees=("ep",),
        facts=("num_experts",),
        allows=lambda d, f: f.num_experts % d["ep"] == 0,
        explain=lambda d, f: (
            f"each expert-parallel rank holds E / ep experts: needs the {f.num_experts} routed "
            f"experts divisible by ep ({d['ep']})"
        ),
        source="Megatron-LM moe_layer.py:185; torchtitan expert_parallel.py:108",
    ),
    Rule(
        key="context-parallel-chunks",
        engines=("megatron", "torch", "torchtitan"),
        degrees=("cp",),
        facts=("seq_len",),
        allows=lambda d, f: d["cp"] == 1 or f.seq_len % (2 * d["cp"]) == 0,
        explain=lambda d, f: (
            f"context parallelism cuts the sequence into 2 cp load-balanced chunks: needs the "
            f"sequence length ({f.seq_len}) divisible by 2 cp ({2 * d['cp']})"
        ),
        source="Megatron-LM megatron/core/utils.py:2456-2506; torchtitan parallel_dims.py:369",
    ),
    Rule(
        key="sequence-parallel",
        engines=("megatron", "deepspeed", "torch"),
        degrees=("tp", "cp", "sp"),
        facts=("seq_len",),
        allows=lambda d, f: not d["sp"] or f.seq_len % (d["cp"] * d["tp"]) == 0,
        explain=lambda d, f: (
            f"sequence parallelism splits each rank's s / cp tokens over tp: needs the sequence "
            f"length ({f.seq_len}) divisible by cp x tp ({d['cp'] * d['tp']})"
        ),
        source="Megatron-LM tensor_parallel/mappings.py:60-74",
    ),
    Rule(
        key="torchtitan-sequence",
        engines=("torchtitan",),
        degrees=("tp", "cp"),
        facts=("seq_len",),
        allows=lambda d, f: f.seq_len % (d["tp"] * 2 * d["cp"]) == 0,
        explain=lambda d, f: (
            f"torchtitan needs the sequence length ({f.seq_len}) divisible by tp x 2 cp "
            f"({d['tp'] * 2 * d['cp']})"
        ),
        source="torchtitan parallel_dims.py:365-372, llama3/infra/parallelize.py:70",
    ),
    Rule(
        key="megatron-moe-sequence-parallel",
        engines=("megatron",),
        degrees=("tp", "sp"),
        facts=("num_experts",),
        allows=lambda d, f: d["tp"] == 1 or bool(d["sp"]),
        explain=lambda d, f: (
            f"megatron-core trains MoE layers ({f.num_experts} experts) with tensor parallelism "
            f"(tp {d['tp']}) only under sequence parallelism (MoELayer.forward raises without)"
        ),
        source="Megatron-LM megatron/core/transformer/moe/moe_layer.py:379 (core_v0.16.1), :629 "
        "(core_v0.19.0)",
    ),
    Rule(
        key="megatron-zero",
        engines=("megatron",),
        degrees=("zero", "pp"),
        facts=(),
        allows=lambda d, f: d["zero"] <= 1 or d["pp"] == 1,
        explain=lambda d, f: (
            f"Megatron-LM's distributed optimizer is ZeRO-1; ZeRO-{d['zero']} needs Megatron-FSDP, "
            "which Megatron runs at pp 1 only"
        ),
        source="Megatron-LM arguments.py:2997, 3023, 1100-1165; "
        "examples/megatron_fsdp/README.md:58",
    ),
    Rule(
        key="deepspeed-zero",
        engines=("deepspeed",),
        degrees=("zero", "pp"),
        facts=(),
        allows=lambda d, f: d["zero"] <= 1 or d["pp"] == 1,
        explain=lambda d, f: (
            f"DeepSpeed's PipelineEngine refuses ZeRO-{d['zero']} ('ZeRO-2 and ZeRO-3 are "
            "incompatible with pipeline parallelism'; at pp 1 its plain engine runs them)"
        ),
        source="DeepSpeed deepspeed/runtime/pipe/engine.py:76-77",
    ),
    Rule(
        key="deepspeed-context-parallel",
        engines=("deepspeed",),
        degrees=("cp",),
        facts=(),
        allows=lambda d, f: d["cp"] == 1,
        explain=lambda d, f: "DeepSpeed's PipelineEngine has no ring-attention context parallelism",
        source="DeepSpeed deepspeed/runtime/pipe/engine.py (no cp group)",
    ),
    Rule(
        key="deepspeed-interleaving",
        engines=("deepspeed",),
        degrees=("virtual_stages",),
        facts=(),
        allows=lambda d, f: d["virtual_stages"] == 1,
        explain=lambda d, f: "DeepSpeed's PipelineEngine runs one contiguous stage per rank",
        source="DeepSpeed deepspeed/runtime/pipe/schedule.py (TrainSchedule)",
    ),
)
"""Every rule of every engine, the one table the searches, pins, evaluate and exports read."""


@dataclass(frozen=True)
class Refusal:
    """Why a runtime (or one engine) refuses a layout: the first broken rule of each engine."""

    runtime: str
    broken: tuple[tuple[str, Rule, str], ...]
    """(engine, rule, explanation) per refusing engine."""

    @property
    def keys(self) -> tuple[str, ...]:
        """The broken rules' keys, one per engine."""
        return tuple(rule.key for _, rule, _ in self.broken)

    def text(self) -> str:
        """'Megatron-LM and DeepSpeed: ...' or 'Megatron-LM: ...; DeepSpeed: ...': the engines
        that broke the same rule together (an engine its explanation names is not repeated)."""
        engines: dict[str, list[str]] = {}
        for engine, _, explanation in self.broken:
            engines.setdefault(explanation, []).append(ENGINE_NAMES[engine])
        parts = []
        for explanation, names in engines.items():
            names = [name for name in names if name not in explanation]
            parts.append(f"{' and '.join(names)}: {explanation}" if names else explanation)
        return "; ".join(parts)


def degrees_of(config: Any) -> dict[str, Any]:
    """The degrees the rules read of a ``specs.ParallelConfig`` (or anything with its fields)."""
    keys = ("pp", "tp", "cp", "dp", "ep", "zero", "sp", "virtual_stages")
    return {key: getattr(config, key) for key in keys if hasattr(config, key)}


def broken_rules(
    degrees: Mapping[str, Any], facts: ModelFacts, engine: str
) -> list[tuple[Rule, str]]:
    """The rules of ``engine`` that ``degrees`` (a partial layout: an absent degree is unknown)
    break on a model of ``facts``, with their explanations; rules with an unknown input skipped."""
    broken = []
    for rule in RULES:
        if engine not in rule.engines or not applies(rule, degrees, facts):
            continue
        if not rule.allows(degrees, facts):
            broken.append((rule, rule.explain(degrees, facts)))
    return broken


def applies(rule: Rule, degrees: Mapping[str, Any], facts: ModelFacts) -> bool:
    """Every degree and fact ``rule`` reads is known."""
    return all(degrees.get(key) is not None for key in rule.degrees) and all(
        getattr(facts, name) is not None for name in rule.facts
    )


def engine_refusal(degrees: Mapping[str, Any], facts: ModelFacts, engine: str) -> str | None:
    """Why ``engine`` refuses the layout (its first broken rule), None when it runs it."""
    broken = broken_rules(degrees, facts, engine)
    if not broken:
        return None
    rule, explanation = broken[0]
    name = ENGINE_NAMES[engine]
    return explanation if name in explanation else f"{name}: {explanation}"


def runtime_refusal(degrees: Mapping[str, Any], facts: ModelFacts, runtime: str) -> Refusal | None:
    """The refusal when every engine of ``runtime`` refuses the layout, else None."""
    broken = []
    for engine in RUNTIME_ENGINES[runtime]:
        rules = broken_rules(degrees, facts, engine)
        if not rules:
            return None
        broken.append((engine, *rules[0]))
    return Refusal(runtime=runtime, broken=tuple(broken))


def skipped_facts(degrees: Mapping[str, Any], facts: ModelFacts, runtime: str) -> list[str]:
    """The model facts the runtime's rules would read for ``degrees`` but the graph lacks
    (rules skipped), for the plan's note; rules whose degrees are trivial (1, ZeRO 0) skipped."""
    engines = set(RUNTIME_ENGINES[runtime])
    missing = []
    for rule in RULES:
        if not engines & set(rule.engines):
            continue
        if any(degrees.get(key) in (None, 1, False) for key in rule.degrees if key != "zero"):
            continue
        missing += [name for name in rule.facts if getattr(facts, name) is None]
    return list(dict.fromkeys(missing))


def padded_vocab_size(vocab_size: int, tp: int, runtime: str) -> int:
    """Rows of the embedding and output layer as the runtime builds them: Megatron pads the
    vocabulary to a multiple of 128 tp (``calculate_padded_vocab_size``,
    megatron/training/vocab_utils.py:45-58); torch and torchtitan keep it (DTensor shards it
    unevenly)."""
    if runtime != "megatron":
        return vocab_size
    multiple = MEGATRON_VOCAB_MULTIPLE * tp
    return math.ceil(vocab_size / multiple) * multiple


def check_config(config: Any, facts: ModelFacts, runtime: str, *, where: str) -> None:
    """InputError (exit 2) when no engine of ``runtime`` runs ``config`` (a
    ``specs.ParallelConfig``): ``where``, the config, the rule and the engines."""
    refusal = runtime_refusal(degrees_of(config), facts, runtime)
    if refusal is not None:
        from solver.errors import InputError

        raise InputError(
            f"{where}config {config.label()}: on --runtime {runtime}, {refusal.text()}; "
            "python -m solver.plan proposes only layouts an engine of the runtime runs"
        )


def refuse_export_sections(
    sections: dict[str, Any], config: Any, facts: ModelFacts
) -> dict[str, Any]:
    """``plan.exports`` with the section of every engine that refuses ``config`` replaced by
    ``{"refused": why}``: an export never carries a layout its engine refuses."""
    degrees = degrees_of(config)
    result = {}
    for name, section in sections.items():
        engine = EXPORT_ENGINE.get(name)
        refusal = None if engine is None else engine_refusal(degrees, facts, engine)
        result[name] = section if refusal is None else {"refused": refusal}
    return result


def implementation_warning(meta: Mapping[str, Any], runtime: str, *, graph: str) -> str | None:
    """The one line a plan gets when its graph profiled another implementation's modules than
    the runtime runs (``meta.implementation``, ``profiling.export --implementation``; an hf:
    graph without it is transformers'): the megatron runtime runs megatron-core's layers, the
    others transformers' (their saved tensors, loss and experts differ: a few % of a stage's
    peak, benchmarks/bench_accuracy_hf_megatron.md). None when they agree, when the graph is no
    hf: model's, or when megatron-core cannot run the model (``meta.megatron_expressible``
    false or absent: nothing to re-export to)."""
    implementation = meta.get("implementation") or ("transformers" if "hf_class" in meta else None)
    wanted = "megatron" if runtime == "megatron" else "transformers"
    if implementation is None or implementation == wanted:
        return None
    if wanted == "megatron" and not meta.get("megatron_expressible"):
        return None  # no megatron-core profile to re-export to (or a graph from before the field)
    return (
        f"warning: {graph} profiles {implementation} modules (meta.implementation) and "
        f"--runtime {runtime} runs {wanted} modules, which keep other tensors; re-export with "
        f"python -m profiling.export hf:... --implementation {wanted}"
    )
