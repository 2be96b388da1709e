"""The zero-bubble and V pipeline schedules' action lists, ported from torch 2.13
(``torch/distributed/pipelining/schedules.py``) without importing torch: each rank's ordered
forwards (F), input-gradient backwards (I), weight-gradient backwards (W) and full backwards (B).

  interleaved-zb  ``ScheduleInterleavedZeroBubble`` (Qi et al. 2024, ZB1P): v chunks per rank,
                  loop placement (virtual stage j on rank j mod p); 1F1B's order with the
                  backward split into I and W, rank r deferring its W steps by r micro-batches,
                  then ``_add_bubbles_to_actions``' idle steps where a forward's input is not
                  ready yet. torch refuses m not a multiple of its rounds max(1, m // p).
  zbv             ``ScheduleZBVZeroBubble`` (Qi et al. 2024, section 6, ZB-V): 2 chunks per
                  rank in a V (rank r holds virtual stages r and 2p - 1 - r, so rank 0 holds the
                  first and the last); m is padded to at least 2p - 1 and the padding's actions
                  become idle steps.
  dualpipev       ``ScheduleDualPipeV`` (DeepSeek-V3's DualPipe, V variant): the same V
                  placement; its steady state pairs a forward of one chunk with a full backward
                  of the other (``OVERLAP_F_B``, which torch's runtime runs one after the other:
                  here an :class:`OverlapStep`, flattened to F then B); needs m >= 2p.

``pipeline_order`` gives torch's lists (with its idle steps as None, for the equality test
against torch); ``zero_bubble_actions`` gives one rank's compute actions in the form the time
simulation and the memory replay run (``schedule.ScheduleAction``, chunk = the rank's c-th
smallest virtual stage, as torch's ``generate_rank_to_stage_mapping`` sorts them).
docs/cost-model.md, "Zero-bubble and V schedules".
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from solver.parallel import (  # the schedules' names, placement and torch's rules
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    check_zero_bubble,
    rank_stages,
    stage_ranks,
)

__all__ = [
    "V_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "OverlapStep",
    "PipelineStep",
    "ScheduleAction",
    "check_zero_bubble",
    "pipeline_order",
    "rank_stages",
    "stage_ranks",
    "zero_bubble_actions",
]


class ScheduleAction(NamedTuple):
    """One step of a pipeline rank's schedule: a forward ("F"), a full backward ("B"), an
    input-gradient backward ("I") or a weight-gradient backward ("W") of micro-batch
    ``microbatch`` through the rank's chunk ``chunk`` (``rank_stages``: virtual stage chunk p + r
    with loop placement)."""

    kind: str
    chunk: int
    microbatch: int


class PipelineStep(NamedTuple):
    """One entry of torch's ``pipeline_order``: (stage index, computation type, micro-batch)."""

    stage: int
    kind: str
    microbatch: int


class OverlapStep(NamedTuple):
    """torch's ``OVERLAP_F_B``: a forward and a full backward, run one after the other."""

    forward: PipelineStep
    backward: PipelineStep


Entry = PipelineStep | OverlapStep | None


@lru_cache(maxsize=64)
def pipeline_order(
    schedule: str, num_microbatches: int, num_ranks: int, num_chunks: int
) -> tuple[tuple[Entry, ...], ...]:
    """torch's ``pipeline_order`` of ``schedule``: per rank, its entries with idle steps as
    None (``check_zero_bubble`` first)."""
    check_zero_bubble(schedule, num_microbatches, num_ranks, num_chunks)
    p, m, v = num_ranks, num_microbatches, num_chunks
    if schedule == "zbv":
        return tuple(tuple(_zbv_rank(m, p, r)) for r in range(p))
    if schedule == "dualpipev":
        return tuple(tuple(_dualpipev_rank(m, p, r)) for r in range(p))
    orders = [_interleaved_zb_rank(m, p, v, r) for r in range(p)]
    return tuple(tuple(order) for order in _add_bubbles(orders, p * v))


@lru_cache(maxsize=512)
def overlapped_forwards(
    schedule: str, num_microbatches: int, num_ranks: int, num_chunks: int, rank: int
) -> frozenset[int]:
    """Positions in ``zero_bubble_actions`` of the forwards that open an ``OverlapStep``: torch's
    runtime posts their sends after the backward that follows (``_add_send_recv`` appends an
    OVERLAP_F_B's sends after the whole action, the forward's first)."""
    positions, position = [], 0
    for entry in pipeline_order(schedule, num_microbatches, num_ranks, num_chunks)[rank]:
        if isinstance(entry, OverlapStep):
            positions.append(position)
            position += 2
        elif entry is not None:
            position += 1
    return frozenset(positions)


@lru_cache(maxsize=512)
def zero_bubble_actions(
    schedule: str, num_microbatches: int, num_ranks: int, num_chunks: int, rank: int
) -> tuple[ScheduleAction, ...]:
    """Rank r's compute actions of ``schedule`` in its order: ``pipeline_order`` without idle
    steps, an ``OverlapStep`` as its forward then its backward, each stage as its chunk."""
    chunk_of = {
        stage: c for c, stage in enumerate(rank_stages(schedule, num_ranks, num_chunks, rank))
    }
    actions = []
    for entry in pipeline_order(schedule, num_microbatches, num_ranks, num_chunks)[rank]:
        steps = (entry.forward, entry.backward) if isinstance(entry, OverlapStep) else (entry,)
        for step in steps:
            if step is not None:
                actions.append(ScheduleAction(step.kind, chunk_of[step.stage], step.microbatch))
    return tuple(actions)


def _interleaved_zb_rank(m: int, p: int, v: int, rank: int) -> list[Entry]:
    """``ScheduleInterleavedZeroBubble._calculate_single_rank_operations`` (``_get_warmup_ops``
    with multiply_factor 1, ``_get_1f1b_rank_ops`` with enable_zero_bubble)."""
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (p - 1 - rank), m * v)
    total = m * v  # forwards; the 1F1B steps pair each later forward with a backward

    def forward_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def backward_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    counts: dict[tuple[str, int], int] = {}

    def step_of(kind: str, stage: int) -> PipelineStep:
        index = counts.get((kind, stage), 0)
        counts[(kind, stage)] = index + 1
        return PipelineStep(stage, kind, index)

    ops: list[Entry] = [None] * rank
    backward_ops: list[int] = []
    weights = 0
    for op in range(total + warmup):
        if op < total:
            ops.append(step_of("F", forward_stage(op)))
            if op == warmup - 1:
                ops.extend([None] * (p - rank - 1))  # wait for the first backward
        if op >= warmup:
            ops.append(step_of("I", backward_stage(op)))
            backward_ops.append(op)
            if op - warmup >= rank:  # W deferred by r micro-batches on rank r
                ops.append(step_of("W", backward_stage(backward_ops[weights])))
                weights += 1
    for op in backward_ops[weights:]:
        ops.append(step_of("W", backward_stage(op)))
    return ops


def _add_bubbles(orders: list[list[Entry]], num_stages: int) -> list[list[Entry]]:
    """``ScheduleInterleavedZeroBubble._add_bubbles_to_actions``: time step by time step over
    all ranks, a forward whose previous stage has not run that micro-batch in an earlier time
    step waits (an idle step) instead."""
    p = len(orders)
    seen: set[tuple[int, str, int]] = set()
    result: list[list[Entry]] = [[] for _ in range(p)]
    pointer = [0] * p
    while any(pointer[r] < len(orders[r]) for r in range(p)):
        new: set[tuple[int, str, int]] = set()
        for r in range(p):
            if pointer[r] >= len(orders[r]):
                continue
            entry = orders[r][pointer[r]]
            if entry is None:
                pointer[r] += 1
                result[r].append(None)
                continue
            assert isinstance(entry, PipelineStep)
            stage, kind, i = entry
            if kind == "F" and stage != 0 and (stage - 1, "F", i) not in seen:
                result[r].append(None)
                continue
            result[r].append(entry)
            new.add((stage, kind, i))
            pointer[r] += 1
        seen |= new
    return result


def _zbv_rank(m: int, p: int, rank: int) -> list[Entry]:
    """``ScheduleZBVZeroBubble._calculate_single_rank_operations``: m padded to 2p - 1, the
    padding's micro-batches become idle steps."""
    padded = max(2 * p - 1, m)
    first, second = rank, 2 * p - 1 - rank
    ops: list[Entry] = [None] * rank
    count = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}

    def add(kind: str, chunk: int, key: str | None = None) -> None:
        key = key or f"{kind if kind == 'F' else 'B'}{chunk}"
        ops.append(PipelineStep(second if chunk else first, kind, count[key]))

    def forward(chunk: int) -> None:
        add("F", chunk)
        count[f"F{chunk}"] += 1

    def backward(chunk: int, weight: bool = True) -> None:
        add("I", chunk)
        if weight:
            add("W", chunk)
        count[f"B{chunk}"] += 1

    for _ in range(2 * (p - rank) - 1):
        forward(0)
    for _ in range(rank):
        forward(1)
        forward(0)
    for _ in range(p - rank):
        forward(1)
        backward(1)
    while count["F1"] < count["F0"] or count["F0"] < padded:
        if count["F0"] < padded:
            forward(0)
        backward(0)
        forward(1)
        backward(1)
    count["W0"], count["W1"] = count["B0"], count["B1"]

    def weight(chunk: int) -> None:
        add("W", chunk, f"W{chunk}")
        count[f"W{chunk}"] += 1

    for _ in range(rank):
        backward(0, weight=False)
        backward(1, weight=False)
    for _ in range(p - rank):
        backward(0, weight=False)
        weight(0)
    while count["W1"] < count["B1"]:
        weight(1)
    while count["W0"] < count["B0"]:
        weight(0)
    return [None if step is None or step.microbatch >= m else step for step in ops]


def _dualpipev_rank(m: int, p: int, rank: int) -> list[Entry]:
    """``ScheduleDualPipeV._calculate_single_rank_operations``: F0, F0F1, I1W1F1, then the
    overlapped F0B1-F1B0 main steps, B1-F1B0, B1B0 (the second half as I), W0B0, W0."""
    first, second = rank, 2 * p - 1 - rank
    counters: dict[tuple[int, str], int] = {}
    pending: list[tuple[int, int]] = []  # (stage, micro-batch) of the W steps still to run
    ops: list[Entry] = []

    def make(stage: int, kind: str) -> PipelineStep:
        """The step, counting F, I (a full backward counts as an I and a W) and W."""
        key = (stage, "I" if kind == "B" else kind)
        index = counters.get(key, 0)
        if kind == "B":
            counters[(stage, "I")] = index + 1
            counters[(stage, "W")] = counters.get((stage, "W"), 0) + 1
        else:
            counters[key] = index + 1
            if kind == "I":
                pending.append((stage, index))
        return PipelineStep(stage, kind, index)

    def overlap(forward_stage: int, backward_stage: int) -> None:
        ops.append(OverlapStep(make(forward_stage, "F"), make(backward_stage, "B")))

    def weight() -> None:
        if pending:
            stage, index = pending.pop(0)
            ops.append(PipelineStep(stage, "W", index))
            counters[(stage, "W")] = counters.get((stage, "W"), 0) + 1

    for _ in range(2 * (p - rank - 1)):
        ops.append(make(first, "F"))
    for _ in range(rank + 1):
        ops += [make(first, "F"), make(second, "F")]
    for _ in range(p - rank - 1):
        ops.append(make(second, "I"))
        weight()
        ops.append(make(second, "F"))
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:  # not overlapped, to shorten the bubble
            ops += [make(first, "F"), make(second, "B")]
        else:
            overlap(first, second)
        overlap(second, first)
    for _ in range(p - rank - 1):
        ops.append(make(second, "B"))
        overlap(second, first)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        ops.append(make(second, "I" if split else "B"))
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        ops.append(make(first, "I" if split else "B"))
    for _ in range(p - rank - 1):
        weight()
        ops.append(make(first, "I" if split else "B"))
    for _ in range(rank + 1):
        weight()
    return ops
