"""Iteration time of a layout by simulating its pipeline schedule, action by action: what every
plan reports (``evaluation.Evaluation.iteration_ns``).

The bubble formula ``(m + p - 1) max_s T_s`` charges every stage the slowest stage's time in every
slot; on an uneven split the faster stages finish their slots early and the real schedule is
shorter. Here each pipeline rank runs its own list of forwards and
backwards (``solver.costs.schedule_actions``: torch's ``Schedule1F1B`` / ``ScheduleGPipe`` /
``ScheduleInterleaved1F1B`` order, and megatron-core's, the same one the memory model replays)
and the iteration is the time its last rank finishes (docs/cost-model.md, "Iteration time by
schedule simulation").

Event rules (all times integer ns, per micro-batch):
  F(j, i), the forward of micro-batch i through virtual stage j, starts when its rank has ended
  its previous action and every input has arrived: F(a, i) ended + the transfer a -> j, for the
  previous stage a = j - 1 and every other stage a that sends j a tensor (the torch runtime's
  direct sends).
  B(j, i), its backward (the recompute forward of a recomputed layer runs right before it, inside
  B), starts when the rank is free, F(j, i) has run, and the gradients have arrived: B(c, i)
  ended + the transfer c -> j for the next stage c = j + 1 and every other stage c that j sent to.
  A transfer occupies its directed rank-to-rank link: it starts when the sending action ends and
  the link has finished the sender's earlier transfers on it (FIFO); a send does not block the
  sending rank (asynchronous p2p).
  Split backwards (the zero-bubble and V schedules, ``schedule_orders``): I(j, i), the input
  gradient, waits as B does and sends the gradient on; W(j, i), the weight gradient, needs only
  its own I, which its rank has run before it (the lists' order); DualPipeV's full backwards are
  B. The V's turn-around (virtual stages p - 1 and p, both on rank p - 1) passes the activation
  and the gradient within the rank: no transfer time. I = B - W per virtual stage, W from
  ``weight_gradient_ns``.
  Rank r ends at its last backward + its data-parallel gradient sync AR_r (``dp_overlap="none"``:
  started after the last backward, as Megatron-LM's ``finalize_model_grads`` runs after the
  schedule without --overlap-grad-reduce) or at max(end of last backward, start of last
  backward + AR_r) (``"last_backward"``: torch DDP's and megatron's --overlap-grad-reduce bucket
  all-reduces launched during the last micro-batch's backward, ideally overlapped;
  ``solver.costs.dp_overlap_of`` says which the runtime does), + its optimizer step and the
  runtime's per-step work. The iteration is the latest rank end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from solver.costs.coefficients import LayerCosts
from solver.costs.schedule import ScheduleAction, interleaved_schedule_groups, schedule_actions
from solver.costs.schedule_orders import (
    ZERO_BUBBLE_SCHEDULES,
    overlapped_forwards,
    rank_stages,
    stage_ranks,
)
from solver.costs.stage_cost import StageCost
from solver.costs.stages import stage_costs
from solver.errors import InputError

MAX_SCHEDULE_ACTIONS = 2**20
"""Most actions (forwards, backwards and, with split backwards, weight-gradient steps:
``schedule_size``) a simulation runs: each is a few Python objects (about 350 bytes) and a few
microseconds, so 2^20 take about 0.4 GB and 5 s; pp 20,002 with 20,002 micro-batches would take
300 GB. Configs beyond it are not searched (``candidate_configs``) and a layout beyond it is
refused (``check_schedule_size``)."""
DP_OVERLAPS = ("none", "last_backward")
"""When a rank's data-parallel gradient sync runs (``simulate_schedule``)."""


def _actions_per_microbatch(schedule: str) -> int:
    """Actions per micro-batch and virtual stage: F and B (2), or F, I and W (3) where the
    backward is split (``ZERO_BUBBLE_SCHEDULES``; a DualPipeV B or an overlapped F + B counts
    no more)."""
    return 3 if schedule in ZERO_BUBBLE_SCHEDULES else 2


def schedule_size(
    pp: int, virtual_stages: int, num_microbatches: int, schedule: str = "1f1b"
) -> int:
    """Actions of one iteration over all ranks: 2 m v p forwards and backwards, 3 m v p with
    split backwards (F, I, W)."""
    return _actions_per_microbatch(schedule) * pp * virtual_stages * num_microbatches


def check_schedule_size(
    pp: int,
    virtual_stages: int,
    num_microbatches: int,
    micro_batch: int = 1,
    schedule: str = "1f1b",
) -> None:
    """InputError (naming the flags that would do) when a layout's schedule has more than
    ``MAX_SCHEDULE_ACTIONS`` actions to simulate."""
    size = schedule_size(pp, virtual_stages, num_microbatches, schedule)
    if size <= MAX_SCHEDULE_ACTIONS:
        return
    per = _actions_per_microbatch(schedule)
    most_m = MAX_SCHEDULE_ACTIONS // (per * pp * virtual_stages)  # micro-batches that would do
    if most_m >= 1:
        larger = -(-micro_batch * num_microbatches // most_m)
        fix = f"a --micro-batch of at least {larger} or a smaller --global-batch"
    else:
        fix = f"at most {MAX_SCHEDULE_ACTIONS // (per * virtual_stages)} pipeline stages (--pp)"
    steps = "forward, input- and weight-gradient steps" if per == 3 else "forwards and backwards"
    raise InputError(
        f"the pipeline schedule of pp {pp} x virtual stages {virtual_stages} x {per} x "
        f"{num_microbatches} micro-batches = {size} {steps} is too long to "
        f"simulate (at most {MAX_SCHEDULE_ACTIONS}): give {fix}"
    )


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """The simulated schedule of one iteration; times in ns from its start."""

    makespan_ns: int
    """The iteration: the latest rank end."""
    busy_ns: list[int]
    """Per rank: time spent in forwards and backwards (overheads included)."""
    tail_ns: list[int]
    """Per rank: from its last backward's end to its own end (exposed sync + optimizer step)."""
    idle_ns: list[int]
    """Per rank: makespan - busy - tail (pipeline bubbles and waiting for the slowest rank)."""
    actions: list[list[tuple[ScheduleAction, int, int]]]
    """Per rank, its actions in order as (action, start, end)."""


def simulate_schedule(
    *,
    schedule: str,
    num_microbatches: int,
    num_ranks: int,
    forward_ns: Sequence[int],
    backward_ns: Sequence[int],
    weight_ns: Sequence[int] | None = None,
    group: int | None = None,
    transfer_ns: Mapping[tuple[int, int], int] | None = None,
    gradient_ns: Mapping[tuple[int, int], int] | None = None,
    dp_sync_ns: Sequence[int] | None = None,
    dp_overlap: str = "none",
    microbatch_overhead_ns: int = 0,
    optimizer_step_ns: int | Sequence[int] = 0,
) -> Timeline:
    """Simulate one iteration (module docstring for the rules).

    ``forward_ns`` / ``backward_ns``: per virtual stage j = chunk p + rank (p v of them), per
    micro-batch, ns; backward includes the recompute forward. ``weight_ns``: the W step's part
    of each backward under a split-backward schedule (the I step runs the rest; None: half).
    Virtual stage j runs on rank ``schedule_orders.stage_ranks`` (j mod p; a V for zbv and
    dualpipev). ``transfer_ns[(a, c)]``: an
    activation transfer from stage a to stage c > a per micro-batch; ``gradient_ns[(c, a)]``:
    the gradient transfer back (missing pairs: 0; the neighbours j -> j + 1 are always
    dependencies). ``group``: interleaved rounds (default p). ``dp_sync_ns``: AR_r per rank.
    ``microbatch_overhead_ns``: added to every forward (one per micro-batch and virtual stage).
    ``optimizer_step_ns``: per rank, or one for all."""
    p, m = num_ranks, num_microbatches
    num_stages = len(forward_ns)
    assert num_stages == len(backward_ns) and num_stages % p == 0, "a time per virtual stage"
    assert dp_overlap in DP_OVERLAPS, dp_overlap
    steps, num_links = _rank_steps(
        schedule=schedule,
        m=m,
        p=p,
        forward_ns=forward_ns,
        backward_ns=backward_ns,
        weight_ns=weight_ns,
        group=group,
        transfer_ns=transfer_ns,
        gradient_ns=gradient_ns,
        microbatch_overhead_ns=microbatch_overhead_ns,
    )
    done = _run(steps, num_links)
    rank_end = _rank_ends(done, dp_sync_ns, dp_overlap, optimizer_step_ns)
    makespan = max(rank_end)
    busy = [sum(end - start for _, start, end in actions) for actions in done]
    tail = [rank_end[r] - done[r][-1][2] for r in range(p)]
    return Timeline(
        makespan_ns=makespan,
        busy_ns=busy,
        tail_ns=tail,
        idle_ns=[makespan - busy[r] - tail[r] for r in range(p)],
        actions=done,
    )


Send = tuple[list, int, int]
"""(arrival list, link, transfer ns)."""
Step = tuple[
    ScheduleAction, int, int, list[list], Sequence[Send], Sequence[tuple[int, Sequence[Send]]]
]
"""One action of a rank as ``_run`` takes it: (action, micro-batch, duration ns, the arrival
lists it waits on, its sends, and sends of an earlier action it posts first as (micro-batch,
sends): an overlapped forward's, ``schedule_orders.overlapped_forwards``)."""


def _rank_steps(
    *,
    schedule: str,
    m: int,
    p: int,
    forward_ns: Sequence[int],
    backward_ns: Sequence[int],
    weight_ns: Sequence[int] | None,
    group: int | None,
    transfer_ns: Mapping[tuple[int, int], int] | None,
    gradient_ns: Mapping[tuple[int, int], int] | None,
    microbatch_overhead_ns: int,
) -> tuple[list[list[Step]], int]:
    """(each rank's steps in its order, the number of directed links): ``simulate_schedule``'s
    actions with their durations, the transfers each waits for and those it sends."""
    num_stages = len(forward_ns)
    v = num_stages // p
    rank_of = stage_ranks(schedule, p, v)
    transfer_ns = dict(transfer_ns or {})
    gradient_ns = dict(gradient_ns or {})
    for j in range(num_stages - 1):  # the neighbours always feed each other
        transfer_ns.setdefault((j, j + 1), 0)
        gradient_ns.setdefault((j + 1, j), 0)
    # arrival[(kind, a, j)][i]: when micro-batch i's transfer of that kind from stage a reaches
    # stage j (None: not sent yet); each action waits for its own and sends to its targets
    arrival = {("F", a, c): [None] * m for a, c in transfer_ns}
    arrival |= {("B", c, a): [None] * m for c, a in gradient_ns}
    waits: dict[tuple[str, int], list[list]] = {
        (kind, j): [] for kind in "FB" for j in range(num_stages)
    }
    waits |= {("I", j): waits[("B", j)] for j in range(num_stages)}  # I waits as B does
    waits |= {("W", j): [] for j in range(num_stages)}  # after its own I, on its own rank
    for (kind, _, target), times in arrival.items():  # one pass (per stage was O(p^2))
        waits[(kind, target)].append(times)
    link_index: dict[tuple[int, int], int] = {}
    sends: dict[tuple[str, int], list[tuple[list, int, int]]] = {}
    for kind, pairs in (("F", transfer_ns), ("B", gradient_ns)):
        for (a, c), ns in sorted(pairs.items()):
            link = link_index.setdefault((rank_of[a], rank_of[c]), len(link_index))
            ns = 0 if rank_of[a] == rank_of[c] else int(ns)  # within a rank (the V's turn)
            sends.setdefault((kind, a), []).append((arrival[(kind, a, c)], link, ns))
    for j in range(num_stages):  # I sends the input gradient as B does
        sends[("I", j)] = sends.get(("B", j), ())
    duration = {("F", j): int(forward_ns[j]) + microbatch_overhead_ns for j in range(num_stages)}
    duration |= {("B", j): int(backward_ns[j]) for j in range(num_stages)}
    if weight_ns is None:
        weight_ns = [int(backward_ns[j]) // 2 for j in range(num_stages)]
    for j in range(num_stages):
        weight = min(int(weight_ns[j]), int(backward_ns[j]))
        duration |= {("W", j): weight, ("I", j): int(backward_ns[j]) - weight}
    if schedule in ZERO_BUBBLE_SCHEDULES:  # torch skips stage 0's I; its W runs it all
        duration |= {("W", 0): int(backward_ns[0]), ("I", 0): 0}
    lists = []
    for r in range(p):
        own = rank_stages(schedule, p, v, r)
        deferred = (
            overlapped_forwards(schedule, m, p, v, r) if schedule == "dualpipev" else frozenset()
        )
        actions = schedule_actions(m, p, v, r, group, schedule)
        if not deferred:  # the common case, in one comprehension (a search simulates often)
            parts = {
                (kind, c): (duration[key], waits[key], sends.get(key, ()), ())
                for kind in "FBIW"
                for c, key in enumerate((kind, j) for j in own)
            }
            lists.append([(action, action.microbatch) + parts[action[:2]] for action in actions])
            continue
        steps: list[Step] = []
        carried: tuple = ()
        for position, action in enumerate(actions):
            key, i = (action.kind, own[action.chunk]), action.microbatch
            targets = sends.get(key, ())
            if position in deferred:
                steps.append((action, i, duration[key], waits[key], (), ()))
                carried = ((i, targets),) if targets else ()
                continue
            steps.append((action, i, duration[key], waits[key], targets, carried))
            carried = ()
        lists.append(steps)
    return lists, len(link_index)


def _run(lists: list[list[Step]], num_links: int) -> list[list[tuple[ScheduleAction, int, int]]]:
    """Run every rank's steps, each as soon as its rank is free and its inputs have arrived;
    per rank its actions as (action, start, end), ns. Sweeps over the ranks run each one until
    an input is missing, alternately up (forwards flow through every rank in one sweep) and down
    (backwards do): one-way sweeps moved a backward one rank per sweep, O(p^2) visits. The times
    do not depend on the visiting order (each link carries one rank's sends, in its order)."""
    p = len(lists)
    link_free = [0] * num_links
    free = [0] * p
    done: list[list[tuple[ScheduleAction, int, int]]] = [[] for _ in range(p)]
    position = [0] * p
    remaining = sum(len(steps) for steps in lists)
    up, down = range(p), range(p - 1, -1, -1)
    sweeps = 0
    while remaining:
        progressed = False
        for r in up if sweeps % 2 == 0 else down:
            steps, pos, now, ran = lists[r], position[r], free[r], done[r]
            while pos < len(steps):
                action, i, length, waited, targets, carried = steps[pos]
                start = now
                for times in waited:
                    arrived = times[i]
                    if arrived is None:
                        break  # an input has not been sent yet: another rank first
                    if arrived > start:
                        start = arrived
                else:
                    now = end = start + length
                    ran.append((action, start, end))
                    for k, earlier in carried:  # an overlapped forward's, posted first
                        for times, link, ns in earlier:
                            sent = link_free[link]
                            times[k] = link_free[link] = (end if end > sent else sent) + ns
                    for times, link, ns in targets:  # FIFO on the directed link
                        sent = link_free[link]
                        times[i] = link_free[link] = (end if end > sent else sent) + ns
                    pos += 1
                    continue
                break
            if pos != position[r]:
                remaining -= pos - position[r]
                position[r], free[r] = pos, now
                progressed = True
        assert progressed, "the schedule deadlocks"
        sweeps += 1
    return done


def _rank_ends(
    done: list[list[tuple[ScheduleAction, int, int]]],
    dp_sync_ns: Sequence[int] | None,
    dp_overlap: str,
    optimizer_step_ns: int | Sequence[int],
) -> list[int]:
    """When each rank ends: its last backward, its gradient sync AR_r (after it, or from its
    start with ``dp_overlap`` "last_backward") and its optimizer step, ns."""
    p = len(done)
    sync = [0] * p if dp_sync_ns is None else [int(x) for x in dp_sync_ns]
    step = (
        [int(optimizer_step_ns)] * p
        if isinstance(optimizer_step_ns, int | np.integer)
        else [int(x) for x in optimizer_step_ns]
    )
    rank_end = []
    for r in range(p):
        _, last_start, last_end = done[r][-1]
        if dp_overlap == "none":
            synced = last_end + sync[r]
        else:
            synced = max(last_end, last_start + sync[r])
        rank_end.append(synced + step[r])
    return rank_end


def stage_transfer_bytes(
    costs: LayerCosts, stage_of: np.ndarray
) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """(activations {(a, c): bytes}, gradients {(c, a): bytes}) per micro-batch between
    (virtual) stages, each tensor once per pair (``LayerCosts.tensor_groups``). Neighbour p2p
    (megatron): a tensor made on stage a whose farthest consumer is on c crosses every boundary
    k -> k + 1 in between (relays, ``solver.costs.boundary_bytes``); direct sends (torch): it goes
    from a to each consuming stage. Its gradient comes back the same way if it requires grad
    (``Edge.requires_grad``)."""
    num_stages = costs.num_stages
    first_edge, size, tensor_of_edge = costs.tensor_arrays
    stage_of = np.asarray(stage_of, dtype=np.int64)
    made = stage_of[costs.edge_src[first_edge]]
    consumer = stage_of[costs.edge_dst]
    later = (consumer > made[tensor_of_edge]) & (size[tensor_of_edge] != 0)
    grad = (
        np.ones(len(first_edge), dtype=bool)
        if costs.edge_requires_grad is None
        else np.asarray(costs.edge_requires_grad, dtype=bool)[first_edge]
    )
    if costs.direct_sends:  # (producer's stage, reader) once per tensor and later reader
        pairs = np.unique(tensor_of_edge[later] * num_stages + consumer[later])
        tensor, reader = pairs // num_stages, pairs % num_stages
        sender = made[tensor]
    else:  # every boundary k | k + 1 from the producer's stage to its farthest reader
        farthest = np.full(len(first_edge), -1, dtype=np.int64)
        np.maximum.at(farthest, tensor_of_edge[later], consumer[later])
        tensor = np.flatnonzero(farthest > made)
        hops = farthest[tensor] - made[tensor]
        tensor = np.repeat(tensor, hops)
        sender = made[tensor] + np.arange(len(tensor)) - np.repeat(np.cumsum(hops) - hops, hops)
        reader = sender + 1
    forward = _pair_sums(sender, reader, size[tensor], num_stages)
    chosen = grad[tensor]
    backward = _pair_sums(reader[chosen], sender[chosen], size[tensor][chosen], num_stages)
    return forward, backward


def _pair_sums(
    source: np.ndarray, target: np.ndarray, size: np.ndarray, num_stages: int
) -> dict[tuple[int, int], int]:
    """{(source, target): the sum of ``size`` over the items of that pair}, pairs in order."""
    keys, index = np.unique(source * num_stages + target, return_inverse=True)
    totals = np.zeros(len(keys), dtype=np.int64)
    np.add.at(totals, index, size)
    return {
        (int(key) // num_stages, int(key) % num_stages): int(total)
        for key, total in zip(keys.tolist(), totals.tolist(), strict=True)
    }


FROM_COSTS = object()
"""``schedule_timeline``'s default for a term: the one ``LayerCosts`` carries."""


def schedule_timeline(
    costs: LayerCosts,
    stage_of_layer: Sequence[int] | np.ndarray,
    recomputed: Sequence[bool] | np.ndarray | None = None,
    **options,
) -> Timeline:
    """The simulated schedule of an assignment (layer position -> virtual stage) under ``costs``
    with the layers ``recomputed`` (selective): :func:`stages_timeline` of its stage costs."""
    stages = stage_costs(costs, stage_of_layer, recomputed)
    return stages_timeline(costs, stages, stage_of_layer, **options)


def stages_timeline(
    costs: LayerCosts,
    stages: Sequence[StageCost],
    stage_of_layer: Sequence[int] | np.ndarray,
    **options,
) -> Timeline:
    """The simulated schedule of a split from its stage costs (``schedule_inputs``)."""
    return simulate_schedule(**schedule_inputs(costs, stages, stage_of_layer, **options))


def stages_iteration_ns(
    costs: LayerCosts,
    stages: Sequence[StageCost],
    stage_of_layer: Sequence[int] | np.ndarray,
) -> int:
    """The simulated iteration of a split, ns: ``stages_timeline``'s makespan."""
    return simulate_schedule(**schedule_inputs(costs, stages, stage_of_layer)).makespan_ns


def schedule_inputs(
    costs: LayerCosts,
    stages: Sequence[StageCost],
    stage_of_layer: Sequence[int] | np.ndarray,
    *,
    link_gb_per_s: float | Mapping[tuple[int, int], float] | None = FROM_COSTS,
    p2p_latency_ns: int = FROM_COSTS,
    dp_overlap: str = FROM_COSTS,
    microbatch_overhead_ns: int = FROM_COSTS,
    optimizer_step_ns: int | Sequence[int] = FROM_COSTS,
) -> dict:
    """``simulate_schedule``'s keywords for a split from its stage costs (one per rank, in rank
    order; a heterogeneous cluster's with their groups' times): virtual stage j = chunk c p + r runs
    rank r's ``chunk_forward_ns[c]`` forward and the rest of ``chunk_time_ns[c]`` backward
    (recompute included), AR_r and the optimizer step are the rank's ``dp_sync_ns`` and
    ``optimizer_step_ns``, transfers = latency + ceil(bytes / bandwidth)
    (``stage_transfer_bytes``; ``link_gb_per_s`` one for every link, or per directed rank pair
    as ``solver.costs.pipeline_link_gb_per_s`` gives; None: no transfer time; none between chunks
    of one rank). Every term not given is the one ``costs`` and ``stages`` carry
    (``FROM_COSTS``)."""
    config = costs.config
    p, m, n = config.pp, config.num_microbatches, costs.num_stages
    check_schedule_size(p, config.virtual_stages, m, config.micro_batch, config.schedule)
    if link_gb_per_s is FROM_COSTS:
        link_gb_per_s = costs.link_gb_per_s
    if p2p_latency_ns is FROM_COSTS:
        p2p_latency_ns = costs.p2p_latency_ns
    if microbatch_overhead_ns is FROM_COSTS:
        microbatch_overhead_ns = costs.microbatch_overhead_ns
    if dp_overlap is FROM_COSTS:
        dp_overlap = costs.dp_overlap
    if optimizer_step_ns is FROM_COSTS:  # with the runtime's own step work
        optimizer_step_ns = [stage.optimizer_step_ns + costs.step_overhead_ns for stage in stages]
    v = config.virtual_stages
    rank_of = stage_ranks(config.schedule, p, v)
    forward_stage, backward_stage = [0] * n, [0] * n
    for r, stage in enumerate(stages):
        own = rank_stages(config.schedule, p, v, r)
        for j, time_ns, forward_ns in zip(
            own, stage.chunk_time_ns, stage.chunk_forward_ns, strict=True
        ):
            forward_stage[j], backward_stage[j] = forward_ns, time_ns - forward_ns
    activations, gradients = stage_transfer_bytes(costs, np.asarray(stage_of_layer, dtype=np.int64))

    def ns(pairs: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
        out = {}
        for (a, c), size in pairs.items():
            link = (rank_of[a], rank_of[c])
            if link_gb_per_s is None or link[0] == link[1]:
                out[(a, c)] = 0
                continue
            rate = link_gb_per_s if isinstance(link_gb_per_s, float | int) else link_gb_per_s[link]
            out[(a, c)] = p2p_latency_ns + math.ceil(size / rate)
        return out

    group = interleaved_schedule_groups(costs.runtime, m, p) if config.virtual_stages > 1 else None
    weight_ns = None
    if config.schedule in ZERO_BUBBLE_SCHEDULES:
        weight_ns = weight_gradient_ns(costs, forward_stage, stage_of_layer)
    return {
        "schedule": config.schedule,
        "num_microbatches": m,
        "num_ranks": p,
        "forward_ns": forward_stage,
        "backward_ns": backward_stage,
        "weight_ns": weight_ns,
        "group": group,
        "transfer_ns": ns(activations),
        "gradient_ns": ns(gradients),
        "dp_sync_ns": [stage.dp_sync_ns for stage in stages],
        "dp_overlap": dp_overlap,
        "microbatch_overhead_ns": microbatch_overhead_ns,
        "optimizer_step_ns": optimizer_step_ns,
    }


def weight_gradient_ns(
    costs: LayerCosts,
    forward_ns: Sequence[int],
    stage_of_layer: Sequence[int] | np.ndarray,
) -> list[int]:
    """W_j: the weight-gradient part of virtual stage j's backward per micro-batch, ns (the
    W step of a split-backward schedule; its I step runs the rest, recompute included).

    A layer's weight gradients are matmuls of its saved inputs with its output gradients, as
    many FLOPs as its forward's matmuls, and its input gradients as many again (Qi et al. 2024,
    "Zero Bubble Pipeline Parallelism", section 2: T_F ~ T_B ~ T_W for a transformer layer). So
    a layer with weights (``weight_bytes`` > 0) has w_l = min(F_l, (T_l - F_l) / 2) (its forward
    time, at most half its backward without recompute; ``forward_ns``, ``time_ns``); one without
    weights (attention core, activations) has none. W_j = sum of w_l over j's layers, scaled by
    the stage's forward in ``forward_ns`` over theirs (a heterogeneous group's times).
    Over-counts W for a layer whose forward holds weightless work (attention scores)."""
    stage_of = np.asarray(stage_of_layer, dtype=np.int64)
    forward = np.asarray(costs.forward_ns, dtype=np.int64)
    backward = np.asarray(costs.time_ns, dtype=np.int64) - forward
    weighted = np.asarray(costs.weight_bytes, dtype=np.int64) > 0
    per_layer = np.where(weighted, np.minimum(forward, backward // 2), 0)
    n = len(forward_ns)
    sum_w, sum_f = np.zeros(n, np.int64), np.zeros(n, np.int64)
    np.add.at(sum_w, stage_of, per_layer)
    np.add.at(sum_f, stage_of, forward)
    return [
        int(forward_ns[j]) * int(sum_w[j]) // int(sum_f[j]) if sum_f[j] > 0 else 0 for j in range(n)
    ]


def simulated_iteration_ns(
    costs: LayerCosts,
    stage_of_layer: Sequence[int] | np.ndarray,
    recomputed: Sequence[bool] | np.ndarray | None = None,
    **options,
) -> int:
    """The iteration time of an assignment by schedule simulation, ns (``schedule_timeline``'s
    makespan; ``options`` are its keywords)."""
    return schedule_timeline(costs, stage_of_layer, recomputed, **options).makespan_ns
