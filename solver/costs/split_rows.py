"""The moments of a split-backward schedule every backend constrains: once per config.

A rank of a split-backward schedule (``schedule_orders.ZERO_BUBBLE_SCHEDULES``) has, after each
action of torch's list, per chunk c: n_c micro-batches held, w_c of them between their I and
their W, B_c W or B steps done, and g_c (a W or B of chunk c has run: its gradients exist
under step lifetime) (``schedule.split_moments``). Its memory there is linear in the per-chunk
sums (``stages._split_peak_moment``, docs/cost-model.md "Zero-bubble and V schedules"):

  states_r + sum_c [ -(1 - g_c) grads_c + n_c kept_c + w_c dY_c + R(n_c, B_c, w_c) In_c
                     + S(n_c, B_c) Out_c ] + X

with kept, dY (``stages.weight_output_gradients``), In, Out >= 0 per chunk and R, S the copies
(``LayerCosts.copies_at``), and X >= 0 what runs beside them (``schedule.split_action_moments``:
nothing, chunk c's largest layer moment T_c, its input step's transient I_c, its weight step's
W_c, or its first full backward's G_c or first weight step's V_c with g_c = 0,
``stages.split_extras``). A moment is dropped when another one has, in every chunk, n, w, R
and S at least as large and g_c at least as large, and the same X or none itself
(``undominated``): its memory is then at least as large whatever the split, so the largest
moment is among the kept ones. On the torch runtime
the boundary terms also carry + n known In - n counted (``formulation_terms._buffer_terms``),
which grow with n since the counted tensors are part of kept (``_counted_here``).
"""

from __future__ import annotations

import numpy as np

from solver.costs.schedule import SplitMoment, split_moments, undominated_rows

EXTRA_KINDS = ("T", "G", "I", "W", "V")
"""What can run beside a moment's counts (``schedule.SplitMoment``), "" none."""


def latest(moments: tuple[SplitMoment, ...]) -> list[SplitMoment]:
    """For each (n, w, g, kind, c), the last of ``moments`` (in schedule order) with it: the
    done counts B only grow, and the copies R(n, B), S(n, B) never shrink as B grows at the
    same n (``LayerCosts.copies_at``), so it dominates the earlier ones. Order of first
    appearance."""
    last: dict[tuple, SplitMoment] = {}
    for moment in moments:
        held, waiting, _, started, kind, chunk = moment
        last[(held, waiting, started, kind, chunk)] = moment
    return list(last.values())


def undominated(moments, copies) -> list[SplitMoment]:
    """``moments`` less those another one dominates (module docstring); ``copies(c, n, B)``:
    (R, S) of chunk c at n held after B done, w of them between I and W. Order kept."""
    moments = latest(tuple(moments))
    keys = np.array(
        [
            [
                value
                for c, (n, b, w) in enumerate(zip(held, done, waiting, strict=True))
                for value in (n, *copies(c, n, b, w))
            ]
            + list(waiting)
            + [int(g) for g in started]
            + [int(kind == k and chunk == c) for k in EXTRA_KINDS for c in range(len(held))]
            for held, waiting, done, started, kind, chunk in moments
        ],
        dtype=np.int64,
    )
    return undominated_rows(moments, keys)


KEPT_ROWS = 256
"""``split_rows`` answers kept (a search bounds hundreds of configs that share a few pipelines:
the rows took 2/3 of the bounding of a 96-layer model's split-backward configs)."""
_kept_rows: dict[tuple, list[list[SplitMoment]]] = {}


def _rows_key(costs) -> tuple:
    """Everything ``split_rows`` reads of ``costs``: the schedule's moments and the copies
    (``LayerCosts.copies_at`` without a moment: runtime, stages, in-flight counts and copies)."""
    config = costs.config
    return (
        config.num_microbatches, config.pp, config.virtual_stages, config.schedule,
        costs.grad_lifetime != "step", costs.runtime, costs.deallocate_pipeline_outputs,
        costs.num_stages, tuple(np.asarray(costs.in_flight).tolist()),
        tuple(np.asarray(costs.receive_copies).tolist()),
        tuple(np.asarray(costs.send_copies).tolist()),
    )  # fmt: skip


def split_rows(costs) -> list[list[SplitMoment]]:
    """Per rank of ``costs`` (a ``LayerCosts`` of a split-backward schedule), its undominated
    moments (module docstring), the rows of every backend's memory constraint; the last
    :data:`KEPT_ROWS` answers are kept by what they depend on (``_rows_key``)."""
    key = _rows_key(costs)
    if key not in _kept_rows:
        _kept_rows[key] = _split_rows(costs)
        while len(_kept_rows) > KEPT_ROWS:
            del _kept_rows[next(iter(_kept_rows))]
    return [list(rank) for rank in _kept_rows[key]]


def _split_rows(costs) -> list[list[SplitMoment]]:
    """``split_rows`` computed."""
    config = costs.config
    rows = []
    for rank in range(config.pp):
        own = costs.stages_of_rank(rank)
        moments = split_moments(
            config.num_microbatches, config.pp, config.virtual_stages, rank, config.schedule,
            costs.grad_lifetime != "step",  # persistent: every gradient all step
        )  # fmt: skip
        rows.append(
            undominated(
                moments, lambda c, n, b, w, own=own: costs.copies_at(own[c], n, b, w)
            )
        )
    return rows


def attach_split_rows(costs) -> None:
    """Set ``costs``' in-flight vectors, backwards done, pending vectors and gradient flags (per
    chunk) to the split-backward schedule's undominated moments (``split_rows``)."""
    rows = split_rows(costs)
    costs.in_flight_vectors = [[row[0] for row in rank] for rank in rows]
    costs.pending_vectors = [[row[1] for row in rank] for rank in rows]
    costs.backwards_done = [[row[2] for row in rank] for rank in rows]
    costs.grads_started = [[row[3] for row in rank] for rank in rows]
    costs.split_extras = [[row[4:] for row in rank] for rank in rows]


def most_held(config) -> int:
    """The most micro-batches' activations and dY a rank of ``config``'s split-backward schedule
    keeps at once (max over its moments of sum_c n_c + w_c), for the exact-range check."""
    return max(
        sum(n) + sum(w)
        for rank in range(config.pp)
        for n, w, *_ in split_moments(
            config.num_microbatches, config.pp, config.virtual_stages, rank, config.schedule
        )
    )
