"""Each pipeline rank's memory at every action of its schedule: the curve under a schedule
picture (``solver.report.schedule_plot``), from the same terms as the stage peaks
(``stages.stage_costs``), so that its largest value is the rank's predicted peak, exactly.

Per rank r, its actions in the order it runs them (``schedule.schedule_actions``, the list the
time simulation runs), with n_c micro-batches held and B_c backwards done per chunk c after each
(bytes per GPU; kept_j = stored_j + relay_j per micro-batch, buffers(n, B) = R(n, B) into +
S(n, B) out_of, ``boundaries.stage_buffer_bytes``, trans_r = the largest transient of the rank,
what the split-backward schedules' moments take):

  states    = weights + optimizer (+ DDP's gradient buckets, + the batch a torch step() holds,
              + a calibration's constant)
  grads     = every gradient; with gradient lifetime "step" and no interleaving, none before
              the rank's first backward (they appear there)

Interleaved ranks (v > 1), every gradient throughout, with n_c held and B_c backwards done per
chunk (``schedule.running_moments``): while an action of chunk c runs its layer l, its micro-batch
keeps its relays and stored_c(<= l) (a forward has not run the later layers yet, a backward has
freed them) and l has its transient (``stages.chunk_moment``: the chunk's largest such moment):

  F         = states + grads + sum_c' n_c' kept_c' - stored_c(> l) + trans_l + buffers(n, B)
              (n, B after it: the forward's micro-batch counted)
  B         = the larger of the same with n, B before it (its micro-batch still counted) and
              states + grads + sum_c' n_c' kept_c' + buffers(n, B) after it (nothing running)

A stage without interleaving peaks inside one of its layers (``stages.layer_moments``); its
actions follow the same layers (h micro-batches held during the action, the current one among
them, layers l in forward order):

  F         = states + grads + max_l [(h - 1) kept + relay + stored(<= l) + trans_l] + buffers(h)
              (the forward's own moments: its layers up to l, l's transient)
  first B   = where the gradients appear at the first backward and no forward follows it
              (``LayerCosts.first_backward_peak``: step lifetime, GPipe or 1F1B with
              m <= p - s): states + the largest of ``layer_moments``' during(l) (with the
              gradients of the layers after l) and the moment after it (as other B)
  other B   = states + grads + n kept + trans_r + buffers(n, B)    (n held, B done after it;
              torch GPipe's sends held: ``LayerCosts.after_moments``)

so the k-th forward (with every gradient where it follows a backward) is max_l during(l).

The optimizer step (where the model has its temporary, ``LayerCosts.step_bytes``) is one more
moment after the last backward (``stages.optimizer_step_moment``).

Split backwards (the zero-bubble and V schedules, ``schedule_orders``; always replayed as held
micro-batches, a rank's chunks by the schedule's placement), on the torch runtime: its
``stage_backward_input`` (I) runs ``autograd.grad(..., retain_graph=True)``, so between a
micro-batch's I and its W the chunk keeps ALL the micro-batch's saved activations, plus the
gradients at the outputs of its weight ops (dY, ``param_groups``' "grads") that W consumes;
W (``stage_backward_weight``, no retained graph) frees both. With w_c pending W steps of chunk c
and n_c micro-batches held from their F to their B or W (``schedule.split_action_moments``):

  held      = states + grads + sum_c n_c kept_c + sum_c w_c dY_c + buffers(n, B, w)
  F of c    = held after it - stored_c(> l) + trans_l at c's largest layer moment
  I of c    = the larger of held after it + max_{l in c} trans_l and held after it
  W of c    = the larger of held before it + W_c (``stages.weight_step_transient``: the
              weight step's own moments, each layer's beside what the layers before it left)
              and held after it
  B of c    = the larger of held before it - stored_c(> l) + trans_l and held after it

(a W on the first virtual stage is its full backward, as B; an I there runs nothing). A chunk's
gradients count from its first B or W under step lifetime (in that action already), always
under persistent.
docs/cost-model.md, "Memory over the step" and "Zero-bubble and V schedules".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.costs.boundaries import boundary_bytes, direct_buffer_adjustments, stage_buffer_bytes
from solver.costs.coefficients import LayerCosts
from solver.costs.megatron_buffers import megatron_moment_copies
from solver.costs.schedule import (
    ScheduleAction,
    interleaved_schedule_groups,
    schedule_actions,
    split_action_moments,
)
from solver.costs.schedule_orders import ZERO_BUBBLE_SCHEDULES
from solver.costs.stages import (
    chunk_moment,
    layer_moments,
    optimizer_step_moment,
    pending_gradients,
    per_stage_sum,
    split_extras,
)


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """The cost model's memory of one pipeline rank over one iteration, bytes per GPU."""

    rank: int
    actions: tuple[ScheduleAction, ...]
    """The rank's forwards and backwards in the order it runs them (``schedule_actions``)."""
    action_bytes: tuple[int, ...]
    """Parallel to ``actions``: the memory at each (module docstring)."""
    step_bytes: int | None
    """At the optimizer step, after the last backward; None where the model has no step
    moment (no step temporary)."""
    states_bytes: int
    """Weights + optimizer state (+ gradient buckets, + a calibration's constant): what the
    rank holds throughout."""
    held_at_peak: tuple[int, ...] = ()
    """Split-backward schedules: micro-batches each chunk holds (F run, W or B not yet) at the
    rank's largest action; () for the others."""
    pending_at_peak: tuple[int, ...] = ()
    """Split-backward schedules: of those, the ones between their I and their W per chunk."""

    @property
    def peak_bytes(self) -> int:
        """The largest value: the rank's predicted peak (``StageCost.peak_bytes``)."""
        step = [] if self.step_bytes is None else [self.step_bytes]
        return max([*self.action_bytes, *step])


def rank_memory(
    costs: LayerCosts,
    stage_of_layer: list[int] | np.ndarray,
    recomputed: list[bool] | np.ndarray | None = None,
) -> list[RankMemory]:
    """Every rank's memory at each action of its schedule for an assignment (layer position ->
    virtual stage) with the layers ``recomputed`` (selective), in rank order."""
    stage_of = np.asarray(stage_of_layer, dtype=np.int64)
    mask = costs.recompute_mask(recomputed)
    stored, transient, _ = costs.coefficients(mask)
    terms = _Terms(costs, stage_of, stored, transient, mask)
    config = costs.config
    m, p, v = config.num_microbatches, config.pp, config.virtual_stages
    group = interleaved_schedule_groups(costs.runtime, m, p) if v > 1 else None
    result = []
    split = config.schedule in ZERO_BUBBLE_SCHEDULES
    for rank in range(p):
        actions = schedule_actions(m, p, v, rank, group, config.schedule)
        counts: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        if split:
            own = costs.stages_of_rank(rank)
            values, counts = _split_bytes(terms, rank, own, actions)
        elif v == 1 and (terms.stage_of == rank).any():
            values = _layerwise_bytes(terms, rank, actions)
        elif costs.layer_moment_ranks:
            values = _interleaved_bytes(terms, rank, actions)
        else:
            values = _held_bytes(terms, rank, actions)
        step = None
        if costs.step_bytes is not None:
            own = costs.stages_of_rank(rank)
            buffers, temporary = optimizer_step_moment(
                costs, rank, stage_of, terms.into, terms.out_of, terms.adjust
            )
            step = terms.states(rank) + int(terms.grads[own].sum()) + buffers + temporary
        result.append(
            RankMemory(
                rank=rank,
                actions=actions,
                action_bytes=tuple(values),
                step_bytes=step,
                states_bytes=terms.states(rank),
                held_at_peak=counts[0],
                pending_at_peak=counts[1],
            )
        )
    return result


class _Terms:
    """The per-(virtual-)stage terms of one assignment, as ``stage_costs`` sums them."""

    def __init__(
        self,
        costs: LayerCosts,
        stage_of: np.ndarray,
        stored: np.ndarray,
        transient: np.ndarray,
        mask: np.ndarray,
    ) -> None:
        n = costs.num_stages
        self.costs, self.stage_of = costs, stage_of
        self.stored_per_layer, self.transient_per_layer = stored, transient
        self.into, self.out_of, self.relayed = boundary_bytes(costs, stage_of)
        self.adjust = direct_buffer_adjustments(costs, stage_of)
        self.weight, self.grads, self.optimizer, self.stored = (
            per_stage_sum(values, stage_of, n)
            for values in (costs.weight_bytes, costs.grad_bytes, costs.optimizer_bytes, stored)
        )
        buckets = np.zeros(n, np.int64)
        for held in (costs.grad_buffer_bytes, costs.input_batch_bytes):
            # DDP's buckets beside .grad, the batch a torch step() holds: all step
            if held is not None:
                buckets = buckets + per_stage_sum(held, stage_of, n)
        self.buckets = buckets
        self.transient = np.zeros(n, dtype=np.int64)
        np.maximum.at(self.transient, stage_of, transient)
        self.kept = self.stored + self.relayed
        self.pending = pending_gradients(costs, stage_of, transient)
        self.extras = (
            split_extras(costs, stage_of, stored, transient, mask)
            if costs.split_backward
            else None
        )

    def states(self, rank: int) -> int:
        """Weights + optimizer + gradient buckets + constant of the rank, bytes."""
        own = self.costs.stages_of_rank(rank)
        held = self.weight[own].sum() + self.optimizer[own].sum() + self.buckets[own].sum()
        return self.costs.constant_bytes + int(held)

    def buffers(
        self, stage: int, held: int, done: int, pending: int = 0, moment: tuple | None = None
    ) -> int:
        """``stage_buffer_bytes`` of (virtual) stage ``stage``."""
        return stage_buffer_bytes(
            self.costs, stage, held, done, self.into, self.out_of, self.adjust, pending, moment
        )


def _held_bytes(terms: _Terms, rank: int, actions: tuple[ScheduleAction, ...]) -> list[int]:
    """The memory at the end of each action: held micro-batches, buffers, the rank's largest
    transient, and its gradients (from its first backward under step lifetime without
    interleaving; always otherwise)."""
    costs = terms.costs
    own = costs.stages_of_rank(rank)
    v = len(own)
    states, largest = terms.states(rank), int(terms.transient[own].max())
    all_grads = int(terms.grads[own].sum())
    grads = 0 if costs.grad_lifetime == "step" and v == 1 else all_grads
    held, done = [0] * v, [0] * v
    values = []
    for action in actions:
        assert action.kind in ("F", "B"), f"no memory rule for a {action.kind} step yet"
        if action.kind == "F":
            held[action.chunk] += 1
        else:
            held[action.chunk] -= 1
            done[action.chunk] += 1
            grads = all_grads
        activations = sum(n * int(terms.kept[j]) for n, j in zip(held, own, strict=True))
        buffers = sum(terms.buffers(j, n, b) for n, b, j in zip(held, done, own, strict=True))
        values.append(states + grads + activations + buffers + largest)
    return values


def _interleaved_bytes(
    terms: _Terms, rank: int, actions: tuple[ScheduleAction, ...]
) -> list[int]:
    """The memory of each action of an interleaved rank (module docstring: F, B), every
    gradient throughout."""
    costs = terms.costs
    own = costs.stages_of_rank(rank)
    v = len(own)
    base = terms.states(rank) + int(terms.grads[own].sum())
    running = [
        chunk_moment(
            costs,
            np.flatnonzero(terms.stage_of == j).tolist(),
            terms.stored_per_layer,
            terms.transient_per_layer,
        )
        for j in own
    ]
    held, done = [0] * v, [0] * v
    copies = iter(_moment_copies(costs, rank) or [None] * (2 * len(actions)))

    def now(chunk: int) -> int:
        """The rank's memory with ``held``, ``done`` and ``chunk``'s layer running (-1: none),
        the buffers those of the next moment (``LayerCosts.moment_copies``: megatron's)."""
        activations = sum(n * int(terms.kept[j]) for n, j in zip(held, own, strict=True))
        at = next(copies) or (None,) * v
        buffers = sum(
            terms.buffers(j, n, b, moment=a) for n, b, j, a in zip(held, done, own, at, strict=True)
        )
        fewer, transient = running[chunk] if chunk >= 0 else (0, 0)
        return base + activations - fewer + transient + buffers

    values = []
    for action in actions:
        assert action.kind in ("F", "B"), f"no memory rule for a {action.kind} step yet"
        c = action.chunk
        if action.kind == "F":
            held[c] += 1
            values.append(now(c))
            continue
        during = now(c)
        held[c] -= 1
        done[c] += 1
        values.append(max(during, now(-1)))
    return values


def _moment_copies(costs: LayerCosts, rank: int) -> list | None:
    """megatron-core's (R, S) per chunk at every moment of ``schedule.running_moments`` (in its
    order), where the costs follow them (``LayerCosts.moment_copies``); None otherwise."""
    if not costs.moment_copies:
        return None
    config = costs.config
    m, p = config.num_microbatches, config.pp
    return megatron_moment_copies(
        m,
        p,
        config.virtual_stages,
        rank,
        interleaved_schedule_groups(costs.runtime, m, p),
        deallocate=costs.deallocate_pipeline_outputs,
    )


def _layerwise_bytes(terms: _Terms, rank: int, actions: tuple[ScheduleAction, ...]) -> list[int]:
    """The memory of each action of a stage without interleaving, layer by layer (module
    docstring: F, first B, later B)."""
    costs = terms.costs
    layers = np.flatnonzero(terms.stage_of == rank)  # positions, in forward order
    states, kept, relay = terms.states(rank), int(terms.kept[rank]), int(terms.relayed[rank])
    stored = terms.stored_per_layer[layers]
    # max_l stored(<= l) + trans_l: the forward's largest moment of its own micro-batch (with
    # the output held on the last layer's stage, ``stages.layer_moments``)
    running = costs.moment_transient(terms.transient_per_layer, costs.num_layers - 1 in layers)
    reach = np.cumsum(stored) + running[layers]
    if costs.backward_weight_bytes is not None:  # unsharded weights of the layers after l only
        reach = reach - np.cumsum(costs.backward_weight_bytes[layers])
    own_moment = int(reach.max()) if len(reach) else 0
    all_grads = int(terms.grads[rank])
    # after a backward: the largest transient less FSDP2's gathers (``stages.layer_moments``)
    largest = int(costs.after_transient(terms.transient_per_layer)[layers].max(initial=0))
    late = costs.first_backward_peak[rank]
    grads = 0 if costs.grad_lifetime == "step" else all_grads  # step: from the first backward
    held, done, seen_backward = 0, 0, False
    values = []
    for action in actions:
        assert action.kind in ("F", "B"), f"no memory rule for a {action.kind} step yet"
        if action.kind == "F":
            held += 1
            during = (held - 1) * kept + relay + own_moment
            values.append(states + grads + during + terms.buffers(rank, held, done))
            continue
        held, done = held - 1, done + 1
        after = held * kept + largest + terms.buffers(rank, held, done)
        if late and not seen_backward:  # in it (its layers' moments), then after it
            moments = layer_moments(
                costs,
                rank,
                layers.tolist(),
                terms.stored_per_layer,
                terms.transient_per_layer,
                relay,
                terms.into,
                terms.out_of,
                terms.adjust,
            )
            during = max(sum(moment) for moment in moments[: len(layers)])
            values.append(states + max(during, all_grads + after))
        else:
            values.append(states + all_grads + after)
        seen_backward, grads = True, all_grads
    return values


def _split_bytes(
    terms: _Terms, rank: int, own: list[int], actions: tuple[ScheduleAction, ...]
) -> tuple[list[int], tuple[tuple[int, ...], tuple[int, ...]]]:
    """The memory of each action of a split-backward schedule, its largest moment (module
    docstring), and the (held, pending W) counts per chunk at the largest."""
    costs = terms.costs
    states = terms.states(rank)
    persistent = costs.grad_lifetime != "step"
    extras = terms.extras
    values, best, at_best = [], -1, ((0,) * len(own), (0,) * len(own))
    first = costs.stages_of_rank(rank)[0] == 0
    for moments in split_action_moments(actions, len(own), first, persistent):
        value = -1
        for held, pending, done, started, kind, chunk in moments:
            grads = sum(
                int(terms.grads[j]) for g, j in zip(started, own, strict=True) if g
            )
            activations = sum(n * int(terms.kept[j]) for n, j in zip(held, own, strict=True))
            waiting = sum(w * int(terms.pending[j]) for w, j in zip(pending, own, strict=True))
            buffers = sum(
                terms.buffers(j, n, b, w)
                for n, b, w, j in zip(held, done, pending, own, strict=True)
            )
            extra = 0
            if kind:
                extra = int(extras[kind][own[chunk]])
                extra -= int(extras["fewer"][own[chunk]]) if kind == "T" else 0
            total = states + grads + activations + waiting + buffers + extra
            if total > value:
                value = total
            if total > best:
                best, at_best = total, (held, pending)
        values.append(value)
    return values, at_best
