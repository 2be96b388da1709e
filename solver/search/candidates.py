"""Valid parallel configurations (pp, tp, cp, dp, micro-batch, ZeRO, recompute) and their lower
bounds.

Rules: pp * tp * cp * dp = number of GPUs; tp divides gpus_per_node (tensor parallelism stays
inside a node); pp <= number of layers (every stage holds a layer); dp * micro_batch divides the
global batch (m = B / (dp b) micro-batches per step). ZeRO stages only differ when dp * cp > 1
(they shard over both), so with dp = cp = 1 only the smallest requested stage is kept, and ZeRO 1
dominates ZeRO 0 (``searched_zero_stages``), so ZeRO 0 is left out when both are asked for. Expert
parallelism: ep | dp, from ``TrainingConfig.ep`` or, auto, every ep dividing dp and the graph's
routed experts (``expert_parallel_degrees``). Sequence parallelism
(``TrainingConfig.sequence_parallel`` on or auto) goes with every tp > 1 (it only splits
activations further, and its communication costs what TP's all-reduces cost), never with tp = 1.

Context parallelism (``TrainingConfig.cp``, candidate degrees c): pp * tp * cp * dp = GPUs, each
c of the list that divides gpus / (pp tp). Megatron-LM orders ranks tp fastest, then cp
(``--rank-order tp-cp-ep-dp-pp``), so a stage's tp * cp GPUs are consecutive: one node's when
tp * cp divides gpus_per_node. That is not required (Llama 3 405B trained its 131K-token stage
with tp 8 and cp 16, the cp ring across nodes; Dubey et al. 2024): the cost model takes the
intra-node bandwidth for the K/V ring when tp * cp divides gpus_per_node and the inter-node one
otherwise (``costs.ring_bytes_per_ns``), and the search weighs that.

Heterogeneous clusters (``Cluster.groups``): every stage runs on tp * cp * dp GPUs of one node
group, and every GPU is used, so tp divides every group's GPUs per node (``Cluster.gpus_per_node``
is their gcd) and tp * cp * dp divides every group's GPU count; group k then hosts exactly
gpus_k / (tp cp dp) stages (``stages_per_group``), which sum to pp. ``--recompute auto`` is
none and full there too, selective when neither fits (the placed formulation takes the recompute
decision).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from solver import parallel
from solver.costs import LayerCosts, iteration_floor_ns
from solver.costs.schedule_time import MAX_SCHEDULE_ACTIONS, check_schedule_size, schedule_size
from solver.engine_rules import ModelFacts
from solver.errors import InputError
from solver.search.rule_checks import RuleFilter, check_pinned_rules
from solver.specs import Cluster, ParallelConfig, TrainingConfig

MAX_CONFIG_LAYERS = 2**23
"""Most (candidate config x layer) pairs a search may hold: every config keeps per-layer
coefficients (about 100 bytes a layer, ``costs.LayerCosts``), so this keeps them under
about 1 GiB; a larger search is an InputError that says how to narrow it."""


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending, from its prime factors (fast for any 64-bit n: a GPU
    count of 1,000,000,007 is not a loop to n)."""
    result = [1]
    for prime, power in _prime_factors(n).items():
        result = [d * prime**k for d in result for k in range(power + 1)]
    return sorted(result)


def _prime_factors(n: int) -> dict[int, int]:
    """{prime: exponent} of n >= 1: trial division by small primes, then Miller-Rabin and
    Pollard-Brent rho for what is left (each step O(n^(1/4)))."""
    if n < 1:
        raise ValueError(f"divisors of {n}: need n >= 1")
    factors: dict[int, int] = {}
    for prime in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        while n % prime == 0:
            factors[prime] = factors.get(prime, 0) + 1
            n //= prime
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if _is_prime(m):
            factors[m] = factors.get(m, 0) + 1
            continue
        d = _pollard_brent(m)
        stack += [d, m // d]
    return factors


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the first 12 prime bases: exact below 3.3e24 (n has no factor <= 37)."""
    if n < 2:
        return False
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for base in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if base % n == 0:
            return True
        x = pow(base, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _pollard_brent(n: int) -> int:
    """A non-trivial factor of the odd composite n (Brent's cycle finding, batched gcds)."""
    for c in range(1, n):
        y, m, g, r, q = 2, 128, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(m, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += m
            r *= 2
        if g == n:  # the batch overshot: step one by one
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise AssertionError(f"no factor found for {n}")


def check_pinned_degrees(cluster: Cluster, training: TrainingConfig) -> None:
    """Explain, with the numbers, why pinned pp/tp/dp (and one cp above 1) cannot work on this
    cluster (``parallel.check_pinned_degrees``)."""
    pinned_cp = training.cp[0] if len(training.cp) == 1 and training.cp[0] > 1 else None
    pins = {
        "pp": training.pp,
        "tp": training.tp,
        "cp": pinned_cp,  # one context-parallel degree above 1 is a pin too
        "dp": training.dp,
    }
    parallel.check_pinned_degrees(pins, cluster.num_gpus, cluster.gpus_per_node)


def candidate_configs(
    num_layers: int,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    num_experts: int | None = None,
    long_schedules: bool = False,
    facts: ModelFacts | None = None,
) -> list[ParallelConfig]:
    """Every valid config, in a fixed order (deterministic search). ``num_experts``: the
    graph's routed experts E (``moe.routed_experts``), None for a dense graph; it gives the
    expert-parallel degrees (``expert_parallel_degrees``). A config whose schedule is too long
    to simulate (``costs.MAX_SCHEDULE_ACTIONS``) is left out; ``long_schedules`` lists those
    instead (for the plan's note). ``facts``: the model's architecture
    (``engine_rules.ModelFacts.of_graph``); a config no engine of the runtime runs
    (``solver.engine_rules``) is never proposed, and pins that break a rule are an InputError."""
    facts = facts if facts is not None else ModelFacts(num_experts=num_experts)
    check_pinned_degrees(cluster, training)
    check_pinned_expert_degrees(training)
    gpu_divisors = divisors(cluster.num_gpus)
    ranges = {
        "zero": [0, 1, 2, 3],
        "tp": divisors(cluster.gpus_per_node),
        "pp": [p for p in gpu_divisors if p <= num_layers],
        "cp": gpu_divisors,
        "ep": gpu_divisors,
    }
    check_pinned_rules(training, facts, ranges)
    rules = RuleFilter(training, facts)
    recompute_modes, virtual_stages, cp_degrees = _searched_settings(cluster, training)
    schedules = _searched_schedules(cluster, training)
    refusals: list[tuple[bool, str]] = []  # (pp < 2, why a schedule could not run)
    configs: list[ParallelConfig] = []
    skipped = 0
    most = MAX_CONFIG_LAYERS // (num_layers * max(1, len(cluster.groups)))
    for pp in divisors(cluster.num_gpus):
        if pp > num_layers:
            break  # ascending: every larger pp has an empty stage
        if training.pp not in (None, pp):
            continue
        # tensor parallelism stays inside a node: tp | gcd(gpus / pp, gpus per node)
        for tp, cp in _tensor_and_context_degrees(cluster.num_gpus // pp, cluster, cp_degrees):
            if training.tp not in (None, tp):
                continue
            dp = cluster.num_gpus // (pp * tp * cp)
            if training.dp not in (None, dp):
                continue
            width = tp * cp * dp  # the GPUs of one stage
            if cluster.is_heterogeneous and any(g.num_gpus % width for g in cluster.groups):
                continue  # a stage's GPUs come from one group, and all GPUs are used
            if training.memory_model == "empirical" and tp * dp > 1:
                continue  # the statistics describe one pipeline (CAPSlog): tp = dp = 1
            zero_stages = searched_zero_stages(training.zero_stages, dp * cp)
            for micro_batch in sorted(set(training.micro_batch_sizes)):
                if training.global_batch % (dp * micro_batch):
                    continue
                m = training.global_batch // (dp * micro_batch)
                for zero in zero_stages:
                    for recompute in recompute_modes:
                        layouts = _schedule_layouts(
                            schedules, virtual_stages, num_layers, pp, m, refusals
                        )
                        for schedule, virtual in layouts:
                            size = schedule_size(pp, virtual, m, schedule)
                            if long_schedules != (size > MAX_SCHEDULE_ACTIONS):
                                skipped += 1
                                continue
                            for ep in expert_parallel_degrees(training, dp, num_experts):
                                if len(configs) >= most:
                                    raise InputError(_too_many_configs(num_layers, most, training))
                                config = ParallelConfig(
                                    pp=pp,
                                    tp=tp,
                                    cp=cp,
                                    dp=dp,
                                    micro_batch=micro_batch,
                                    num_microbatches=m,
                                    zero=zero,
                                    recompute=recompute,
                                    schedule=schedule,
                                    virtual_stages=virtual,
                                    sp=sequence_parallel(training, tp),
                                    ep=ep,
                                )
                                if not rules.refuses(config):
                                    configs.append(config)
    if not configs and not long_schedules:
        if refusals and not skipped and len(schedules) == 1:
            # the pinned schedule's own rule, from a pipeline (pp >= 2) where one was tried
            raise InputError(min(refusals, key=lambda refusal: refusal[0])[1])
        _raise_no_config(num_layers, cluster, training, num_experts, skipped=skipped, rules=rules)
    return configs


def _schedule_layouts(
    schedules: tuple[str, ...],
    virtual_stages: list[int],
    num_layers: int,
    pp: int,
    m: int,
    refusals: list[tuple[bool, str]],
):
    """The (schedule, virtual stages) pairs that can run with (pp, m): each refused one
    (``parallel.schedule_refusal``) is skipped, its reason appended to ``refusals``."""
    for schedule in schedules:
        for virtual in virtual_stages:
            refusal = parallel.schedule_refusal(schedule, num_layers, pp, m, virtual)
            if refusal is None:
                yield schedule, virtual
            else:
                refusals.append((pp < 2, refusal))


def _searched_schedules(cluster: Cluster, training: TrainingConfig) -> tuple[str, ...]:
    """The schedules searched (``TrainingConfig.schedules``): the split-backward ones are
    modelled for the analytic memory model on homogeneous clusters, left out elsewhere, an
    InputError when nothing else is asked."""
    schedules = training.schedules
    kept = tuple(s for s in schedules if s not in parallel.ZERO_BUBBLE_SCHEDULES)
    if kept == schedules:
        return schedules
    why = None
    if training.memory_model != "analytic":
        why = "the empirical statistics describe 1F1B stages; use --memory-model analytic"
    elif cluster.is_heterogeneous:
        why = "not supported on a heterogeneous cluster; use --schedule 1f1b with --cluster"
    if why is None:
        return schedules
    if not kept:
        raise InputError(f"--schedule {training.schedule}: {why}")
    return kept


def _raise_no_config(
    num_layers: int,
    cluster: Cluster,
    training: TrainingConfig,
    num_experts: int | None,
    *,
    skipped: int,
    rules: RuleFilter,
) -> None:
    """InputError saying why ``candidate_configs`` found no config: every schedule too long
    (the smallest one says what would do), the engines' rules, or the degrees themselves."""
    if skipped:
        smallest = min(
            candidate_configs(
                num_layers, cluster, training, num_experts=num_experts, long_schedules=True
            ),
            key=lambda c: schedule_size(c.pp, c.virtual_stages, c.num_microbatches, c.schedule),
        )
        check_schedule_size(
            smallest.pp,
            smallest.virtual_stages,
            smallest.num_microbatches,
            smallest.micro_batch,
            smallest.schedule,
        )
    if rules.removed:
        raise InputError(rules.message())
    raise InputError(_why_no_config(num_layers, cluster, training))


def _searched_settings(
    cluster: Cluster, training: TrainingConfig
) -> tuple[tuple[str, ...], list[int], list[int]]:
    """The recompute modes, virtual stage counts and context-parallel degrees every config is
    searched with; raises InputError where the options cannot go together."""
    # auto: none and full on every config (the exact chain/DAG algorithms, milliseconds); the
    # planner searches selective only when neither fits (``selective_fallback``)
    recompute_modes = (training.recompute,)
    if training.recompute == "auto":
        recompute_modes = ("none", "full")
    virtual_stages = sorted(set(training.virtual_stages))
    if virtual_stages != [1]:
        check_interleaving(cluster, training)
    cp_degrees = sorted(set(training.cp))
    if training.memory_model == "empirical" and cp_degrees != [1]:
        raise InputError(
            f"--cp {','.join(map(str, training.cp))} with the empirical memory model: the "
            "statistics are measured on whole sequences of one pipeline; use --cp 1 or "
            "--memory-model analytic"
        )
    return recompute_modes, virtual_stages, cp_degrees


def searched_zero_stages(stages: tuple[int, ...], sharding_degree: int) -> list[int]:
    """The ZeRO stages searched for a config sharding over ``sharding_degree`` = dp x cp GPUs:
    the smallest one when nothing is sharded (they all hold the same); ZeRO 0 left out when
    ZeRO 1 is searched too, which dominates it on both runtimes: the same layout and engine
    (Megatron's --use-distributed-optimizer, torch's ZeroRedundancyOptimizer) with the optimizer
    state and the step's temporary sharded, the same gradient sync and a shorter optimizer step,
    so no split of it has a larger peak or a longer iteration (``costs.states``,
    ``costs.times``)."""
    if sharding_degree == 1:
        return [min(stages)]
    searched = sorted(set(stages))
    return searched[1:] if searched[:2] == [0, 1] else searched


def selective_fallback(training: TrainingConfig) -> TrainingConfig | None:
    """The search space of ``--recompute auto`` when no config fits with no or full
    recomputation: the same options with per-layer selective recomputation (CP-SAT/MILP; it
    contains none and full, so it is never worse), or None when there is none to fall back to
    (recompute pinned, or the empirical memory model, which measures one setting per run)."""
    if training.recompute != "auto" or training.memory_model == "empirical":
        return None
    return dataclasses.replace(training, recompute="selective")


def _tensor_and_context_degrees(
    stage_gpus: int, cluster: Cluster, cp_degrees: list[int]
) -> list[tuple[int, int]]:
    """(tp, cp) pairs for a pipeline stage of ``stage_gpus`` = tp cp dp GPUs, tp ascending then
    cp: tp | gcd(stage GPUs, GPUs per node) (tensor parallelism stays inside a node), cp one of
    the candidate degrees dividing stage_gpus / tp (it may cross nodes: module docstring)."""
    return [
        (tp, cp)
        for tp in divisors(math.gcd(stage_gpus, cluster.gpus_per_node))
        for cp in cp_degrees
        if (stage_gpus // tp) % cp == 0
    ]


def sequence_parallel(training: TrainingConfig, tp: int) -> bool:
    """Whether a candidate with tensor-parallel degree ``tp`` uses sequence parallelism: with
    "on" or "auto" exactly when tp > 1 (SP splits over the TP ranks; Megatron-LM recommends it
    whenever tp > 1), with "off" never. The option defaults to auto on the megatron runtime and
    off on the torch runtime (``specs.default_sequence_parallel``)."""
    return parallel.uses_sequence_parallel(training.sequence_parallel, tp)


def check_pinned_expert_degrees(training: TrainingConfig) -> None:
    """With dp pinned, at least one requested ep must divide it (the experts are sharded within
    the data-parallel ranks)."""
    parallel.check_pinned_expert_degrees(training.ep, training.dp)


def expert_parallel_degrees(
    training: TrainingConfig, dp: int, num_experts: int | None
) -> list[int]:
    """The expert-parallel degrees of a candidate with data-parallel degree ``dp``, ascending:
    those of ``training.ep`` that divide dp (Megatron shards the experts within the
    data-parallel ranks), or with ep auto (None) every divisor of dp that divides the graph's
    ``num_experts`` routed experts, and 1 on a dense graph (None). Whether a requested ep fits
    the graph is ``moe.check_expert_degree``'s (in ``evaluation.prepare_training``)."""
    if training.ep is None:
        if num_experts is None:
            return [1]
        return [e for e in divisors(dp) if num_experts % e == 0]
    return sorted({e for e in training.ep if dp % e == 0})


def check_interleaving(cluster: Cluster, training: TrainingConfig) -> None:
    """Interleaved stages are modelled for the analytic memory model on homogeneous clusters;
    anything else is a one-line error."""
    asked = ",".join(str(v) for v in training.virtual_stages)
    if training.memory_model != "analytic":
        raise InputError(
            f"--virtual-stages {asked}: the empirical statistics describe contiguous stages; "
            "use --memory-model analytic or --virtual-stages 1"
        )
    if cluster.is_heterogeneous:
        raise InputError(
            f"--virtual-stages {asked}: interleaved stages on a heterogeneous cluster are not "
            "supported; use --virtual-stages 1 with --cluster"
        )


def stages_per_group(cluster: Cluster, config: ParallelConfig) -> list[int]:
    """Stages each group of a heterogeneous cluster hosts: gpus_k / (tp cp dp)."""
    width = config.tp * config.cp * config.dp
    return [group.num_gpus // width for group in cluster.groups]


def _too_many_configs(num_layers: int, most: int, training: TrainingConfig) -> str:
    lists = (
        f"micro-batch sizes {len(training.micro_batch_sizes)}, ZeRO stages "
        f"{len(training.zero_stages)}, virtual stages {len(training.virtual_stages)}, cp degrees "
        f"{len(training.cp)}, ep degrees "
        + ("auto" if training.ep is None else str(len(training.ep)))
    )
    return (
        f"more than {most} candidate configs for {num_layers} layers (the search keeps per-layer "
        f"costs of each, at most {MAX_CONFIG_LAYERS} configs x layers; {lists}): pin --pp, --tp "
        "or --dp, or give fewer --micro-batch / --zero / --virtual-stages / --cp / --ep values"
    )


def _why_no_config(num_layers: int, cluster: Cluster, training: TrainingConfig) -> str:
    batch = training.global_batch
    if cluster.is_heterogeneous:
        sizes = ", ".join(f"{g.name}: {g.num_gpus}" for g in cluster.groups)
        return (
            f"no valid parallel config for the cluster's groups ({sizes} GPUs), {num_layers} "
            f"layers, global batch {batch}, micro-batch sizes {list(training.micro_batch_sizes)}: "
            f"need tp | gpus per node ({cluster.gpus_per_node}), tp * dp | every group's GPUs, "
            "pp <= layers and dp * micro_batch | global batch; try other group sizes or a global "
            "batch that is a multiple of the GPU count"
        )
    interleaved = (
        ", and with --virtual-stages v > 1: pp >= 2, pp * v <= layers and pp | micro-batches"
        if min(training.virtual_stages) > 1
        else ""
    )
    if training.ep is not None:
        interleaved += (
            f", and with --ep {','.join(map(str, training.ep))}: dp divisible by one of them "
            "(the experts are sharded within the data-parallel ranks)"
        )
    return (
        f"no valid parallel config for {cluster.num_gpus} GPUs ({cluster.gpus_per_node} per node), "
        f"{num_layers} layers, global batch {batch}, micro-batch sizes "
        f"{list(training.micro_batch_sizes)}: need pp <= layers, tp | gpus_per_node and "
        f"dp * micro_batch | global batch{interleaved}; try a global batch that is a multiple of "
        "the GPU count, micro-batch 1, or fewer pinned degrees"
    )


def memory_lower_bound(costs: LayerCosts) -> int:
    """A peak no split of this config can beat (bytes per GPU).

    Every layer sits in some stage, whose peak is at least the layer's states (without its
    gradients where a peak can come before them, ``LayerCosts.state_lower_bytes``), k_min stored
    micro-batches and its transient; and the p stage peaks together hold every layer's states and
    at least k_min stored micro-batches of each, so the largest is >= their sum / p; likewise
    with every state and the step temporary at the optimizer step. Plus a
    calibration's constant, which every stage carries.
    """
    k_min = min(costs.in_flight)
    stored, transient, _ = costs.bounding_coefficients(np.minimum)
    per_layer = costs.state_lower_bytes + k_min * stored
    single = int((per_layer + transient).max())
    # with interleaving the p ranks together hold least_held micro-batches of every chunk
    spread_layer = costs.state_lower_bytes + costs.least_held * stored
    spread = -(-int(spread_layer.sum()) // costs.num_ranks)
    if costs.step_bytes is not None:  # the optimizer step: every state and the step temporary
        at_step = costs.state_bytes + costs.step_bytes
        single = max(single, int(at_step.max()))
        spread = max(spread, -(-int(at_step.sum()) // costs.num_ranks))
    return costs.constant_bytes + max(single, spread)


def time_lower_bound(costs: LayerCosts) -> int:
    """An iteration bound (ns) no split of this config can beat (``iteration_floor_ns``)."""
    return iteration_floor_ns(costs)
