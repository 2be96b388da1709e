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
  T[s] >= during(l) - E[s]           layer l's moment over the stage's end of forward, read
                                     from a window of the layers after l (``formulation_moments``)
  torch runtime (``LayerCosts.direct_sends``: each tensor goes straight to every consuming
  stage, no r), for a tensor T that can skip a stage (``_received``, ``_sent``):
  rv[T][s] >= y[u][s-1] + x[v][s] - 1  s receives T: stage(u) < s = stage(v) for an edge (u, v)
  sd[T][s] >= x[u][s] - y[v][s]        s sends T: stage(u) = s < stage(v) for an edge (u, v)
                                     (both replace ct[T][s-1], ct[T][s] in the memory rows)

  monotone     y[l][s] <= y[l][s+1]
  precedence   y[v][s] <= y[u][s]                          stage(u) <= stage(v)
  non-empty    sum_l x[l][s] >= 1
  memory       peak >= sum_l (state_l + k_s stored_l) x[l][s] + T[s]
                       + sum_T eb_T (R_s ct[T][s-1] + S_s ct[T][s]) + k_s sum_T eb_T r[T][s]
               (R_s, S_s: boundary copies of the cost model; a relayed edge is received and sent;
               ``costs.layer_moments``: layer l of one micro-batch running beside k_s - 1 whole,
               as rows: ``formulation_moments``)
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
  memory       peak >= sum_c [ S_c + n_c A_c + R(n_c) In_c + S(n_c) Out_c ] + T_{s_c'}
               (c for s_c = r + c p; R, S: ``LayerCosts.copies_at``), for every kept moment
               (n, B, c') of r (``LayerCosts.running_chunks``: chunk c' runs, none: no T)
  moment       T_s >= transient_l - sum_{i > l on s} stored_i   per layer l that can sit on s,
               windowed rows as without interleaving (``formulation_moments._chunk_top``)
  (split-backward schedules: + tr[r] instead, tr[r] >= transient_l x[l][s_c], every chunk c)
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
  transient    tr[r], T[s] rows + d_transient_l z[l][s] (``formulation_moments``)
  time         Ts[s] >= sum_l time_l x[l][s] + d_time_l z[l][s]
so "none" (rc = 0) and "full" (rc = 1) are both feasible choices of the same model. With a
placement the same z terms enter the placed memory rows (``_layer_rows`` is shared) and every
group's time rows: T >= sum_l time_l^k x[l][s] + d_time_l^k z[l][s] - M^k (1 - g[s][k]), with
M^k = sum_l max(time_l^k, recompute_time_l^k).

Gradients that appear at the first backward (``LayerCosts.first_backward_peak``, step lifetime):
the moments take off the gradients up to l (c_l = stored_l - grad_l in ``formulation_moments``).
The moments after a backward (``LayerCosts.after_moments``: after that first backward, k - 1
held; torch GPipe's backward phase at m - 1 and 1 held, its sends kept): one row each,
peak >= the stage at h held with every gradient, the copies after k - h backwards, + tr[s],
with tr[s] >= transient_l x[l][s] (``_add_transient``).

Size: the layer moments keep the persistent moment's model (k_s stored_s + tr[s]) where every
layer's window is one layer (a transformer chain): one T[s] per stage in place of tr[s], one row
per (l, s) pair; a layer that needs the running sum adds a variable and two rows. Measured:
docs/cost-model.md, "Transient peak".

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
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from solver.backends.formulation_hints import FormulationHints
from solver.backends.formulation_moments import FormulationMoments
from solver.backends.formulation_rules import FormulationRules
from solver.backends.formulation_split import FormulationSplit
from solver.backends.formulation_terms import FormulationTerms
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


MAX_FORMULATION_CELLS = 2**20
"""Most layers x (virtual) stages a CP-SAT or MILP model is built for: y[l][s] and the rows over
them are Python objects of about 1 KiB each, so 2^20 cells take a GiB or two before the solver
sees them (and minutes to build). A larger problem is not built: its hint stands, unproven."""
MAX_FORMULATION_LAYERS = 2**14
"""Most layers a model is built for whatever the stages: the presolve's reachability sets take
L^2 / 8 bytes (32 MiB here; a 200,000-layer chain would take 5 GB)."""


def formulation_fits(num_layers: int, num_stages: int) -> bool:
    """The CP-SAT / MILP model of a problem of this size is within ``MAX_FORMULATION_CELLS``
    and ``MAX_FORMULATION_LAYERS`` (else ``solve_problem`` keeps the hint without building
    it)."""
    return num_layers <= MAX_FORMULATION_LAYERS and num_layers * num_stages <= MAX_FORMULATION_CELLS


def formulation_size_text(num_layers: int, num_stages: int) -> str:
    """Why a model is too large to build, with the numbers (``formulation_fits``)."""
    return (
        f"{num_layers} layers x {num_stages} stages = {num_layers * num_stages} stage variables "
        f"(the CP-SAT/MILP model holds at most {MAX_FORMULATION_CELLS} = 2^20, and at most "
        f"{MAX_FORMULATION_LAYERS} layers)"
    )


class BuildTimeUp(Exception):
    """The time limit ran out while the model was being built (``PrefixFormulation.stop_at``)."""


class PrefixFormulation(
    FormulationRules,
    FormulationTerms,
    FormulationMoments,
    FormulationSplit,
    FormulationHints,
    abc.ABC,
):
    """The model of the module docstring; a subclass creates ``self.model`` and calls
    :meth:`_build`. Here: the solve, the backend's methods, the variables and the objective;
    the expressions (``formulation_terms``), the ``_add_<rule>`` builders
    (``formulation_rules``) and the hints (``formulation_hints``) are its mixins."""

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
        self._split_parts: dict[tuple[str, int], Any] = {}  # ("lean" | "pending", stage)
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
        self._layer_sums: dict[int, tuple[Any, list[tuple[int, Any]]]] = {}
        """Per stage s without interleaving whose layers need the running sum: (B_s, [(l,
        D[l][s])]) (``formulation_moments``; hints)."""
        self._moment_tops: dict[int, Any] = {}
        """T_s per stage without interleaving, T_j per virtual stage of an interleaved rank
        (``formulation_moments``; hints)."""
        self._chunk_sums: dict[int, tuple[Any, list[tuple[int, Any]]]] = {}
        """Per virtual stage j of an interleaved rank whose layers need the running sum: (K_j,
        [(l, D[l][j])]) (``formulation_moments._chunk_running_rows``; hints)."""
        self._ordered: np.ndarray | None = None
        """Per layer: a chain from it on (``FormulationMoments._ordered_from``)."""

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
        if not formulation_fits(problem.num_layers, problem.num_stages):
            # bounded memory: no model, the hint (if valid) stands
            solution = make_solution(UNKNOWN, cls.backend_of(options), bound=0)
            solution = keep_hint_if_better(problem, solution, hint, hint_recomputed, hint_groups)
            solution.wall_s = time.perf_counter() - start
            return solution
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
            # tr[r]: split-backward ranks and the moment after a first backward (_add_transient)
            # (split-backward ranks take what runs per moment instead: formulation_split)
            persistent = costs.rank_rows and not costs.layer_moment_ranks
            persistent = persistent and not costs.split_backward
            if top and (persistent or any(costs.after_moments)):
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
        self._add_excluded()
        if self.needs_memory:
            self._add_relay()
            self._add_transient()
            self._add_stage_memory()
            self._add_capacity()
        if self.needs_time:
            self._add_stage_time()
            self._add_iteration_budget()
            self._add_iteration_bound()

    def _add_excluded(self) -> None:
        """Each cut-off assignment (``problem.excluded``: split, recompute flags, groups) as a
        no-good row: at least one of its binary variables (y, rc, g) takes the other value."""
        for k, (split, flags, groups) in enumerate(self.problem.excluded):
            self._tick()
            terms = [
                1 - y if split[layer] <= s else y
                for layer, row in enumerate(self.vars.prefix)
                for s, y in enumerate(row)
            ]
            if self.problem.selective:
                terms += [
                    1 - rc if flags is not None and flags[layer] else rc
                    for layer, rc in enumerate(self.vars.recompute)
                ]
            if self.placement is not None and groups is not None:
                terms += [
                    1 - g if groups[s] == group else g
                    for s, row in enumerate(self.vars.group)
                    for group, g in enumerate(row)
                ]
            self._add(self._sum(terms) >= 1, f"cut_{k}")

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
