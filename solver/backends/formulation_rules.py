"""The constraint families of the prefix formulation (``formulation.py``), one ``_add_<rule>``
each with its formula: the split's structure, the placement on node groups, memory, time."""

from __future__ import annotations

import itertools

import numpy as np

from solver.backends.problem import (
    OBJECTIVE_TIME,
)
from solver.costs import (
    PPM,
    bound_terms,
)


class FormulationRules:
    """The ``_add_<rule>`` builders of :class:`solver.backends.formulation.PrefixFormulation` (a
    mixin: it adds rows through the formulation's backend methods and expressions)."""

    # -- the split: stage ranges, prefix order, precedence, relays, transients ----------------

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
        under selective); without interleaving only where a moment after a backward can set
        the peak (``costs.after_moments``; every other moment is ``_layer_rows``')."""
        costs = self.costs
        if not self.vars.transient:
            return
        for rank, s in self._rank_stages():
            if not costs.rank_rows and not costs.after_moments[rank]:
                continue
            self._tick()
            largest = self.vars.transient[rank]
            # without interleaving tr[r] is the moment after a backward's (less FSDP2's gathers)
            after = costs.config.virtual_stages == 1
            kept_all = costs.transient_bytes
            kept_all = costs.after_transient(kept_all) if after else kept_all
            again = costs.recompute_transient_bytes
            again_all = costs.after_transient(again) if after and again is not None else again
            for layer in self._layers_of(s):
                kept = kept_all[layer]
                extra = again_all[layer] - kept
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

    # -- placement on node groups -------------------------------------------------------------

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

    # -- memory -------------------------------------------------------------------------------

    def _add_stage_memory(self) -> None:
        """peak >= each of the stage's layer moments (``_layer_rows``); with interleaving,
        per rank and in-flight vector, the sum over its chunks of states_c + n_c stored_c +
        buffers_c + n_c relay_c, + tr[r]; with a placement
        sum_k P[s][k] >= that, and peak >= P[s][k] (absolute) or the utilization rows."""
        if self.placement is None:
            costs = self.costs
            for rank, vectors in enumerate(costs.in_flight_vectors):
                for i, row in enumerate(self._optimizer_step_rows(rank)):
                    self._add(self.vars.peak >= row, f"memory_s{rank}_step{i}")
                if not costs.rank_rows:
                    for i, row in enumerate(self._layer_rows(rank)):
                        self._add(self.vars.peak >= row, f"memory_s{rank}_b{i}")
                    continue
                running = [-1] * len(vectors)  # the rank's largest transient, tr[r]
                if costs.layer_moment_ranks:
                    running = costs.running_chunks[rank]
                extras = costs.split_extras[rank] if costs.split_extras else None
                rows = zip(
                    vectors,
                    costs.backwards_done[rank],
                    costs.pending_vectors[rank],
                    costs.grads_started[rank],
                    running,
                    costs.copies_of_moments(rank),
                    extras or [("", -1)] * len(vectors),
                    strict=True,
                )
                for i, (vector, done, pending, started, chunk, at, extra) in enumerate(rows):
                    self._tick()
                    suffix = f"_n{i}" if len(vectors) > 1 else ""
                    row = self._rank_bytes_from_parts(
                        rank, vector, done, pending, started, chunk, copies=at, extra=extra
                    )
                    self._add(self.vars.peak >= row, f"memory_s{rank}{suffix}")
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

    # -- time ---------------------------------------------------------------------------------

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
