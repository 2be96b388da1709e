"""The iteration bound every backend constrains and minimises: a lower bound on the simulated
iteration (``schedule_time``) from each rank's terms (``bound_terms``, ``iteration_bound_ns``),
and the floor no split of a config can beat (``iteration_floor_ns``). docs/cost-model.md,
"Time"."""

from __future__ import annotations

from operator import mul
from typing import NamedTuple

import numpy as np

from solver.costs.coefficients import LayerCosts
from solver.costs.schedule import forwards_before_first_backward
from solver.costs.stage_cost import StageCost


class BoundTerm(NamedTuple):
    """One lower bound on the iteration through one rank (``bound_terms``), ns: (m + own_time)
    T_r (the rank's m micro-batches of every chunk, T_r with its v h overhead) plus, each with
    its coefficient here,
      before_time T_<r and before_forward F_<r (the first chunks of the ranks before: forward
      and backward of one micro-batch, or its forward only), own_forward F_r (its forward per
      micro-batch, overhead included), own_tail X_r, after_time T_>r (one micro-batch through
      the ranks after), first_tail X_0 (rank 0's tail), and constant_ns (the overheads h of
      the forwards before and after: T_<r, F_<r and T_>r are the layers' times alone)."""

    before_time: int
    before_forward: int
    own_forward: int
    own_tail: int
    after_time: int
    first_tail: int
    constant_ns: int
    own_time: int = 0


def bound_terms(costs: LayerCosts) -> list[list[BoundTerm]]:
    """The terms of the iteration bound of each rank (``iteration_bound_ns``); every rank has
    as many (the chain backend stacks them).

    Rank r's first action waits for micro-batch 0's forward through the virtual stages before
    it (F_<r). It then runs m micro-batches, m T_r, and waits twice more:
      E_r = max(0, F_r + T_>r - c_r F_r): its first backward, after its c_r first forwards
            (``forwards_before_first_backward``), waits for micro-batch 0 through the ranks
            after it and back;
      D_r = max(0, T_>r - (d_r - 1) B_r): its last backward, d_r = c_r backwards after its last
            forward (``forwards_before_first_backward``), waits for micro-batch m - 1 the same way
            while it runs the d_r - 1 others.
    With 1F1B and m > c_r the two waits are apart (the first backward comes before the last
    forward) and add up; else only the larger counts. After its last backward the rank syncs
    and steps (X_r), while that micro-batch still runs backward through the virtual stages
    before (B_<r) and then rank 0 syncs and steps (X_0). The terms are these combinations; with
    interleaving only the two without waits; with a split backward (zbv, dualpipev,
    interleaved-zb) only F_<r + m T_r + X_r."""
    cached = costs.__dict__.get("_bound_terms")  # config-fixed: made once per LayerCosts
    if cached is not None:
        return cached
    config, h = costs.config, costs.microbatch_overhead_ns
    m, p, v = config.num_microbatches, config.pp, config.virtual_stages
    terms = []
    for r in range(p):
        # r h: the overhead of one forward on each virtual stage before; every term ends with
        # a rank's tail, its step overhead included
        before = r * h + costs.step_overhead_ns
        waits = [(0, 0, 0, 0)]  # (own_time, own_forward, after_time, overhead) of the waits
        if v == 1:
            c = d = forwards_before_first_backward(m, p, r, config.schedule)
            after = (p - 1 - r) * h  # the overhead of the forwards after
            first = (0, 1 - c, 1, after)  # E_r = F_r + T_>r - c_r F_r
            last = (1 - d, d - 1, 1, after)  # D_r = T_>r - (d_r - 1) (T_r - F_r)
            both = (1 - d, d - c, 2, 2 * after) if config.schedule == "1f1b" and m > c else first
            waits += [first, last, both]
        if costs.split_backward:
            # deferred W steps let the ranks before run their backwards beside rank r's: only
            # the wait for micro-batch 0's forward, m T_r and the rank's own tail are sure
            term = BoundTerm(0, 1, 0, 1, 0, 0, before, 0)
            terms.append([term, term])
            continue
        rank = []
        for own_time, own_forward, after_time, overhead in waits:
            constant = before + overhead
            rank += [  # ... + X_0 after the backwards before; + X_r
                BoundTerm(1, 0, own_forward, 0, after_time, 1, constant, own_time),
                BoundTerm(0, 1, own_forward, 1, after_time, 0, constant, own_time),
            ]
        terms.append(rank)
    costs.__dict__["_bound_terms"] = terms
    return terms


def iteration_bound_ns(costs: LayerCosts, stages: list[StageCost]) -> int:
    """A lower bound on the simulated iteration of these stages (``solver.costs.schedule_time``),
    ns: the largest ``bound_terms`` term of any rank, on any schedule (1F1B, GPipe, interleaved)
    and any transfer times (they only delay): what every backend constrains and minimises
    (docs/cost-model.md, "Time"). On an even split without data parallelism it is the
    bubble formula (m + p - 1) T."""
    m, h = costs.config.num_microbatches, costs.microbatch_overhead_ns
    total = sum(stage.time_ns for stage in stages)  # overheads: in the terms' constants
    first_tail = costs.stage_tail_ns(stages[0])
    bound = before_time = before_forward = 0
    for stage, terms in zip(stages, bound_terms(costs), strict=True):
        own = stage.time_ns + len(stage.chunk_time_ns) * h
        forward = sum(stage.chunk_forward_ns) + len(stage.chunk_time_ns) * h
        # the amounts of BoundTerm's first six fields, in their order
        values = (
            before_time,
            before_forward,
            forward,
            costs.stage_tail_ns(stage),
            total - before_time - stage.time_ns,
            first_tail,
        )
        for term in terms:
            value = (m + term.own_time) * own + term.constant_ns + sum(map(mul, term, values))
            bound = max(bound, value)
        # chunk 0 of this rank is virtual stage r, before every later rank's chunk 0
        before_time += stage.chunk_time_ns[0]
        before_forward += stage.chunk_forward_ns[0] if stage.chunk_forward_ns else 0
    return bound


def iteration_floor_ns(
    costs: LayerCosts, time_ns: np.ndarray | None = None, tail_ns: np.ndarray | None = None
) -> int:
    """An ``iteration_bound_ns`` no split of this config can beat, ns, from the layers' times
    alone (``time_ns``: per layer and micro-batch, default each layer's faster recompute state;
    ``tail_ns``: default ``LayerCosts.tail_ns``); each term below carries the m v h overhead.

    - the rank holding layer l: m time_l + tail_l;
    - without interleaving, a weighted sum of the ranks' first terms T_<r + m T_r with weights
      w_r = (1 - 1/m)^(p-1-r) / m counts every layer's time c = 1 times, and the weights sum to
      W = 1 - (1 - 1/m)^p, so their largest is >= sum_l time_l / W (an even split of a
      continuous chain meets it);
    - with interleaving or a split backward, each rank's m T_r: at least m sum_l time_l / p."""
    config = costs.config
    m, p, v = config.num_microbatches, config.pp, config.virtual_stages
    if time_ns is None:
        time_ns = costs.bounding_coefficients(np.minimum)[2]
    tail_ns = costs.tail_ns if tail_ns is None else tail_ns
    total = int(np.sum(time_ns))
    if v == 1 and not costs.split_backward:  # total m^p / (m^p - (m-1)^p), floored (exact)
        spread = total * m**p // (m**p - (m - 1) ** p)
    else:
        spread = -(-m * total // p)
    single = int(np.max(m * np.asarray(time_ns, dtype=np.int64) + tail_ns, initial=0))
    return max(spread, single) + m * v * costs.microbatch_overhead_ns + costs.step_overhead_ns
