"""What a user would run instead of the plan, each at its best config: baseline families (an
engine's own split and recomputation settings) searched over the planner's candidate configs
(pp, tp, cp, dp, ep, micro-batch, ZeRO, interleaving, SP), keeping per family the fastest config
that fits and its smallest peak (``Plan.best_baselines``).

A family is what one engine does with its own flags; its configs are only those the engine runs
(``engine_rules.engine_refusal``), on the plan's runtime (``engine_rules.RUNTIME_ENGINES``: the
megatron runtime's buffers are Megatron-LM's and DeepSpeed's, the torch runtime's torchtitan's),
evaluated exactly by the cost model like any plan (``evaluation.evaluate_assignment``).

- megatron-even: Megatron-LM's default split (``baselines.even_split``), no recomputation.
- megatron-embedding / megatron-loss / megatron-embedding-loss:
  ``--account-for-embedding-in-pipeline-split`` and/or ``--account-for-loss-in-pipeline-split``:
  each counts as one more layer of the split, ``(blocks + e + l) / p`` per (virtual) stage, the
  first stage holding one block fewer for the embedding, the last one fewer for the loss
  (megatron/core/transformer/transformer_layer.py ``get_transformer_layer_offset``); Megatron
  asserts the division, so a config where it is not whole is not run.
- megatron-recompute-uniform: the even split with ``--recompute-granularity full
  --recompute-method uniform --recompute-num-layers 1``: every block recomputed, its input
  stored. N > 1 (one checkpoint per N blocks, all N re-materialised in the backward) is not
  expressible per layer and not searched.
- megatron-recompute-block: the even split with ``--recompute-method block
  --recompute-num-layers N``: the first N blocks of every (virtual) stage recomputed, N searched
  (the smallest N that fits for the fastest; every block of a stage for the smallest peak).
- deepspeed-uniform / deepspeed-parameters / deepspeed-transformer: PipelineModule's
  ``partition_method`` "uniform", "parameters" and "type:transformer" (the min-max split of
  block counts: ``partition_balanced`` on weights 1 per block, 0 otherwise), with no or every
  block recomputed (``activation_checkpoint_interval`` 0 or 1).
- torchtitan: FSDP2 (ZeRO 3 at pp 1; under PP its default ``reshard_after_forward`` "never", ZeRO
  2 here, the same memory on the torch runtime) with its pipeline split
  (``generate_llm_fqn_per_model_part``: embedding and norm+output one layer each, the remainder
  one more to the first stages) and ``activation_checkpoint.mode`` none, full, or selective with
  ``selective_ac_option = "2"`` (its JobConfig default: every second block of a rank wrapped in
  ``checkpoint_wrapper``): exact per block. The op-level option (``"op"``, in its example
  configs) saves matmul outputs inside every block, which a per-layer model cannot express; it
  stores more than full and less than none, and is not searched: the family may be slower than
  a user's op-level run where memory binds, and is never below its memory.

ZeRO: the family's engine's usual stage (Megatron-LM's distributed optimizer and DeepSpeed's
ZeRO-1: 1; torchtitan's FSDP2) beside the planner's ``--zero`` stages. Recomputation is the
family's own knob whatever ``--recompute`` says: a user runs it.

"Best" is per family the fastest fitting (config, setting), and the smallest peak of any; the
smallest peak fits exactly when anything does. Configs are visited in order of their lower
bounds (``candidates.time_lower_bound``, ``memory_lower_bound``, valid for any split and
recomputation) and the visit stops once the bound passes the best found, so large clusters cost
a few evaluations per family. Each visit looks at the deadline; when it passes the families
keep what they found and say so.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from solver.costs import LayerCosts, iteration_bound_ns, layer_costs, stage_costs
from solver.costs.graph_inputs import layer_roles
from solver.costs.moe import num_routed_experts
from solver.deadline import Deadline
from solver.engine_rules import (
    ENGINE_NAMES,
    RUNTIME_ENGINES,
    ModelFacts,
    degrees_of,
    engine_refusal,
)
from solver.errors import InputError
from solver.evaluation import Evaluation, evaluate_assignment
from solver.graph import LayerGraph
from solver.report.baselines import (
    counts_to_assignment,
    even_split,
    min_max_blocks,
    parameter_balanced_split,
    uniform_split,
)
from solver.search.candidates import candidate_configs, memory_lower_bound, time_lower_bound
from solver.specs import Cluster, ParallelConfig, TrainingConfig

Split = Callable[[LayerGraph, int], list[int] | None]
"""(graph, (virtual) stage count) -> a stage per layer, or None where the engine refuses it."""


def _parts(graph: LayerGraph) -> tuple[int, int, int]:
    """(lead, blocks, tail): an embedding first and a head last, as ``even_split`` counts them."""
    roles = layer_roles(graph)
    lead = 1 if roles[0] == "embedding" else 0
    tail = 1 if roles[-1] == "head" and len(roles) > lead + 1 else 0
    return lead, len(roles) - lead - tail, tail


def megatron_accounted_split(
    graph: LayerGraph, num_stages: int, *, embedding: bool, loss: bool
) -> list[int] | None:
    """Megatron's even split with the embedding and/or the loss counted as one layer each:
    (blocks + e + l) / p blocks per stage, e fewer on the first, l fewer on the last; None
    where Megatron refuses it (the division not whole, a stage left without a layer)."""
    lead, blocks, tail = _parts(graph)
    e, l_ = int(embedding), int(loss)
    total = blocks + e + l_
    if total % num_stages:
        return None
    per = total // num_stages
    counts = [per] * num_stages
    counts[0] += lead - e
    counts[-1] += tail - l_
    if min(counts) < 1:
        return None
    return counts_to_assignment(counts)


def torchtitan_split(graph: LayerGraph, num_stages: int) -> list[int] | None:
    """torchtitan's ``generate_llm_fqn_per_model_part`` (input and output weight 1): blocks + 2
    effective layers, ``// p`` per stage and the remainder one more to the first stages; the
    first stage holds the embedding in place of one, the last norm+output; None where it raises
    (a stage of no effective layer, a weight above the per-stage count)."""
    lead, blocks, tail = _parts(graph)
    if num_stages == 1:
        return [0] * graph.num_layers
    effective = blocks + 2
    per, extra = divmod(effective, num_stages)
    if per < 1:
        return None
    counts = [per + (1 if s < extra else 0) for s in range(num_stages)]
    counts[0] -= 1
    counts[-1] -= 1
    counts[0] += lead
    counts[-1] += tail
    if min(counts) < 1:
        return None
    return counts_to_assignment(counts)


def transformer_balanced_split(graph: LayerGraph, num_stages: int) -> list[int]:
    """DeepSpeed ``partition_method="type:transformer"``: the min-max split of block counts (a
    block weighs 1, any other layer 0; ``baselines.min_max_blocks``, first parts fuller)."""
    weights = (np.array(layer_roles(graph), dtype=object) == "block").astype(np.int64)
    if not weights.any():
        weights[:] = 1
    return min_max_blocks(weights, num_stages)


Recompute = Callable[[LayerGraph, list[int], int, int], list[bool]]
"""(graph, stage per layer, pipeline ranks, N) -> recomputed flag per layer."""


def _blocks(graph: LayerGraph) -> np.ndarray:
    return np.array(layer_roles(graph), dtype=object) == "block"


def no_recompute(graph, stage_of_layer, ranks, n) -> list[bool]:
    return [False] * graph.num_layers


def every_block(graph, stage_of_layer, ranks, n) -> list[bool]:
    """Megatron uniform N = 1, DeepSpeed interval 1, torchtitan ``mode = "full"``."""
    return _blocks(graph).tolist()


def first_blocks(graph, stage_of_layer, ranks, n) -> list[bool]:
    """Megatron ``--recompute-method block --recompute-num-layers n``: the first n blocks of
    every (virtual) stage (a model chunk's ``TransformerBlock``)."""
    blocks = _blocks(graph)
    seen: dict[int, int] = {}
    flags = []
    for layer, stage in enumerate(stage_of_layer):
        position = seen.get(stage, 0)
        flags.append(bool(blocks[layer]) and position < n)
        seen[stage] = position + int(blocks[layer])
    return flags


def every_second_block(graph, stage_of_layer, ranks, n) -> list[bool]:
    """torchtitan layer SAC, ``selective_ac_option = "2"``: a counter over the blocks each rank
    wraps (its chunks in order) checkpoints those where it reaches a multiple of 2."""
    blocks = _blocks(graph)
    order = sorted(range(graph.num_layers), key=lambda i: (stage_of_layer[i] % ranks, i))
    counts: dict[int, int] = {}
    flags = [False] * graph.num_layers
    for layer in order:
        if blocks[layer]:
            rank = stage_of_layer[layer] % ranks
            counts[rank] = counts.get(rank, 0) + 1
            flags[layer] = counts[rank] % 2 == 0
    return flags


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One recomputation setting of a family: its flags, and N searched when ``searched``."""

    label: str
    flags: Recompute
    searched: bool = False


NONE = Setting(label="no recompute", flags=no_recompute)
FULL = Setting(label="recompute every block", flags=every_block)


@dataclass(frozen=True, kw_only=True)
class Family:
    """A baseline a user runs: an engine, its split, its recomputation settings, its ZeRO."""

    name: str
    engine: str
    source: str
    split: Split
    settings: tuple[Setting, ...] = (NONE,)
    usual_zero: int | None = None
    """The engine's usual ZeRO stage, searched beside the planner's (None: only the planner's)."""
    fsdp: bool = False
    """torchtitan: ZeRO 3 at pp 1, 2 under PP (FSDP2's default reshard_after_forward)."""

    def zero_ok(self, config: ParallelConfig, stages: tuple[int, ...]) -> bool:
        if config.dp * config.cp == 1:
            return True  # ZeRO changes nothing without sharding ranks
        if self.fsdp:
            return config.zero == (3 if config.pp == 1 else 2)
        return config.zero in stages or config.zero == self.usual_zero


def _accounted(embedding: bool, loss: bool) -> Split:
    return lambda graph, n: megatron_accounted_split(graph, n, embedding=embedding, loss=loss)


FAMILIES = (
    Family(name="megatron-even", engine="megatron", source="Megatron-LM default split",
           split=even_split, usual_zero=1),
    Family(name="megatron-embedding", engine="megatron",
           source="--account-for-embedding-in-pipeline-split", split=_accounted(True, False),
           usual_zero=1),
    Family(name="megatron-loss", engine="megatron",
           source="--account-for-loss-in-pipeline-split", split=_accounted(False, True),
           usual_zero=1),
    Family(name="megatron-embedding-loss", engine="megatron",
           source="--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
           split=_accounted(True, True), usual_zero=1),
    Family(name="megatron-recompute-uniform", engine="megatron",
           source="even split, --recompute-method uniform --recompute-num-layers 1",
           split=even_split, settings=(FULL,), usual_zero=1),
    Family(name="megatron-recompute-block", engine="megatron",
           source="even split, --recompute-method block --recompute-num-layers N",
           split=even_split,
           settings=(Setting(label="recompute block N", flags=first_blocks, searched=True),),
           usual_zero=1),
    Family(name="deepspeed-uniform", engine="deepspeed", source='partition_method="uniform"',
           split=uniform_split, settings=(NONE, FULL), usual_zero=1),
    Family(name="deepspeed-parameters", engine="deepspeed",
           source='partition_method="parameters"', split=parameter_balanced_split,
           settings=(NONE, FULL), usual_zero=1),
    Family(name="deepspeed-transformer", engine="deepspeed",
           source='partition_method="type:transformer"', split=transformer_balanced_split,
           settings=(NONE, FULL), usual_zero=1),
    Family(name="torchtitan", engine="torchtitan",
           source="FSDP2, its pipeline split, activation_checkpoint none/full/selective 2",
           split=torchtitan_split, fsdp=True,
           settings=(NONE, Setting(label="selective_ac_option 2", flags=every_second_block),
                     Setting(label="ac full", flags=every_block))),
)  # fmt: skip
"""Every family (module docstring), in report order."""


@dataclass(kw_only=True)
class Candidate:
    """One evaluated (config, split, recomputation) of a family."""

    evaluation: Evaluation
    setting: str
    """The recomputation setting, e.g. "recompute block N=2"."""


@dataclass(kw_only=True)
class FamilyBest:
    """A family at its best: the fastest config that fits and the smallest peak."""

    family: Family
    fastest: Candidate | None = None
    """The fastest fitting candidate; None when none fits (or none was evaluated)."""
    smallest: Candidate | None = None
    """The smallest peak of any candidate: it fits exactly when any does."""
    configs: int = 0
    """Candidate configs the engine runs."""
    evaluated: int = 0
    complete: bool = True
    """Every config was evaluated or pruned by its bounds before the deadline."""

    @property
    def fits(self) -> bool:
        return self.fastest is not None


@dataclass(kw_only=True)
class BestBaselines:
    """Every family of the plan's runtime at its best, and why any was cut short."""

    families: list[FamilyBest]
    notes: list[str] = field(default_factory=list)

    @property
    def fastest(self) -> FamilyBest | None:
        """The family whose fastest fitting config is the fastest (None: none fits)."""
        fitting = [f for f in self.families if f.fastest is not None]
        return max(
            fitting,
            key=lambda f: (f.fastest.evaluation.throughput, -f.fastest.evaluation.peak_bytes),
            default=None,
        )

    @property
    def smallest(self) -> FamilyBest | None:
        """The family with the smallest peak of all."""
        found = [f for f in self.families if f.smallest is not None]
        return min(found, key=lambda f: f.smallest.evaluation.peak_bytes, default=None)


KEPT_LAYERS = 2**21
"""Config x layer coefficients kept in memory at once (about 100 bytes a layer: 200 MiB), at
least 16 configs' worth: the other configs keep their bounds only and are rebuilt when a family
evaluates them (few: the bounds prune)."""

MAX_LAYERS = 100_000
"""Graphs above this many layers get no baseline search (a note says so): one config's
coefficients take a second there, and the plan's own search needs the time."""


@dataclass(kw_only=True)
class _Entry:
    config: ParallelConfig
    costs_of: Callable[[ParallelConfig], LayerCosts] = field(repr=False)
    time_bound: int
    memory_bound: int
    evaluations: dict[bytes, Evaluation] = field(default_factory=dict)
    """Full evaluations by (split, flags): families that share a split share its simulation."""

    @property
    def costs(self) -> LayerCosts:
        return self.costs_of(self.config)


def best_baselines(
    graph: LayerGraph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    deadline: Deadline,
    families: tuple[Family, ...] = FAMILIES,
    plan_zero: bool = False,
    configs: list[ParallelConfig] | None = None,
    faster_than_ns: int | None = None,
) -> BestBaselines:
    """Each family of ``training.runtime`` at its best config (module docstring); ``training``
    as the planner prepared it (``evaluation.prepare_training``). ``plan_zero``: only the plan's
    ZeRO stages, not the engine's usual one beside them (the planner's seeds,
    ``solver.search.seeds``). ``configs``: only these of the candidate configs (the seeds'
    configs that may beat the plan's search). ``faster_than_ns``: only the fastest fitting
    config, and only when its simulated iteration is shorter (the seeds: no smallest peak)."""
    if cluster.is_heterogeneous or training.memory_model != "analytic":
        return BestBaselines(
            families=[],
            notes=["baselines at their best config: analytic memory model on one GPU type only"],
        )
    if deadline.expired():
        return BestBaselines(
            families=[],
            notes=["time limit reached before the baselines at their best config were searched"],
        )
    if graph.num_layers > MAX_LAYERS:
        return BestBaselines(
            families=[],
            notes=[
                f"baselines at their best config: not searched above {MAX_LAYERS} layers "
                "(python -m solver.evaluate --split even evaluates one config)"
            ],
        )
    engines = RUNTIME_ENGINES[training.runtime]
    chosen = [family for family in families if family.engine in engines]
    search = dataclasses.replace(training, zero_stages=(0, 1, 2, 3), recompute="selective")
    facts = ModelFacts.of_graph(graph)
    try:
        candidates = candidate_configs(
            graph.num_layers,
            cluster,
            search,
            num_experts=num_routed_experts(graph),
            facts=facts,
        )
    except InputError as error:
        return BestBaselines(families=[], notes=[f"no baseline config: {error}"])
    if configs is not None:
        kept = set(configs)
        configs = [c for c in candidates if c in kept]
    else:
        configs = candidates
    entries: dict[ParallelConfig, _Entry] = {}
    costs_of = functools.lru_cache(maxsize=max(16, KEPT_LAYERS // graph.num_layers))(
        lambda config: layer_costs(graph, config, cluster, training)
    )
    result = BestBaselines(families=[])
    for family in chosen:
        mine = [
            c
            for c in configs
            if family.zero_ok(c, training.zero_stages)
            and (not plan_zero or c.dp * c.cp == 1 or c.zero in training.zero_stages)
            and engine_refusal(degrees_of(c), facts, family.engine) is None
        ]
        best = FamilyBest(family=family, configs=len(mine))
        result.families.append(best)
        try:
            search = _FamilySearch(
                best=best, graph=graph, cluster=cluster, training=training, deadline=deadline,
                cutoff_ns=faster_than_ns,
            )  # fmt: skip
            _search_family(search, mine, entries, costs_of)
        except InputError as error:  # a calibration taking a baseline's stage below its states
            best.complete = False
            result.notes.append(f"{family.name} baseline search stopped: {error}")
            continue
        if not best.complete:
            result.notes.append(
                f"time limit reached during the {family.name} baseline search ({best.evaluated} "
                f"candidates evaluated): its best is among those; raise --time-limit"
            )
    return result


def _entry(entries, config, costs_of) -> _Entry:
    """The config's bounds, computed once for every family."""
    if config not in entries:
        costs = costs_of(config)
        entries[config] = _Entry(
            config=config,
            costs_of=costs_of,
            time_bound=time_lower_bound(costs),
            memory_bound=memory_lower_bound(costs),
        )
    return entries[config]


def _search_family(search: _FamilySearch, configs, entries, costs_of) -> None:
    """Fastest fitting config by ascending time bound (configs whose memory bound is over the
    usable memory skipped), then the smallest peak by ascending memory bound, each stopping once
    the bound cannot beat the best found. Stage peaks come first (cheap); the schedule is
    simulated only for a fitting split whose iteration bound may beat the best."""
    best, deadline = search.best, search.deadline
    found: list[_Entry] = []
    for config in configs:
        if deadline.expired():
            best.complete = False
            return
        found.append(_entry(entries, config, costs_of))
    try:
        _visit(search, found)
    except _OutOfTime:
        best.complete = False
    if search.smallest is not None and not deadline.expired():
        _, entry, setting, n = search.smallest
        best.smallest = search.candidate(entry, setting, n)


def _faster(candidate: Candidate, best: Candidate) -> bool:
    """Shorter iteration, or as short at a smaller peak: of equally fast configs a user keeps
    the one with the most headroom."""
    ours, theirs = candidate.evaluation, best.evaluation
    return (ours.iteration_ns, ours.peak_bytes) < (theirs.iteration_ns, theirs.peak_bytes)


class _OutOfTime(Exception):
    """The deadline passed between two evaluations of a family's search."""


def _visit(search: _FamilySearch, found: list[_Entry]) -> None:
    """The two passes of ``_search_family`` (its docstring)."""
    best, training, graph = search.best, search.training, search.graph
    usable = training.usable_bytes(search.cluster.gpu_memory_bytes)
    for entry in sorted(found, key=lambda e: e.time_bound):
        if search.fastest_ns is not None and entry.time_bound > search.fastest_ns:
            break  # (a tie may still hold a smaller peak)
        if entry.memory_bound > usable:
            continue
        for setting in best.family.settings:
            search.fastest_of(entry, setting)
    if search.cutoff_ns is not None:
        return  # the seeds: the fastest only
    for entry in sorted(found, key=lambda e: e.memory_bound):
        if search.smallest is not None and entry.memory_bound >= search.smallest[0]:
            break
        for setting in best.family.settings:
            n = _most_blocks(best.family, graph, entry) if setting.searched else 0
            search.peak(entry, setting, n)


@dataclass(kw_only=True)
class _FamilySearch:
    """One family's search state: stage costs per (config, setting, N), the best found."""

    best: FamilyBest
    graph: LayerGraph
    cluster: Cluster
    training: TrainingConfig
    deadline: Deadline
    smallest: tuple[int, _Entry, Setting, int] | None = None
    """(peak, entry, setting, N) of the smallest peak so far."""
    splits: dict = field(default_factory=dict)
    cutoff_ns: int | None = None
    """Only a fastest run shorter than this counts (``best_baselines``'s ``faster_than_ns``)."""

    @property
    def fastest_ns(self) -> int | None:
        fastest = self.best.fastest
        if fastest is None:
            return self.cutoff_ns
        return fastest.evaluation.iteration_ns

    def _split_and_flags(self, entry: _Entry, setting: Setting, n: int):
        key = entry.costs.num_stages
        if key not in self.splits:
            self.splits[key] = self.best.family.split(self.graph, key)
        split = self.splits[key]
        if split is None:
            return None, None
        return split, setting.flags(self.graph, split, entry.costs.num_ranks, n)

    def peak(self, entry: _Entry, setting: Setting, n: int) -> tuple[int, list] | None:
        """The split's largest stage peak and its stages (None where the engine refuses the
        split); the smallest peak so far is kept."""
        split, flags = self._split_and_flags(entry, setting, n)
        if split is None:
            return None
        if self.deadline.expired():
            raise _OutOfTime
        stages = stage_costs(entry.costs, split, flags)
        self.best.evaluated += 1
        peak = max(stage.peak_bytes for stage in stages)
        if self.smallest is None or peak < self.smallest[0]:
            self.smallest = (peak, entry, setting, n)
        return peak, stages

    def fits(self, entry: _Entry, setting: Setting, n: int) -> bool:
        found = self.peak(entry, setting, n)
        usable = self.training.usable_bytes(self.cluster.gpu_memory_bytes)
        return found is not None and found[0] <= usable

    def fastest_of(self, entry: _Entry, setting: Setting) -> None:
        """The setting's fastest fitting run on this config (for a searched N the smallest N
        that fits, by bisection: more recomputed blocks never take more memory nor less time),
        kept when it beats the best."""
        n = 0
        if setting.searched:
            most = _most_blocks(self.best.family, self.graph, entry)
            if not self.fits(entry, setting, most):
                return
            low, high = 0, most
            while low < high:
                middle = (low + high) // 2
                if self.fits(entry, setting, middle):
                    high = middle
                else:
                    low = middle + 1
            n = low
        elif not self.fits(entry, setting, 0):
            return
        _, stages = self.peak(entry, setting, n)
        if self.fastest_ns is not None and iteration_bound_ns(entry.costs, stages) > (
            self.fastest_ns
        ):
            return
        if self.deadline.expired():
            raise _OutOfTime
        candidate = self.candidate(entry, setting, n)
        if self.best.fastest is None or _faster(candidate, self.best.fastest):
            self.best.fastest = candidate

    def candidate(self, entry: _Entry, setting: Setting, n: int) -> Candidate:
        """The full evaluation (simulated schedule) of a split the search keeps."""
        split, flags = self._split_and_flags(entry, setting, n)
        key = np.asarray(split, dtype=np.int64).tobytes() + np.asarray(flags, bool).tobytes()
        if key not in entry.evaluations:
            entry.evaluations[key] = evaluate_assignment(
                self.graph, entry.costs, split, cluster=self.cluster, training=self.training,
                recomputed=flags,
            )  # fmt: skip
        evaluation = entry.evaluations[key]
        label = setting.label.replace(" N", f" N={n}") if setting.searched else setting.label
        return Candidate(evaluation=evaluation, setting=label if any(flags) else "no recompute")


def _most_blocks(family: Family, graph: LayerGraph, entry: _Entry) -> int:
    """The most blocks a (virtual) stage of the family's split holds (0 with no split)."""
    split = family.split(graph, entry.costs.num_stages)
    if split is None:
        return 0
    blocks = _blocks(graph)
    return int(np.bincount(np.asarray(split)[blocks], minlength=1).max()) if blocks.any() else 0


def describe(candidate: Candidate) -> str:
    """'pp4 tp2 dp2 b1 m16 zero1 1f1b sp, no recompute' (the config's selective label dropped:
    the setting says what is recomputed)."""
    label = candidate.evaluation.config.label().replace(" selective-recompute", "")
    return f"{label}, {candidate.setting}"


def engine_name(family: Family) -> str:
    return ENGINE_NAMES[family.engine]
