"""The pipeline schedule as the memory model sees it: each rank's order of forwards and
backwards, the micro-batches it holds at the moments that can be its peak, and the copies of each
boundary tensor the runtime keeps then.

Notation: p pipeline ranks (stages s = 0..p-1), m micro-batches per step, v model chunks per rank
(interleaved 1F1B: p v virtual stages, virtual stage j on rank j mod p), g the micro-batches a rank
forwards through one chunk before the next (``interleaved_schedule_groups``).

  k_s       = min(m, p - s) under 1F1B, m under GPipe                  micro-batches in flight
              (``in_flight_microbatches``; with interleaving the vectors (n_0 .. n_{v-1}) held per
              chunk at each possible peak, ``in_flight_vectors``)
  c_r = d_r = the forwards before rank r's first backward, the backwards after its last forward
              (``forwards_before_first_backward``)
  R_s, S_s  = copies of each received and each sent boundary tensor stage s keeps
              (``boundary_copies``):
              megatron  R_s = 1 (s > 0), S_s = 1 (s < p - 1): the next input's and the next
                        gradient's receive buffers; sent outputs are freed at once
                        (deallocate_pipeline_outputs, as Megatron-LM sets it) and the in-flight
                        inputs are the stage's saved input, already in its activations. Without
                        deallocate_pipeline_outputs (megatron-core's TransformerConfig default)
                        S_s = 1 + k_s: the outputs of the k_s in-flight micro-batches stay alive
                        until their backward
              torch     R_s = m - k_s (s > 0): torch.distributed.pipelining allocates a receive
                        buffer per micro-batch and keeps them for the run (the k_s in flight are
                        the saved inputs); S_s = m + k_s (s < p - 1): m gradient receive buffers
                        and the outputs of the k_s in-flight micro-batches, held until their
                        backward

The buffers' bytes are ``boundaries.stage_buffer_bytes``; the time of the same order is
``schedule_time`` (docs/cost-model.md, "In-flight micro-batches" and "Boundary buffers").
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from solver.costs.megatron_buffers import megatron_moment_copies
from solver.costs.schedule_orders import (
    ZERO_BUBBLE_SCHEDULES,
    ScheduleAction,
    rank_stages,
    stage_ranks,
    zero_bubble_actions,
)
from solver.errors import InputError
from solver.specs import ParallelConfig, TrainingConfig

SplitCounts = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[bool, ...]]
"""(n, w, B, g) per chunk of a split-backward rank after an action (``split_action_counts``)."""
SplitMoment = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[bool, ...], str, int]
"""(n, w, B, g, kind, c): the counts a moment of a split-backward rank holds (``SplitCounts``)
and what runs beside them (``split_action_moments``): kind "" nothing, "T" a layer of chunk
c's forward or full backward (its largest layer moment, ``stages.chunk_moment``), "I" its
input step, "W" its weight step, "G" and "V" its first full backward and first weight step
(its gradients made then)."""


def in_flight_microbatches(
    schedule: str, num_microbatches: int, num_stages: int, stage: int
) -> int:
    """k_s: micro-batches whose activations stage s holds at its peak (s is 0-based).

    1F1B: stage s runs p - s warm-up forwards before its first backward (Narayanan et al. 2021).
    GPipe: all m forwards run before any backward.
    """
    if schedule == "gpipe":
        return num_microbatches
    return min(num_microbatches, num_stages - stage)


def interleaved_schedule_groups(runtime: str, num_microbatches: int, num_ranks: int) -> int:
    """Micro-batches a rank forwards through one chunk before moving to its next chunk.

    megatron: ``microbatch_group_size_per_vp_stage``, default p (it must divide m then);
    torch: ``ScheduleInterleaved1F1B.microbatches_per_round`` = m // max(1, m // p)."""
    if runtime == "torch":
        return num_microbatches // max(1, num_microbatches // num_ranks)
    return num_ranks


def in_flight_vectors(
    num_microbatches: int, num_ranks: int, num_chunks: int, rank: int, group: int | None = None
) -> list[tuple[int, ...]]:
    """Micro-batches of each of rank r's v chunks whose activations are held, at every moment
    that can be the rank's activation peak, as the maximal such vectors (n_0 .. n_{v-1}).

    Interleaved 1F1B (Narayanan et al. 2021; Megatron-core ``get_schedule_table`` and
    ``get_pp_rank_microbatches``, torch ``ScheduleInterleaved1F1B``): forwards visit the chunks
    in rounds of ``group`` micro-batches (chunk 0 for micro-batches 0..g-1, chunk 1 for the same,
    ..., then chunk 0 for g..2g-1), backwards in the same order with the chunks reversed. Rank r
    runs W_r = min(m v, (v - 1) g + 2 (p - 1 - r)) warm-up forwards, then one forward and one
    backward per step, then the remaining backwards. Activations grow only with a forward, so the
    peaks are just after each forward; dominated vectors are dropped (activations are >= 0).

    With equal chunks the largest total is W_r + 1 units of one chunk: rank 0 holds
    (v - 1) g + 2 p - 1 chunk-micro-batches, i.e. p (1 + (p - 1) / (p v)) micro-batches of a
    stage with g = p (Korthikanti et al. 2022, section 4.2.3), against p without interleaving.
    """
    moments = schedule_moments(num_microbatches, num_ranks, num_chunks, rank, group)
    held = [n for n, _ in moments]  # distinct vectors
    # [i, j]: vector i >= vector j in every chunk (i != j: distinct, so then it dominates j)
    counts = np.array(held, dtype=np.int64).reshape(len(held), num_chunks)
    at_least = np.all(counts[:, None, :] >= counts[None, :, :], axis=2)
    np.fill_diagonal(at_least, False)
    dominated = at_least.any(axis=0)
    return [vector for vector, drop in zip(held, dominated.tolist(), strict=True) if not drop]


def forwards_before_first_backward(
    num_microbatches: int, num_ranks: int, rank: int, schedule: str
) -> int:
    """c_r: the forwards rank r runs before its first backward without interleaving
    (``schedule_actions``' order): all m with GPipe; with 1F1B its p - 1 - r warm-up forwards
    and the first steady one, at most m. It is also d_r, the backwards after its last forward:
    GPipe's m; 1F1B's last steady one and its cool-down, as many as its warm-up plus one."""
    if schedule == "gpipe":
        return num_microbatches
    return min(num_microbatches, num_ranks - rank)


@lru_cache(maxsize=512)
def schedule_actions(
    num_microbatches: int,
    num_ranks: int,
    num_chunks: int,
    rank: int,
    group: int | None = None,
    schedule: str = "1f1b",
) -> tuple[ScheduleAction, ...]:
    """Rank r's forwards and backwards in the order it runs them (idle steps left out).

    GPipe (torch ``ScheduleGPipe``): the m forwards, then the m backwards, both in micro-batch
    order. 1F1B (torch ``Schedule1F1B``, megatron-core
    ``forward_backward_pipelining_without_interleaving``): min(m, p - 1 - r) warm-up forwards,
    then one forward and one backward per step, then the remaining backwards. Interleaved 1F1B
    (v > 1; torch ``ScheduleInterleaved1F1B``, megatron-core
    ``forward_backward_pipelining_with_interleaving``): forwards visit the chunks in rounds of
    ``group`` micro-batches (default p; ``interleaved_schedule_groups``), backwards in the same
    order with the chunks reversed, after W_r = min(m v, (v - 1) g + 2 (p - 1 - r)) warm-up
    forwards (``in_flight_vectors``). Each chunk takes its micro-batches in order. The
    zero-bubble and V schedules (``ZERO_BUBBLE_SCHEDULES``: F, I, W and B steps) are torch's
    (``schedule_orders.zero_bubble_actions``)."""
    m, p, v = num_microbatches, num_ranks, num_chunks
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return zero_bubble_actions(schedule, m, p, v, rank)
    if schedule == "gpipe":
        assert v == 1, "GPipe runs one chunk per rank"
        return tuple(ScheduleAction("F", 0, i) for i in range(m)) + tuple(
            ScheduleAction("B", 0, i) for i in range(m)
        )
    g = p if group is None else group
    order = [
        chunk for start in range(0, m, g) for chunk in range(v) for _ in range(min(g, m - start))
    ]
    total = m * v
    # without interleaving (v = 1) rank r runs p - 1 - r warm-up forwards (plain 1F1B)
    ahead = (v - 1) * g + 2 * (p - 1 - rank) if v > 1 else p - 1 - rank
    warmup = min(total, ahead)
    forwards, backwards = [0] * v, [0] * v
    actions: list[ScheduleAction] = []

    def forward(step: int) -> None:
        chunk = order[step]
        actions.append(ScheduleAction("F", chunk, forwards[chunk]))
        forwards[chunk] += 1

    def backward(step: int) -> None:
        chunk = v - 1 - order[step]
        actions.append(ScheduleAction("B", chunk, backwards[chunk]))
        backwards[chunk] += 1

    for step in range(warmup):
        forward(step)
    for k in range(total - warmup):
        forward(warmup + k)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    return tuple(actions)


def schedule_moments(
    num_microbatches: int,
    num_ranks: int,
    num_chunks: int,
    rank: int,
    group: int | None = None,
    schedule: str = "1f1b",
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every moment of rank r's schedule just after a forward or a backward, as (n, B): the
    micro-batches each chunk holds and the backwards each chunk has done (the order of
    ``schedule_actions``, replayed; with split backwards a micro-batch is held until its W,
    ``schedule_memory``). B only grows, so for each distinct n only the latest moment is kept;
    largest n first."""
    v = num_chunks
    held, done = [0] * v, [0] * v
    latest: dict[tuple[int, ...], tuple[int, ...]] = {}
    for action in schedule_actions(num_microbatches, num_ranks, v, rank, group, schedule):
        if action.kind == "F":
            held[action.chunk] += 1
        elif action.kind != "I":
            held[action.chunk] -= 1
            done[action.chunk] += 1
        latest[tuple(held)] = tuple(done)
    return sorted(latest.items(), reverse=True)


@lru_cache(maxsize=512)
def split_moments(
    num_microbatches: int,
    num_ranks: int,
    num_chunks: int,
    rank: int,
    schedule: str,
    persistent: bool = False,
) -> tuple[SplitMoment, ...]:
    """Every distinct moment of rank r's split-backward schedule (``ZERO_BUBBLE_SCHEDULES``)
    inside or just after one of its actions (``split_action_moments``), as (n, w, B, g, kind,
    c): per chunk the micro-batches held (F run, W or B not yet), those of them between their
    I and their W, the W or B steps done, and whether a W or B of the chunk has run (its
    gradients exist then under step lifetime), and what runs beside them. The replay of
    ``schedule_memory.rank_memory``, action by action, which ``stage_costs`` maximises over.
    ``persistent``: the gradients exist all step (``split_action_moments``)."""
    actions = schedule_actions(num_microbatches, num_ranks, num_chunks, rank, None, schedule)
    moments = split_action_moments(actions, num_chunks, rank == 0, persistent)
    return tuple(dict.fromkeys(moment for action in moments for moment in action))


class SplitMomentArrays(NamedTuple):
    """``split_moments`` of one rank as arrays, a row per moment (M) and a column per chunk (v):
    held, waiting (between I and W), done and started (a W or B run: its gradients exist) as
    int64 (M, v); kind (M,) as str; chunk (M,), -1 where nothing runs beside the counts."""

    held: np.ndarray
    waiting: np.ndarray
    done: np.ndarray
    started: np.ndarray
    kind: np.ndarray
    chunk: np.ndarray


@lru_cache(maxsize=512)
def split_moment_arrays(
    num_microbatches: int,
    num_ranks: int,
    num_chunks: int,
    rank: int,
    schedule: str,
    persistent: bool = False,
) -> SplitMomentArrays:
    """:func:`split_moments` as :class:`SplitMomentArrays` (read only): ``stages`` takes the
    largest of thousands of moments per rank at once."""
    moments = split_moments(num_microbatches, num_ranks, num_chunks, rank, schedule, persistent)
    columns = list(zip(*moments, strict=True))
    arrays = SplitMomentArrays(
        *(np.array(columns[i], dtype=np.int64).reshape(len(moments), num_chunks) for i in range(4)),
        np.array(columns[4], dtype=str),
        np.array(columns[5], dtype=np.int64),
    )
    for array in arrays:
        array.flags.writeable = False
    return arrays


def split_action_moments(
    actions: tuple[ScheduleAction, ...],
    num_chunks: int,
    holds_first_stage: bool,
    persistent: bool = False,
) -> Iterator[tuple[SplitMoment, ...]]:
    """The moments of each of a split-backward rank's ``actions``, in order (torch 2.13,
    ``torch/distributed/pipelining/_backward.py`` and ``stage.py``):

    F of chunk c    the counts after it (its micro-batch held) with c's largest layer moment
                    ("T": the layers after l not run yet, l's transient)
    I of chunk c    its input step (``stage_backward_input``, the graph retained): the counts
                    after it (the micro-batch and its dY whole) with the largest transient of
                    c ("I"); on the first virtual stage torch runs no I step (its input needs
                    no gradient): the counts after it alone
    W of chunk c    its weight step (``stage_backward_weight``): the counts before it (the
                    micro-batch and its dY held) with the W step's own moments ("W"), chunk
                    c's gradients as after it; on the first virtual stage the W step is the
                    full backward: as B
    B of chunk c    the full backward (``stage_backward``): the counts before it with c's
                    largest layer moment ("T", the layers after l freed), c's gradients as
                    after it
    and after an I, a W or a B the counts after it alone (the buffers grow with the backwards
    done). Under step lifetime (not ``persistent``) chunk c's first W or B makes its
    gradients: its moment counts none of them (g_c as before it) and runs "V" (a first weight
    step: the groups so far, ``stages.weight_step_transient``) or "G" (a first full backward:
    the gradients of the layers after l and l's own, as ``stages.layer_moments``' first
    backward) instead. ``persistent``: every g is true. ``holds_first_stage``: chunk 0 is
    virtual stage 0 (rank 0)."""
    before = None
    every = (True,) * num_chunks
    for counts, action in zip(split_action_counts(actions, num_chunks), actions, strict=True):
        c = action.chunk
        first = holds_first_stage and c == 0
        if persistent:
            counts = (*counts[:3], every)
        if action.kind == "F":
            yield ((*counts, "T", c),)
        elif action.kind == "I":
            yield ((*counts, "", -1),) if first else ((*counts, "I", c), (*counts, "", -1))
        else:
            assert before is not None, "a W or B follows the micro-batch's F"
            full = action.kind == "B" or first
            started = before[3][c]
            kind = ("T" if full else "W") if started else ("G" if full else "V")
            during = (*before, kind, c)  # g as before it: the same where c's already exist
            yield during, (*counts, "", -1)
        before = counts


def split_action_counts(
    actions: tuple[ScheduleAction, ...], num_chunks: int
) -> Iterator[SplitCounts]:
    """(n, w, B, g) just after each of a split-backward rank's ``actions``, in order: per chunk
    the micro-batches held (F run, W or B not yet), those between their I and their W, the W
    or B steps done, and whether a W or B of the chunk has run (``split_moments``).

    g is per chunk: with torch's ``zero_grad(set_to_none=True)`` a parameter's ``.grad``
    appears at the first W or B of the chunk (``stage_backward_weight`` assigns it, an I step
    makes none), so a V rank's first chunk has none while its last chunk's W steps run
    (tagged: dualpipev pp 2 rank 0 peaks with (3, 1) held after chunk 0's first backward; the
    (4, 1) moment before it lacks chunk 0's 339 KiB of gradients)."""
    held, pending, done = [0] * num_chunks, [0] * num_chunks, [0] * num_chunks
    grads = [False] * num_chunks
    for action in actions:
        c = action.chunk
        if action.kind == "F":
            held[c] += 1
        elif action.kind == "I":
            pending[c] += 1
        else:  # W or B frees the micro-batch (a W its dY too)
            held[c] -= 1
            done[c] += 1
            pending[c] -= action.kind == "W"
            grads[c] = True
        yield tuple(held), tuple(pending), tuple(done), tuple(grads)


def running_moments(
    num_microbatches: int,
    num_ranks: int,
    num_chunks: int,
    rank: int,
    group: int | None = None,
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Every moment of interleaved rank r's schedule (``schedule_actions``) as (n, B, c): the
    micro-batches each chunk holds, the backwards each chunk has done, and the chunk c whose
    layer runs then (-1: none). While a forward of chunk c runs, n counts its micro-batch
    (the state after it); while a backward runs, n still counts it (the state before it);
    after a backward nothing runs until the next action (n, B after it). The moment after a
    forward is its own running moment at its last layer (``stages._rank_peak_moment``)."""
    v = num_chunks
    held, done = [0] * v, [0] * v
    moments = []
    for action in schedule_actions(num_microbatches, num_ranks, v, rank, group):
        c = action.chunk
        if action.kind == "F":
            held[c] += 1
            moments.append((tuple(held), tuple(done), c))
            continue
        moments.append((tuple(held), tuple(done), c))
        held[c] -= 1
        done[c] += 1
        moments.append((tuple(held), tuple(done), -1))
    return moments


def undominated_running(
    moments, runtime: str, copies: list | None = None
) -> list[tuple[tuple[int, ...], ...]]:
    """``running_moments`` less those another dominates, in their order (the first of equal
    ones). A rank's memory at (n, B, c) is states + sum_c' [n_c' kept_c' + R In_c' + S Out_c']
    + extra_c (extra_c >= 0 of the running chunk, 0 when none runs; ``stages``), so a moment
    is dropped when another has n, R and S at least as large in every chunk and the same
    running chunk, or any running chunk where it has none. torch: (R, S) grow with (B - n,
    B + n) (``LayerCosts.copies_at``); megatron: B is dropped (zeros) and (R, S) are the
    moment's ``copies`` (``megatron_buffers.megatron_moment_copies``, parallel to
    ``moments``), returned as a fourth element; without them with n only."""
    torch = runtime == "torch"
    if not torch:
        at = copies or [()] * len(moments)
        moments = list(  # equal moments once (the first), before the pairwise comparison
            dict.fromkeys(
                (n, (0,) * len(n), c, a) for (n, _, c), a in zip(moments, at, strict=True)
            )
        )
        rows = [
            [*n, *(r for r, _ in a), *(s for _, s in a), *(int(c == j) for j in range(len(n)))]
            for n, _, c, a in moments
        ]
        kept = undominated_rows(moments, np.array(rows, dtype=np.int64))
        return kept if copies else [moment[:3] for moment in kept]
    # B only grows: at the same (n, c) the latest moment has R and S at least as large (in
    # its place; megatron's, all alike, in the first one's)
    latest: dict[tuple, tuple] = {}
    for held, done, running in moments:
        latest.pop((held, running), None)
        latest.setdefault((held, running), (held, done, running))
    moments = list(latest.values())
    rows = []
    for held, done, running in moments:
        v = len(held)
        key = list(held)
        key += [b - n for n, b in zip(held, done, strict=True)]
        key += [b + n for n, b in zip(held, done, strict=True)]
        rows.append(key + [int(running == c) for c in range(v)])
    return undominated_rows(moments, np.array(rows, dtype=np.int64))


def undominated_rows(moments: list, keys: np.ndarray) -> list:
    """``moments`` less those whose key row (``keys[i]``, one per moment; memory grows with
    every column) another row is at least everywhere and differs from; of equal rows the
    first. Order kept."""
    at_least = np.all(keys[:, None, :] >= keys[None, :, :], axis=2)  # [j, i]: j >= i everywhere
    differs = np.any(keys[:, None, :] != keys[None, :, :], axis=2)
    dominated = np.any(at_least & differs, axis=0)
    _, first = np.unique(keys, axis=0, return_index=True)
    unique = np.zeros(len(moments), dtype=bool)
    unique[first] = True
    return [
        moment
        for moment, drop, keep in zip(moments, dominated.tolist(), unique.tolist(), strict=True)
        if keep and not drop
    ]


def in_flight_counts(config: ParallelConfig, training: TrainingConfig):
    """(k_j per virtual stage, in-flight vectors per rank, backwards done at each, the running
    chunk at each, the (R, S) of each chunk at each: megatron with interleaving,
    ``megatron_buffers.megatron_moment_copies``, else []) of ``config``. With interleaving
    (1F1B) the undominated moments of ``running_moments`` (the running chunks, -1 none;
    ``stages._rank_peak_moment``); for the
    split-backward schedules on the torch runtime every moment of the schedule (its buffers
    grow with the backwards done, and shrink with the held inputs) and no running chunk (their
    persistent moment); without interleaving [(k_s)] and none."""
    p, v, m = config.pp, config.virtual_stages, config.num_microbatches
    if config.schedule in ZERO_BUBBLE_SCHEDULES:  # every moment of torch's lists
        moments = [
            _undominated_moments(schedule_moments(m, p, v, r, None, config.schedule))
            for r in range(p)
        ]
        vectors = [[n for n, _ in rank] for rank in moments]
        dones = [[done for _, done in rank] for rank in moments]
        ranks = stage_ranks(config.schedule, p, v)
        chunk = [rank_stages(config.schedule, p, v, ranks[j]).index(j) for j in range(p * v)]
        in_flight = [max(vector[chunk[j]] for vector in vectors[ranks[j]]) for j in range(p * v)]
        return in_flight, vectors, dones, [], []
    if v == 1:
        in_flight = [in_flight_microbatches(config.schedule, m, p, s) for s in range(p)]
        return in_flight, [[(k,)] for k in in_flight], [[(0,)] for _ in in_flight], [], []
    if training.memory_model != "analytic":
        raise InputError(
            "memory model empirical: the statistics describe contiguous stages; interleaved "
            "stages (--virtual-stages > 1) need the analytic model"
        )
    group = interleaved_schedule_groups(training.runtime, m, p)
    moments = []
    for r in range(p):
        copies = None
        if training.runtime == "megatron":
            copies = megatron_moment_copies(
                m, p, v, r, group, deallocate=training.deallocate_pipeline_outputs
            )
        moments.append(
            undominated_running(running_moments(m, p, v, r, group), training.runtime, copies)
        )
    vectors = [[moment[0] for moment in rank] for rank in moments]
    dones = [[moment[1] for moment in rank] for rank in moments]
    running = [[moment[2] for moment in rank] for rank in moments]
    copies = [[moment[3] for moment in rank] for rank in moments] if moments[0][0][3:] else []
    in_flight = [max(vector[j // p] for vector in vectors[j % p]) for j in range(p * v)]
    return in_flight, vectors, dones, running, copies


def _undominated_moments(moments):
    """Drop a moment (n, B) when another has, for every chunk, n' >= n, B' - n' >= B - n and
    B' + n' >= B + n: the coefficients of a chunk's kept, received and sent bytes on the torch
    runtime with interleaving (n, m - n + B, m + n + B, ``LayerCosts.copies_at``) are then all
    at least as large, so its memory is too, whatever the split."""
    held = np.array([n for n, _ in moments], dtype=np.int64)
    done = np.array([b for _, b in moments], dtype=np.int64)
    keys = np.concatenate([held, done - held, done + held], axis=1)
    at_least = np.all(keys[:, None, :] >= keys[None, :, :], axis=2)  # [j, i]: j >= i everywhere
    differs = np.any(keys[:, None, :] != keys[None, :, :], axis=2)
    dominated = np.any(at_least & differs, axis=0)
    return [moment for moment, drop in zip(moments, dominated.tolist(), strict=True) if not drop]


def boundary_copies(
    runtime: str,
    schedule: str,
    num_microbatches: int,
    num_stages: int,
    stage: int,
    *,
    deallocate_pipeline_outputs: bool = True,
    held: int | None = None,
    done: int = 0,
) -> tuple[int, int]:
    """(R_s, S_s): copies of each received and each sent boundary tensor stage s holds at its peak
    (or with ``held`` in flight after ``done`` backwards).

    megatron: one buffer for the next input (s > 0) and one for the next gradient (s < p - 1).
    With ``deallocate_pipeline_outputs`` (Megatron-LM's argument parsing sets it) a sent output's
    data is freed at once; without it (megatron-core's ``TransformerConfig`` default) the outputs
    of the k_s in-flight micro-batches stay alive until their backward: S_s = 1 + k_s (measured on
    megatron-core 0.16.1, ../shared/reference/runtime-memory-facts.md).
    torch: torch.distributed.pipelining allocates a receive buffer per micro-batch (activations on
    every non-first stage, gradients on every non-last one) and keeps them for the run, and a stage
    keeps the outputs of its in-flight micro-batches until their backward (measured,
    ``benchmarks/bench_accuracy.md``); ``deallocate_pipeline_outputs`` does not apply. In both, the
    in-flight inputs are what the stage's first layer saves, so they are part of the stage's
    activations. ``held``: k_s (default: the schedule's, :func:`in_flight_microbatches`; with
    interleaving the virtual stage's count at the moment).

    torch's ``Schedule1F1B`` keeps two more tensors alive through its steady state, found by
    tagging the live storages at the peak (HF Llama, Mixtral, DeepSeek-V2 at pp 2,
    ``tests/test_hf_validate.py``): the input gradient a non-first stage sent after its last
    backward (the ``bwd_sends`` list holds it until the next backward has run; counted as one
    more copy of the received tensors, which over-counts any that need no gradient), and, on a
    non-last stage with k_s >= 2, the output of micro-batch k_s - 2, whose warm-up send the
    ``send_work`` list holds until the cool-down, long after its backward (there is a steady
    state moment past that backward when m >= 2 k_s - 1).

    torch's ``ScheduleGPipe`` waits on its sends only at the end of each phase and keeps their
    works (``fwd_sends_to_wait``, ``bwd_sends_to_wait``) until ``step()`` returns, and a gloo
    send's work holds its tensor until the work is freed: a GPipe stage in its backward phase
    (held > 0 after ``done`` = m - held backwards) still holds the outputs of those micro-
    batches and the input gradients they sent, (m - held + done, m + held + done) as with
    interleaving (``LayerCosts.copies_at``); at 0 held (the optimizer step, after ``step()``)
    none. Found by tagging the live storages at the peak (HF Llama pp 3 GPipe, step lifetime:
    the first stage held all m outputs after its first backward). Those moments are
    ``LayerCosts.after_moments``.
    """
    first, last = stage == 0, stage == num_stages - 1
    k = held
    if k is None:
        k = in_flight_microbatches(schedule, num_microbatches, num_stages, stage)
    if runtime == "megatron":
        kept_outputs = 0 if deallocate_pipeline_outputs else k
        return int(not first), (0 if last else 1 + kept_outputs)
    m = num_microbatches
    sent_gradient = int(schedule == "1f1b" and m > 1)
    stale_output = int(schedule == "1f1b" and 2 <= k and 2 * k - 1 <= m)
    done = done if schedule == "gpipe" and k > 0 else 0  # GPipe's sends held to the end
    return (
        0 if first else m - k + sent_gradient + done,
        0 if last else m + k + stale_output + done,
    )


def stage_boundary_copies(
    runtime: str,
    config: ParallelConfig,
    *,
    deallocate_pipeline_outputs: bool = True,
    in_flight: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """([R_j], [S_j]) of every (virtual) stage of ``config`` under ``runtime``; with v chunks per
    rank each of the p v virtual stages keeps its own buffers. With interleaving on the torch
    runtime, and on the megatron runtime without ``deallocate_pipeline_outputs``, the copies
    follow the schedule (``LayerCosts.copies_at``); these are their largest values (for bounds),
    from ``in_flight`` (the most micro-batches each virtual stage holds, ``LayerCosts.in_flight``;
    needed in that megatron case)."""
    num_stages = config.pp * config.virtual_stages
    m = config.num_microbatches
    if runtime == "torch" and (
        config.virtual_stages > 1 or config.schedule in ZERO_BUBBLE_SCHEDULES
    ):
        # held + done <= m and pending <= held, so R <= 2 m and S <= 2 m
        return [0] + [2 * m] * (num_stages - 1), [2 * m] * (num_stages - 1) + [0]
    if config.virtual_stages > 1 and not deallocate_pipeline_outputs:
        assert in_flight is not None, "interleaved megatron copies without deallocation need k_j"
    held = None if in_flight is None else tuple(in_flight)
    receive, send = _stage_copies(
        runtime, config.schedule, m, num_stages, deallocate_pipeline_outputs, held
    )
    return list(receive), list(send)


@lru_cache(maxsize=1024)
def _stage_copies(
    runtime: str,
    schedule: str,
    num_microbatches: int,
    num_stages: int,
    deallocate_pipeline_outputs: bool,
    held: tuple[int, ...] | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``stage_boundary_copies`` of the stages one at a time (``boundary_copies``), cached: a
    search asks for the same few layouts' copies once per candidate configuration."""
    copies = [
        boundary_copies(
            runtime,
            schedule,
            num_microbatches,
            num_stages,
            j,
            deallocate_pipeline_outputs=deallocate_pipeline_outputs,
            held=None if held is None else held[j],
        )
        for j in range(num_stages)
    ]
    return tuple(receive for receive, _ in copies), tuple(send for _, send in copies)
