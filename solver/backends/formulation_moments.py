"""The layer moments of a stage without interleaving (``costs.layer_moments``) as rows of the
prefix formulation (``formulation.py``), built only where a moment can bind.

With c_l = stored_l (- grad_l where gradients appear at the first backward) and E_s the stage's
end-of-forward moment less its transient,

  E_s       = states_s + k_s stored_s + k_s relay_s + buffers_s(k_s) (- grads up to l, late)
  during(l) = E_s - sum_{j > l on s} c_j + transient_l (+ own_l where late: l's own gradients,
              ``LayerCosts.late_own``; every transient_l below takes it)
  peak     >= E_s + T_s,   T_s >= during(l) - E_s for every layer l that can sit on s

T_s takes the place the persistent moment's largest transient tr[s] had (E_s + max transient),
so the model keeps its size: one T row per (l, s) pair of a few terms. Each row reads only what
its moment can depend on. On a chain (every edge (i, i+1) from l on exists: a stage holds
consecutive layers) layer l's moment is below layer j's whenever both sit on s and

  transient_l <= transient_j + sum_{l < i <= j} c_i          (the smallest j > l: l + r)

(bounds over both recompute states under selective). Then during(l) binds only when l is among
the last r layers of s, and its row is exact with the r - 1 layers between and j alone:

  r = 1:  T_s >= transient_l (y[l][s] - y[l+1][s])           (l is the stage's last layer)
  r > 1:  T_s >= transient_l x[l][s] - sum_{l < i < l+r} c_i x[i][s] - M_l x[l+r][s]
          M_l = max(0, transient_l - sum_{l < i < l+r} c_i)  (the row is <= 0 once l+r sits on s)

(+ d_transient_l z[l][s] - max(d_transient_l, 0) x[l+1][s], and - d_stored_i z[i][s], under
selective). A layer j that cannot sit on s ends the window without an M term. Every row is
valid at every placement: where l is not on s it is at most 0 <= T_s (c_i >= 0 in the window),
and where j sits on s at most during(j) - E_s. A layer whose window would be longer than
``WINDOW_MAX``, hold a negative c, or leave the chain's order (a DAG) keeps the exact running
sum of the general model: B_s >= E_s less one micro-batch, D[l][s] >= D[l'][s] + sum c_i x[i][s]
(l' the previous such layer), peak >= B_s + D[l][s] + transient_l x[l][s].

On a stage that can hold the last layer the moments before it hold H more, the output the torch
pipeline keeps (``LayerCosts.moment_transient``): the transients' bounds take + H, and a row that
can bind with the last layer on s (a window reaching the graph's end, a running-sum row) takes
+ H (x[l][s] + x[last][s] - 1), <= 0 where either is elsewhere; a closed row binds only where
l + r, hence the last layer (a stage holds consecutive layers from l on), sits elsewhere.

Interleaved ranks (``LayerCosts.layer_moment_ranks``) take the same rows per virtual stage j,
with c_l = stored_l (every gradient exists): T_j >= transient_l - stored_j(> l), the running
chunk's largest layer moment over its micro-batch kept whole (``stages.chunk_moment``), which
joins each of the rank's rows where chunk j runs (``formulation_terms._rank_bytes_from_parts``).
A layer that needs the running sum takes it against K_j, the virtual stage's stored bytes as an
equality (so it may carry a minus sign):

  K_j == sum_i stored_i x[i][j] (+ d_stored_i z[i][j]),   D[l][j] >= D[l'][j] + sum c_i x[i][j]
  T_j >= D[l][j] + transient_l x[l][j] (+ d_transient_l z[l][j]) - K_j

Measured (CP-SAT, memory objective, no hint, bench_search's chains): docs/cost-model.md,
"Transient peak".
"""

from __future__ import annotations

from typing import Any

import numpy as np

WINDOW_MAX = 8
"""Most layers a moment's row reads after its own layer (``FormulationMoments._window``); a
longer window takes the running sum instead."""


class FormulationMoments:
    """The layer-moment rows of :class:`solver.backends.formulation.PrefixFormulation` (a
    mixin: it reads the formulation's problem, presolve, variables, terms and backend)."""

    def _layer_rows(self, stage: int) -> list:
        """``costs.layer_moments`` of stage s (no interleaving) as expressions the peak is at
        least (module docstring): E_s + T_s, the running-sum moments of the layers that need
        them, and the moments after a backward (``costs.after_moments``: after the first where
        gradients appear then; torch GPipe's backward phase)."""
        costs = self.costs
        k = costs.in_flight[stage]
        late = costs.first_backward_peak[stage]
        grads = costs.late_column(stage) if late else np.zeros_like(costs.grad_bytes)
        bounds = self._moment_bounds(late, stage)
        t_ub = bounds[3]
        top = self._new_var(0, self._bytes(int(t_ub.max(initial=0))), f"T_s{stage}")
        self._moment_tops[stage] = top
        ends = self._rank_bytes(stage, (k,), relays_held=k, copies_held=k, transient=False)
        ends = self._sum(
            [ends]
            + [
                -self._bytes(int(grads[i])) * self._member(i, stage)
                for i in self._layers_of(stage)
                if grads[i]
            ]
        )
        rows = [self._sum([ends, top])]
        running = self._windowed_moments(stage, top, bounds, grads, "s")
        if running:
            rows += self._running_rows(stage, running, grads)
        for h, done in costs.after_moments[stage]:  # after a backward: every gradient, h held
            rows.append(
                self._rank_bytes(stage, (h,), relays_held=h, copies_held=h, copies_done=done)
            )
        return rows

    def _windowed_moments(self, stage: int, top, bounds, grads, tag: str) -> list[int]:
        """``top`` at least the windowed row of every layer of (virtual) stage ``stage`` whose
        moment can be positive; the layers with no window, whose rows the caller adds as running
        sums."""
        t_ub = bounds[3]
        running = []
        for layer in self._layers_of(stage):
            self._tick()
            window = self._window(layer, stage, bounds)
            if window is None:
                running.append(layer)
            elif t_ub[layer] > 0:
                row = self._window_row(layer, stage, window, bounds, grads)
                self._add(top >= row, f"moment_l{layer}_{tag}{stage}")
        return running

    def _chunk_top(self, stage: int):
        """T_j of virtual stage j of an interleaved rank (module docstring): a variable at
        least every layer's moment over the chunk's micro-batch kept whole, built once."""
        top = self._moment_tops.get(stage)
        if top is not None:
            return top
        bounds = self._moment_bounds(False, stage)
        t_ub = bounds[3]
        top = self._new_var(0, self._bytes(int(t_ub.max(initial=0))), f"T_v{stage}")
        self._moment_tops[stage] = top
        grads = np.zeros_like(self.costs.grad_bytes)
        running = self._windowed_moments(stage, top, bounds, grads, "v")
        if running:
            self._chunk_running_rows(stage, top, running)
        return top

    def _chunk_running_rows(self, stage: int, top, layers: list[int]) -> None:
        """The running-sum rows of ``layers`` on virtual stage j (module docstring):
        K_j == its stored bytes, D[l][j] >= D[l'][j] + sum c_i x[i][j],
        T_j >= D[l][j] + transient_l x[l][j] - K_j."""
        costs = self.costs
        stored_ub, _, _ = costs.bounding_coefficients(np.maximum)
        high = self._bytes(int(stored_ub.sum()))
        recompute = dict(self._stage_recompute[stage])
        extra_stored = costs.recompute_stored_bytes - costs.stored_bytes
        extra_transient = costs.recompute_transient_bytes - costs.transient_bytes

        def stored_terms(layer: int) -> list:
            terms = [self._bytes(int(costs.stored_bytes[layer])) * self._member(layer, stage)]
            z = recompute.get(layer)
            if z is not None and extra_stored[layer]:
                terms.append(self._bytes(int(extra_stored[layer])) * z)
            return terms

        total = self._new_var(0, high, f"K_v{stage}")
        self._add(
            total == self._sum(t for i in self._layers_of(stage) for t in stored_terms(i)),
            f"chunk_k_v{stage}",
        )
        wanted, previous, terms, sums = set(layers), 0, [], []
        for layer in self._layers_of(stage):
            if layer > layers[-1]:
                break
            terms += stored_terms(layer)
            if layer not in wanted:
                continue
            running = self._new_var(0, high, f"D_l{layer}_v{stage}")
            self._add(running >= self._sum([previous, *terms]), f"chunk_d_l{layer}_v{stage}")
            sums.append((layer, running))
            row = [running, -total, self._bytes(int(costs.transient_bytes[layer]))
                   * self._member(layer, stage)]  # fmt: skip
            row += self._held_output_term(layer, stage)
            z = recompute.get(layer)
            if z is not None and extra_transient[layer]:
                row.append(self._bytes(int(extra_transient[layer])) * z)
            self._add(top >= self._sum(row), f"chunk_moment_l{layer}_v{stage}")
            previous, terms = running, []
        self._chunk_sums[stage] = (total, sums)

    def _moment_bounds(self, late: bool, stage: int) -> tuple[np.ndarray, ...]:
        """(c lower, c upper, transient lower, transient upper) per layer over both recompute
        states, c = stored (- grad where ``late``); the transients as stage s's moments take
        them where s can hold the last layer (``_held_output``)."""
        costs = self.costs
        stored_lb, transient_lb, _ = costs.bounding_coefficients(np.minimum)
        stored_ub, transient_ub, _ = costs.bounding_coefficients(np.maximum)
        grads = costs.late_column(stage) if late else 0
        if self._held_output(stage):
            transient_lb = costs.moment_transient(transient_lb)
            transient_ub = costs.moment_transient(transient_ub)
        own = costs.late_own(stage)  # l's own gradients at a first backward's moment
        return stored_lb - grads, stored_ub - grads, transient_lb + own, transient_ub + own

    def _held_output(self, stage: int) -> int:
        """``costs.held_output_bytes`` where stage s can hold the model's last layer, else 0."""
        last = self.problem.num_layers - 1
        held = self.costs.held_output_bytes
        return held if held and self.presolve.can_hold(last, stage) else 0

    def _held_output_term(self, layer: int, stage: int) -> list:
        """The output held at layer l's moment on stage s (``costs.moment_transient``):
        held x[l][s] x[last][s], linear as held (x[l][s] + x[last][s] - 1), which is <= 0 where
        either is elsewhere; none at the last layer."""
        last = self.problem.num_layers - 1
        held = self._held_output(stage)
        if not held or layer == last:
            return []
        both = self._member(layer, stage) + self._member(last, stage) - 1
        return [self._bytes(held) * both]

    def _ordered_from(self) -> np.ndarray:
        """ordered[l]: every edge (i, i+1) with i >= l exists, so a stage's layers from l on are
        consecutive (precedence: stage(i) <= stage(i+1))."""
        ordered = self._ordered
        if ordered is None:
            num_layers = self.problem.num_layers
            feeds_next = np.zeros(num_layers, dtype=bool)
            feeds_next[-1] = True
            for u, v in self.edges:
                if v == u + 1:
                    feeds_next[u] = True
            ordered = np.logical_and.accumulate(feeds_next[::-1])[::-1]
            self._ordered = ordered
        return ordered

    def _window(self, layer: int, stage: int, bounds: tuple) -> tuple[int, bool] | None:
        """(r, closed) of layer l's row on stage s (module docstring): l + r is the first layer
        whose moment is above l's whenever both sit on s (closed: an M term), or the first that
        cannot sit on s or the end of the graph (not closed); None where l needs the running
        sum."""
        if not self._ordered_from()[layer]:
            return None
        c_lb, _, t_lb, t_ub = bounds
        total = 0
        for r in range(1, WINDOW_MAX + 1):
            j = layer + r
            if j >= self.problem.num_layers or not self.presolve.can_hold(j, stage):
                return r, False
            total += int(c_lb[j])
            if t_ub[layer] <= t_lb[j] + total:
                return r, True
            if c_lb[j] < 0:  # j would be inside the window with a negative coefficient
                return None
        return None

    def _window_row(
        self, layer: int, stage: int, window: tuple[int, bool], bounds: tuple, grads: np.ndarray
    ):
        """The right-hand side of layer l's T_s row (module docstring)."""
        costs, (r, closed) = self.costs, window
        c_lb, _, _, t_ub = bounds
        member, recompute = self._member, self.vars.recompute_member
        extra_stored = costs.recompute_stored_bytes - costs.stored_bytes
        extra_transient = costs.recompute_transient_bytes - costs.transient_bytes
        between = range(layer + 1, layer + r)
        kept = int(costs.transient_bytes[layer] + costs.late_own(stage)[layer])
        z = recompute.get((layer, stage))
        rise = int(extra_transient[layer]) if z is not None else 0
        if r == 1 and closed:
            last = self._y(layer, stage) - self._y(layer + 1, stage)
            terms = [self._bytes(kept) * last]
            if rise > 0:
                terms.append(-self._bytes(rise) * member(layer + 1, stage))
        else:
            terms = [self._bytes(kept) * member(layer, stage)]
            if closed:
                slack = max(0, int(t_ub[layer]) - sum(int(c_lb[i]) for i in between))
                terms.append(-self._bytes(slack) * member(layer + r, stage))
        if rise:
            terms.append(self._bytes(rise) * z)
        if not closed:  # a closed row binds only where l + r, hence the last layer, is elsewhere
            terms += self._held_output_term(layer, stage)
        for i in between:
            c = int(costs.stored_bytes[i] - grads[i])
            terms.append(-self._bytes(c) * member(i, stage))
            z_i = recompute.get((i, stage))
            if z_i is not None and extra_stored[i]:
                terms.append(-self._bytes(int(extra_stored[i])) * z_i)
        return self._sum(terms)

    def _running_rows(self, stage: int, layers: list[int], grads: np.ndarray) -> list:
        """The running-sum moments of ``layers`` on stage s (module docstring):

        B_s     >= states_s + (k-1) stored_s + k relay_s + buffers_s(k)
        D[l][s] >= D[l'][s] + sum_{l' < i <= l} (c_i x[i][s] + d_stored_i z[i][s])
        peak    >= B_s + D[l][s] + transient_l x[l][s] (+ d_transient_l z[l][s])"""
        costs = self.costs
        k = costs.in_flight[stage]
        stored_ub, _, _ = costs.bounding_coefficients(np.maximum)
        base = self._new_var(0, self._bytes(self.presolve.peak_ub_bytes), f"B_s{stage}")
        base_terms = self._rank_bytes(
            stage, (k - 1,), relays_held=k, copies_held=k, transient=False
        )
        self._add(base >= base_terms, f"layer_base_s{stage}")
        self._layer_sums[stage] = (base, [])
        recompute = dict(self._stage_recompute[stage])
        extra_stored = costs.recompute_stored_bytes - costs.stored_bytes
        extra_transient = costs.recompute_transient_bytes - costs.transient_bytes
        low, high = -self._bytes(int(grads.sum())), self._bytes(int(stored_ub.sum()))
        wanted, rows, previous, terms = set(layers), [], 0, []
        for layer in self._layers_of(stage):
            if layer > layers[-1]:
                break
            member, z = self._member(layer, stage), recompute.get(layer)
            terms.append(self._bytes(int(costs.stored_bytes[layer] - grads[layer])) * member)
            if z is not None and extra_stored[layer]:
                terms.append(self._bytes(int(extra_stored[layer])) * z)
            if layer not in wanted:
                continue
            running: Any = self._new_var(low, high, f"D_l{layer}_s{stage}")
            self._add(running >= self._sum([previous, *terms]), f"layer_d_l{layer}_s{stage}")
            self._layer_sums[stage][1].append((layer, running))
            own = int(costs.late_own(stage)[layer])  # at a first backward's moment
            row = [base, running, self._bytes(int(costs.transient_bytes[layer]) + own) * member]
            row += self._held_output_term(layer, stage)
            if z is not None and extra_transient[layer]:
                row.append(self._bytes(int(extra_transient[layer])) * z)
            rows.append(self._sum(row))
            previous, terms = running, []
        return rows
