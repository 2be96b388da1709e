"""Interleaved chains by chunk sizes: a lower bound on the optimum and a split to start from.

The problem (``formulation.py``, "interleaving"): a chain of L layers is cut into J = p v
contiguous, non-empty virtual stages; virtual stage j runs on rank j mod p as its chunk j div p,
and a rank's peak and time sum its v chunks (one memory row per in-flight vector). A split of a
chain is nothing but its chunk sizes k_0 .. k_{J-1} (each >= 1, summing to L): virtual stage j
holds the layers [k_0 + ... + k_{j-1}, k_0 + ... + k_j).

The relaxation forgets where a virtual stage starts and keeps only its size. Virtual stage j of
size k holds some window [s, s + k) of the chain with j <= s and s + k <= L - (J - 1 - j) (the
stages before and after it are non-empty), s = 0 for j = 0 and s + k = L for j = J - 1. Each of its
aggregates (states, stored bytes per micro-batch, bytes received, bytes sent, largest transient,
optimizer-step temporary, time, tail: gradient sync + optimizer step) is at least its least value
over those windows, made non-decreasing in k by a suffix minimum (which only lowers it); so is
the largest layer moment of the chunk over its micro-batch kept whole, max_l (transient_l -
stored(> l in the window)), which a running chunk adds to a moment (``stages.chunk_moment``;
not suffix-minimised: a later layer lowers it). Every
row of a rank's peak and of the iteration time has non-negative coefficients on these
aggregates, so each row is at
least the same row at the least values: a function of the rank's v chunk sizes alone,
``rank value``. The relaxation chooses each rank's chunk sizes, all of them summing to L, to
minimise the largest rank value; its optimum is a lower bound on the true one, found exactly by
a bottleneck dynamic program over ranks whose state is the number of layers placed so far:

  B_0(0) = -inf,   B_{r+1}(t) = min over the rank's size vectors k (|k| = k_0 + ... + k_{v-1})
                                of max(B_r(t - |k|), value_r(k)),      bound = B_p(L)

The limits apply per rank, as necessary conditions: value_r(k) <= capacity, and the iteration
bound (``costs.iteration_bound_ns``) at least m (T_r + v h) + tail_r, rank r's own term
without the micro-batch that reaches it through the ranks before (which the sizes alone do not
say). The time objective minimises the largest such rank term.

The sizes the program picks are a split: evaluated with the cost model, it is feasible or not,
and its objective is an upper bound when it is. Where the layers of the middle of the chain are
alike (a transformer's blocks between an embedding and a head), every window of a size costs the
same, the relaxation is exact, and the two meet: the split is proven optimal without a solver.
Elsewhere the bound goes to the solver as a cut and the split as its start.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from solver.backends.problem import OBJECTIVE_MEMORY, StageProblem

MAX_WINDOW_CELLS = 2**24
"""Most (virtual stage size, window start) pairs the least aggregates scan, (L - J + 1) x L: the
scan is O(L^2) numpy work (1 s at 2,000 layers, 5 s at 5,000, hours at 200,000), so a longer
chain gets no bound (None) and goes to the solver as it is."""
MAX_SIZE_VECTORS = 200_000
"""Per rank, the most chunk-size vectors the program enumerates; beyond it (many chunks per rank
on a long chain) there is no bound (None)."""


@dataclass(kw_only=True)
class ChunkSizeBound:
    """What the relaxation of the module docstring proves and proposes."""

    lower_bound: int | None
    """No split has a smaller objective (bytes or ns); None: no split satisfies the limits (the
    relaxation is infeasible, so the problem is)."""
    split: list[int] | None
    """Stage of each layer from the program's chunk sizes (None when infeasible); it need not
    satisfy the limits unless the relaxation is exact."""


def applies(problem: StageProblem) -> bool:
    """The relaxation describes interleaved chains with fixed per-layer costs on one group."""
    costs = problem.costs
    return (
        costs.config.virtual_stages > 1
        and not costs.split_backward  # pending W steps and gradient moments: not modelled here
        and problem.placement is None
        and not problem.selective
        and costs.is_chain()
        and not any(costs.first_backward_peak)
    )


def chunk_size_bound(
    problem: StageProblem, *, time_limit_s: float = math.inf
) -> ChunkSizeBound | None:
    """The relaxation's bound and split, or None where it does not apply (``applies``) or would
    enumerate too many size vectors. One program (``time_limit_s`` is accepted for the callers
    that share a deadline; the program is not cut short)."""
    del time_limit_s
    costs = problem.costs
    if not applies(problem):
        return None
    if (costs.num_layers - costs.num_stages + 1) * costs.num_layers > MAX_WINDOW_CELLS:
        return None
    return _ChunkSizes(problem).solve()


class _ChunkSizes:
    """Least window aggregates per (virtual stage, size), rank values per size vector, the DP."""

    def __init__(self, problem: StageProblem) -> None:
        self.problem = problem
        costs = self.costs = problem.costs
        self.num_layers, self.num_stages = costs.num_layers, costs.num_stages
        self.num_ranks, self.num_chunks = costs.num_ranks, costs.config.virtual_stages
        self.largest = self.num_layers - self.num_stages + 1
        """Largest size a virtual stage can have (every other one holds a layer)."""
        edge = np.zeros(self.num_layers + 1, dtype=np.int64)
        edge[1 : self.num_layers] = costs.edge_bytes  # edge[s]: bytes from layer s - 1 into s
        self.least = {
            "state": self._least_sums(costs.state_bytes),
            "stored": self._least_sums(costs.stored_bytes),
            "time": self._least_sums(costs.time_ns),
            "tail": self._least_sums(costs.tail_ns),
            "into": self._least_windows(lambda k: edge[: self.num_layers - k + 1]),
            "out": self._least_windows(lambda k: edge[k:]),
            "transient": self._least_windows(
                lambda k: sliding_window_view(costs.transient_bytes, k).max(axis=1)
            ),
        }
        if costs.layer_moment_ranks:  # the running chunk's largest layer moment
            self.least["moment"] = self._least_moments()
        if costs.step_bytes is not None:
            self.least["step"] = self._least_sums(costs.step_bytes)

    # -- least aggregates ---------------------------------------------------------------------

    def _least_sums(self, per_layer: np.ndarray) -> np.ndarray:
        prefix = np.concatenate([[0], np.cumsum(per_layer.astype(np.int64))])
        return self._least_windows(lambda k: prefix[k:] - prefix[:-k])

    def _least_windows(self, window_values, monotone: bool = True) -> np.ndarray:
        """[j, k]: the least value of a window of size k that virtual stage j can hold
        (``window_values(k)[s]``: the window [s, s + k)), suffix-minimised over k where
        ``monotone`` (k = 0 unused)."""
        num_layers, num_stages = self.num_layers, self.num_stages
        least = np.zeros((num_stages, self.largest + 1), dtype=np.int64)
        for k in range(1, self.largest + 1):
            values = np.asarray(window_values(k), dtype=np.int64)  # s = 0 .. L - k
            width = num_layers - num_stages + 2 - k  # starts j .. L - (J - 1 - j) - k
            middle = sliding_window_view(values, width).min(axis=1)  # index j
            least[:, k] = middle[:num_stages]
            least[0, k] = values[0]
            least[num_stages - 1, k] = values[num_layers - k]
        if monotone:  # suffix minimum over k: a lower bound that never decreases with the size
            least[:, 1:] = np.minimum.accumulate(least[:, :0:-1], axis=1)[:, ::-1]
        return least

    def _least_moments(self) -> np.ndarray:
        """[j, k]: the least over the windows virtual stage j can hold of its largest layer
        moment over its micro-batch kept whole, max_l (transient_l - stored(> l in the
        window)) (``stages.chunk_moment``; the last virtual stage with the output the torch
        pipeline keeps, ``LayerCosts.moment_transient``)."""
        costs = self.costs
        prefix = np.concatenate([[0], np.cumsum(costs.stored_bytes.astype(np.int64))])

        def windows(transient: np.ndarray):
            reach = np.asarray(transient, dtype=np.int64) + prefix[1:]  # + stored(<= l)
            return lambda k: sliding_window_view(reach, k).max(axis=1) - prefix[k:]

        # (a later layer lowers the moments of those before it: no suffix minimum)
        least = self._least_windows(windows(costs.transient_bytes), monotone=False)
        held = costs.moment_transient(costs.transient_bytes)
        if (held != costs.transient_bytes).any():
            least[-1] = self._least_windows(windows(held), monotone=False)[-1]
        return least

    # -- per rank -----------------------------------------------------------------------------

    def _size_vectors(self, most: int | None = None) -> np.ndarray | None:
        """Every (k_0 .. k_{v-1}) a rank can take: sizes >= 1, total <= L - (p - 1) v (and
        <= ``most``)."""
        v, total = self.num_chunks, self.num_layers - (self.num_ranks - 1) * self.num_chunks
        total = total if most is None else min(total, most)
        if total < v:
            return np.zeros((0, v), dtype=np.int64)
        if math.comb(total, v) > MAX_SIZE_VECTORS:
            return None
        sizes = np.arange(1, total + 1, dtype=np.int64)[:, None]
        for used in range(1, v):  # append a chunk: at least 1, leaving 1 for each one after it
            room = total - (v - used - 1) - sizes.sum(axis=1)  # largest size the next can take
            counts = np.maximum(room, 0)
            head = np.repeat(sizes, counts, axis=0)
            starts = np.cumsum(counts) - counts
            tail = np.arange(int(counts.sum())) - np.repeat(starts, counts) + 1
            sizes = np.concatenate([head, tail[:, None]], axis=1)
        return sizes

    def _possible_totals(self) -> np.ndarray:
        """[t]: a rank may hold t layers, as far as the t layers with the least states (time,
        tail) show: any t layers hold at least their sum."""
        costs, problem = self.costs, self.problem
        possible = np.ones(self.num_layers + 1, dtype=bool)

        def least(per_layer: np.ndarray) -> np.ndarray:
            return np.concatenate([[0], np.cumsum(np.sort(per_layer.astype(np.int64)))])

        if problem.capacity_bytes is not None:
            possible &= least(costs.state_bytes) + costs.constant_bytes <= problem.capacity_bytes
        if problem.iteration_budget_ns is not None:
            slowest = self._rank_iteration(least(costs.time_ns), least(costs.tail_ns))
            possible &= slowest <= problem.iteration_budget_ns
        return possible

    def _rank_terms(self, rank: int, sizes: np.ndarray) -> dict[str, np.ndarray]:
        """Per size vector the rank can take within the limits: its sizes, total, time, tail and
        least peak over its rows (vectors out of the limits are dropped as soon as a cheap part
        of them shows it)."""
        costs, problem = self.costs, self.problem
        stages = costs.stages_of_rank(rank)

        def get(name: str, kept: np.ndarray) -> list[np.ndarray]:
            return [self.least[name][j, kept[:, c]] for c, j in enumerate(stages)]

        terms = {
            "sizes": sizes,
            "time": sum(get("time", sizes)),
            "tail": sum(get("tail", sizes)),
        }
        if problem.iteration_budget_ns is not None:
            fastest = self._rank_iteration(terms["time"], terms["tail"])
            terms = _where(terms, fastest <= problem.iteration_budget_ns)
        sizes = terms["sizes"]
        base = sum(get("state", sizes)) + costs.constant_bytes
        peak = base + functools.reduce(np.maximum, get("transient", sizes))
        if problem.capacity_bytes is not None:  # states and transient alone
            keep = peak <= problem.capacity_bytes
            terms, base, peak, sizes = _where(terms, keep), base[keep], peak[keep], sizes[keep]
        stored, into, out = get("stored", sizes), get("into", sizes), get("out", sizes)
        # per moment: the rank's largest transient, or the running chunk's layer moment
        if costs.layer_moment_ranks:
            moments, running = get("moment", sizes), costs.running_chunks[rank]
        else:
            running = [None] * len(costs.in_flight_vectors[rank])
        rows = set(
            zip(
                costs.in_flight_vectors[rank],
                costs.backwards_done[rank],
                running,
                costs.copies_of_moments(rank),
                strict=True,
            )
        )
        in_flight = peak  # states and the largest transient: every rank reaches it
        for vector, done, chunk, at in sorted(
            rows, key=lambda row: (row[0], row[1], row[2] or 0, row[3] or ())
        ):
            row = peak.copy() if chunk is None else base.copy()
            if chunk is not None and chunk >= 0:
                row += moments[chunk]
            for c, j in enumerate(stages):
                receive, send = costs.copies_at(j, vector[c], done[c], 0, at and at[c])
                row += vector[c] * stored[c] + receive * into[c] + send * out[c]
            in_flight = np.maximum(in_flight, row)
        if costs.step_bytes is not None:  # the optimizer step: every state, the temporary,
            row = base + sum(get("step", sizes))  # buffers at 0 held
            for c, j in enumerate(stages):
                receive, send = costs.copies_at(j, 0, 0)
                row += receive * into[c] + send * out[c]
            in_flight = np.maximum(in_flight, row)
        terms["peak"] = in_flight
        if problem.capacity_bytes is not None:
            terms = _where(terms, in_flight <= problem.capacity_bytes)
        terms["total"] = terms["sizes"].sum(axis=1)
        return terms

    # -- the program ----------------------------------------------------------------------------

    def solve(self) -> ChunkSizeBound | None:
        """The bottleneck program of the module docstring, once: its optimum is the bound and
        its sizes the split (None: too many size vectors)."""
        # the totals within the limits are 0..most (least sums grow with the count)
        most = int(np.flatnonzero(self._possible_totals()).max())
        sizes = self._size_vectors(most)
        if sizes is None:
            return None
        sizes = sizes[np.argsort(sizes.sum(axis=1), kind="stable")]  # grouped by total
        self.terms = [self._rank_terms(r, sizes) for r in range(self.num_ranks)]
        found = self._program()
        if found is None:
            return ChunkSizeBound(lower_bound=None, split=None)
        bound, split = found
        return ChunkSizeBound(lower_bound=bound, split=split)

    def _rank_iteration(self, time_ns: np.ndarray, tail_ns: np.ndarray) -> np.ndarray:
        """m (T_r + v h) + tail_r: a rank's least term of the iteration bound, ns."""
        costs = self.costs
        overhead = costs.config.virtual_stages * costs.microbatch_overhead_ns
        busy = costs.config.num_microbatches * (time_ns + overhead)
        return busy + tail_ns + costs.step_overhead_ns

    def _time_matters(self) -> bool:
        problem = self.problem
        return problem.objective != OBJECTIVE_MEMORY or problem.iteration_budget_ns is not None

    def _program(self) -> tuple[int, list[int]] | None:
        """(bound, split) of the bottleneck program over ranks; None: no split."""
        problem, inf = self.problem, np.iinfo(np.int64).max
        tables, choices = [], []
        for terms in self.terms:
            value = terms["peak"]
            if self._time_matters():
                iteration = self._rank_iteration(terms["time"], terms["tail"])
                keep = np.ones(len(iteration), dtype=bool)
                if problem.iteration_budget_ns is not None:
                    keep &= iteration <= problem.iteration_budget_ns
                if problem.objective != OBJECTIVE_MEMORY:
                    value = iteration
                value = np.where(keep, value, inf)
            tables.append(self._least_per_total(terms, value))
            choices.append(value)
        reach = np.full(self.num_layers + 1, inf, dtype=np.int64)
        reach[0] = np.iinfo(np.int64).min
        came = []
        t = np.arange(self.num_layers + 1)
        for totals, least in tables:
            if not len(totals):
                return None  # a rank with no vector within the limits
            # nxt[t] = min over a rank total a of max(reach[t - a], least[a])
            before = t[None, :] - totals[:, None]
            candidate = np.maximum(
                np.where(before >= 0, reach[np.maximum(before, 0)], inf), least[:, None]
            )
            pick = candidate.argmin(axis=0)
            reach = candidate[pick, t]
            came.append(totals[pick])
        if reach[-1] == inf:
            return None
        counts, left = [], self.num_layers
        for rank in range(self.num_ranks - 1, -1, -1):
            total = int(came[rank][left])
            terms, value = self.terms[rank], choices[rank]
            index = np.flatnonzero(terms["total"] == total)
            counts.append(terms["sizes"][index[np.argmin(value[index])]])
            left -= total
        per_stage = np.stack(counts[::-1]).T.reshape(-1)  # virtual stage j = chunk * p + rank
        split = np.repeat(np.arange(self.num_stages), per_stage).tolist()
        return int(reach[-1]), split

    def _least_per_total(self, terms, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(totals, least value of a vector of each total) of one rank, inf-valued ones
        dropped (the vectors are grouped by total)."""
        totals = terms["total"]
        if not len(totals):
            return totals, totals
        starts = np.flatnonzero(np.r_[True, totals[1:] != totals[:-1]])
        least = np.minimum.reduceat(value, starts)
        finite = least < np.iinfo(np.int64).max
        return totals[starts][finite], least[finite]


def _where(terms: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    return {name: values[keep] for name, values in terms.items()}


__all__ = ["ChunkSizeBound", "applies", "chunk_size_bound"]
