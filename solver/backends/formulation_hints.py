"""Start values of the prefix formulation (``formulation.py``): a split, its recompute flags and
its stage groups set as a hint on every variable they determine."""

from __future__ import annotations

import numpy as np

from solver.costs import (
    PPM,
    boundary_bytes,
    direct_buffer_adjustments,
    iteration_bound_ns,
    stage_buffer_bytes,
    stage_costs,
)
from solver.costs.stages import output_gradient_consumers, pending_gradients


class FormulationHints:
    """The hints of :class:`solver.backends.formulation.PrefixFormulation` (a mixin: it sets
    the formulation's variables through its ``_hint``)."""

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
        self._hint_layer_sums(stage_of_layer, recomputed, stages)
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

    def _split_sums(self, stage_of_layer: list[int], recomputed: list[bool] | None) -> tuple:
        """What the hints of a split's sums read: the stage of each layer (an array), each
        layer's stored bytes (with the split's recompute flags under selective) and the bytes
        into, out of and relayed by each stage (``costs.boundary_bytes``)."""
        stage_of = np.asarray(stage_of_layer)
        stored, _, _ = self.costs.coefficients(recomputed if self.problem.selective else None)
        return (stage_of, stored, *boundary_bytes(self.costs, stage_of))

    def _hint_parts(self, stage_of_layer: list[int], recomputed: list[bool] | None) -> None:
        """The exact sums of ``_stage_parts`` for a split (interleaving only)."""
        if not self._parts:
            return
        costs = self.costs
        stage_of, stored, into, out_of, relayed = self._split_sums(stage_of_layer, recomputed)
        for stage, (states, kept, received, sent) in self._parts.items():
            here = stage_of == stage
            self._hint(states, self._bytes(int(costs.state_bytes[here].sum())))
            self._hint(kept, self._bytes(int(stored[here].sum()) + int(relayed[stage])))
            self._hint(received, self._bytes(int(into[stage])))
            self._hint(sent, self._bytes(int(out_of[stage])))
        if self._split_parts:
            _, transient, _ = costs.coefficients(recomputed if self.problem.selective else None)
            lean = costs.state_bytes - costs.grad_bytes
            pending = pending_gradients(costs, stage_of, transient)
            for (name, stage), part in self._split_parts.items():
                value = pending[stage] if name == "pending" else lean[stage_of == stage].sum()
                self._hint(part, self._bytes(int(value)))
            nearest, _ = output_gradient_consumers(costs)
            for (layer, stage), held in self.__dict__.get("_kept_outputs", {}).items():
                kept = stage_of[layer] == stage and stage_of[nearest[layer]] == stage
                self._hint(held, int(kept))

    def _hint_layer_sums(
        self, stage_of_layer: list[int], recomputed: list[bool] | None, stages: list
    ) -> None:
        """The exact T_s, B_s and D[l][s] of ``formulation_moments`` for a split (T_j, K_j and
        D[l][j] of an interleaved rank's virtual stages)."""
        if not self._moment_tops:
            return
        costs = self.costs
        stage_of, stored, into, out_of, relayed = self._split_sums(stage_of_layer, recomputed)
        _, transient, _ = costs.coefficients(recomputed if self.problem.selective else None)
        adjust = direct_buffer_adjustments(costs, stage_of)
        for stage, top in self._moment_tops.items():
            here = np.flatnonzero(stage_of == stage)
            late = costs.first_backward_peak[stage]
            c = stored[here] - (costs.late_column(stage)[here] if late else 0)
            after = c.sum() - np.cumsum(c)  # c of the layers after each
            # max_l during(l) - E_s, at most T_s's bound (the running sums hold the rest), with
            # the output held on the last layer's stage (costs.moment_transient)
            running = costs.moment_transient(transient, costs.num_layers - 1 in here)
            running = running + costs.late_own(stage)  # l's own gradients, where late
            largest = self._moment_bounds(late, stage)[3].max(initial=0)
            top_value = min(int((running[here] - after).max(initial=0)), int(largest))
            self._hint(top, self._bytes(top_value))
            if stage in self._chunk_sums:  # an interleaved chunk's K_j and D[l][j]
                total, sums = self._chunk_sums[stage]
                before = np.concatenate(([0], np.cumsum(stored[here])))
                self._hint(total, self._bytes(int(before[-1])))
                for layer, variable in sums:
                    up_to = np.searchsorted(here, layer, "right")
                    self._hint(variable, self._bytes(int(before[up_to])))
            if stage not in self._layer_sums:
                continue
            base, runnings = self._layer_sums[stage]
            k = costs.in_flight[stage]
            value = (
                int(costs.state_bytes[here].sum())
                + (k - 1) * int(stored[here].sum())
                + k * int(relayed[stage])
                + stage_buffer_bytes(costs, stage, k, 0, into, out_of, adjust)
                + costs.constant_bytes
            )
            self._hint(base, self._bytes(value))
            before = np.concatenate(([0], np.cumsum(c)))
            for layer, variable in runnings:
                up_to = np.searchsorted(here, layer, "right")  # the stage's layers <= l
                self._hint(variable, self._bytes(int(before[up_to])))

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
