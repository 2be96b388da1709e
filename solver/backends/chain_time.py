"""The chain backend's time rules (``backends.chain``): the iteration bound's terms of a stage
on layers i..j as non-decreasing combinations of prefix sums, U[j+1] - V[i] + offset."""

from __future__ import annotations

import numpy as np

from solver.costs import BoundTerm, LayerCosts

TIME_BASIS = ("time", "forward", "tail")
"""The prefix sums (of time_ns, forward_ns, tail_ns) the bound's terms combine, in the order of
``time_coefficients``' last axis."""


def time_coefficients(
    costs: LayerCosts, terms: list[list[BoundTerm]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The iteration bound's terms (``terms``, ``costs.bound_terms``) of every stage as
    coefficients of the prefix sums pT, pF, pX (``TIME_BASIS``): (U [term, stage, basis], V
    likewise, offset [term, stage] in ns, X_0's [term]); the term of stage s on layers i..j is
    U . P[j+1] - V . P[i] + offset (+ X_0). A term
    (m + a) (T + h) + bt T_<r + bf F_<r + e (F + h) + x X + g T_>r + const, with T_>r the
    total time less pT[j+1], is U = (m + a - g) pT + e pF + x pX and
    V = (m + a - bt) pT + (e - bf) pF + x pX, both non-decreasing (per layer T_l >= F_l, and
    the waits' coefficients leave at least as many micro-batches as they take away;
    tests/test_chain.py checks it). O(terms x stages): the sums themselves are read on demand
    (``_Chain.times``, ``PrefixSums``)."""
    m, h = costs.config.num_microbatches, costs.microbatch_overhead_ns
    total = int(np.sum(costs.time_ns, dtype=np.int64))
    terms = np.array(terms, dtype=np.int64)  # [stage, term, field]
    field = {name: terms[:, :, k].T for k, name in enumerate(BoundTerm._fields)}
    busy = m + field["own_time"]
    own_forward, own_tail = field["own_forward"], field["own_tail"]
    end = np.stack([busy - field["after_time"], own_forward, own_tail], axis=-1)
    start = np.stack(
        [busy - field["before_time"], own_forward - field["before_forward"], own_tail], axis=-1
    )
    offset = field["after_time"] * total + (busy + own_forward) * h + field["constant_ns"]
    return end, start, offset, field["first_tail"][:, 0]


def time_rules(
    costs: LayerCosts, terms: list[list[BoundTerm]], prefix
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``time_coefficients`` with U and V as arrays [term, stage, position] (``prefix`` makes
    a prefix sum): O(terms x stages x layers), for tests of small chains only."""
    end, start, offset, first = time_coefficients(costs, terms)
    basis = np.stack([prefix(v) for v in (costs.time_ns, costs.forward_ns, costs.tail_ns)])
    return end @ basis, start @ basis, offset, first
