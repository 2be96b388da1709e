"""Shared by the CP-SAT and MILP formulations: presolve cuts, bounds and solution handling.

Stages are not interchangeable (k_s differs and precedence orders them), so there is no symmetry
to break. Instead, :class:`Presolve` adds cuts that follow from "every stage is non-empty":

  stage ranges   stage(l) <= #layers that are not descendants of l (stages before l need them)
                 stage(l) >= p - 1 - #layers that are not ancestors of l (likewise after l)
  edge span      stage(v) - stage(u) <= 1 + |W_e|, W_e = layers neither ancestors of u nor
                 descendants of v (only they can fill the stages an edge jumps over); on a chain
                 W_e is empty, so no relay variable exists and stage(l+1) <= stage(l) + 1

and valid lower bounds on the objective (:meth:`Presolve.objective_lower_bound`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.backends.problem import (
    FEASIBLE,
    INFEASIBLE,
    OBJECTIVE_MEMORY,
    OPTIMAL,
    UTILIZATION,
    StageProblem,
    StageSolution,
)
from solver.costs import LayerCosts, iteration_floor_ns, utilization_ppm
from solver.costs.stages import split_extra_columns, weight_output_gradients
from solver.errors import InputError


@dataclass(kw_only=True)
class Presolve:
    """What both formulations derive from the problem before building a model (all proven valid)."""

    first_stage: list[int]
    """Smallest stage each layer can take."""
    last_stage: list[int]
    """Largest stage each layer can take."""
    max_span: list[int]
    """Largest stage(v) - stage(u) each edge can have."""
    peak_lb_bytes: int
    """Lower bound on the largest stage peak."""
    peak_ub_bytes: int
    """Upper bound on any stage peak (every layer, edge and relay counted at the largest k;
    no relay with direct sends)."""
    iteration_floor_ns: int
    """Lower bound on the iteration bound (``costs.iteration_floor_ns``; a layer's time on
    its fastest group), ns."""
    iteration_lb_ns: int = 0
    """Lower bound on the iteration bound from elsewhere (``raise_objective_bound``), ns."""

    @classmethod
    def of(cls, problem: StageProblem) -> Presolve:
        costs, num_stages, num_layers = problem.costs, problem.num_stages, problem.num_layers
        ancestors, descendants = _reachability(costs)
        first = [max(0, num_stages - 1 - (num_layers - 1 - a.bit_count())) for a in ancestors]
        last = [min(num_stages - 1, num_layers - 1 - d.bit_count()) for d in descendants]
        spans = []
        for u, v in zip(costs.edge_src.tolist(), costs.edge_dst.tolist(), strict=True):
            blocked = ancestors[u] | descendants[v] | (1 << u) | (1 << v)
            spans.append(min(num_stages - 1, 1 + num_layers - blocked.bit_count()))
        # under selective recomputation: each layer's cheaper state for lower bounds, its dearer
        # one for upper bounds
        state = costs.state_lower_bytes  # without gradients where a peak can precede them
        stored, transient, time_ns = costs.bounding_coefficients(np.minimum)
        stored_ub, transient_ub, _ = costs.bounding_coefficients(np.maximum)
        k = costs.in_flight
        least_k = [min(k[lo : hi + 1], default=max(k)) for lo, hi in zip(first, last, strict=True)]
        min_acts = np.asarray(least_k, dtype=np.int64) * stored
        # summed over ranks: without interleaving each layer's own k, with it the count every
        # rank holds of all its chunks at one of its peaks (LayerCosts.least_held)
        ranks = costs.num_ranks
        spread_acts = min_acts if ranks == num_stages else costs.least_held * stored
        edge_total = int(costs.edge_bytes.sum())
        relay_copies = 0 if costs.direct_sends else max(k)  # the torch runtime relays nothing
        receive_copies, send_copies = costs.most_copies  # (GPipe's backward phase: more)
        if not costs.plain_boundaries:  # a tensor no layer of s counts takes all m buffers
            receive_copies = max(receive_copies, costs.config.num_microbatches)
        # what one stage's layer moments add over its states and k stored micro-batches at
        # least (``costs.layer_moments``): transient_l less the stored bytes of the layers after
        # l that can sit beside it (during(l)), or its last layer's transient (during(last))
        after = np.concatenate((np.cumsum(stored_ub[::-1])[::-1][1:], [0]))
        one_stage_extra = int(max(transient.min(initial=0), (transient - after).max(initial=0)))
        if costs.layer_moment_ranks:
            # interleaved 1F1B: every rank holds least_held of each chunk while one of its
            # chunks runs its largest layer moment, at least its last layer's transient
            one_stage_extra = ranks * int(transient.min(initial=0))
        elif costs.split_backward:  # what runs beside a moment can be less than a transient
            one_stage_extra = 0  # (``schedule.split_action_moments``): no more than none
        elif ranks < num_stages:  # the persistent moment: the largest transient throughout
            one_stage_extra = int(transient.max(initial=0))
        time_ns, tail_ns = costs.time_ns, costs.tail_ns
        if problem.placement is not None:  # a layer's time on its fastest group
            time_ns = np.min([c.time_ns for c in problem.placement.group_costs], axis=0)
            tail_ns = np.min([c.tail_ns for c in problem.placement.group_costs], axis=0)
        return cls(
            first_stage=first,
            last_stage=last,
            max_span=spans,
            # one layer's own stage; the stage total averaged over p stages
            peak_lb_bytes=costs.constant_bytes
            + max(
                int((state + min_acts + transient).max(initial=0)),
                _ceil_div(int(state.sum() + spread_acts.sum()) + one_stage_extra, ranks),
            ),
            peak_ub_bytes=int(
                costs.constant_bytes
                + costs.state_bytes.sum()
                + max(k) * stored_ub.sum()
                + max(int(transient_ub.max(initial=0)), _split_extra_bytes(costs))
                + (0 if costs.step_bytes is None else costs.step_bytes.sum())
                + (receive_copies + send_copies + relay_copies) * edge_total
                + _most_pending_bytes(costs)
            ),
            iteration_floor_ns=iteration_floor_ns(costs, time_ns, tail_ns),
        )

    def objective_lower_bound(self, problem: StageProblem) -> int:
        """A lower bound on the optimum, valid without solving anything."""
        placement = problem.placement
        if problem.objective == OBJECTIVE_MEMORY:
            if placement is not None and placement.memory_objective == UTILIZATION:
                return utilization_ppm(self.peak_lb_bytes, max(placement.capacity_bytes))
            return self.peak_lb_bytes
        return max(self.iteration_lb_ns, self.iteration_floor_ns)

    def raise_objective_bound(self, problem: StageProblem, bound: int) -> None:
        """Take a proven lower bound on the objective (bytes for memory without a placement,
        ns for time): the peak's lower bound, or a cut on the iteration."""
        assert problem.placement is None, "a bound in bytes or ns, not utilization"
        if problem.objective == OBJECTIVE_MEMORY:
            self.peak_lb_bytes = max(self.peak_lb_bytes, min(int(bound), self.peak_ub_bytes))
        else:
            self.iteration_lb_ns = max(self.iteration_lb_ns, int(bound))

    def can_hold(self, layer: int, stage: int) -> bool:
        return self.first_stage[layer] <= stage <= self.last_stage[layer]


def _split_extra_bytes(costs: LayerCosts) -> int:
    """At least what runs beside any moment of a split-backward schedule
    (``stages.split_extras``, both recompute states: a layer's largest column plus every
    positive part the layers beside it can add); 0 on other schedules."""
    if not costs.split_backward:
        return 0
    most = 0
    states = [costs.recompute_mask(None)]
    if costs.selective:
        states.append(costs.recompute_mask([True] * costs.num_layers))
    for mask in states:
        stored, transient, _ = costs.coefficients(mask)
        columns = split_extra_columns(costs, transient, mask)
        running = costs.moment_transient(transient) + columns["own"]
        first = int(np.maximum(columns["grads"] - stored, 0).sum())
        most = max(
            most,
            int(columns["X"].max(initial=0)),
            int(columns["W"].max(initial=0)) + int(np.maximum(columns["End"], 0).sum()),
            int(columns["W1"].max(initial=0)) + int(np.maximum(columns["End1"], 0).sum()),
            int(running.max(initial=0)) + first,
        )
    return most


def _most_pending_bytes(costs: LayerCosts) -> int:
    """The most bytes a split-backward schedule's pending W steps keep on one rank (its most
    pending micro-batches times every layer's larger dY, ``stages.weight_output_gradients``);
    0 on other schedules."""
    most = max(sum(w) for rank in costs.pending_vectors for w in rank)
    if not most:
        return 0
    kept = weight_output_gradients(costs, costs.transient_bytes)
    redone = weight_output_gradients(costs, costs.recompute_transient_bytes)
    output = costs.weight_op_output_grad_bytes
    extra = 0 if output is None else int(output.sum())
    return most * (int(np.maximum(kept, redone).sum()) + extra)


def make_solution(
    status: str,
    backend: str,
    *,
    bound: int,
    split: list[int] | None = None,
    objective: int | None = None,
    groups: list[int] | None = None,
    recomputed: list[bool] | None = None,
) -> StageSolution:
    """A StageSolution; the caller sets wall_s."""
    return StageSolution(
        status=status,
        stage_of_layer=split,
        objective=objective,
        bound=bound,
        wall_s=0.0,
        backend=backend,
        group_of_stage=groups,
        recomputed=recomputed,
    )


def check_hint(
    problem: StageProblem, hint: list[int] | None, hint_groups: list[int] | None = None
) -> None:
    """A hint must name a stage 0..p-1 for every layer (it need not be feasible), and its groups
    (placed problems only) a group 0..K-1 for every stage."""
    if hint_groups is not None:
        if problem.placement is None or hint is None:
            raise InputError("hint groups need a split hint and a heterogeneous problem")
        num_groups = problem.placement.num_groups
        if len(hint_groups) != problem.num_stages or any(
            not 0 <= int(k) < num_groups for k in hint_groups
        ):
            raise InputError(
                f"hint groups must name a group 0..{num_groups - 1} for each of the "
                f"{problem.num_stages} stages, got {hint_groups}"
            )
    if hint is None:
        return
    if len(hint) != problem.num_layers:
        raise InputError(f"hint has {len(hint)} stages for {problem.num_layers} layers")
    if any(not 0 <= int(s) < problem.num_stages for s in hint):
        raise InputError(f"hint stages must be within 0..{problem.num_stages - 1}, got {hint}")


def keep_hint_if_better(
    problem: StageProblem,
    solution: StageSolution,
    hint: list[int] | None,
    hint_recomputed: list[bool] | None = None,
    hint_groups: list[int] | None = None,
) -> StageSolution:
    """A valid hint is a solution too: return it when the solver stopped with nothing better
    (a time limit shorter than presolve, say). The bound stays the solver's."""
    if hint is None or solution.status in (OPTIMAL, INFEASIBLE):
        return solution
    if not problem.selective:
        hint_recomputed = None
    if problem.violation(hint, hint_recomputed, hint_groups) is not None:
        return solution
    value = problem.objective_value(hint, hint_recomputed, hint_groups)
    if solution.objective is not None and solution.objective <= value:
        return solution
    return StageSolution(
        status=FEASIBLE,
        stage_of_layer=[int(s) for s in hint],
        objective=value,
        bound=min(solution.bound, value),
        wall_s=solution.wall_s,
        backend=solution.backend,
        recomputed=(
            None
            if not problem.selective
            else [bool(flag) for flag in (hint_recomputed or [False] * problem.num_layers)]
        ),
        group_of_stage=None if hint_groups is None else [int(k) for k in hint_groups],
    )


def split_from_prefix(prefix_values: list[list[float]], num_stages: int) -> list[int]:
    """stage(l) = #{s : y[l][s] < 1/2}, which is (p - 1) - sum_s y[l][s] for monotone y."""
    if num_stages == 1:
        return [0] * len(prefix_values)
    return [sum(1 for value in row if value < 0.5) for row in prefix_values]


def _reachability(costs: LayerCosts) -> tuple[list[int], list[int]]:
    """Strict ancestors and descendants of every layer, as bit sets (bit i = layer i)."""
    n = costs.num_layers
    parents: list[list[int]] = [[] for _ in range(n)]
    children: list[list[int]] = [[] for _ in range(n)]
    for u, v in zip(costs.edge_src.tolist(), costs.edge_dst.tolist(), strict=True):
        parents[v].append(u)
        children[u].append(v)
    order = _topological_order(parents, children)
    ancestors, descendants = [0] * n, [0] * n
    for v in order:
        for u in parents[v]:
            ancestors[v] |= ancestors[u] | (1 << u)
    for u in reversed(order):
        for v in children[u]:
            descendants[u] |= descendants[v] | (1 << v)
    return ancestors, descendants


def _topological_order(parents: list[list[int]], children: list[list[int]]) -> list[int]:
    """Positions are topological for a validated graph; this does not rely on it."""
    missing = [len(p) for p in parents]
    ready = [layer for layer, count in enumerate(missing) if count == 0]
    order = []
    while ready:
        u = ready.pop()
        order.append(u)
        for v in children[u]:
            missing[v] -= 1
            if missing[v] == 0:
                ready.append(v)
    if len(order) != len(parents):
        raise InputError("the layer graph has a cycle")
    return order


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
