"""Exact dynamic program for layer DAGs: stages are differences of ideals.

An ideal is a down-closed set of layers (every predecessor of a member is a member). A valid
split of a non-interleaved problem (``StageProblem.violation``: every edge goes forward, no stage
empty) is a chain of ideals  empty = I_0 < I_1 < ... < I_p = all layers,  stage s = I_{s+1} \\ I_s.
Every term of a stage's peak in ``costs.stage_costs`` depends only on the pair (J, I) and the
stage index s (homogeneous cluster, no selective recomputation):

  layer sums over A = I \\ J        weights, gradients, optimizer, DDP buckets, stored, step
                                    temporary, time, tail: sum(I) - sum(J) of per-ideal sums
  the iteration bound's term        max(T(J) + m T_A + X_0, F(J) + m T_A + tail_A) + (s + m) h
  (``iteration_bound_ns``)          (T, F: per-ideal sums of time and forward time)
  max transient over A             a pairs x layers membership matrix
  megatron boundaries              into = sum n_t [producer in J, a consumer outside J]
  (``boundary_bytes``)             out  = sum n_t [producer in I, a consumer outside I]
                                   relay = sum n_t [producer in J, a consumer outside I]
  torch direct sends               receive = sum n_t [producer in J, a consumer in A];
  (``direct_boundary_bytes``,      send = out - relay; per-tensor adjustments by where the
  ``direct_buffer_adjustments``)   tensor's charged layers are (A or not)
  the layers' moments              max over l in A (graph order) of stored_A(<= l) + transient_l
  (``layer_moments``)              (- grads_A(<= l) where gradients appear at the first backward;
                                   + the held output before the last layer where A holds it,
                                   ``LayerCosts.moment_transient``)
  optimizer-step moment            the copies at 0 held, every gradient and the step temporary

with the s-dependent coefficients k_s, R_s, S_s (``LayerCosts.copies_at``) applied per stage.
So the min-max recursion  f_s(I) = min_{J < I} max(f_{s-1}(J), c_s(J, I))  is exact: one vector
pass over every (J, I) pair per stage. The pair structure (ideals, memberships, which tensors
each pair receives, sends, relays) depends on the graph only and is cached per graph, so the
configs of one search share it; each config computes its s-independent pair costs once.

The constrained problems (capacity, iteration budget, time objective) reuse the chain
backend's outer search (``backends.split_search``): this module supplies the same "splitter"
interface as the chain's ``_Chain`` with the DP as its exact min-max stage solver.

Beyond ``MAX_IDEALS`` ideals or ``MAX_PAIR_CELLS`` pair cells the exact DP does not apply;
:func:`topological_split` runs the same code on the prefixes of the layer order (a chain of
ideals that is always valid): a feasible split fast, proven only on chains.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from solver.backends.problem import FEASIBLE, UNKNOWN, StageProblem, StageSolution
from solver.backends.split_search import INF, PEAK, _Limits, _TimeUp, run_search
from solver.costs import BoundTerm, LayerCosts, bound_terms
from solver.errors import InputError

BACKEND = "dag"
MAX_IDEALS = 4096
"""Most ideals the exact DP enumerates (config-independent; T5-11B has 79). Measured on a shared
2-core machine (CPU time): 12 parallel branches (4098 ideals, 535,538 pairs) take 2.1 s to
structure once per graph, then 0.16 s per memory solve with pp 8; two parallel chains of 30
layers (962 ideals, 246,016 pairs) 0.23 s and 0.33 s; T5-11B (79 ideals, 2,730 pairs) a few ms."""
MAX_PAIR_CELLS = 2**26
"""Most (pairs x layers) cells of the stage-membership matrix (64 MiB of bools)."""
_CHUNK_CELLS = 2**22
"""Cells per chunk of the pairs x layers passes (bounds their temporary memory)."""
_CACHE_SIZE = 8
"""Graph structures kept (a search plans one graph; tests plan many small ones)."""


def dag_fits_graph(costs: LayerCosts) -> bool:
    """The layer DAG behind ``costs`` has its ideals within the exact DP's caps
    (``MAX_IDEALS``, ``MAX_PAIR_CELLS``); config-independent, cached per graph."""
    return _structure(costs) is not None


def dag_applies(costs: LayerCosts) -> bool:
    """The exact DP applies to these coefficients: no interleaving, no selective recomputation,
    and the graph's ideals within the caps (a homogeneous cluster is the caller's to check)."""
    if costs.selective or costs.rank_rows:
        return False
    return dag_fits_graph(costs)


def solve_dag(problem: StageProblem, *, time_limit_s: float | None = None) -> StageSolution:
    """Exact optimum of a non-interleaved, homogeneous, non-selective problem on any DAG (the
    same objective value as ``solve_brute_force``). Deterministic. With ``time_limit_s`` the
    search stops when the time is up and returns its best split (FEASIBLE) or none (UNKNOWN).
    Among splits of the optimal value it returns one whose stages are runs of the layer order
    when there is one (:func:`_prefer_layer_order`). Raises InputError when the problem is
    outside what the DP describes."""
    _check_applies(problem)
    structure = _structure(problem.costs)
    if structure is None:
        raise InputError(
            f"--backend dag: this graph has more than {MAX_IDEALS} ideals (down-closed layer "
            f"sets) or more than {MAX_PAIR_CELLS} (ideal pair, layer) cells, too many for the "
            "exact DP: use --backend auto or cpsat"
        )
    solution = _run(problem, structure, time_limit_s, proven=True)
    return _prefer_layer_order(problem, solution, time_limit_s)


def _prefer_layer_order(
    problem: StageProblem, solution: StageSolution, time_limit_s: float | None
) -> StageSolution:
    """``solution``, or the best split along the layer order when that is as good.

    An optimum may hold an ideal that is not a prefix of the layer (module execution) order,
    e.g. T5's decoder embedding on a stage with the encoder's first blocks; such a stage is not
    what torch.distributed.pipelining's split points cut (the exports warn, ``profiling.run``
    refuses). The prefix DP finds the best split along the order; on T5 it ties with the DAG
    optimum in most configs (every non-prefix optimum of T5-11B we tried)."""
    stage_of = solution.stage_of_layer
    if stage_of is None or all(a <= b for a, b in zip(stage_of[:-1], stage_of[1:], strict=True)):
        return solution
    left = None if time_limit_s is None else max(time_limit_s - solution.wall_s, 0.0)
    along = topological_split(problem, time_limit_s=left)
    if along.objective is None or along.objective > solution.objective:
        return solution
    return dataclasses.replace(
        solution,
        stage_of_layer=along.stage_of_layer,
        objective=along.objective,
        bound=min(solution.bound, along.objective),
        wall_s=solution.wall_s + along.wall_s,
    )


def topological_split(problem: StageProblem, *, time_limit_s: float | None) -> StageSolution:
    """The best split whose stages are consecutive runs of the layer order (a topological
    order), under the problem's constraints and objective: the DP over the prefixes. OPTIMAL
    when the prefixes are all the ideals (the graph is a chain) or there is one stage, else
    FEASIBLE (bound 0: not proven) or UNKNOWN when no prefix split satisfies the constraints,
    or when the layers are too many for the DP's pairs x layers cap (``MAX_PAIR_CELLS``: about
    500 layers; the chain backend plans long chains)."""
    _check_applies(problem)
    structure = _structure(problem.costs, prefixes=True)
    if structure is None:  # (L + 1) L / 2 intervals x L layers over MAX_PAIR_CELLS: L > ~500
        return StageSolution(
            status=UNKNOWN,
            stage_of_layer=None,
            objective=None,
            bound=0,
            wall_s=0.0,
            backend=BACKEND,
        )
    single = problem.num_stages == 1  # one split only: every layer on stage 0
    return _run(problem, structure, time_limit_s, proven=structure.all_ideals or single)


def _check_applies(problem: StageProblem) -> None:
    check_plain(
        heterogeneous=problem.placement is not None,
        selective=problem.costs.selective,
        interleaved=problem.costs.rank_rows,
    )


def check_plain(*, heterogeneous: bool, selective: bool, interleaved: bool) -> None:
    """--backend dag on a problem the DP does not describe: an InputError naming the fix (a
    graph too wide for it is refused by :func:`solve_dag`)."""
    if heterogeneous:
        raise InputError(
            "--backend dag does not place stages on node groups; on a heterogeneous cluster "
            "use --backend auto, cpsat or milp"
        )
    if selective:
        raise InputError(
            "--backend dag does not choose recomputed layers (recompute selective/auto): "
            "use --backend cpsat or milp"
        )
    if interleaved:
        raise InputError(
            "--backend dag does not plan interleaved stages (--virtual-stages > 1) or "
            "split-backward schedules (interleaved-zb, zbv, dualpipev): use "
            "--backend auto, cpsat or milp"
        )


def _run(
    problem: StageProblem, structure: _Structure, time_limit_s: float | None, *, proven: bool
) -> StageSolution:
    solution = run_search(
        problem,
        lambda deadline: _DagSplitter(problem.costs, structure, deadline),
        time_limit_s=time_limit_s,
        backend=BACKEND,
    )
    if not proven:  # an optimum over prefix splits only
        solution.bound = 0
        solution.status = FEASIBLE if solution.has_solution else UNKNOWN
    return solution


# -- graph structure (config-independent) ------------------------------------------------------


@dataclass(kw_only=True)
class _Structure:
    """Ideals of one graph and every (J, I) pair J < I of them, with the tensor incidences."""

    members: np.ndarray
    """bool (ideals, layers); row 0 the empty ideal, the last row every layer."""
    low: np.ndarray
    """Per pair, the smaller ideal J (index into ``members``); pairs sorted by ``high``."""
    high: np.ndarray
    """Per pair, the larger ideal I."""
    segments: np.ndarray
    """First pair of each ideal 1..N-1 as ``high`` (every non-empty ideal contains the empty
    one, so none is missing)."""
    stage_members: np.ndarray
    """bool (pairs, layers): I \\ J."""
    producer: np.ndarray
    """Per tensor (``LayerCosts.tensor_groups`` order), its producing layer."""
    escapes: np.ndarray
    """bool (ideals, tensors): produced inside the ideal, some consumer outside."""
    relay: tuple[np.ndarray, np.ndarray]
    """(pair, tensor) incidences, sorted by pair: producer in J, a consumer outside I."""
    reads: tuple[np.ndarray, np.ndarray]
    """(pair, tensor): producer in J, a consumer in I \\ J (a direct receive)."""
    all_ideals: bool
    """These are every ideal of the graph (False: the prefixes of a non-chain graph)."""


_CACHE: OrderedDict[tuple, _Structure | None] = OrderedDict()


def _structure(costs: LayerCosts, *, prefixes: bool = False) -> _Structure | None:
    """The cached structure of the graph behind ``costs`` (None: over the caps)."""
    key = (
        prefixes,
        costs.num_layers,
        costs.edge_src.tobytes(),
        costs.edge_dst.tobytes(),
        np.asarray(costs.edge_tensor).tobytes(),
    )
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    members = None
    if not prefixes:
        members = enumerate_ideals(
            costs.num_layers, costs.edge_src.tolist(), costs.edge_dst.tolist(), limit=MAX_IDEALS
        )
    all_ideals = members is not None
    layers = costs.num_layers
    # the prefixes' pairs over the cap: known before the (L + 1) x L prefix matrix is made
    prefixes = prefixes and (layers + 1) * layers // 2 * layers <= MAX_PAIR_CELLS
    if members is None and prefixes:
        order = np.arange(costs.num_layers)
        members = order[None, :] < np.arange(costs.num_layers + 1)[:, None]
        all_ideals = _is_total_order(costs)
    structure = None if members is None else _build_structure(costs, members, all_ideals)
    _CACHE[key] = structure
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return structure


def _is_total_order(costs: LayerCosts) -> bool:
    """Every layer i > 0 reads layer i - 1: the prefixes are then all the ideals."""
    linked = set(zip(costs.edge_src.tolist(), costs.edge_dst.tolist(), strict=True))
    return all((i - 1, i) in linked for i in range(1, costs.num_layers))


def enumerate_ideals(
    num_layers: int, edge_src: list[int], edge_dst: list[int], *, limit: int | None = None
) -> np.ndarray | None:
    """Every ideal (down-closed layer set) of the DAG, as bool rows (ideals, layers) sorted by
    size then by membership bits: row 0 is the empty set and the last row all layers. A
    breadth-first search adding one layer whose predecessors are all in; None when there are
    more than ``limit``."""
    predecessors = [0] * num_layers
    successors: list[list[int]] = [[] for _ in range(num_layers)]
    for u, v in zip(edge_src, edge_dst, strict=True):
        predecessors[v] |= 1 << u
        successors[u].append(v)
    # each frontier ideal with the layers it can take next (all predecessors in)
    first = [layer for layer in range(num_layers) if predecessors[layer] == 0]
    seen = {0}
    frontier = [(0, first)]
    while frontier:
        grown = []
        for ideal, addable in frontier:
            for layer in addable:
                bigger = ideal | (1 << layer)
                if bigger in seen:
                    continue
                seen.add(bigger)
                opened = [v for v in successors[layer] if predecessors[v] & ~bigger == 0]
                grown.append((bigger, [x for x in addable if x != layer] + sorted(set(opened))))
            if limit is not None and len(seen) > limit:
                return None
        frontier = grown
    ideals = sorted(seen, key=lambda bits: (bits.bit_count(), bits))
    width = (num_layers + 7) // 8
    raw = np.frombuffer(b"".join(bits.to_bytes(width, "little") for bits in ideals), np.uint8)
    bits = np.unpackbits(raw.reshape(len(ideals), width), axis=1, bitorder="little")
    return bits[:, :num_layers].astype(bool)


def _build_structure(costs: LayerCosts, members: np.ndarray, all_ideals: bool) -> _Structure | None:
    num_ideals, num_layers = members.shape
    # J < I strictly: J's members are all in I and I is larger (rows are sorted by size)
    sizes = members.sum(axis=1)
    pairs_low, pairs_high, num_pairs = [], [], 0
    packed = np.packbits(members, axis=1)
    for i in range(1, num_ideals):
        inside = ~np.any(packed[:i] & ~packed[i], axis=1) & (sizes[:i] < sizes[i])
        below = np.flatnonzero(inside)
        pairs_low.append(below)
        pairs_high.append(np.full(len(below), i))
        num_pairs += len(below)
        if num_pairs * num_layers > MAX_PAIR_CELLS:
            return None
    low = np.concatenate(pairs_low).astype(np.int64)
    high = np.concatenate(pairs_high).astype(np.int64)
    counts = np.array([len(p) for p in pairs_low])
    segments = np.cumsum(counts) - counts
    stage_members = members[high] & ~members[low]
    groups = costs.tensor_groups
    producer = np.array([int(costs.edge_src[edges[0]]) for edges, _ in groups], dtype=np.int64)
    consumers = [np.unique(costs.edge_dst[edges]) for edges, _ in groups]
    made_in = members[:, producer]  # (ideals, tensors)
    outside = _columns([~members[:, c].all(axis=1) for c in consumers], num_ideals)
    escapes = made_in & outside

    def read_in_stage(rows: np.ndarray) -> np.ndarray:
        inside = stage_members[rows]
        return made_in[low[rows]] & _columns(
            [inside[:, c].any(axis=1) for c in consumers], len(rows)
        )

    relay = _incidences(lambda rows: made_in[low[rows]] & outside[high[rows]], len(low), groups)
    reads = _incidences(read_in_stage, len(low), groups)
    return _Structure(
        members=members,
        low=low,
        high=high,
        segments=segments,
        stage_members=stage_members,
        producer=producer,
        escapes=escapes,
        relay=relay,
        reads=reads,
        all_ideals=all_ideals,
    )


class _PairTimes:
    """The iteration bound's terms (``costs.bound_terms``) of every pair (J, I) as stage s:
    (m + a) (T_A + h) + bt T(J) + bf F(J) + e (F_A + h) + x X_A + g (T_all - T(I)) + const, the
    ranks before holding J and those after all but I. The parts without e are kept per kind of
    term; the stage's e and constant are added when asked (a few vectors, not p x 4)."""

    def __init__(self, costs: LayerCosts, members: np.ndarray, st, pair_sum) -> None:
        m, h = costs.config.num_microbatches, costs.microbatch_overhead_ns
        time = members @ np.asarray(costs.time_ns, dtype=np.int64)  # per ideal
        forward = members @ np.asarray(costs.forward_ns, dtype=np.int64)
        own_tail, total = pair_sum(costs.tail_ns), int(np.sum(costs.time_ns))
        self.terms = bound_terms(costs)
        self.own_forward = pair_sum(costs.forward_ns) + h
        self.base: dict[tuple[int, ...], np.ndarray] = {}
        own_time = pair_sum(costs.time_ns) + h
        for t in {term for terms in self.terms for term in terms}:
            key = _base_key(t)
            if key not in self.base:
                value = (m + t.own_time) * own_time
                value = value + t.before_time * time[st.low] + t.before_forward * forward[st.low]
                value = value + t.own_tail * own_tail + t.after_time * (total - time[st.high])
                self.base[key] = value

    def __call__(self, stage: int, first_tail: int) -> np.ndarray:
        """The largest term of every pair as stage ``stage`` with X_0 = ``first_tail``, ns."""
        values = []
        for t in self.terms[stage]:
            value = self.base[_base_key(t)]
            value = value + t.constant_ns + t.first_tail * first_tail
            if t.own_forward:
                value = value + t.own_forward * self.own_forward
            values.append(value)
        return np.max(values, axis=0)


def _base_key(term: BoundTerm) -> tuple[int, ...]:
    """What of a term ``_PairTimes`` keeps per pair (all but own_forward, constant, X_0)."""
    return (term.before_time, term.before_forward, term.own_tail, term.after_time, term.own_time)


def _columns(columns: list[np.ndarray], num_rows: int) -> np.ndarray:
    """bool (rows, len(columns)) from per-column vectors (an empty matrix for none)."""
    if not columns:
        return np.zeros((num_rows, 0), dtype=bool)
    return np.stack(columns, axis=1)


def _incidences(
    matrix: Callable[[np.ndarray], np.ndarray], num_pairs: int, groups: list
) -> tuple[np.ndarray, np.ndarray]:
    """(pair, tensor) index arrays where ``matrix(rows)`` (bool rows x tensors) holds, in pair
    order, built in chunks of pairs."""
    if not groups:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    step = max(1, _CHUNK_CELLS // len(groups))
    pairs, tensors = [], []
    for first in range(0, num_pairs, step):
        rows = np.arange(first, min(num_pairs, first + step))
        p, t = np.nonzero(matrix(rows))
        pairs.append(rows[p])
        tensors.append(t)
    return np.concatenate(pairs), np.concatenate(tensors)


def _pair_sums(
    incidence: tuple[np.ndarray, np.ndarray], weights: np.ndarray, num_pairs: int
) -> np.ndarray:
    """Per pair, the sum of ``weights[tensor]`` over its incidences (exact int64)."""
    pairs, tensors = incidence
    total = np.zeros(num_pairs, dtype=np.int64)
    if len(pairs) == 0:
        return total
    values = weights[tensors]
    starts = np.flatnonzero(np.r_[True, pairs[1:] != pairs[:-1]])
    total[pairs[starts]] = np.add.reduceat(values, starts)
    return total


def _masked_max(
    stage_members: np.ndarray, values: np.ndarray, *, cumulative: np.ndarray | None = None
) -> np.ndarray:
    """Per pair, max over its layers l of values[l] (+ the sum of ``cumulative`` over its layers
    up to l, in layer order), in chunks of pairs."""
    num_pairs, num_layers = stage_members.shape
    out = np.empty(num_pairs, dtype=np.int64)
    step = max(1, _CHUNK_CELLS // max(num_layers, 1))
    for first in range(0, num_pairs, step):
        inside = stage_members[first : first + step]
        candidate = np.broadcast_to(values, inside.shape)
        if cumulative is not None:
            candidate = candidate + np.cumsum(np.where(inside, cumulative, 0), axis=1)
        out[first : first + step] = np.where(inside, candidate, -INF).max(axis=1)
    return out


# -- one config ----------------------------------------------------------------------------------


class _DagSplitter:
    """The min-max stage solver over ideal pairs, with the interface ``split_search._Search`` uses
    (``measure``, ``minimise``, ``first_tails``, ``first_tail``, ``check_time``,
    ``stage_of_layer``). A split is an array of pair indices, one per stage."""

    def __init__(self, costs: LayerCosts, structure: _Structure, deadline: float | None) -> None:
        self.costs = costs
        self.structure = structure
        self.deadline = deadline
        self.num_stages = costs.num_stages
        self.num_layers = costs.num_layers
        st = structure
        num_pairs = len(st.low)
        members = st.members.astype(np.int64)

        def pair_sum(values: np.ndarray) -> np.ndarray:
            per_ideal = members @ np.asarray(values, dtype=np.int64)
            return per_ideal[st.high] - per_ideal[st.low]

        buckets = costs.grad_buffer_bytes
        held = costs.weight_bytes + costs.optimizer_bytes
        if buckets is not None:
            held = held + buckets
        if costs.input_batch_bytes is not None:  # the batch a torch step() holds
            held = held + costs.input_batch_bytes
        grads = costs.grad_bytes
        if costs.backward_weight_bytes is not None:  # late weights (FSDP2 ZeRO 3 under PP)
            held, grads = held - costs.backward_weight_bytes, grads + costs.backward_weight_bytes
        self.held_bytes = pair_sum(held)  # weights, optimizer state, DDP buckets: always
        self.grad_bytes = pair_sum(grads)  # with what is late at a first backward (late_column)
        self.stored_bytes = pair_sum(costs.stored_bytes)
        # the iteration bound's terms of a stage (costs.bound_terms) on pair (J, I): the
        # ranks before hold J, those after all but I
        self.tail_ns = pair_sum(costs.tail_ns)
        self.pair_times = _PairTimes(costs, members, st, pair_sum)
        self.step_bytes = None if costs.step_bytes is None else pair_sum(costs.step_bytes)
        transient = np.asarray(costs.transient_bytes, dtype=np.int64)
        sizes = np.array([size for _, size in costs.tensor_groups], dtype=np.int64)
        escaping = st.escapes.astype(np.int64) @ sizes  # per ideal
        relay = _pair_sums(st.relay, sizes, num_pairs)
        self.out_of = escaping[st.high]
        if costs.direct_sends:
            self.into = _pair_sums(st.reads, sizes, num_pairs)
            self.out_of = self.out_of - relay
            self.relayed = np.zeros(num_pairs, dtype=np.int64)
        else:
            self.into = escaping[st.low]
            self.relayed = relay
        self.per_held = self.no_grad = None
        if costs.direct_sends and not costs.plain_boundaries:
            self.per_held, self.no_grad = self._direct_adjustments(sizes, relay)
        self.kept = self.stored_bytes + self.relayed
        self.late = list(costs.first_backward_peak)
        stored = np.asarray(costs.stored_bytes, dtype=np.int64)
        # during(l) - (k - 1) kept - relay - buffers = grads_A + stored_A(<= l) + t_l
        self.during = self.grad_bytes + _masked_max(st.stage_members, transient, cumulative=stored)
        # a pair holding the last layer: its output held through the earlier layers' moments
        # (costs.moment_transient)
        held = costs.moment_transient(transient)
        last = np.flatnonzero(st.stage_members[:, -1]) if (held != transient).any() else []
        if len(last):
            self.during[last] = self.grad_bytes[last] + _masked_max(
                st.stage_members[last], held, cumulative=stored
            )
        self.first_during: dict[bytes, np.ndarray] = {}  # per late column (late_column, own)
        if any(costs.after_moments):  # the moments after a backward (costs.after_moments)
            self.transient = _masked_max(
                st.stage_members, costs.after_transient(transient)
            )
        for stage in np.flatnonzero(self.late):
            # with the gradients made at the first backward: grads_A - grads_A(<= l) instead
            # + own_l: l's own gradients made by its moment (``LayerCosts.late_own``)
            grads = np.asarray(costs.late_column(int(stage)), dtype=np.int64)
            own, key = costs.late_own(int(stage)), self._late_key(int(stage))
            if key in self.first_during:
                continue
            first = self.grad_bytes + _masked_max(
                st.stage_members, transient + own, cumulative=stored - grads
            )
            if len(last):
                first[last] = self.grad_bytes[last] + _masked_max(
                    st.stage_members[last], held + own, cumulative=stored - grads
                )
            self.first_during[key] = first
        self._peaks: dict[int, np.ndarray] = {}

    def _late_key(self, stage: int) -> bytes:
        """A late stage's key of ``first_during``: its late column and own column."""
        grads = np.asarray(self.costs.late_column(stage), dtype=np.int64)
        return grads.tobytes() + self.costs.late_own(stage).tobytes()

    def _direct_adjustments(
        self, sizes: np.ndarray, relay: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(per held micro-batch, per micro-batch of the run) of ``direct_buffer_adjustments``,
        per pair: - n for a sent tensor some layer of A counts, + n for a received tensor whose
        saving is known and no layer of A counts, m n off for a sent tensor without grad."""
        st, costs = self.structure, self.costs
        roles = costs.tensor_roles
        num_pairs = len(st.low)
        grad = np.array([g for g, _, _ in roles], dtype=bool)
        known = np.array([k for _, k, _ in roles], dtype=bool)
        charged_here = np.zeros((num_pairs, len(roles)), dtype=bool)
        for t, (_, _, charged) in enumerate(roles):
            if charged:
                charged_here[:, t] = st.stage_members[:, charged].any(axis=1)
        made_in = st.members[:, st.producer]
        sent = made_in[st.high] & ~made_in[st.low] & st.escapes[st.high]  # producer in A
        readers = np.zeros((num_pairs, len(roles)), dtype=bool)
        reads_pair, reads_tensor = st.reads
        readers[reads_pair, reads_tensor] = True
        per_held = (readers & known & ~charged_here).astype(np.int64) @ sizes
        per_held -= (sent & charged_here).astype(np.int64) @ sizes
        no_grad = (sent & ~grad).astype(np.int64) @ sizes
        return per_held, no_grad

    # -- stage quantities ------------------------------------------------------------------

    def check_time(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise _TimeUp

    def _buffers(self, stage: int, held: int, done: int = 0) -> np.ndarray:
        """``stage_buffer_bytes`` of every pair as stage ``stage`` holding ``held`` after
        ``done`` backwards."""
        receive, send = self.costs.copies_at(stage, held, done)
        value = receive * self.into + send * self.out_of
        if self.per_held is not None:
            value = value + held * self.per_held - self.costs.config.num_microbatches * self.no_grad
        return value

    def peaks(self, stage: int) -> np.ndarray:
        """peak_s(J, I) of every pair as stage ``stage``, bytes (``stage_costs``)."""
        if stage in self._peaks:
            return self._peaks[stage]
        k = int(self.costs.in_flight[stage])
        base = (k - 1) * self.kept + self.relayed + self._buffers(stage, k)
        if not self.late[stage]:
            schedule = base + self.during
        else:
            schedule = base + self.first_during[self._late_key(stage)]
        for h, done in self.costs.after_moments[stage]:  # every gradient, h held
            after = h * self.kept + self.grad_bytes + self._buffers(stage, h, done)
            schedule = np.maximum(schedule, after + self.transient)
        if self.step_bytes is not None:
            step = self.grad_bytes + self._buffers(stage, 0) + self.step_bytes
            schedule = np.maximum(schedule, step)
        value = self.costs.constant_bytes + self.held_bytes + schedule
        if len(value) * (len(self._peaks) + 1) <= _CHUNK_CELLS:
            self._peaks[stage] = value
        return value

    def times(self, stage: int, first_tail: int) -> np.ndarray:
        """The iteration bound's term of every pair as stage ``stage`` with X_0 = ``first_tail``,
        ns."""
        return self.pair_times(stage, first_tail)

    def first_tails(self) -> np.ndarray:
        """The tails the first stage can have (its pairs start at the empty ideal), sorted, ns."""
        return np.unique(self.tail_ns[self.structure.low == 0])

    def first_tail(self, split: np.ndarray) -> int:
        """The first stage's tail in a split, ns."""
        return int(self.tail_ns[split[0]])

    def measure(self, split: np.ndarray) -> tuple[int, int]:
        """(max peak bytes, iteration bound ns) of a split (a pair index per stage)."""
        peak = max(int(self.peaks(s)[pair]) for s, pair in enumerate(split))
        first_tail = int(self.tail_ns[split[0]])
        return peak, max(int(self.times(s, first_tail)[pair]) for s, pair in enumerate(split))

    def stage_of_layer(self, split: np.ndarray) -> list[int]:
        """The stage of each layer."""
        stage_of = np.empty(self.num_layers, dtype=np.int64)
        for s, pair in enumerate(split):
            stage_of[self.structure.stage_members[pair]] = s
        return stage_of.tolist()

    # -- exact min-max stage problem -------------------------------------------------------

    def minimise(
        self,
        limits: _Limits,
        *,
        floor: int = 0,
        ceiling: int = INF,
        offer: Callable[[np.ndarray], None] | None = None,
        on_lower: Callable[[int], None] | None = None,
    ) -> tuple[int, np.ndarray] | None:
        """Exact min over splits of max_s quantity under the limits, among values <= ceiling:
        (value, split) or None. ``floor``, ``offer`` and ``on_lower`` are the chain's interface
        (the DP is exact in one pass, so it needs none of them)."""

        def stage_cost(stage: int) -> np.ndarray:
            times = self.times(stage, limits.first_tail_ns)
            value = self.peaks(stage) if limits.kind == PEAK else times
            ok = value <= ceiling
            if limits.budget_ns is not None:
                ok &= times <= limits.budget_ns
            if stage == 0 and limits.first_tail_max_ns is not None:
                ok &= self.tail_ns <= limits.first_tail_max_ns
            if limits.kind != PEAK and limits.cap_bytes is not None:
                ok &= self.peaks(stage) <= limits.cap_bytes
            return np.where(ok, value, INF)

        found = self._dp(stage_cost)
        if found is None or found[0] > ceiling:
            return None
        return found

    def _dp(self, stage_cost: Callable[[int], np.ndarray]) -> tuple[int, np.ndarray] | None:
        """f_s(I) = min_{J < I} max(f_{s-1}(J), c_s(J, I)), f_{-1} = 0 at the empty ideal only;
        (f_{p-1}(all layers), the argmin pair of each stage) or None when it is INF."""
        st = self.structure
        num_ideals, num_pairs = len(st.members), len(st.low)
        previous = np.full(num_ideals, INF, dtype=np.int64)
        previous[0] = 0
        choices = []
        positions = np.arange(num_pairs)
        for s in range(self.num_stages):
            self.check_time()
            value = np.maximum(previous[st.low], stage_cost(s))
            best = np.full(num_ideals, INF, dtype=np.int64)
            best[1:] = np.minimum.reduceat(value, st.segments)
            first_hit = np.where(value == best[st.high], positions, num_pairs)
            choice = np.full(num_ideals, -1, dtype=np.int64)
            choice[1:] = np.minimum.reduceat(first_hit, st.segments)
            choices.append(choice)
            previous = best
        if previous[-1] >= INF:
            return None
        split = np.empty(self.num_stages, dtype=np.int64)
        ideal = num_ideals - 1
        for s in reversed(range(self.num_stages)):
            split[s] = choices[s][ideal]
            ideal = st.low[split[s]]
        assert ideal == 0
        return int(previous[-1]), split
