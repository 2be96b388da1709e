"""Exact fast path for chain graphs: every stage holds a contiguous run of layers.

For stage s = layers i..j (0-based, inclusive) ``costs.stage_costs`` reduces on a chain to
  peak_s(i, j) = sum state[i..j] + (k_s - 1) sum stored[i..j] + R_s e[i-1] + S_s e[j]
                 + max_l (stored[i..l] + transient_l)   (``costs.layer_moments``, no relays)
  (R_s, S_s: the cost model's boundary copies, 0 on the first / last stage); the last term is
  a range maximum of stored_prefix[l+1] + transient_l (sparse table), less stored_prefix[i]
  (a stage ending at the last layer: its own table, with the output the torch pipeline keeps
  at the earlier layers' moments, ``LayerCosts.moment_transient``).
  On a stage whose gradients appear at its first backward (``LayerCosts.first_backward_peak``)
  during(l) also leaves out grads(i..l) but l's own made by then (``LayerCosts.late_own``), a
  range maximum of stored_prefix[l+1] - grad_prefix[l+1] + own_l + transient_l, and the
  monotone relaxation counts the states without gradients (a lower bound of during(j)); the
  moments after a backward (``LayerCosts.after_moments``, h held) add sum state[i..j]
  + h sum stored[i..j] + R_h e[i-1] + S_h e[j] + max transient[i..j];
  with an optimizer-step temporary (``LayerCosts.step_bytes``) also the step moment
  sum (state + step)[i..j] + R0_s e[i-1] + S0_s e[j] (``costs.optimizer_step_moment``)
  time(s; i, j) = the largest of stage s's terms of the iteration bound
      (``costs.bound_terms``), each U[j+1] - V[i] + offset (+ X_0) with U, V non-decreasing
      combinations of the prefix sums of time_ns, forward_ns and the tail (dp sync + optimizer
      step) (``time_rules``); X_0 is the first stage's tail; the iteration bound is
      max_s time(s; i_s, j_s).

Algorithm (exact; numpy vectorised over layers, Python loops over stages only):
1. Min-max stage problem: minimise max_s c_s, with c = peak or time, under per-stage limits
   (peak <= cap, time <= budget). Each rule U[j+1] - V[i] (U, V non-decreasing prefix sums) is
   monotone in the interval (a sub-interval never exceeds it); edges and the transient term
   are not. Bounding those below (smallest edge, smallest transient) and letting stages be
   empty gives a relaxation that greedy solves; a k-ary search on its bound gives a lower bound
   and, after cutting stages to fill the empty ones, an incumbent split.
2. From there a banded min-max DP f_s(j) = min_i max(f_{s-1}(i-1), c_s(i, j)) over the (i, j)
   pairs that the relaxation allows under a trial bound U (greedy forward and backward reach
   bound the stage ends, prefix-sum searches the starts). The DP is exact inside the band, so a
   value <= U is the optimum; otherwise U rises (relative slack 1/64, 1/16, 1/4, 1, then the
   incumbent). The band holds about L x (layers per stage) x (1 + slack x p) pairs. A small
   chain (p L^2 / 2 <= ``DIRECT_BAND_PAIRS``) takes U = the incumbent at once; the peak problem
   of a short one (L <= ``DENSE_DP_MAX_LAYERS``) is the same DP over every pair.
3. The iteration bound is a max of per-stage terms but for X_0, which couples every stage to
   the first: best-first branch and bound over X_0, whose candidates are the first stage's
   possible tails (ranges are snapped to them and bisected). A range [a, b] relaxes to "X_0 <= b
   on the first stage, X_0 = a in every stage's term": per-stage limits, so steps 1-2 solve it;
   its split settles the range when its true bound meets the budget (memory) or equals the
   range's value (time), as it always does at a single candidate; otherwise the range is split
   at that split's own X_0 (which the upper part then values exactly). That outer search is
   ``split_search.py`` (the DAG backend's too); this module is its splitter on a chain.

Memory is O(L + terms x p) at any stage count: the rules' U, V are combinations of a few prefix
sums with per-(term, stage) coefficients (``time_coefficients``), tabled while ``TABLE_BYTES``
lasts and evaluated where read beyond (``prefix_sums.PrefixSums``), and the DP evaluates its
band ``DP_CHUNK_PAIRS`` pairs at a time. Both give the same integers as full tables.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from solver.backends.chain_time import TIME_BASIS, time_coefficients
from solver.backends.prefix_sums import PrefixSums, Sums, search, sparse_max_table
from solver.backends.problem import (
    StageProblem,
    StageSolution,
)
from solver.backends.split_search import INF, PEAK, TIME, _Limits, _TimeUp, run_search
from solver.costs import LayerCosts, bound_terms
from solver.errors import InputError

BACKEND = "chain"
PROBES_PER_ROUND = 64
"""Bounds tested at once in one round of the k-ary search on the relaxation."""
BAND_STEPS = (6, 4, 2, 0, None)
"""Trial bounds of the DP: lower + lower >> step (a relative slack), then the incumbent value;
the band, hence the DP's work, grows with the slack above the optimum."""
DENSE_DP_MAX_LAYERS = 96
"""A chain of at most this many layers has its peak problem (no per-stage time limit) solved by the
DP over every (start, end) pair (``_Chain.dense_peak_dp``): one numpy pass over an L x L table per
stage, 1.2-2.5x faster than the band at 24-96 layers x 8-32 stages (even at 128, slower at 200).
The split can differ from the band's when its greedy incumbent is already optimal: same peak."""
TABLE_BYTES = 2**26
"""Bytes of the relaxation's U, V tables one chain makes at most; beyond, ``PrefixSums`` read on
demand (a 20,002-layer chain on as many stages asked for 8 x 20,002 x 20,003 int64, 24 GiB)."""
DP_CHUNK_PAIRS = 2**21
"""(start, end) pairs of one DP stage evaluated at once (about 200 MiB of arrays); a wider band (a
long chain on few stages: L^2 / p pairs at a loose bound) goes by chunks of ends."""
DIRECT_BAND_PAIRS = 2**20
"""A chain with at most this many (stage, start, end) triples, p L^2 / 2, goes straight to the
DP at the incumbent value: even a band of every pair costs less than the Python overhead of the
three or four narrower rounds (one numpy pass per stage each) that usually precede it there."""


def is_chain_problem(problem: StageProblem) -> bool:
    """True when the layers form one chain 0 -> 1 -> ... -> L-1 (this backend applies)."""
    return problem.costs.is_chain()


def solve_chain(problem: StageProblem, *, time_limit_s: float | None = None) -> StageSolution:
    """Exact optimum of a chain problem (same objective value as ``solve_brute_force``).

    Deterministic. Raises ValueError when the graph is not a chain. With ``time_limit_s`` the
    search stops when the time is up and returns its best split (FEASIBLE) or none (UNKNOWN).
    """
    if not is_chain_problem(problem):
        raise ValueError("solve_chain needs a chain graph (edges exactly i -> i+1)")
    if problem.selective:
        # the best recompute subset of a fixed interval under a time limit is a knapsack per
        # stage; CP-SAT solves the joint problem exactly (``backends.resolve_backend``)
        raise InputError(
            "--backend chain does not choose recomputed layers (recompute selective/auto): "
            "use --backend cpsat or milp"
        )
    return run_search(
        problem,
        lambda deadline: _Chain(problem.costs, deadline),
        time_limit_s=time_limit_s,
        backend=BACKEND,
    )


class _Chain:
    """Prefix sums and tables of one chain, and the min-max stage solver on top of them."""

    def __init__(self, costs: LayerCosts, deadline: float | None) -> None:
        self.num_layers = costs.num_layers
        self.num_stages = costs.num_stages
        self.in_flight = np.asarray(costs.in_flight, dtype=np.int64)
        self.deadline = deadline
        prefix = lambda values: np.concatenate(([0], np.cumsum(values, dtype=np.int64)))  # noqa: E731
        self.state_prefix = prefix(costs.state_bytes)
        self.stored_prefix = prefix(costs.stored_bytes)
        # the bound's terms as coefficients [term, stage, basis] of the time basis (every
        # stage has as many terms): U = end . basis, V = start . basis (``time_coefficients``)
        terms = bound_terms(costs)
        self.tail_prefix = prefix(costs.tail_ns)
        self._time_basis = np.stack(
            [prefix(costs.time_ns), prefix(costs.forward_ns), self.tail_prefix]
        )  # [TIME_BASIS, position]
        self._time_end, self._time_start, self._time_offset, self._time_first = time_coefficients(
            costs, terms
        )
        # per stage, its distinct terms (the relaxation's rules need each once)
        self._time_terms = [
            [k for k, term in enumerate(rank) if term not in rank[:k]] for rank in terms
        ]
        self._sums: dict[tuple, Sums] = {}
        self._time_sums: dict[int, list] = {}
        self._time_lists: tuple[list, list] | None = None
        self._table_bytes_left = TABLE_BYTES
        for name in (
            "state_bytes",
            "stored_bytes",
            "transient_bytes",
            "time_ns",
            "forward_ns",
            "backward_ns",
            "tail_ns",
            "edge_bytes",
        ):
            if np.any(getattr(costs, name) < 0):  # the prefix-sum searches need monotone sums
                raise ValueError(f"chain backend needs non-negative {name}")
        edges = np.asarray(costs.edge_bytes, dtype=np.int64)
        self.edge_in = np.concatenate(([0], edges))  # bytes entering layer i from i-1
        self.edge_out = np.concatenate((edges, [0]))  # bytes leaving layer j to j+1
        self.edge_min = int(edges.min()) if len(edges) else 0
        self.receive_copies = np.asarray(costs.receive_copies, dtype=np.int64)  # R_s (cost model)
        self.send_copies = np.asarray(costs.send_copies, dtype=np.int64)  # S_s
        self.constant_bytes = costs.constant_bytes  # a calibration's, on every stage
        transient = np.asarray(costs.transient_bytes, dtype=np.int64)
        # the moment after a first backward's (less FSDP2's gathers: ``transient``), at most these
        self.after_transient = np.asarray(costs.after_transient(transient), dtype=np.int64)
        self.transient_min = int(self.after_transient.min())
        self.transient_max = int(self.after_transient.max())
        self._log2 = np.floor(np.log2(np.arange(1, self.num_layers + 1))).astype(np.int64)
        self._rules: tuple[_Limits, list] | None = None
        # stages whose gradients appear at the first backward (costs.layer_moments, grads(> l))
        self.late = np.asarray(costs.first_backward_peak, dtype=bool)
        # distinct (costs.late_column, late_own): kind c + 1 (0: not late), prefix sums, owns
        columns: dict[tuple[bytes, bytes], int] = {}
        self.kind = np.zeros(self.num_stages, dtype=np.int64)
        for s in np.flatnonzero(self.late):
            column = np.asarray(costs.late_column(int(s)), dtype=np.int64)
            key = (column.tobytes(), costs.late_own(int(s)).tobytes())
            self.kind[s] = columns.setdefault(key, len(columns)) + 1
        self.grad_prefixes = [prefix(np.frombuffer(c, dtype=np.int64)) for c, _ in columns]
        owns = [np.frombuffer(own, dtype=np.int64) for _, own in columns]
        # the prefix sums the relaxation's rules combine (``sums``)
        self._bases = dict(zip(TIME_BASIS, self._time_basis, strict=True)) | {
            "state": self.state_prefix,
            "stored": self.stored_prefix,
        }
        for c, grad_prefix in enumerate(self.grad_prefixes, start=1):
            self._bases[f"ungraded{c}"] = self.state_prefix - grad_prefix
        # during(l) of costs.layer_moments, less what does not depend on l: stored(i..l)
        # + transient_l = h[l] - stored_prefix[i] (every gradient exists), and with the
        # gradients made at the first backward (``late``) stored(i..l) + grads(l+1..j)
        # + own_l + transient_l = h[l] - stored_prefix[i] + grad_prefix[j + 1]
        reach = self.stored_prefix[1:] + transient
        self._tables = [sparse_max_table(reach)] + [
            sparse_max_table(reach + own - grad[1:]) for grad, own in zip(self.grad_prefixes, owns)
        ]
        # the moments after a backward, [stage, moment, (held, R, S)] (costs.after_table)
        self.after = costs.after_table
        self.has_after = np.array([bool(moments) for moments in costs.after_moments], dtype=bool)
        if self.has_after.any():  # and max transient[i..j] for the moments after
            self._transient_table = sparse_max_table(self.after_transient)
        # a stage ending at the last layer: its output held through the earlier layers' moments
        # (costs.moment_transient); the same tables with those moments
        held = costs.moment_transient(transient) - transient
        self._last_tables = None
        if held.any():
            self._last_tables = [sparse_max_table(reach + held)] + [
                sparse_max_table(reach + held + own - grad[1:])
                for grad, own in zip(self.grad_prefixes, owns)
            ]
        # the optimizer step: every state, the step temporary, the buffers at 0 held
        self.step_prefix = None if costs.step_bytes is None else prefix(costs.step_bytes)
        at_step = [costs.copies_at(s, 0) for s in range(self.num_stages)]
        self.step_receive = np.array([r for r, _ in at_step], dtype=np.int64)
        self.step_send = np.array([c for _, c in at_step], dtype=np.int64)

    # -- stage quantities ------------------------------------------------------------------

    def check_time(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise _TimeUp

    def sums(self, names: tuple[str, ...], coefficients: tuple[int, ...]) -> Sums:
        """The prefix combination sum_b c_b P_b (P_b the ``_bases`` of ``names``), shared by the
        rules that use it; a table while ``TABLE_BYTES`` lasts."""
        key = (names, coefficients)
        found = self._sums.get(key)
        if found is None:
            terms = tuple(
                (c, self._bases[name]) for c, name in zip(coefficients, names, strict=True) if c
            )
            found = PrefixSums(terms, self.num_layers)
            if self._table_bytes_left >= 8 * (self.num_layers + 1):
                found = found.table()
                self._table_bytes_left -= found.nbytes
            self._sums[key] = found
        return found

    def memory_sums(self, stage: int) -> Sums:
        """Prefix sums of state + k_s stored, bytes; without the gradients on a stage whose peak
        can precede them (``late``: its first-backward moments are at least that, at the last
        layer)."""
        states = f"ungraded{self.kind[stage]}" if self.late[stage] else "state"
        return self.sums((states, "stored"), (1, int(self.in_flight[stage])))

    def time_sums(self, stage: int) -> list[tuple[Sums, Sums, int, int]]:
        """Per distinct term of the bound of a stage, (U, V, offset ns, X_0's coefficient)
        (``time_coefficients``)."""
        found = self._time_sums.get(stage)
        if found is None:
            if self._time_lists is None:
                self._time_lists = self._time_tables_or_lists()
            ends, starts = self._time_lists
            tabled = isinstance(ends, np.ndarray)
            found = self._time_sums[stage] = [
                (
                    ends[k, stage] if tabled else self.sums(TIME_BASIS, tuple(ends[k][stage])),
                    starts[k, stage] if tabled else self.sums(TIME_BASIS, tuple(starts[k][stage])),
                    int(self._time_offset[k, stage]),
                    int(self._time_first[k]),
                )
                for k in self._time_terms[stage]
            ]
        return found

    def _time_tables_or_lists(self) -> tuple:
        """Every U and V of the bound's terms, [term, stage, position], in one product when they
        fit in ``TABLE_BYTES``; else their coefficients, [term][stage][basis], for ``sums``."""
        size = 2 * self._time_end[..., 0].size * (self.num_layers + 1) * 8
        if size <= self._table_bytes_left:
            self._table_bytes_left -= size
            return self._time_end @ self._time_basis, self._time_start @ self._time_basis
        return self._time_end.tolist(), self._time_start.tolist()

    def boundary_floor(self, stage: int) -> int:
        """Smallest possible buffers + transient of a stage, bytes (the relaxation's constant)."""
        copies = self.receive_copies[stage] + self.send_copies[stage]
        if self.late[stage]:  # (during(last layer) is at least this floor: a safe minimum)
            copies = min(copies, int(self.after[stage, :, 1:].sum(axis=1).min()))
        return int(copies) * self.edge_min + self.transient_min + self.constant_bytes

    def range_max(self, table: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """max values[i..j] for each pair from a ``sparse_max_table`` of the values."""
        level = self._log2[ends - starts]
        return np.maximum(table[level, starts], table[level, ends - (1 << level) + 1])

    def transient(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """max transient[i..j] for each pair, bytes (sparse-table range maximum)."""
        if self.transient_min == self.transient_max:
            return np.full(len(starts), self.transient_max, dtype=np.int64)
        level = self._log2[ends - starts]
        return np.maximum(
            self._transient_table[level, starts],
            self._transient_table[level, ends - (1 << level) + 1],
        )

    def peaks(self, stage: int | np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """peak_s(i, j) in bytes; ``stage`` is one index or one per pair."""
        peaks = self.schedule_peaks(stage, starts, ends)
        if self.step_prefix is None:
            return peaks
        stage = np.asarray(stage)
        step = (
            self.state_prefix[ends + 1]
            - self.state_prefix[starts]
            + self.step_prefix[ends + 1]
            - self.step_prefix[starts]
            + self.step_receive[stage] * self.edge_in[starts]
            + self.step_send[stage] * self.edge_out[ends]
            + self.constant_bytes
        )
        return np.maximum(peaks, step)

    def schedule_peaks(
        self, stage: int | np.ndarray, starts: np.ndarray, ends: np.ndarray
    ) -> np.ndarray:
        """peak_s(i, j) over the moments of the schedule (before the optimizer step), bytes:
        ``costs.layer_moments`` on a chain (no relays), the largest of during(l) over l in
        i..j beside the states and k - 1 whole micro-batches (without the gradients after l
        where they appear at the first backward, ``late``), and the moments after a backward
        (every gradient, h held, ``costs.after_moments``)."""
        stage = np.asarray(stage)  # one index (kept scalar: cheaper gathers) or one per pair
        starts, ends = np.broadcast_arrays(starts, ends)
        k = self.in_flight[stage]
        states = self.state_prefix[ends + 1] - self.state_prefix[starts]
        stored = self.stored_prefix[ends + 1] - self.stored_prefix[starts]
        into, out_of = self.edge_in[starts], self.edge_out[ends]
        reach = self._reach(0, starts, ends)
        during = (
            states
            + (k - 1) * stored
            + reach
            - self.stored_prefix[starts]
            + self.receive_copies[stage] * into
            + self.send_copies[stage] * out_of
        )
        if np.any(self.late[stage]):
            stage = np.broadcast_to(stage, starts.shape)
            late = self.late[stage]
            first = during.copy()  # grads(i..j) off the states, grads(l+1..j) back
            kinds = self.kind[stage]
            for c in np.unique(kinds[late]):
                on = kinds == c
                first[on] += self._reach(c, starts[on], ends[on]) - reach[on]
                first[on] += self.grad_prefixes[c - 1][starts[on]]
            during = np.where(late, first, during)
        after_on = self.has_after[stage]
        if not np.any(after_on):
            return during + self.constant_bytes
        base = states + self.transient(starts, ends)
        for i in range(self.after.shape[1]):  # [stage, moment, (held, R, S)]
            h, receive, send = self.after[:, i].T
            moment = base + h[stage] * stored + receive[stage] * into + send[stage] * out_of
            during = np.maximum(during, moment if after_on.all() else np.where(after_on, moment, 0))
        return during + self.constant_bytes

    def _reach(self, which: int, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """max_l over i..j of stored_prefix[l + 1] + transient_l (``which`` 0), or less the
        prefix of late column c (``which`` c > 0: gradients made at the first backward), with the
        output held on a stage that ends at the last layer (``costs.moment_transient``), bytes."""
        table = self._tables[which]
        values = self.range_max(table, starts, ends)
        if self._last_tables is None:
            return values
        last = ends == self.num_layers - 1
        if not last.any():
            return values
        values[last] = self.range_max(self._last_tables[which], starts[last], ends[last])
        return values

    def times(
        self, stage: int | np.ndarray, starts: np.ndarray, ends: np.ndarray, first_tail: int
    ) -> np.ndarray:
        """time(s; i, j) of the module docstring with X_0 = ``first_tail``, ns; ``stage`` is one
        index or one per pair."""
        # [basis, pair]
        at_end, at_start = self._time_basis[:, ends + 1], self._time_basis[:, starts]
        first = self._time_first * first_tail
        if np.ndim(stage) == 0:  # U . P[j+1] - V . P[i] + offset for every term at once
            value = self._time_end[:, stage] @ at_end - self._time_start[:, stage] @ at_start
            return (value + (self._time_offset[:, stage] + first)[:, None]).max(axis=0)
        stage = np.broadcast_to(stage, np.shape(starts))
        value = np.einsum("kpb,bp->kp", self._time_end[:, stage], at_end)
        value -= np.einsum("kpb,bp->kp", self._time_start[:, stage], at_start)
        return (value + self._time_offset[:, stage] + first[:, None]).max(axis=0)

    def first_tails(self) -> np.ndarray:
        """The tails the first stage can have (it ends at layer 0 .. L - p), sorted, ns."""
        return np.unique(self.tail_prefix[1 : self.num_layers - self.num_stages + 2])

    def first_tail(self, starts: np.ndarray) -> int:
        """The first stage's tail in a split given by its stage starts, ns."""
        end = int(starts[1]) if len(starts) > 1 else self.num_layers
        return int(self.tail_prefix[end])

    def measure(self, starts: np.ndarray) -> tuple[int, int]:
        """(max peak bytes, iteration bound ns) of a split given by its stage starts."""
        ends = np.append(starts[1:] - 1, self.num_layers - 1)
        stages = np.arange(self.num_stages)
        peak = self.peaks(stages, starts, ends)
        first_tail = int(self.tail_prefix[ends[0] + 1])
        return int(peak.max()), int(self.times(stages, starts, ends, first_tail).max())

    def only_split(self) -> np.ndarray:
        """The stage starts of the only split when there are as many stages as layers."""
        return np.arange(self.num_stages, dtype=np.int64)

    def stage_of_layer(self, starts: np.ndarray) -> list[int]:
        """The stage of each layer of a split given by its stage starts."""
        lengths = np.diff(np.append(starts, self.num_layers))
        return np.repeat(np.arange(self.num_stages), lengths).tolist()

    # -- monotone relaxation ---------------------------------------------------------------

    def stage_rules(self, limits: _Limits) -> list[list[tuple[Sums, Sums, int, bool]]]:
        """Per stage, (end sums U, start sums V, offset, scaled) rules of the monotone
        relaxation: stage i..j passes at a bound iff U[j+1] - V[i] <= (bound + offset if scaled
        else offset) for each rule (U, V non-decreasing). It relaxes 'stage quantity <= bound
        and the per-stage limits'."""
        if self._rules is not None and self._rules[0] == limits:
            return self._rules[1]
        rules = []
        tail = self.sums(("tail",), (1,))
        timed_rules = limits.kind == TIME or limits.budget_ns is not None
        for s in range(self.num_stages):
            self.check_time()
            floor = self.boundary_floor(s)
            memory = self.memory_sums(s)
            # the terms with X_0 take its lower bound (none when no rule reads them)
            timed = [
                (end, start, offset + first * limits.first_tail_ns)
                for end, start, offset, first in (self.time_sums(s) if timed_rules else ())
            ]
            if limits.kind == PEAK:
                stage = [(memory, memory, -floor, True)]
            else:
                stage = [(end, start, -offset, True) for end, start, offset in timed]
            if limits.cap_bytes is not None and limits.kind != PEAK:
                stage.append((memory, memory, limits.cap_bytes - floor, False))
            if limits.budget_ns is not None:
                stage += [
                    (end, start, limits.budget_ns - offset, False) for end, start, offset in timed
                ]
            if s == 0 and limits.first_tail_max_ns is not None:
                stage.append((tail, tail, limits.first_tail_max_ns, False))
            rules.append(stage)
        self._rules = (limits, rules)
        return rules

    def reach_forward(self, limits: _Limits, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Farthest stage ends under the relaxation, for each bound at once.

        The relaxation lets stages be empty; then, by induction on s, the greedy end of stage s is
        the largest end of stage s over all relaxed-valid splits, even though k_s differs between
        stages (the argument only needs 'a sub-interval of a valid stage is valid'). Stage s ends
        at most at L - p + s, as in every split. Returns (ok per bound, ends[s, bound]).
        """
        num_layers, num_stages = self.num_layers, self.num_stages
        position = np.zeros(len(bounds), dtype=np.int64)  # first layer after stage s
        ends = np.empty((num_stages, len(bounds)), dtype=np.int64)
        for s, rules in enumerate(self.stage_rules(limits)):
            if s % 64 == 0:
                self.check_time()
            last = stop = num_layers - (num_stages - 1 - s)  # position <= last
            for end, start, offset, scaled in rules:
                target = start[position] + (bounds + offset if scaled else offset)
                # clipped to [position, last + 1]: the same after the min and max (``search``)
                if end.__class__ is np.ndarray:
                    found = end.searchsorted(target, "right")
                else:
                    found = end.searchsorted(target, "right", position, last + 1)
                stop = np.minimum(stop, found - 1)
            position = np.maximum(position, stop)
            ends[s] = position - 1
        return position == num_layers, ends

    def reach_backward(self, limits: _Limits, bound: int) -> np.ndarray | None:
        """Smallest stage starts under the relaxation (mirror of reach_forward), or None."""
        starts = np.empty(self.num_stages, dtype=np.int64)
        stop = self.num_layers  # first layer after stage s
        for s in reversed(range(self.num_stages)):
            if s % 64 == 0:
                self.check_time()
            first = s
            for end, start, offset, scaled in self.stage_rules(limits)[s]:
                target = end[stop] - (bound + offset if scaled else offset)
                # clipped to [s, stop]: the same after the max and min
                first = max(first, int(search(start, target, "left", s, stop)))
            starts[s] = stop = min(first, stop)
        return starts if starts[0] == 0 else None

    def relaxed_minimum(self, limits: _Limits, floor: int, ceiling: int) -> int | None:
        """Smallest bound in [floor, ceiling] at which the relaxation has a split (k-ary search)."""
        found = self.relaxed_range(limits, floor, ceiling)
        return None if found is None else found[0]

    def relaxed_range(
        self, limits: _Limits, floor: int, ceiling: int, *, slack_shift: int | None = None
    ) -> tuple[int, int] | None:
        """(low, high) in [floor, ceiling]: the relaxation has no split below low and one at
        high (None: none up to ceiling); the k-ary search runs to low == high, the smallest such
        bound, or with ``slack_shift`` stops once high - low <= low >> slack_shift."""
        if floor > ceiling:
            return None
        low, high = floor, min(ceiling, max(floor, self.relaxed_top(limits)))
        if not self.reach_forward(limits, np.array([high]))[0][0]:
            return None  # the relaxation is the same at every bound >= relaxed_top
        while low < high and (slack_shift is None or high - low > low >> slack_shift):
            self.check_time()
            probes = sorted(
                {low + (high - low) * t // PROBES_PER_ROUND for t in range(PROBES_PER_ROUND)}
            )
            ok, _ = self.reach_forward(limits, np.array(probes, dtype=np.int64))
            passing = np.flatnonzero(ok)
            if len(passing) == 0:
                low = probes[-1] + 1
            else:
                first = int(passing[0])
                high = probes[first]
                low = probes[first - 1] + 1 if first > 0 else low
        return low, high

    def relaxed_top(self, limits: _Limits) -> int:
        """A bound above every stage's relaxed quantity: the bound itself never binds there."""
        if limits.kind == TIME:
            at_end, at_start = self._time_basis[:, -1], self._time_basis[:, 0]
            top = self._time_end @ at_end - self._time_start @ at_start + self._time_offset
            return int(top.max() + self._time_first.max() * limits.first_tail_ns)
        return max(
            int(self.memory_sums(s)[self.num_layers]) + self.boundary_floor(s)
            for s in range(self.num_stages)
        )

    def exact_top(self, limits: _Limits) -> int:
        """A value no stage quantity exceeds (INF for peaks)."""
        return INF if limits.kind == PEAK else self.relaxed_top(limits)

    def greedy_split(self, limits: _Limits, bound: int) -> np.ndarray:
        """Stage starts of a split made from the relaxation's greedy split at ``bound``.

        Empty stages are filled by cutting the non-empty ones; the pieces need not pass the
        relaxation (stage costs depend on s and on where a stage starts).
        """
        _, ends = self.reach_forward(limits, np.array([bound]))
        cuts = ends[:-1, 0] + 1  # first layer after each stage but the last
        is_start = np.zeros(self.num_layers, dtype=bool)
        is_start[0] = True
        is_start[cuts[cuts < self.num_layers]] = True
        missing = self.num_stages - int(is_start.sum())
        is_start[np.flatnonzero(~is_start)[:missing]] = True
        return np.flatnonzero(is_start)

    # -- exact stage problem ---------------------------------------------------------------

    def stage_value(self, limits: _Limits, starts: np.ndarray) -> int | None:
        """max_s of the minimised quantity for a split, or None when it breaks the cap."""
        peak, bound = self.measure(starts)
        if limits.budget_ns is not None and bound > limits.budget_ns:
            return None
        if limits.kind == PEAK:
            return peak
        if limits.cap_bytes is not None and peak > limits.cap_bytes:
            return None
        return bound

    def minimise(
        self,
        limits: _Limits,
        *,
        floor: int = 0,
        ceiling: int = INF,
        offer: Callable[[np.ndarray], None] | None = None,
        on_lower: Callable[[int], None] | None = None,
    ) -> tuple[int, np.ndarray] | None:
        """Exact min over splits of max_s quantity, among values in [floor, ceiling].

        ``floor`` must be a proven lower bound. Returns (value, stage starts) or None when no
        split has a value <= ceiling. ``offer`` sees valid splits found on the way and
        ``on_lower`` the lower bounds proven on the way (both for a time-limited caller).
        """
        if self.num_layers <= DENSE_DP_MAX_LAYERS and limits == _Limits(kind=PEAK):
            found = self.dense_peak_dp()
            return found if found is not None and found[0] <= ceiling else None
        # a small chain goes straight to the DP at the incumbent (DIRECT_BAND_PAIRS), which
        # needs only a near-minimal bound for the greedy incumbent, not the exact minimum
        small = self.num_stages * self.num_layers**2 // 2 <= DIRECT_BAND_PAIRS
        found = self.relaxed_range(
            limits, floor, ceiling, slack_shift=BAND_STEPS[0] if small else None
        )
        if found is None:
            return None
        lower, passing = found
        greedy = self.greedy_split(limits, passing)
        value = self.stage_value(limits, greedy)
        best = (value, greedy) if value is not None and value <= ceiling else None
        # a time never exceeds the relaxation's top; a peak can, so use the ceiling
        upper = best[0] if best else min(ceiling, self.exact_top(limits))
        for step in (None,) if small else BAND_STEPS:
            if best is not None and offer is not None:
                offer(best[1])
            if on_lower is not None:
                on_lower(lower)
            if best is not None and best[0] <= lower:
                return best
            bound = upper if step is None else min(upper, lower + max(1, lower >> step))
            found = self.banded_dp(limits, bound)
            if found is not None and found[0] <= bound:
                return found  # the DP is exact up to ``bound``
            if bound >= upper:
                break  # nothing <= upper, so no split within the ceiling (``best`` is None)
            if found is not None and found[0] < upper:  # a split of the band, above ``bound``
                best, upper = found, found[0]
            lower = bound + 1
        return None

    def dense_peak_dp(self) -> tuple[int, np.ndarray] | None:
        """Min over splits of the largest stage peak by the DP over every (start, end) pair,
        f_s(j) = min_i max(f_{s-1}(i - 1), peak_s(i, j)): (optimum, stage starts), or None when
        no split exists. Ties go to the smallest start of each stage, from the last stage back,
        as in :meth:`banded_dp` (whose band holds every pair of such a split): the same split."""
        num_layers, num_stages = self.num_layers, self.num_stages
        # every stage i..j, i <= j; a start i < s has f_{s-1}(i - 1) = INF (s stages need s
        # layers), an end leaving too few layers for the later stages is never reached back
        starts, ends = np.triu_indices(num_layers)
        table = np.full((num_layers, num_layers), INF, dtype=np.int64)  # [start, end]
        reached = np.full(num_layers + 1, INF, dtype=np.int64)  # f_{s-1}(i - 1) by start i
        reached[0] = 0
        peaks: dict[tuple[int, ...], np.ndarray] = {}  # stages with equal coefficients share
        choices = []
        for s in range(num_stages):
            self.check_time()
            key = self._peak_key(s)
            if key not in peaks:
                peaks[key] = self.peaks(s, starts, ends)
            table[starts, ends] = np.maximum(reached[starts], peaks[key])
            choices.append(table.argmin(axis=0))  # the first, smallest start of the minimum
            reached[1:] = table.min(axis=0)
            reached[0] = INF
        value = int(reached[num_layers])
        if value >= INF:
            return None
        split = np.empty(num_stages, dtype=np.int64)
        end = num_layers - 1
        for s in reversed(range(num_stages)):
            split[s] = choices[s][end]
            end = split[s] - 1
        return value, split

    def _peak_key(self, stage: int) -> tuple[int, ...]:
        """What :meth:`peaks` reads of a stage: two stages with the same key have the same
        peak_s(i, j) for every pair (k_s only matters with stored bytes)."""
        stored = bool(self.stored_prefix[-1])
        return (
            int(self.in_flight[stage]) if stored else 0,
            int(self.receive_copies[stage]),
            int(self.send_copies[stage]),
            int(self.kind[stage]),  # 0: not late
            tuple(self.after[stage].ravel().tolist()) if self.has_after[stage] else (),
            int(self.step_receive[stage]),
            int(self.step_send[stage]),
        )

    def banded_dp(self, limits: _Limits, bound: int) -> tuple[int, np.ndarray] | None:
        """Min-max DP over the splits whose every stage passes the relaxation at ``bound``.

        Exact within that band: returns (optimum, stage starts) when the optimum is <= bound;
        else the best split of the band (value > bound) or None when the band has none.
        f_s(j) = min over starts i of max(f_{s-1}(i-1), c_s(i, j)).
        """
        num_layers, num_stages = self.num_layers, self.num_stages
        ok, forward = self.reach_forward(limits, np.array([bound]))
        first_start = self.reach_backward(limits, bound) if ok[0] else None
        if first_start is None:
            return None
        end_high = forward[:, 0]
        end_low = np.maximum(np.append(first_start[1:] - 1, num_layers - 1), np.arange(num_stages))
        if np.any(end_low > end_high):
            return None
        previous = np.zeros(1, dtype=np.int64)  # f_{-1}: only "stage -1 ends at layer -1"
        previous_low = previous_high = -1
        choices = []
        for s in range(num_stages):
            self.check_time()
            ends = np.arange(end_low[s], end_high[s] + 1)
            lowest = max(previous_low + 1, int(first_start[s]))
            starts_low = self.first_starts(s, limits, bound, ends, lowest)
            starts_high = np.minimum(ends, previous_high + 1)
            best, choice = self._stage_step(
                s, limits, ends, starts_low, starts_high, previous, previous_low
            )
            if best.min() >= INF:
                return None
            choices.append(choice)
            previous, previous_low, previous_high = best, end_low[s], end_high[s]
        if previous[-1] >= INF:
            return None
        starts = np.empty(num_stages, dtype=np.int64)
        end = num_layers - 1
        for s in reversed(range(num_stages)):
            starts[s] = choices[s][end - end_low[s]]
            end = starts[s] - 1
        return int(previous[-1]), starts

    def first_starts(
        self, stage: int, limits: _Limits, bound: int, ends: np.ndarray, lowest: int
    ) -> np.ndarray:
        """Smallest start (at least ``lowest``) of stage ``stage`` ending at each of ``ends``
        under the relaxation; ends + 1 where there is none."""
        first = np.full(len(ends), lowest, dtype=np.int64)
        for end, start, offset, scaled in self.stage_rules(limits)[stage]:
            limit = bound + offset if scaled else offset
            found = search(start, end[ends + 1] - limit, "left", lowest, ends + 1)
            first = np.maximum(first, found)
        return first

    def _stage_step(
        self,
        stage: int,
        limits: _Limits,
        ends: np.ndarray,
        starts_low: np.ndarray,
        starts_high: np.ndarray,
        previous: np.ndarray,
        previous_low: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One DP stage on the ragged band: (f_s per end, argmin start per end); at most
        ``DP_CHUNK_PAIRS`` (start, end) pairs at a time (ends apart are independent)."""
        counts = np.maximum(starts_high - starts_low + 1, 0)
        reached = np.cumsum(counts)
        if reached[-1] <= DP_CHUNK_PAIRS:
            return self._stage_pairs(
                stage, limits, ends, starts_low, counts, previous, previous_low
            )
        best, choice = np.empty(len(ends), dtype=np.int64), np.empty(len(ends), dtype=np.int64)
        first = 0
        while first < len(ends):
            self.check_time()
            taken = reached[first] - counts[first]  # pairs before this chunk
            last = max(first + 1, int(np.searchsorted(reached, taken + DP_CHUNK_PAIRS, "right")))
            part = slice(first, last)
            best[part], choice[part] = self._stage_pairs(
                stage, limits, ends[part], starts_low[part], counts[part], previous, previous_low
            )
            first = last
        return best, choice

    def _stage_pairs(
        self,
        stage: int,
        limits: _Limits,
        ends: np.ndarray,
        starts_low: np.ndarray,
        counts: np.ndarray,
        previous: np.ndarray,
        previous_low: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``_stage_step`` over every pair of ``ends`` at once (``counts`` starts from
        ``starts_low`` each)."""
        total = int(counts.sum())
        if total == 0:
            return np.full(len(ends), INF, dtype=np.int64), np.full(len(ends), -1)
        offsets = np.cumsum(counts) - counts
        segment = np.repeat(np.arange(len(ends)), counts)
        starts = starts_low[segment] + np.arange(total) - offsets[segment]
        pair_ends = ends[segment]
        value = np.maximum(
            previous[starts - 1 - previous_low],
            self._interval_cost(stage, limits, starts, pair_ends),
        )
        filled = offsets[counts > 0]
        best = np.full(len(ends), INF, dtype=np.int64)
        best[counts > 0] = np.minimum.reduceat(value, filled)
        first_hit = np.where(value == best[segment], np.arange(total), total)
        choice = np.full(len(ends), -1, dtype=np.int64)
        choice[counts > 0] = starts[np.minimum.reduceat(first_hit, filled)]
        return best, choice

    def _interval_cost(
        self, stage: int, limits: _Limits, starts: np.ndarray, ends: np.ndarray
    ) -> np.ndarray:
        """c_s(i, j): peak bytes or time ns (INF where the peak breaks the cap or the time the
        budget)."""
        times = self.times(stage, starts, ends, limits.first_tail_ns)
        if limits.kind == PEAK:
            value = self.peaks(stage, starts, ends)
        else:
            value = times
            if limits.cap_bytes is not None:
                value = np.where(self.peaks(stage, starts, ends) > limits.cap_bytes, INF, value)
        if limits.budget_ns is not None:
            value = np.where(times > limits.budget_ns, INF, value)
        if stage == 0 and limits.first_tail_max_ns is not None:
            tail = self.tail_prefix[ends + 1] - self.tail_prefix[starts]
            value = np.where(tail > limits.first_tail_max_ns, INF, value)
        return value
