"""The linear expressions of the prefix formulation (``formulation.py``): x, c, r and the
buffers as expressions of the prefix variables y, and each stage's or rank's memory and time
rows, in the backend's units (``_bytes``, ``_ns``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from solver.costs.stages import output_gradient_consumers, weight_output_gradients


class FormulationTerms:
    """Expressions of :class:`solver.backends.formulation.PrefixFormulation` (a mixin: it reads
    the formulation's problem, presolve, variables and backend methods)."""

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

    def _rank_bytes(
        self,
        rank: int,
        vector: tuple[int, ...],
        done: tuple[int, ...] = (),
        *,
        relays_held: int | None = None,
        copies_held: int | None = None,
        copies_done: int = 0,
        transient: bool = True,
    ):
        """Peak of rank r when it holds vector[c] micro-batches of its chunk c, after done[c]
        backwards of it (module docstring, 'interleaving'; one chunk and k_s without
        interleaving). Without interleaving ``relays_held`` and ``copies_held`` (default
        vector[0]) count the relayed tensors and the boundary copies at another held count,
        the copies after ``copies_done`` backwards (``_layer_rows``); ``transient`` False
        leaves tr[r] out."""
        costs = self.costs
        if costs.rank_rows:
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
            held = k if copies_held is None else copies_held
            terms += self._buffer_terms(stage, held, copies_done)
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
        """Expressions the peak of stage s (no interleaving) is at least: its layers' moments
        (``_layer_rows``) and the optimizer step where it makes a temporary
        (``_optimizer_step_row``)."""
        return self._layer_rows(stage) + self._optimizer_step_rows(stage)

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

    def _buffer_terms(self, stage: int, held: int, done: int, pending: int = 0) -> list:
        """Boundary buffers of stage s holding ``held`` micro-batches after ``done`` backwards,
        ``pending`` between a split backward's I and W (``costs.stage_buffer_bytes``), per
        tensor T of n bytes:

          (R + held [saving of T known]) n rv[T][s] + (S - m [T needs no grad]) n sd[T][s]
          - held n w[T][s]                        (w: a layer of s counts T, ``_counted_here``)

        the plain R n rv + S n sd when every boundary is (``LayerCosts.plain_boundaries``)."""
        costs = self.costs
        receive, send = costs.copies_at(stage, held, done, pending)
        adjusted = costs.direct_sends and not costs.plain_boundaries
        m, last = costs.config.num_microbatches, self.problem.num_stages - 1
        turn_sender = -1 if costs.v_turn is None else costs.v_turn - 1
        terms = []
        for t, (_, nbytes) in enumerate(costs.tensor_groups):
            if not nbytes:
                continue
            into, out_of = receive * nbytes, send * nbytes
            if adjusted:
                grad, known, charged = costs.tensor_roles[t]
                into += held * nbytes if known else 0
                out_of -= 0 if grad or stage == last else m * nbytes
                if charged and held:  # a V's p - 1 keeps no held outputs (``v_turn``)
                    counted = self._counted_here(t, stage, stage == turn_sender)
                    terms.append(-self._bytes(held * nbytes) * counted)
            terms.append(
                self._bytes(into) * self._received(t, stage)
                + self._bytes(out_of) * self._sent(t, stage)
            )
        return terms

    def _counted_here(self, tensor: int, stage: int, received_only: bool = False):
        """w[T][s] in [0, 1] with

          w <= sum_c x[c][s]   (c: the layers whose stored bytes count T, ``tensor_roles``)
          w <= rv[T][s] + sd[T][s]   (``received_only``: rv[T][s])

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
            crossing = self._received(tensor, stage)
            if not received_only:
                crossing = crossing + self._sent(tensor, stage)
            self._add(counted <= crossing, f"w_t{tensor}_s{stage}_crossing")
            self._counted[key] = counted
        return counted

    def _rank_bytes_from_parts(
        self,
        rank: int,
        vector: tuple[int, ...],
        done: tuple[int, ...],
        pending: tuple[int, ...] = (),
        started: tuple[bool, ...] = (),
        running: int = -1,
        copies: tuple[tuple[int, int], ...] | None = None,
        extra: tuple[str, int] = ("", -1),
    ):
        """With interleaving a rank has a row per in-flight vector: each row sums four
        variables per chunk (``_stage_parts``) instead of every layer and edge again, and the
        running chunk's T_j (``_chunk_top``; none where ``running`` is -1) where the moments
        say which runs (``LayerCosts.layer_moment_ranks``), else the rank's largest transient
        tr[r]. A split-backward schedule's moment (``costs.split_rows``) adds pending[c] dY_c
        per chunk (``_pending_part``) and, for a chunk whose gradients do not exist yet (not
        ``started[c]``; all exist by default), takes its states without them
        (``_lean_part``), and what runs beside (``extra``: kind and chunk,
        ``formulation_split``) in place of tr[r]. ``copies``: the moment's (R, S) per chunk
        (``LayerCosts.moment_copies``; None: ``copies_at``'s of (n, B))."""
        terms = []
        stages = self.costs.stages_of_rank(rank)
        pending = pending or (0,) * len(vector)
        started = started or (True,) * len(vector)
        copies = copies or (None,) * len(vector)
        parts = zip(vector, done, pending, started, stages, copies, strict=True)
        for k, finished, w, grads, stage, at in parts:
            states, kept, received, sent = self._stage_parts(stage)
            receive, send = self.costs.copies_at(stage, k, finished, w, at)
            terms += [states if grads else self._lean_part(stage), k * kept]
            if w:
                terms.append(w * self._pending_part(stage))
            if self.costs.direct_sends and not self.costs.plain_boundaries:
                # per-tensor copies (_buffer_terms): the parts In, Out carry one coefficient each
                terms += self._buffer_terms(stage, k, finished, w)
            else:
                terms += [receive * received, send * sent]
        if self.costs.split_backward:
            kind, chunk = extra
            if kind:
                terms.append(self._split_extra(kind, stages[chunk]))
        elif self.costs.layer_moment_ranks:
            if running >= 0:
                terms.append(self._chunk_top(stages[running]))
        elif self.vars.transient:
            terms.append(self.vars.transient[rank])
        if self.costs.constant_bytes:
            terms.append(self._bytes(self.costs.constant_bytes))
        return self._sum(terms)

    def _lean_part(self, stage: int):
        """states_s without the gradients (``.grad``; DDP's buckets stay), bytes, as a variable
        bounded below by its sum: lean_s >= sum_l (state_l - grad_l) x[l][s]."""
        key = ("lean", stage)
        if key not in self._split_parts:
            costs = self.costs
            per_layer = costs.state_bytes - costs.grad_bytes
            self._split_parts[key] = self._part_at_least(
                f"L_v{stage}",
                [
                    self._bytes(per_layer[i]) * self._member(i, stage)
                    for i in self._layers_of(stage)
                ],
                int(per_layer.sum()),
            )
        return self._split_parts[key]

    def _pending_part(self, stage: int):
        """dY_s, bytes per micro-batch a pending W keeps (``stages.pending_gradients``), as a
        variable bounded below by its sum (0 on virtual stage 0):

          dy_s >= sum_l dY_l x[l][s] + (dY'_l - dY_l) z[l][s] + sum_l out_l h[l][s]

        (dY'_l: of a recomputed layer; h[l][s]: l's output gradient is kept on s,
        ``_output_gradient_kept``)."""
        if stage == 0:
            return 0
        key = ("pending", stage)
        if key not in self._split_parts:
            costs = self.costs
            kept = weight_output_gradients(costs, costs.transient_bytes)
            redone = weight_output_gradients(costs, costs.recompute_transient_bytes)
            terms = [self._bytes(kept[i]) * self._member(i, stage) for i in self._layers_of(stage)]
            terms += self._recompute_terms(redone - kept, stage, self._bytes)
            most = int(np.maximum(kept, redone).sum())
            output = costs.weight_op_output_grad_bytes
            if output is not None:
                for i in self._layers_of(stage):
                    if output[i]:
                        terms.append(self._bytes(output[i]) * self._output_gradient_kept(i, stage))
                most += int(output.sum())
            self._split_parts[key] = self._part_at_least(f"dY_v{stage}", terms, most)
        return self._split_parts[key]

    def _output_gradient_kept(self, layer: int, stage: int):
        """h[l][s] in [0, 1], 1 where layer l's output gradient is a new storage on stage s
        (``stages.output_gradient_consumers``): l and its nearest consumer v both on s,

          h >= y[v][s] - y[l][s-1]     (exact when the edge cannot pass over s: span <= 1)

        a variable bounded below by that and 0 where it can; x[l][s] where several layers
        read l's output."""
        nearest, several = output_gradient_consumers(self.costs)
        if several[layer]:
            return self._member(layer, stage)
        consumer = int(nearest[layer])
        if consumer < 0:
            return 0
        both = self._y(consumer, stage) - self._y(layer, stage - 1)
        edge = self._nearest_edge(layer, consumer)
        if edge is None or self.presolve.max_span[edge] <= 1:
            return both
        kept = self.__dict__.setdefault("_kept_outputs", {})  # (layer, stage) -> h
        if (layer, stage) not in kept:
            held = self._new_var(0, 1, f"h_l{layer}_s{stage}")
            self._add(held >= both, f"h_l{layer}_s{stage}")
            kept[layer, stage] = held
        return kept[layer, stage]

    def _nearest_edge(self, layer: int, consumer: int) -> int | None:
        """The index of an edge layer -> consumer."""
        index = self.__dict__.get("_edge_index")
        if index is None:
            index = {(u, v): e for e, (u, v) in reversed(list(enumerate(self.edges)))}
            self._edge_index = index
        return index.get((layer, consumer))

    def _part_at_least(self, name: str, terms: list, most: int):
        """A variable in [0, most] bytes (model units) at least the sum of ``terms``."""
        part = self._new_var(0, self._bytes(most), name)
        self._add(part >= self._sum(terms), name)
        return part

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
