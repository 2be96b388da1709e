"""The prefix-variable formulation of the per-config assignment problem, shared by the backends.

Layers are in topological order l = 0..L-1, stages s = 0..p-1, edges e = (u, v) with eb_e bytes.
The formulation (``cpsat.py`` and ``milp.py`` build it through :class:`PrefixFormulation`):

  y[l][s] in {0, 1}, s = 0..p-2      y[l][s] = 1 iff stage(l) <= s (prefix variables);
                                     y[l][-1] = 0 and y[l][p-1] = 1 are constants
  x[l][s] = y[l][s] - y[l][s-1]      layer l sits on stage s (linear, no variable)
  c[e][s] = y[u][s] - y[v][s]        edge e crosses the boundary s | s+1 (in {0, 1} by precedence)
  r[T][s] >= y[u][s-1] - y[v][s]     tensor T (edges e = (u, v) naming it, one producer u) is
                                     relayed by stage s: stage(u) < s < max stage(v)
  ct[T][s] >= c[e][s]                T crosses s | s+1 (a variable only for a tensor on several
                                     edges; c[e][s] itself otherwise)
  tr[s] >= transient_l x[l][s]       largest transient of stage s
  torch runtime (``LayerCosts.direct_sends``: each tensor goes straight to every consuming
  stage, no r), for a tensor T that can skip a stage (``_received``, ``_sent``):
  rv[T][s] >= y[u][s-1] + x[v][s] - 1  s receives T: stage(u) < s = stage(v) for an edge (u, v)
  sd[T][s] >= x[u][s] - y[v][s]        s sends T: stage(u) = s < stage(v) for an edge (u, v)
                                     (both replace ct[T][s-1], ct[T][s] in the memory rows)

  monotone     y[l][s] <= y[l][s+1]
  precedence   y[v][s] <= y[u][s]                          stage(u) <= stage(v)
  non-empty    sum_l x[l][s] >= 1
  memory       peak >= sum_l (state_l + k_s stored_l) x[l][s]
                       + sum_T eb_T (R_s ct[T][s-1] + S_s ct[T][s]) + k_s sum_T eb_T r[T][s] + tr[s]
               (R_s, S_s: boundary copies of the cost model; a relayed edge is received and sent)
  time         Ts[s] >= sum_l time_l x[l][s],  Fs[s] = sum_l forward_l x[l][s],
               X[r] >= sum_l tail_l x[l][s] over the rank's stages s    (tail: sync + step)
  iteration    I >= each term of ``costs.bound_terms`` (every rank r), e.g.
               sum_{j<r} Ts[j] + m (sum_{s of r} Ts[s] + v h) + X[0] + r h
               (h: the micro-batch overhead; Fs is exact as a term may subtract it)
  limits       peak <= capacity;  I <= budget
  objective    min peak ("memory") or min I ("time")

Heterogeneous clusters (``problem.placement``: node groups k with capacity C_k, n_k stages each and
their own per-layer times time_l^k, sync_l^k) add, and use instead of the memory and time rows:

  g[s][k] in {0, 1}                  stage s runs on group k
  P[s][k] >= 0                       peak of stage s if it runs on group k, else 0
  one group    sum_k g[s][k] = 1
  group sizes  sum_s g[s][k] = n_k                         every GPU is used
  (solver.search.candidates) memory       sum_k P[s][k] >= (stage peak expression above)
  capacity     P[s][k] <= C_k g[s][k]
  objective    utilization (integer ppm U):  10^6 P[s][k] <= C_k U
               absolute:                     peak >= P[s][k]
  time         Ts[s] >= sum_l time_l^k x[l][s] - M^k (1 - g[s][k]),  M^k = sum_l time_l^k
               (X likewise with tail_l^k; Fs also <= its sum + M^k (1 - g[s][k]))

P is the disaggregated (convex-hull) form of "P_s <= C_k(s)": no big-M in the memory rows, so the
LP relaxation stays tight and the coefficients small (HiGHS's presolve declared a feasible big-M
version infeasible). The time rows are exact: with g[s][k] = 0 their right-hand side is at most 0.
U is an integer, so its optimum is max_s ceil(10^6 peak_s / C_k(s)),
``costs.utilization_ppm`` exactly. Without a placement none of this exists and the model is
the one above, unchanged.

Interleaving (``config.virtual_stages`` v > 1): the stages s above are the p v virtual stages, and
virtual stage s runs on rank s mod p as its chunk s div p. Memory, transient and time rows are per
rank r instead of per stage, one memory row per in-flight vector n of the rank
(``LayerCosts.in_flight_vectors``):

  parts        S_s >= sum_l state_l x[l][s],  A_s >= sum_l stored_l x[l][s] + relays of s,
               In_s >= sum_e eb_e c[e][s-1],  Out_s >= sum_e eb_e c[e][s]     (every s)
  memory       peak >= sum_c [ S_c + n_c A_c + R(n_c) In_c + S(n_c) Out_c ] + tr[r]
               (c for s_c = r + c p; R, S: ``LayerCosts.copies_at``), for every n in N_r
  transient    tr[r] >= transient_l x[l][s_c]           for every chunk c of r
  time         the rows above, per virtual stage (Ts, Fs) and per rank (X, I): the virtual
               stages j < r before rank r are its predecessors' first chunks

Without interleaving each rank is one stage with one vector (k_s), and the rows are the ones
above. The chain algorithm does not solve interleaved problems (a rank's chunks are not
contiguous); CP-SAT and MILP do, and agree with brute force (tests/test_interleaved.py). On an
interleaved chain :meth:`PrefixFormulation.solve_problem` first runs the chunk-size relaxation
(``solver.backends.interleaved``): INFEASIBLE when it has no split, OPTIMAL when its split meets
its bound (alike middle layers: a transformer), else its bound raises the peak's lower bound (or
cuts the iteration, ``_add_iteration_bound``) and its split is the start when better than the
hint (tests/test_interleaved_fast.py).

Selective recomputation (``costs.selective``): rc[l] in {0, 1} marks layer l recomputed, and
z[l][s] = x[l][s] rc[l] (z <= x, z <= rc, z >= x + rc - 1: exact at integer x, rc, no big-M).
With d_l the recomputed state's coefficient minus the kept one's (stored, transient, time):
  memory       ... + k_s sum_l d_stored_l z[l][s]
  transient    tr[s] >= transient_l x[l][s] + d_transient_l z[l][s]
  time         Ts[s] >= sum_l time_l x[l][s] + d_time_l z[l][s]
so "none" (rc = 0) and "full" (rc = 1) are both feasible choices of the same model. With a
placement the same z terms enter the placed memory rows (``_stage_bytes`` is shared) and every
group's time rows: T >= sum_l time_l^k x[l][s] + d_time_l^k z[l][s] - M^k (1 - g[s][k]), with
M^k = sum_l max(time_l^k, recompute_time_l^k).

Gradients that appear at the first backward (``LayerCosts.first_backward_peak``, step lifetime):
the stage's memory rows are ``_first_backward_rows``: B_s >= the stage without transient at k-1
held (relays and buffers at k), D[l][s] >= D[l'][s] + (stored_l - grad_l) x[l][s] (+ d z), and
peak >= B_s + D[l][s] + transient_l x[l][s] per layer, plus the 'after' row at k - 1 held
(``costs.first_backward_moments``).

The optimizer step (``LayerCosts.step_bytes``, a foreach Adam's temporary): one more row per
rank, ``_optimizer_step_row``:
  peak >= sum_l (state_l + step_l) x[l][s] + sum_T eb_T (R0_s ct[T][s-1] + S0_s ct[T][s])
(R0, S0: the copies with nothing held, ``LayerCosts.copies_at(s, 0)``; the sum over the rank's
chunks with interleaving; ``costs.optimizer_step_moment``).

The buffer term is exact: an edge leaving s crosses s | s+1 only, one entering s crosses s-1 | s
only, and a relayed one crosses both ((R_s + S_s) eb_e). Prefix variables make all of this linear
with no big-M; r is the only product, and ``y[u][s-1] - y[v][s]`` is the tightest linear lower
bound of it (at least as strong as ``c[e][s-1] + c[e][s] - 1``). Every auxiliary variable is only
bounded from below, so a solution's model objective can exceed the true one; it is always
recomputed with the cost model, and at the optimum the two agree.

Every rule is written once, against OR-Tools and PuLP expressions alike (both overload
``+ - * <= >= ==``). A backend supplies the model and its variables (``_new_bool``, ``_new_var``:
integer for CP-SAT, continuous for the MILP), the units of coefficients (``_bytes``, ``_ns``: exact
for CP-SAT, scaled by powers of two for the MILP), ``_sum``, ``_add``, ``_minimize``, ``_hint``,
``dump`` and ``solve``; :meth:`PrefixFormulation.solve_problem` runs a whole solve.

Cuts and static bounds: :class:`solver.backends.presolve.Presolve`.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from solver.backends.interleaved import ChunkSizeBound, chunk_size_bound
from solver.backends.presolve import Presolve, check_hint, keep_hint_if_better, make_solution
from solver.backends.problem import (
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OBJECTIVE_TIME,
    OPTIMAL,
    UNKNOWN,
    UTILIZATION,
    StageProblem,
    StageSolution,
)
from solver.costs import (
    PPM,
    LayerCosts,
    bound_terms,
    boundary_bytes,
    direct_buffer_adjustments,
    iteration_bound_ns,
    stage_buffer_bytes,
    stage_costs,
)


@dataclass
class PrefixVariables:
    """prefix[l][s] = y[l][s] for s = 0..p-2; relay[(e, s)] = r[e][s] (only where an edge can be
    relayed); transient[s] = tr[s]; None where the objective and limits do not need the term.
    Values are in the backend's units (``_bytes``, ``_ns``)."""

    prefix: list[list[Any]] = field(default_factory=list)
    relay: dict[tuple[int, int], Any] = field(default_factory=dict)
    transient: list[Any] = field(default_factory=list)
    """tr[r] per rank (per stage without interleaving)."""
    peak: Any = None
    stage_time: list[Any] = field(default_factory=list)
    """Ts[j]: virtual stage j's time per micro-batch, ns."""
    stage_forward: list[Any] = field(default_factory=list)
    """Fs[j]: its forward's part, ns."""
    rank_tail: list[Any] = field(default_factory=list)
    """X[r]: rank r's gradient sync + optimizer step, ns per iteration."""
    iteration: Any = None
    """I: the iteration bound, ns."""
    group: list[list[Any]] = field(default_factory=list)
    """group[s][k] = g[s][k] (placement only)."""
    stage_peak: list[list[Any]] = field(default_factory=list)
    """stage_peak[s][k] = P[s][k] (placement only)."""
    utilization: Any = None
    """U, ppm (placement with the utilization objective only)."""
    recompute: list[Any] = field(default_factory=list)
    """rc[l] under selective recomputation (else empty)."""
    recompute_member: dict[tuple[int, int], Any] = field(default_factory=dict)
    """z[(l, s)] = x[l][s] rc[l], where layer l can sit on stage s."""


MIN_BUILD_S = 0.05
"""Building a model may take this long whatever the time limit (a small model, in
milliseconds, is then solved for at least 0.01 s, as every config of a search is)."""
LOAD_SHARE = 0.1
"""A model is solved only with at least this fraction of its build time left: loading it alone
takes about half of that (CP-SAT: 1.4 s for 1.2 million constraints built in 29 s), whatever
the solver's own time limit, so with less the solve would overrun the limit and find nothing."""


CHUNK_SIZE_SHARE = 0.25
"""Share of a solve's time limit the chunk-size relaxation of an interleaved chain may take
before its box search stops (``solver.backends.interleaved``; milliseconds on a GPT-3 shape)."""


class BuildTimeUp(Exception):
    """The time limit ran out while the model was being built (``PrefixFormulation.stop_at``)."""


class PrefixFormulation(abc.ABC):
    """The model of the module docstring; a subclass creates ``self.model`` and calls
    :meth:`_build`."""

    backend = "prefix"
    """The backend's name in a StageSolution."""

    def __init__(
        self,
        problem: StageProblem,
        presolve: Presolve | None = None,
        *,
        stop_at: float = math.inf,
    ):
        self.stop_at = stop_at
        """``time.perf_counter()`` past which building raises :class:`BuildTimeUp` (a model of
        L x p variables takes minutes to build in Python for thousands of layers: it must not
        outlive the time limit, nor hold memory for a solve there is no time for)."""
        self.problem = problem
        self.costs: LayerCosts = problem.costs
        self.presolve = presolve or Presolve.of(problem)
        self.edges = list(
            zip(self.costs.edge_src.tolist(), self.costs.edge_dst.tolist(), strict=True)
        )
        """(u, v) of every edge, in the order of costs.edge_*."""
        self.placement = problem.placement
        self.needs_memory = (
            problem.objective == OBJECTIVE_MEMORY
            or problem.capacity_bytes is not None
            or self.placement is not None  # every group has a capacity
        )
        self.needs_time = (
            problem.objective == OBJECTIVE_TIME or problem.iteration_budget_ns is not None
        )
        self.vars = PrefixVariables()
        self._parts: dict[int, tuple[Any, Any, Any, Any]] = {}
        """Per virtual stage (states, kept, in, out) variables (``_stage_parts``)."""
        self._stage_layers: dict[int, list[int]] = {}
        """Per stage, the layers it can hold (``_layers_of``)."""
        self._stage_recompute: dict[int, list[tuple[int, Any]]] = defaultdict(list)
        """Per stage s, (l, z[l][s]) (``vars.recompute_member`` by stage)."""
        self._stage_relays: dict[int, list[tuple[int, Any]]] = defaultdict(list)
        """Per stage s, (T, r[T][s]) (``vars.relay`` by stage)."""
        self._tensor_crossings: dict[tuple[int, int], Any] = {}
        """ct[T][s] of tensors with several edges (``_tensor_crossing``)."""
        self._direct_receives: dict[tuple[int, int], Any] = {}
        self._counted: dict[tuple[int, int], Any] = {}
        """(tensor, stage) -> w: T crosses the stage's boundary and a layer of it counts T
        (``_counted_here``)."""
        """rv[T][s] of tensors that can skip a stage, torch runtime (``_received``)."""
        self._direct_sends: dict[tuple[int, int], Any] = {}
        """sd[T][s] of tensors that can skip a stage, torch runtime (``_sent``)."""
        self._first_backward: dict[int, tuple[Any, list[tuple[int, Any]]]] = {}
        """Per stage s with ``first_backward_peak``: (B_s, [(l, D[l][s])]) (hints)."""

    @classmethod
    def solve_problem(
        cls,
        problem: StageProblem,
        *,
        hint: list[int] | None,
        dump_path: str | None,
        hint_recomputed: list[bool] | None = None,
        hint_groups: list[int] | None = None,
        **options,
    ) -> StageSolution:
        """Builds the model, with the hint (a split, the recompute flags under selective, the
        group of each stage with a placement) as a start, writes it to ``dump_path`` and calls
        ``solve(**options)``; a valid hint is returned when the solver found nothing better.
        A placed problem always gets a complete start
        (``solver.backends.placement_start``): the hint's
        split with the best group assignment, or, without a hint, a start built in at most a
        tenth of the time limit."""
        start = time.perf_counter()
        check_hint(problem, hint, hint_groups)
        if problem.placement is not None and hint_groups is None:
            hint, hint_recomputed, hint_groups = _placement_hint(
                problem, hint, hint_recomputed, options
            )
        limit = options.get("time_limit_s")
        presolve = Presolve.of(problem)
        # interleaved chains (solver.backends.interleaved), in at most a quarter of the limit
        sizes = chunk_size_bound(problem, time_limit_s=CHUNK_SIZE_SHARE * (limit or math.inf))
        if sizes is not None:
            closed = _closed_by_chunk_sizes(problem, sizes, cls.backend_of(options))
            if closed is not None:
                closed.wall_s = time.perf_counter() - start
                return closed
            presolve.raise_objective_bound(problem, sizes.lower_bound)
            hint = _better_start(problem, hint, sizes.split)
        try:
            built = time.perf_counter()
            formulation = cls(
                problem,
                presolve,
                stop_at=math.inf if limit is None else start + max(limit, MIN_BUILD_S),
            )
            if hint is not None:
                formulation.set_hint(hint, hint_recomputed, hint_groups)
            built = time.perf_counter() - built
            if dump_path is not None:
                formulation.dump(dump_path)
            if limit is not None:  # the start's and the model's time comes out of the limit
                left = max(0.01, limit - (time.perf_counter() - start))
                if left < LOAD_SHARE * built:
                    raise BuildTimeUp  # the solver could not even load the model in time
                options["time_limit_s"] = left
        except BuildTimeUp:
            # no model in time: the hint (if valid) is the solution, the static bound the bound
            bound = presolve.objective_lower_bound(problem)
            solution = make_solution(UNKNOWN, cls.backend_of(options), bound=bound)
        else:
            solution = formulation.solve(**options)
        solution = keep_hint_if_better(problem, solution, hint, hint_recomputed, hint_groups)
        solution.wall_s = time.perf_counter() - start
        return solution

    @classmethod
    def backend_of(cls, options: dict) -> str:
        """The backend's name in a StageSolution, for the options of a solve."""
        return cls.backend

    def _build(self) -> None:
        self._build_variables()
        self._add_constraints()
        self._set_objective()

    def _tick(self) -> None:
        """Raise :class:`BuildTimeUp` past ``stop_at`` (called once per layer, stage or edge
        of each loop that builds the model)."""
        if time.perf_counter() > self.stop_at:
            raise BuildTimeUp

    # -- backend ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def _new_bool(self, name: str) -> Any:
        """A binary variable."""

    @abc.abstractmethod
    def _new_var(self, lo: int | float, hi: int | float, name: str) -> Any:
        """An auxiliary variable in [lo, hi] (only its lower bound matters)."""

    @abc.abstractmethod
    def _new_int(self, lo: int, hi: int, name: str) -> Any:
        """An integer variable in [lo, hi]."""

    utilization_row_scale: int = 1
    """Factor on both sides of the utilization rows (CP-SAT: 10^6, for integer coefficients)."""

    @abc.abstractmethod
    def _bytes(self, value: int) -> int | float:
        """A byte count in model units."""

    @abc.abstractmethod
    def _ns(self, value: int) -> int | float:
        """A time in model units."""

    @abc.abstractmethod
    def _sum(self, terms) -> Any:
        """The sum of linear terms."""

    @abc.abstractmethod
    def _add(self, constraint, name: str) -> None:
        """Adds a linear constraint, or a Python bool where every variable folded away."""

    @abc.abstractmethod
    def _minimize(self, expression) -> None:
        """Sets the objective."""

    @abc.abstractmethod
    def _hint(self, variable, value: int | float) -> None:
        """A start value for one variable."""

    # -- expressions -----------------------------------------------------------------------------

    def _y(self, layer: int, stage: int):
        """y[l][s] with the constants y[l][-1] = 0 and y[l][p-1] = 1."""
        if stage < 0:
            return 0
        if stage >= self.problem.num_stages - 1:
            return 1
        return self.vars.prefix[layer][stage]

    def _member(self, layer: int, stage: int):
        """x[l][s] = y[l][s] - y[l][s-1]."""
        return self._y(layer, stage) - self._y(layer, stage - 1)

    def _crossing(self, edge: int, boundary: int):
        """c[e][s] = y[u][s] - y[v][s]: edge e crosses s | s+1 (0 outside s = 0..p-2)."""
        if not 0 <= boundary < self.problem.num_stages - 1:
            return 0
        u, v = self.edges[edge]
        return self._y(u, boundary) - self._y(v, boundary)

    def _tensor_crossing(self, tensor: int, boundary: int):
        """ct[T][s]: tensor T crosses s | s+1, i.e. stage(producer) <= s < the farthest
        consumer's stage: c[e][s] of its one edge, or a variable ct >= c[e][s] for each of its
        edges (only bounded below, as every auxiliary: the max of them at the optimum)."""
        edges, _ = self.costs.tensor_groups[tensor]
        if len(edges) == 1 or not 0 <= boundary < self.problem.num_stages - 1:
            return self._crossing(edges[0], boundary)
        key = (tensor, boundary)
        crossing = self._tensor_crossings.get(key)
        if crossing is None:
            crossing = self._new_var(0, 1, f"ct_t{tensor}_s{boundary}")
            for e in edges:
                self._add(crossing >= self._crossing(e, boundary), f"ct_t{tensor}_e{e}_s{boundary}")
            self._tensor_crossings[key] = crossing
        return crossing

    def _can_skip(self, tensor: int) -> bool:
        """Some edge of tensor T can jump over a stage (presolve's span >= 2): only then do a
        relay (megatron) or a direct send past a neighbour (torch) exist."""
        edges, nbytes = self.costs.tensor_groups[tensor]
        return bool(nbytes) and any(self.presolve.max_span[e] >= 2 for e in edges)

    def _received(self, tensor: int, stage: int):
        """Stage s receives tensor T. Megatron (neighbour p2p, relays included): ct[T][s-1].
        torch (``LayerCosts.direct_sends``), for a T that can skip a stage, a variable

          rv[T][s] >= y[u][s-1] + x[v][s] - 1     for each edge (u, v) of T

        (stage(u) < s = stage(v): s receives T straight from u's stage; the max over T's edges at
        the optimum); ct[T][s-1] otherwise, which is then exact."""
        if not self.costs.direct_sends or not self._can_skip(tensor):
            return self._tensor_crossing(tensor, stage - 1)
        if stage <= 0:
            return 0
        key = (tensor, stage)
        receive = self._direct_receives.get(key)
        if receive is None:
            pre, edges = self.presolve, self.costs.tensor_groups[tensor][0]
            readers = [e for e in edges if pre.can_hold(self.edges[e][1], stage)]
            if not readers or pre.first_stage[self.edges[edges[0]][0]] >= stage:
                return 0
            receive = self._new_var(0, 1, f"rv_t{tensor}_s{stage}")
            for e in readers:
                u, v = self.edges[e]
                self._add(
                    receive >= self._y(u, stage - 1) + self._member(v, stage) - 1,
                    f"rv_t{tensor}_e{e}_s{stage}",
                )
            self._direct_receives[key] = receive
        return receive

    def _sent(self, tensor: int, stage: int):
        """Stage s sends tensor T. Megatron: ct[T][s]. torch, for a T that can skip a stage:

          sd[T][s] >= x[u][s] - y[v][s]           for each edge (u, v) of T

        (stage(u) = s < stage(v): made here, read later; the max over T's edges at the
        optimum); ct[T][s] otherwise."""
        if not self.costs.direct_sends or not self._can_skip(tensor):
            return self._tensor_crossing(tensor, stage)
        if stage >= self.problem.num_stages - 1:
            return 0
        key = (tensor, stage)
        send = self._direct_sends.get(key)
        if send is None:
            edges = self.costs.tensor_groups[tensor][0]
            producer = self.edges[edges[0]][0]
            if not self.presolve.can_hold(producer, stage):
                return 0
            send = self._new_var(0, 1, f"sd_t{tensor}_s{stage}")
            for e in edges:
                v = self.edges[e][1]
                self._add(
                    send >= self._member(producer, stage) - self._y(v, stage),
                    f"sd_t{tensor}_e{e}_s{stage}",
                )
            self._direct_sends[key] = send
        return send

    def _layers_of(self, stage: int) -> list[int]:
        layers = self._stage_layers.get(stage)
        if layers is None:
            first, last = self.presolve.first_stage, self.presolve.last_stage
            layers = [
                layer
                for layer in range(self.problem.num_layers)
                if first[layer] <= stage <= last[layer]
            ]
            self._stage_layers[stage] = layers
        return layers

    def _recompute_terms(self, extra: np.ndarray, stage: int, unit) -> list:
        """sum_l extra_l z[l][s]: what recomputing changes on stage s (empty without
        selective recomputation)."""
        return [unit(extra[layer]) * z for layer, z in self._stage_recompute[stage] if extra[layer]]

    def _stage_bytes(self, stage: int):
        """Peak of stage s as a linear expression (module docstring, 'memory'); without
        interleaving, where rank s holds stage s alone with one in-flight count."""
        return self._rank_bytes(stage, self.costs.in_flight_vectors[stage][0])

    def _rank_bytes(
        self,
        rank: int,
        vector: tuple[int, ...],
        done: tuple[int, ...] = (),
        *,
        relays_held: int | None = None,
        copies_held: int | None = None,
        transient: bool = True,
    ):
        """Peak of rank r when it holds vector[c] micro-batches of its chunk c, after done[c]
        backwards of it (module docstring, 'interleaving'; one chunk and k_s without
        interleaving). Without interleaving ``relays_held`` and ``copies_held`` (default
        vector[0]) count the relayed tensors and the boundary copies at another held count
        (``_first_backward_rows``); ``transient`` False leaves tr[r] out."""
        costs = self.costs
        if costs.config.virtual_stages > 1:
            return self._rank_bytes_from_parts(rank, vector, done or (0,) * len(vector))
        terms = []
        for k, stage in zip(vector, costs.stages_of_rank(rank), strict=True):
            per_layer = costs.state_bytes + k * costs.stored_bytes
            terms += [
                self._bytes(per_layer[layer]) * self._member(layer, stage)
                for layer in self._layers_of(stage)
            ]
            terms += self._recompute_terms(
                k * (costs.recompute_stored_bytes - costs.stored_bytes), stage, self._bytes
            )
            terms += self._buffer_terms(stage, k if copies_held is None else copies_held, 0)
            relays = k if relays_held is None else relays_held
            terms += [
                self._bytes(relays * costs.tensor_groups[t][1]) * relay
                for t, relay in self._stage_relays[stage]
            ]
        if self.vars.transient and transient:
            terms.append(self.vars.transient[rank])
        if costs.constant_bytes:
            terms.append(self._bytes(costs.constant_bytes))
        return self._sum(terms)

    def _stage_rows(self, stage: int) -> list:
        """Expressions the peak of stage s (no interleaving) is at least: the persistent moment,
        or the first-backward moments where gradients appear then (``_first_backward_rows``);
        and the optimizer step where it makes a temporary (``_optimizer_step_row``)."""
        if self.costs.first_backward_peak[stage]:
            rows = self._first_backward_rows(stage)
        else:
            rows = [self._stage_bytes(stage)]
        return rows + self._optimizer_step_rows(stage)

    def _optimizer_step_rows(self, rank: int) -> list:
        """[peak of rank r at its optimizer step] (``costs.optimizer_step_moment``), or []
        without a step temporary:

          sum_c [ sum_l (state_l + step_l) x[l][s_c] + R0 In_c + S0 Out_c ] (+ constant)

        every gradient, no activation, the buffers at 0 held (``LayerCosts.copies_at``)."""
        costs = self.costs
        if costs.step_bytes is None:
            return []
        per_layer = costs.state_bytes + costs.step_bytes
        terms = []
        for stage in costs.stages_of_rank(rank):
            terms += [
                self._bytes(per_layer[layer]) * self._member(layer, stage)
                for layer in self._layers_of(stage)
            ]
            terms += self._buffer_terms(stage, 0, 0)
        if costs.constant_bytes:
            terms.append(self._bytes(costs.constant_bytes))
        return [self._sum(terms)]

    def _buffer_terms(self, stage: int, held: int, done: int) -> list:
        """Boundary buffers of stage s holding ``held`` micro-batches after ``done`` backwards
        (``costs.stage_buffer_bytes``), per tensor T of n bytes:

          (R + held [saving of T known]) n rv[T][s] + (S - m [T needs no grad]) n sd[T][s]
          - held n w[T][s]                        (w: a layer of s counts T, ``_counted_here``)

        the plain R n rv + S n sd when every boundary is (``LayerCosts.plain_boundaries``)."""
        costs = self.costs
        receive, send = costs.copies_at(stage, held, done)
        adjusted = costs.direct_sends and not costs.plain_boundaries
        m, last = costs.config.num_microbatches, self.problem.num_stages - 1
        terms = []
        for t, (_, nbytes) in enumerate(costs.tensor_groups):
            if not nbytes:
                continue
            into, out_of = receive * nbytes, send * nbytes
            if adjusted:
                grad, known, charged = costs.tensor_roles[t]
                into += held * nbytes if known else 0
                out_of -= 0 if grad or stage == last else m * nbytes
                if charged and held:
                    terms.append(-self._bytes(held * nbytes) * self._counted_here(t, stage))
            terms.append(
                self._bytes(into) * self._received(t, stage)
                + self._bytes(out_of) * self._sent(t, stage)
            )
        return terms

    def _counted_here(self, tensor: int, stage: int):
        """w[T][s] in [0, 1] with

          w <= sum_c x[c][s]   (c: the layers whose stored bytes count T, ``tensor_roles``)
          w <= rv[T][s] + sd[T][s]

        T's negative coefficient lifts w to the minimum: 1 exactly when s receives or sends T
        and counts it in its stored bytes. Raising rv or sd to lift w never pays: their
        coefficients are at least held n."""
        key = (tensor, stage)
        counted = self._counted.get(key)
        if counted is None:
            charged = self.costs.tensor_roles[tensor][2]
            here = [c for c in charged if self.presolve.can_hold(c, stage)]
            if not here:
                return 0
            counted = self._new_var(0, 1, f"w_t{tensor}_s{stage}")
            self._add(
                counted <= self._sum(self._member(c, stage) for c in here),
                f"w_t{tensor}_s{stage}_layer",
            )
            self._add(
                counted <= self._received(tensor, stage) + self._sent(tensor, stage),
                f"w_t{tensor}_s{stage}_crossing",
            )
            self._counted[key] = counted
        return counted

    def _first_backward_rows(self, stage: int) -> list:
        """``costs.first_backward_moments`` as rows, with k = k_s (= m) and, per layer l
        that can sit on s in forward order, a running sum D[l][s]:

          B_s     >= states_s + (k-1) stored_s + k relay_s + buffers_s(k)      (no transient)
          D[l][s] >= D[l'][s] + (stored_l - grad_l) x[l][s] (+ d_stored_l z[l][s])
                                          (l' the previous such layer; D = 0 before the first)
          peak    >= B_s + D[l][s] + transient_l x[l][s] (+ d_transient_l z[l][s])
                                          during(l): states_s holds every gradient, D takes
                                          off those up to l and adds the current micro-batch's
                                          stored bytes up to l
          peak    >= states_s + (k-1) (stored_s + relay_s) + buffers_s(k-1) + tr[s]   (after)

        2 |layers of s| + 2 rows of a few terms each, no big-M; D and B only bounded below."""
        costs = self.costs
        k = costs.in_flight[stage]
        stored_ub, _, _ = costs.bounding_coefficients(np.maximum)
        grads = costs.grad_bytes
        base = self._new_var(0, self._bytes(self.presolve.peak_ub_bytes), f"B_s{stage}")
        base_terms = self._rank_bytes(
            stage, (k - 1,), relays_held=k, copies_held=k, transient=False
        )
        self._add(base >= base_terms, f"first_backward_base_s{stage}")
        self._first_backward[stage] = (base, [])
        recompute = dict(self._stage_recompute[stage])
        extra_stored = costs.recompute_stored_bytes - costs.stored_bytes
        extra_transient = costs.recompute_transient_bytes - costs.transient_bytes
        low = -self._bytes(int(grads.sum()))
        high = self._bytes(int(stored_ub.sum()))
        rows, previous = [], 0
        for layer in self._layers_of(stage):
            self._tick()
            running = self._new_var(low, high, f"D_l{layer}_s{stage}")
            member = self._member(layer, stage)
            terms = [previous, self._bytes(int(costs.stored_bytes[layer] - grads[layer])) * member]
            row = [base, running, self._bytes(int(costs.transient_bytes[layer])) * member]
            z = recompute.get(layer)
            if z is not None and extra_stored[layer]:
                terms.append(self._bytes(int(extra_stored[layer])) * z)
            if z is not None and extra_transient[layer]:
                row.append(self._bytes(int(extra_transient[layer])) * z)
            self._add(running >= self._sum(terms), f"first_backward_d_l{layer}_s{stage}")
            self._first_backward[stage][1].append((layer, running))
            rows.append(self._sum(row))
            previous = running
        rows.append(self._rank_bytes(stage, (k - 1,), relays_held=k - 1, copies_held=k - 1))
        return rows

    def _rank_bytes_from_parts(self, rank: int, vector: tuple[int, ...], done: tuple[int, ...]):
        """With interleaving a rank has a row per in-flight vector: each row sums four
        variables per chunk (``_stage_parts``) instead of every layer and edge again."""
        terms = []
        stages = self.costs.stages_of_rank(rank)
        for k, finished, stage in zip(vector, done, stages, strict=True):
            states, kept, received, sent = self._stage_parts(stage)
            receive, send = self.costs.copies_at(stage, k, finished)
            terms += [states, k * kept]
            if self.costs.direct_sends and not self.costs.plain_boundaries:
                # per-tensor copies (_buffer_terms): the parts In, Out carry one coefficient each
                terms += self._buffer_terms(stage, k, finished)
            else:
                terms += [receive * received, send * sent]
        if self.vars.transient:
            terms.append(self.vars.transient[rank])
        if self.costs.constant_bytes:
            terms.append(self._bytes(self.costs.constant_bytes))
        return self._sum(terms)

    def _stage_parts(self, stage: int) -> tuple[Any, Any, Any, Any]:
        """(states, kept per micro-batch, received, sent) bytes of virtual stage s as variables
        bounded below by their sums (they only appear with coefficients >= 0 in rows bounding
        the peak from below, so at the optimum they equal the sums):

          states_s >= sum_l state_l x[l][s]
          kept_s   >= sum_l stored_l x[l][s] + d_stored_l z[l][s] + sum_e eb_e r[e][s]
          in_s     >= sum_e eb_e c[e][s-1],   out_s >= sum_e eb_e c[e][s]
        """
        cached = self._parts.get(stage)
        if cached is not None:
            return cached
        costs, layers = self.costs, self._layers_of(stage)
        stored_ub, _, _ = costs.bounding_coefficients(np.maximum)
        edges = [(t, nbytes) for t, (_, nbytes) in enumerate(costs.tensor_groups) if nbytes]
        edge_total = sum(nbytes for _, nbytes in edges)
        states = self._new_var(0, self._bytes(int(costs.state_bytes.sum())), f"S_v{stage}")
        kept = self._new_var(0, self._bytes(int(stored_ub.sum()) + edge_total), f"A_v{stage}")
        received = self._new_var(0, self._bytes(edge_total), f"In_v{stage}")
        sent = self._new_var(0, self._bytes(edge_total), f"Out_v{stage}")
        member = self._member
        self._add(
            states
            >= self._sum(self._bytes(costs.state_bytes[i]) * member(i, stage) for i in layers),
            f"states_v{stage}",
        )
        kept_terms = [self._bytes(costs.stored_bytes[i]) * member(i, stage) for i in layers]
        kept_terms += self._recompute_terms(
            costs.recompute_stored_bytes - costs.stored_bytes, stage, self._bytes
        )
        kept_terms += [
            self._bytes(costs.tensor_groups[t][1]) * relay for t, relay in self._stage_relays[stage]
        ]
        self._add(kept >= self._sum(kept_terms), f"kept_v{stage}")
        self._add(
            received >= self._sum(self._bytes(n) * self._received(t, stage) for t, n in edges),
            f"in_v{stage}",
        )
        self._add(
            sent >= self._sum(self._bytes(n) * self._sent(t, stage) for t, n in edges),
            f"out_v{stage}",
        )
        self._parts[stage] = (states, kept, received, sent)
        return self._parts[stage]

    def _stage_sum(self, per_layer: np.ndarray, stage: int, recomputed: np.ndarray | None = None):
        """sum_l per_layer[l] x[l][s] (+ (recomputed[l] - per_layer[l]) z[l][s]; times in model
        units)."""
        terms = [
            self._ns(per_layer[layer]) * self._member(layer, stage)
            for layer in self._layers_of(stage)
        ]
        if recomputed is not None:
            terms += self._recompute_terms(recomputed - per_layer, stage, self._ns)
        return self._sum(terms)

    def _iteration(self):
        """I, the iteration bound (``costs.iteration_bound_ns``)."""
        return self.vars.iteration

    # -- model -----------------------------------------------------------------------------------

    def _build_variables(self) -> None:
        """y[l][s], r[e][s] where stage(u) < s < stage(v) is possible, tr[s], peak, T, AR."""
        problem, pre, costs = self.problem, self.presolve, self.costs
        p, began = problem.num_stages, time.perf_counter()
        for layer in range(problem.num_layers):
            self._tick()
            if layer % 64 == 63:  # the rows so far say when all of them would be made
                projected = began + (time.perf_counter() - began) * problem.num_layers / layer
                if projected > self.stop_at:
                    raise BuildTimeUp  # not even its variables in time: build none of it
            self.vars.prefix.append([self._new_bool(f"y_l{layer}_s{s}") for s in range(p - 1)])
        if problem.selective:
            self.vars.recompute = [
                self._new_bool(f"rc_l{layer}") for layer in range(problem.num_layers)
            ]
            for s in range(p):
                self._tick()
                for layer in self._layers_of(s):
                    z = self._new_var(0, 1, f"z_l{layer}_s{s}")
                    self.vars.recompute_member[(layer, s)] = z
                    self._stage_recompute[s].append((layer, z))
        stored_ub, transient_ub, time_ub = costs.bounding_coefficients(np.maximum)
        if self.needs_memory:
            for t, (edges, nbytes) in enumerate(costs.tensor_groups):
                self._tick()
                spanning = [e for e in edges if pre.max_span[e] >= 2]
                if not spanning or not nbytes or costs.direct_sends:  # torch relays nothing
                    continue
                u = self.edges[edges[0]][0]
                farthest = max(pre.last_stage[self.edges[e][1]] for e in spanning)
                for s in range(max(1, pre.first_stage[u] + 1), min(p - 1, farthest)):
                    relay = self._new_var(0, 1, f"r_t{t}_s{s}")
                    self.vars.relay[(t, s)] = relay
                    self._stage_relays[s].append((t, relay))
            top = int(transient_ub.max(initial=0))
            if top:
                self.vars.transient = [
                    self._new_var(0, self._bytes(top), f"tr_s{r}") for r in range(costs.num_ranks)
                ]
            self.vars.peak = self._new_var(
                self._bytes(pre.peak_lb_bytes), self._bytes(pre.peak_ub_bytes), "peak"
            )
        if self.placement is not None:
            self._build_placement_variables()
        if self.needs_time:
            group_costs = [costs] if self.placement is None else self.placement.group_costs
            slowest = max(int(c.bounding_coefficients(np.maximum)[2].sum()) for c in group_costs)
            forward = max(int(c.forward_ns.sum()) for c in group_costs)
            tail = max(int(c.tail_ns.sum()) for c in group_costs)
            config, h = costs.config, costs.microbatch_overhead_ns
            # every term: at most m + 1 times all layers, two tails and every overhead
            top = (
                (config.num_microbatches + 1) * slowest
                + 2 * tail
                + (config.num_microbatches * config.virtual_stages + p + 1) * h
            )
            self.vars.stage_time = [
                self._new_var(0, self._ns(slowest), f"Ts_s{s}") for s in range(p)
            ]
            self.vars.stage_forward = [
                self._new_var(0, self._ns(forward), f"Fs_s{s}") for s in range(p)
            ]
            self.vars.rank_tail = [
                self._new_var(0, self._ns(tail), f"X_r{r}") for r in range(costs.num_ranks)
            ]
            lower = max(pre.iteration_lb_ns, pre.iteration_floor_ns)
            self.vars.iteration = self._new_var(
                self._ns(min(lower, top)), self._ns(top), "iteration"
            )

    def _build_placement_variables(self) -> None:
        """g[s][k], P[s][k] and U (utilization objective) or peak (absolute, already built)."""
        placement, p = self.placement, self.problem.num_stages
        self.vars.group = [
            [self._new_bool(f"g_s{s}_k{k}") for k in range(placement.num_groups)] for s in range(p)
        ]
        self.vars.stage_peak = [
            [
                self._new_var(0, self._bytes(capacity), f"P_s{s}_k{k}")
                for k, capacity in enumerate(placement.capacity_bytes)
            ]
            for s in range(p)
        ]
        if placement.memory_objective == UTILIZATION:
            lower = self.presolve.objective_lower_bound(
                dataclasses.replace(self.problem, objective=OBJECTIVE_MEMORY)
            )
            self.vars.utilization = self._new_int(min(lower, PPM), PPM, "U")

    def _add_constraints(self) -> None:
        """Every constraint family; memory rows only with a memory objective or a capacity, time
        rows only with a time objective or a budget."""
        self._add_stage_ranges()
        self._add_monotone_prefix()
        self._add_precedence()
        self._add_nonempty_stages()
        self._add_edge_span()
        if self.placement is not None:
            self._add_one_group_per_stage()
            self._add_group_sizes()
        self._add_recompute_member()
        if self.needs_memory:
            self._add_relay()
            self._add_transient()
            self._add_stage_memory()
            self._add_capacity()
        if self.needs_time:
            self._add_stage_time()
            self._add_iteration_budget()
            self._add_iteration_bound()

    def _add_stage_ranges(self) -> None:
        """y[l][s] = 0 for s < first_l;  y[l][s] = 1 for s >= last_l."""
        pre = self.presolve
        for layer, row in enumerate(self.vars.prefix):
            self._tick()
            for s, y in enumerate(row):
                if s < pre.first_stage[layer]:
                    self._add(y == 0, f"range_lo_l{layer}_s{s}")
                if s >= pre.last_stage[layer]:
                    self._add(y == 1, f"range_hi_l{layer}_s{s}")

    def _add_monotone_prefix(self) -> None:
        """y[l][s] <= y[l][s+1]."""
        for layer, row in enumerate(self.vars.prefix):
            self._tick()
            for s, (low, high) in enumerate(itertools.pairwise(row)):
                self._add(low <= high, f"monotone_l{layer}_s{s}")

    def _add_precedence(self) -> None:
        """y[v][s] <= y[u][s] for every edge u -> v."""
        for e, (u, v) in enumerate(self.edges):
            self._tick()
            for s in range(self.problem.num_stages - 1):
                self._add(self._y(v, s) <= self._y(u, s), f"precedence_e{e}_s{s}")

    def _add_nonempty_stages(self) -> None:
        """sum_l x[l][s] >= 1."""
        for s in range(self.problem.num_stages):
            self._tick()
            members = self._sum(self._member(layer, s) for layer in range(self.problem.num_layers))
            self._add(members >= 1, f"nonempty_s{s}")

    def _add_edge_span(self) -> None:
        """y[v][s] >= y[u][s - span_e]: stage(v) <= stage(u) + span_e."""
        p = self.problem.num_stages
        for e, (u, v) in enumerate(self.edges):
            self._tick()
            span = self.presolve.max_span[e]
            for s in range(span, p - 1):
                self._add(self._y(v, s) >= self._y(u, s - span), f"span_e{e}_s{s}")

    def _add_recompute_member(self) -> None:
        """z[l][s] <= x[l][s],  z[l][s] <= rc[l],  z[l][s] >= x[l][s] + rc[l] - 1."""
        for s, members in self._stage_recompute.items():
            self._tick()
            for layer, z in members:
                member, recompute = self._member(layer, s), self.vars.recompute[layer]
                self._add(z <= member, f"rcx_l{layer}_s{s}")
                self._add(z <= recompute, f"rcr_l{layer}_s{s}")
                self._add(z >= member + recompute - 1, f"rcxr_l{layer}_s{s}")

    def _add_relay(self) -> None:
        """r[e][s] >= y[u][s-1] - y[v][s]."""
        for (t, s), relay in self.vars.relay.items():
            self._tick()
            for e in self.costs.tensor_groups[t][0]:
                u, v = self.edges[e]
                self._add(relay >= self._y(u, s - 1) - self._y(v, s), f"relay_t{t}_e{e}_s{s}")

    def _add_transient(self) -> None:
        """tr[r] >= transient_l x[l][s] for each stage s of rank r (+ d_transient_l z[l][s]
        under selective)."""
        costs = self.costs
        if not self.vars.transient:
            return
        for rank, s in self._rank_stages():
            self._tick()
            largest = self.vars.transient[rank]
            for layer in self._layers_of(s):
                kept = costs.transient_bytes[layer]
                extra = costs.recompute_transient_bytes[layer] - kept
                z = self.vars.recompute_member.get((layer, s))
                if z is None or not extra:
                    if kept:
                        self._add(
                            largest >= self._bytes(kept) * self._member(layer, s),
                            f"transient_l{layer}_s{s}",
                        )
                    continue
                self._add(
                    largest >= self._bytes(kept) * self._member(layer, s) + self._bytes(extra) * z,
                    f"transient_l{layer}_s{s}",
                )

    def _add_one_group_per_stage(self) -> None:
        """sum_k g[s][k] = 1."""
        for s, row in enumerate(self.vars.group):
            self._add(self._sum(row) == 1, f"one_group_s{s}")

    def _add_group_sizes(self) -> None:
        """sum_s g[s][k] = n_k."""
        for k, wanted in enumerate(self.placement.stages_per_group):
            self._add(self._sum(row[k] for row in self.vars.group) == wanted, f"group_size_k{k}")

    def _rank_stages(self) -> list[tuple[int, int]]:
        """(rank, virtual stage) pairs; (s, s) without interleaving."""
        costs = self.costs
        return [(r, s) for r in range(costs.num_ranks) for s in costs.stages_of_rank(r)]

    def _add_stage_memory(self) -> None:
        """peak >= states_s + k_s stored_s + buffers_s + k_s relay_s + tr[s] (with interleaving,
        per rank and in-flight vector: the sum over its chunks); with a placement
        sum_k P[s][k] >= that, and peak >= P[s][k] (absolute) or the utilization rows."""
        if self.placement is None:
            costs = self.costs
            for rank, vectors in enumerate(costs.in_flight_vectors):
                for i, row in enumerate(self._optimizer_step_rows(rank)):
                    self._add(self.vars.peak >= row, f"memory_s{rank}_step{i}")
                if costs.config.virtual_stages == 1 and costs.first_backward_peak[rank]:
                    for i, row in enumerate(self._first_backward_rows(rank)):
                        self._add(self.vars.peak >= row, f"memory_s{rank}_b{i}")
                    continue
                dones = costs.backwards_done[rank]
                for i, (vector, done) in enumerate(zip(vectors, dones, strict=True)):
                    self._tick()
                    suffix = f"_n{i}" if len(vectors) > 1 else ""
                    self._add(
                        self.vars.peak >= self._rank_bytes(rank, vector, done),
                        f"memory_s{rank}{suffix}",
                    )
            return
        for s, row in enumerate(self.vars.stage_peak):
            self._tick()
            for i, bound in enumerate(self._stage_rows(s)):
                self._add(self._sum(row) >= bound, f"memory_s{s}_b{i}")
        if self.vars.utilization is None:
            for s, row in enumerate(self.vars.stage_peak):
                for k, stage_peak in enumerate(row):
                    self._add(self.vars.peak >= stage_peak, f"peak_s{s}_k{k}")
            return
        self._add_utilization()

    def _add_utilization(self) -> None:
        """10^6 P[s][k] <= C_k U (both sides times the backend's scale)."""
        scale, capacities = self.utilization_row_scale, self.placement.capacity_bytes
        for s, row in enumerate(self.vars.stage_peak):
            for k, (capacity, stage_peak) in enumerate(zip(capacities, row, strict=True)):
                coefficient = scale * self._bytes(capacity) / PPM
                if float(coefficient).is_integer():
                    coefficient = int(coefficient)  # CP-SAT: integer coefficients
                self._add(
                    scale * stage_peak <= coefficient * self.vars.utilization,
                    f"utilization_s{s}_k{k}",
                )

    def _add_capacity(self) -> None:
        """peak <= capacity_bytes; with a placement P[s][k] <= C_k g[s][k] (and the limits)."""
        problem = self.problem
        if self.placement is None:
            if problem.capacity_bytes is not None:
                self._add(self.vars.peak <= self._bytes(problem.capacity_bytes), "capacity")
            return
        capacities = self.placement.capacity_bytes
        for s, row in enumerate(self.vars.stage_peak):
            for k, (capacity, stage_peak) in enumerate(zip(capacities, row, strict=True)):
                self._add(
                    stage_peak <= self._bytes(capacity) * self.vars.group[s][k],
                    f"group_capacity_s{s}_k{k}",
                )
                if problem.capacity_bytes is not None:
                    self._add(
                        stage_peak <= self._bytes(problem.capacity_bytes), f"capacity_s{s}_k{k}"
                    )
        if problem.utilization_limit_ppm is not None and self.vars.utilization is not None:
            self._add(self.vars.utilization <= problem.utilization_limit_ppm, "utilization_limit")

    def _add_stage_time(self) -> None:
        """Ts[s] >= sum_l time_l x[l][s], Fs[s] >= sum_l forward_l x[l][s], X[r] >= the rank's
        tail sums; with a placement, per group k, each less M^k (1 - g[s][k]); then the
        iteration rows (module docstring)."""
        if self.placement is not None:
            self._add_placed_stage_time()
        else:
            costs = self.costs
            recomputed = costs.recompute_time_ns if self.problem.selective else None
            for s in range(self.problem.num_stages):
                self._tick()
                time_ns = self._stage_sum(costs.time_ns, s, recomputed)
                self._add(self.vars.stage_time[s] >= time_ns, f"time_s{s}")
                forward = self._stage_sum(costs.forward_ns, s)
                self._add(self.vars.stage_forward[s] == forward, f"forward_s{s}")
            for r in range(costs.num_ranks):
                tails = [self._stage_sum(costs.tail_ns, s) for s in costs.stages_of_rank(r)]
                self._add(self.vars.rank_tail[r] >= self._sum(tails), f"tail_r{r}")
        self._add_iteration_rows()

    def _add_placed_stage_time(self) -> None:
        """Ts[s] >= sum_l time_l^k x[l][s] (+ d_time_l^k z[l][s]) - M^k (1 - g[s][k]); Fs and X
        likewise (M^k: all of group k, each layer at its slower state; one stage per rank)."""
        for k, costs in enumerate(self.placement.group_costs):
            recomputed = costs.recompute_time_ns if self.problem.selective else None
            _, _, time_ub = costs.bounding_coefficients(np.maximum)
            rows = (
                ("time", self.vars.stage_time, costs.time_ns, recomputed, int(time_ub.sum())),
                ("forward", self.vars.stage_forward, costs.forward_ns, None, None),
                ("tail", self.vars.rank_tail, costs.tail_ns, None, None),
            )
            for s, groups in enumerate(self.vars.group):
                self._tick()
                off = 1 - groups[k]
                for name, variables, per_layer, recompute, top in rows:
                    top = int(per_layer.sum()) if top is None else top
                    total = self._stage_sum(per_layer, s, recompute)
                    self._add(variables[s] >= total - self._ns(top) * off, f"{name}_s{s}_k{k}")
                    if name == "forward":  # exact: a bound term may subtract it
                        slowest = max(int(c.forward_ns.sum()) for c in self.placement.group_costs)
                        self._add(
                            variables[s] <= total + self._ns(slowest) * off, f"fmax_s{s}_k{k}"
                        )

    def _add_iteration_rows(self) -> None:
        """I >= every term of every rank (module docstring, "iteration")."""
        costs, v = self.costs, self.costs.config.virtual_stages
        m, h = costs.config.num_microbatches, costs.microbatch_overhead_ns
        times, forwards = self.vars.stage_time, self.vars.stage_forward
        for r, terms in enumerate(bound_terms(costs)):
            self._tick()
            own = costs.stages_of_rank(r)
            parts = {
                "before_time": self._sum(times[:r]),
                "before_forward": self._sum(forwards[:r]),
                "own_forward": self._sum([forwards[s] for s in own]) + self._ns(v * h),
                "own_tail": self.vars.rank_tail[r],
                "after_time": self._sum(times[r + 1 : costs.num_ranks]),
                "first_tail": self.vars.rank_tail[0],
            }
            own_time = self._sum([times[s] for s in own])
            for k, term in enumerate(terms):
                busy = m + term.own_time
                expression = busy * own_time + self._ns(busy * v * h + term.constant_ns)
                for name, part in parts.items():
                    if getattr(term, name):
                        expression = expression + getattr(term, name) * part
                self._add(self.vars.iteration >= expression, f"iteration_r{r}_t{k}")

    def _add_iteration_budget(self) -> None:
        """I <= iteration_budget_ns."""
        if self.problem.iteration_budget_ns is not None:
            self._add(self._iteration() <= self._ns(self.problem.iteration_budget_ns), "budget")

    def _add_iteration_bound(self) -> None:
        """I >= the presolve's lower bound on the iteration (time objective; a cut that
        the LP relaxation does not see by itself, e.g. the chunk-size bound of
        ``solver.backends.interleaved``)."""
        bound = self.presolve.iteration_lb_ns
        if self.problem.objective == OBJECTIVE_TIME and bound:
            self._add(self._iteration() >= self._ns(bound), "iteration_bound")

    def _set_objective(self) -> None:
        """min peak ("memory") or min I ("time")."""
        if self.problem.objective == OBJECTIVE_MEMORY:
            utilization = self.vars.utilization
            self._minimize(self.vars.peak if utilization is None else utilization)
        else:
            self._minimize(self._iteration())

    def groups_from(self, value) -> list[int] | None:
        """Group of each stage from solver values (``value(variable)``), None without a
        placement."""
        if self.placement is None:
            return None
        return [max(range(len(row)), key=lambda k: value(row[k])) for row in self.vars.group]

    def _recomputed(self, value_of) -> list[bool] | None:
        """The recompute flags of a solution (``value_of``: variable -> number), or None."""
        if not self.problem.selective:
            return None
        return [value_of(rc) > 0.5 for rc in self.vars.recompute]

    # -- hints -----------------------------------------------------------------------------------

    def set_hint(
        self,
        stage_of_layer: list[int],
        recomputed: list[bool] | None = None,
        group_of_stage: list[int] | None = None,
    ) -> None:
        """A complete start: y (rc, g) from the split (the recompute flags, none by default; the
        group of each stage, required with a placement), every auxiliary variable at its exact
        value."""
        for layer, row in enumerate(self.vars.prefix):
            self._tick()
            for s, y in enumerate(row):
                self._hint(y, int(stage_of_layer[layer] <= s))
        if not self.problem.selective:
            recomputed = None
        flags = [bool(f) for f in recomputed] if recomputed else [False] * self.problem.num_layers
        for layer, rc in enumerate(self.vars.recompute):
            self._hint(rc, int(flags[layer]))
        for (layer, s), z in self.vars.recompute_member.items():
            self._hint(z, int(flags[layer] and stage_of_layer[layer] == s))
        made_at, reach = self._tensor_spans(stage_of_layer)
        for (t, s), relay in self.vars.relay.items():
            self._hint(relay, int(made_at[t] < s < reach[t]))
        for (t, s), crossing in self._tensor_crossings.items():
            self._hint(crossing, int(made_at[t] <= s < reach[t]))
        self._hint_direct(stage_of_layer)
        if self.placement is None:
            stages = stage_costs(self.costs, stage_of_layer, recomputed)
        else:
            stages = self.problem.stages(stage_of_layer, recomputed, group_of_stage)
            self._hint_placement(stages, group_of_stage)
        _, transient, _ = self.costs.coefficients(recomputed if self.problem.selective else None)
        for s, largest in enumerate(self.vars.transient):
            # the rank's largest (a stage's StageCost.transient_bytes is at its peak moment)
            held = [layer for chunk in stages[s].chunks for layer in chunk]
            self._hint(largest, self._bytes(int(transient[held].max(initial=0))))
        if self.vars.peak is not None:
            self._hint(self.vars.peak, self._bytes(max(st.peak_bytes for st in stages)))
        self._hint_parts(stage_of_layer, recomputed)
        self._hint_first_backward(stage_of_layer, recomputed, stages)
        if self.vars.iteration is not None:
            p = self.costs.num_ranks
            for r, stage in enumerate(stages):
                for c, (time_ns, forward) in enumerate(
                    zip(stage.chunk_time_ns, stage.chunk_forward_ns, strict=True)
                ):
                    self._hint(self.vars.stage_time[c * p + r], self._ns(time_ns))
                    self._hint(self.vars.stage_forward[c * p + r], self._ns(forward))
                self._hint(self.vars.rank_tail[r], self._ns(self.costs.stage_tail_ns(stage)))
            self._hint(self.vars.iteration, self._ns(iteration_bound_ns(self.costs, stages)))

    def _tensor_spans(self, stage_of_layer: list[int]) -> tuple[list[int], list[int]]:
        """Per tensor, its producer's stage and its farthest consumer's stage in a split."""
        made_at, reach = [], []
        for edges, _ in self.costs.tensor_groups:
            made_at.append(stage_of_layer[self.edges[edges[0]][0]])
            reach.append(max(stage_of_layer[self.edges[e][1]] for e in edges))
        return made_at, reach

    def _hint_direct(self, stage_of_layer: list[int]) -> None:
        """The exact rv[T][s] and sd[T][s] of a split (torch runtime, ``_received``/``_sent``)."""
        for (t, s), variable in self._direct_receives.items():
            edges = self.costs.tensor_groups[t][0]
            made = stage_of_layer[self.edges[edges[0]][0]]
            read = any(stage_of_layer[self.edges[e][1]] == s for e in edges)
            self._hint(variable, int(made < s and read))
        for (t, s), variable in self._direct_sends.items():
            edges = self.costs.tensor_groups[t][0]
            made = stage_of_layer[self.edges[edges[0]][0]]
            later = any(stage_of_layer[self.edges[e][1]] > s for e in edges)
            self._hint(variable, int(made == s and later))
        for (t, s), variable in self._counted.items():
            edges = self.costs.tensor_groups[t][0]
            made = stage_of_layer[self.edges[edges[0]][0]]
            readers = {stage_of_layer[self.edges[e][1]] for e in edges}
            crosses = (made < s and s in readers) or (made == s and max(readers) > s)
            here = any(stage_of_layer[c] == s for c in self.costs.tensor_roles[t][2])
            self._hint(variable, int(crosses and here))

    def _hint_parts(self, stage_of_layer: list[int], recomputed: list[bool] | None) -> None:
        """The exact sums of ``_stage_parts`` for a split (interleaving only)."""
        if not self._parts:
            return
        costs = self.costs
        stage_of = np.asarray(stage_of_layer)
        stored, _, _ = costs.coefficients(recomputed if self.problem.selective else None)
        into, out_of, relayed = boundary_bytes(costs, stage_of)
        for stage, (states, kept, received, sent) in self._parts.items():
            here = stage_of == stage
            self._hint(states, self._bytes(int(costs.state_bytes[here].sum())))
            self._hint(kept, self._bytes(int(stored[here].sum()) + int(relayed[stage])))
            self._hint(received, self._bytes(int(into[stage])))
            self._hint(sent, self._bytes(int(out_of[stage])))

    def _hint_first_backward(
        self, stage_of_layer: list[int], recomputed: list[bool] | None, stages: list
    ) -> None:
        """The exact B_s and D[l][s] of ``_first_backward_rows`` for a split."""
        if not self._first_backward:
            return
        costs = self.costs
        stage_of = np.asarray(stage_of_layer)
        stored, _, _ = costs.coefficients(recomputed if self.problem.selective else None)
        into, out_of, relayed = boundary_bytes(costs, stage_of)
        adjust = direct_buffer_adjustments(costs, stage_of)
        for stage, (base, runnings) in self._first_backward.items():
            k = costs.in_flight[stage]
            here = stage_of == stage
            value = (
                int(costs.state_bytes[here].sum())
                + (k - 1) * int(stored[here].sum())
                + k * int(relayed[stage])
                + stage_buffer_bytes(costs, stage, k, 0, into, out_of, adjust)
                + costs.constant_bytes
            )
            self._hint(base, self._bytes(value))
            running = 0
            for layer, variable in runnings:
                if here[layer]:
                    running += int(stored[layer] - costs.grad_bytes[layer])
                self._hint(variable, self._bytes(running))

    def _hint_placement(self, stages: list, group_of_stage: list[int]) -> None:
        """g[s][k] = [k = k(s)], P[s][k] = peak_s there (0 elsewhere), U = the utilization;
        an infeasible start is clipped to the variables' bounds (P <= C_k, U <= 10^6)."""
        capacities = self.placement.capacity_bytes
        for s, (row, peaks) in enumerate(zip(self.vars.group, self.vars.stage_peak, strict=True)):
            for k, (g, stage_peak) in enumerate(zip(row, peaks, strict=True)):
                here = int(group_of_stage[s] == k)
                self._hint(g, here)
                peak = min(stages[s].peak_bytes, capacities[k])
                self._hint(stage_peak, self._bytes(peak) * here)
        if self.vars.utilization is not None:
            utilization = self.problem.memory_value(stages, group_of_stage)
            self._hint(self.vars.utilization, min(utilization, PPM))


def _closed_by_chunk_sizes(
    problem: StageProblem, sizes: ChunkSizeBound, backend: str
) -> StageSolution | None:
    """The solution when the chunk-size relaxation settles the problem: INFEASIBLE when it has
    no split within the limits, OPTIMAL when its split is feasible and meets its bound; else
    None."""
    if sizes.lower_bound is None:
        return make_solution(INFEASIBLE, backend, bound=0)
    if problem.violation(sizes.split) is not None:
        return None
    value = problem.objective_value(sizes.split)
    if value > sizes.lower_bound:
        return None
    assert value == sizes.lower_bound, f"chunk-size bound {sizes.lower_bound} > value {value}"
    return make_solution(
        OPTIMAL, backend, bound=value, split=[int(s) for s in sizes.split], objective=value
    )


def _better_start(
    problem: StageProblem, hint: list[int] | None, split: list[int] | None
) -> list[int] | None:
    """Of the hint and the chunk-size split, the one within the limits with the smaller
    objective (the hint when neither is within them)."""
    if split is None or problem.violation(split) is not None:
        return hint
    if hint is None or problem.violation(hint) is not None:
        return split
    return split if problem.objective_value(split) < problem.objective_value(hint) else hint


def _placement_hint(
    problem: StageProblem,
    hint: list[int] | None,
    hint_recomputed: list[bool] | None,
    options: dict,
) -> tuple[list[int] | None, list[bool] | None, list[int] | None]:
    """A complete start for a placed problem whose hint has no groups (module
    ``solver.backends.placement_start``): the hint's split placed, or a start of its own."""
    from solver.backends.placement_start import complete_start, placement_start

    if hint is not None:
        return hint, hint_recomputed, complete_start(problem, hint, hint_recomputed)
    limit = 0.1 * options.get("time_limit_s", 10.0)
    start = placement_start(problem, time_limit_s=limit)
    if start is None:
        return None, None, None
    split, groups, recomputed = start
    return split, recomputed, groups
