"""What runs beside a split-backward moment's counts (``costs.split_rows``: kind and chunk,
``schedule.split_action_moments``) as variables of the prefix formulation (``formulation.py``),
each at least its ``stages.split_extras`` value on every split and equal to it at the optimum
(a row of the rank's moment adds the running chunk j's variable; ``formulation_terms.
_rank_bytes_from_parts``). Per virtual stage j, over the layers that can sit on it in order
(x[l][j] member, z[l][j] recomputed, each column a + d z in its two recompute states,
``stages.split_extra_columns``):

  "T"  T_j, the chunk's largest layer moment (``formulation_moments._chunk_top``)
  "I"  I_j >= X_l x[l][j] + d_X_l z[l][j]
  "W"  W_j >= D[l][j] + (W_l + M_l) x[l][j] + d_W_l z[l][j] - M_l,
       D[l][j] >= D[l'][j] + End_l' x[l'][j] + d_End_l' z[l'][j]  (l' the previous layer)
       D: what the chunk's earlier layers' weight steps left (a running sum from 0, which can
       fall); M_l >= D[l][j]'s largest value, so the row is <= 0 <= W_j where l sits elsewhere
  "V"  the same of the first weight step's columns (W1, End1)
  "G"  G_j >= E[l][j] + (a_l + M_l) x[l][j] + d_a_l z[l][j] - M_l + H (x[l][j] + x[last][j] - 1),
       E[l][j] >= E[l''][j] + (grads_l'' - stored_l'') x[l''][j] - d_stored_l'' z[l''][j]
       (l'' the next layer; a running sum from the back), a_l = transient_l + own_l, H the
       output the torch pipeline keeps (``LayerCosts.moment_transient``); the row with l's
       gradients less its own: the lean states of the moment's row leave chunk j's out

A variable is built once per (kind, j).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from solver.costs.stages import split_extra_columns


class FormulationSplit:
    """The split-backward extras of :class:`solver.backends.formulation.PrefixFormulation` (a
    mixin: it reads the formulation's problem, presolve, variables, terms and backend)."""

    def _split_extra(self, kind: str, stage: int):
        """The variable of ``kind`` ("T", "G", "I", "W", "V") of virtual stage ``stage``
        (module docstring)."""
        if kind == "T":
            return self._chunk_top(stage)
        key = (f"extra_{kind}", stage)
        if key not in self._split_parts:
            build = {"I": self._input_extra, "G": self._first_backward_extra}.get(kind)
            if build is None:
                first = kind == "V"
                self._split_parts[key] = self._weight_extra(stage, first)
            else:
                self._split_parts[key] = build(stage)
        return self._split_parts[key]

    def _split_columns(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(a, d) per column name: the value in the default recompute state and what a
        recomputed layer (selective: z[l][s]) adds."""
        cached = getattr(self, "_split_columns_cache", None)
        if cached is not None:
            return cached
        costs = self.costs
        mask = costs.recompute_mask(None)
        _, transient, _ = costs.coefficients(mask)
        base = split_extra_columns(costs, transient, mask)
        if costs.selective:
            every = costs.recompute_mask([True] * costs.num_layers)
            _, again, _ = costs.coefficients(every)
            other = split_extra_columns(costs, again, every)
            delta = {name: other[name] - base[name] for name in base}
        else:
            delta = {name: np.zeros_like(base[name]) for name in base}
        self._split_columns_cache = (base, delta)
        return base, delta

    def _with_recompute(self, layer: int, stage: int, value: int, delta: int) -> list:
        """value x[l][s] (+ delta z[l][s] where l can be recomputed on s)."""
        terms = [self._bytes(int(value)) * self._member(layer, stage)] if value else []
        z = self.vars.recompute_member.get((layer, stage))
        if z is not None and delta:
            terms.append(self._bytes(int(delta)) * z)
        return terms

    def _input_extra(self, stage: int):
        """I_j >= X_l x[l][j] + d_X_l z[l][j]."""
        base, delta = self._split_columns()
        layers = self._layers_of(stage)
        high = max([0] + [int(base["X"][i] + max(delta["X"][i], 0)) for i in layers])
        top = self._new_var(0, self._bytes(high), f"I_v{stage}")
        for layer in layers:
            terms = self._with_recompute(layer, stage, base["X"][layer], delta["X"][layer])
            if terms and base["X"][layer] + max(delta["X"][layer], 0) > 0:
                self._add(top >= self._sum(terms), f"input_step_l{layer}_v{stage}")
        return top

    def _weight_extra(self, stage: int, first: bool):
        """W_j (or of a first weight step, ``first``) by the running sum D (module
        docstring)."""
        base, delta = self._split_columns()
        step, end = ("W1", "End1") if first else ("W", "End")
        layers = self._layers_of(stage)
        tag = "V" if first else "W"
        peak = [int(base[step][i] + max(delta[step][i], 0)) for i in layers]
        rise = [max(int(base[end][i]), int(base[end][i] + delta[end][i]), 0) for i in layers]
        fall = [min(int(base[end][i]), int(base[end][i] + delta[end][i]), 0) for i in layers]
        rises = np.concatenate(([0], np.cumsum(rise, dtype=np.int64))).tolist()  # D at most
        falls = np.concatenate(([0], np.cumsum(fall, dtype=np.int64))).tolist()
        high = max([0] + [p + rises[k] for k, p in enumerate(peak)])
        top = self._new_var(0, self._bytes(high), f"{tag}_v{stage}")
        running: Any = 0
        for k, layer in enumerate(layers):
            self._tick()
            most = rises[k]  # D[l][j] at most
            row = [running, -self._bytes(most)] if most else [running]
            value = int(base[step][layer]) + most
            row += self._with_recompute(layer, stage, value, delta[step][layer])
            if peak[k] + most > 0:
                self._add(top >= self._sum(row), f"{tag}_step_l{layer}_v{stage}")
            if k + 1 < len(layers):
                low, hi = falls[k + 1], rises[k + 1]
                terms = self._with_recompute(layer, stage, base[end][layer], delta[end][layer])
                if terms:
                    following = self._new_var(
                        self._bytes(low), self._bytes(hi), f"{tag}_d_l{layer}_v{stage}"
                    )
                    name = f"{tag}_d_l{layer}_v{stage}"
                    self._add(following >= self._sum([running, *terms]), name)
                    running = following
        return top

    def _first_backward_extra(self, stage: int):
        """G_j by the running sum E from the back (module docstring)."""
        costs = self.costs
        base, delta = self._split_columns()
        mask = costs.recompute_mask(None)
        stored, transient, _ = costs.coefficients(mask)
        if costs.selective:
            every = costs.recompute_mask([True] * costs.num_layers)
            stored_again, transient_again, _ = costs.coefficients(every)
        else:
            stored_again, transient_again = stored, transient
        held = self._held_output(stage)
        last = self.problem.num_layers - 1
        layers = self._layers_of(stage)
        grads, own = base["grads"], base["own"]
        change = [int(grads[i] - stored[i]) for i in layers]  # what l adds to E of earlier ones
        change_again = [int(grads[i] - stored_again[i]) for i in layers]
        rise = [max(a, b, 0) for a, b in zip(change, change_again, strict=True)]
        fall = [min(a, b, 0) for a, b in zip(change, change_again, strict=True)]
        value = [int(transient[i] + own[i]) + (held if i != last else 0) for i in layers]
        again = [int(transient_again[i] - transient[i]) for i in layers]
        rises = np.concatenate((np.cumsum(rise[::-1], dtype=np.int64)[::-1], [0])).tolist()
        falls = np.concatenate((np.cumsum(fall[::-1], dtype=np.int64)[::-1], [0])).tolist()
        high = max([0] + [v + max(d, 0) + rises[k + 1] for k, (v, d) in
                          enumerate(zip(value, again, strict=True))])  # fmt: skip
        top = self._new_var(0, self._bytes(high), f"G_v{stage}")
        running: Any = 0
        for k in range(len(layers) - 1, -1, -1):
            self._tick()
            layer = layers[k]
            most = rises[k + 1]  # E[l][j] at most
            row = [running, -self._bytes(most)] if most else [running]
            row += self._with_recompute(layer, stage, transient[layer] + own[layer] + most,
                                        again[k])  # fmt: skip
            row += self._held_output_term(layer, stage)
            self._add(top >= self._sum(row), f"G_step_l{layer}_v{stage}")
            if k > 0:
                terms = self._with_recompute(layer, stage, change[k], change_again[k] - change[k])
                if terms:
                    following = self._new_var(
                        self._bytes(falls[k]), self._bytes(rises[k]),
                        f"G_e_l{layer}_v{stage}",
                    )  # fmt: skip
                    self._add(following >= self._sum([running, *terms]), f"G_e_l{layer}_v{stage}")
                    running = following
        return top
