"""Stage totals and peak moments: the exact per-GPU cost of each stage of an assignment
(``stage_costs``), from the per-layer coefficients (``coefficients.LayerCosts``).

Memory of stage s (bytes per GPU), with k_s in flight (``schedule``), stored_l per layer
(``layers``), the relays and buffers (``boundaries``) and the states (``states``), layers l of
the stage in forward order:
  peak_s    = weights + optimizer + max_l during(l) (+ a calibration's constant), with
  during(l) = (k-1)(stored_s + relay_s) + relay_s + stored(<= l) + grads + trans_l + buffers(k)
              (``layer_moments``: while layer l of one micro-batch runs, forward or backward,
              at most k - 1 others are held whole, and that one holds its layers up to l);
              grads = every gradient of the stage (persistent lifetime, or step lifetime where
              a forward follows the first backward: 1F1B with k < m)
  grad lifetime "step" (``TrainingConfig.grad_lifetime``; torch's zero_grad(set_to_none=True)),
              on a stage whose forwards all precede its first backward (GPipe, 1F1B with
              m <= p - s; ``LayerCosts.first_backward_peak``): grads = grads(> l) + own_l
              (l's own gradients by its largest moment, ``own_grads``)
  after a backward (``LayerCosts.after_moments``: after the first where gradients appear then,
              h = k - 1; torch GPipe's backward phase, h = m - 1 and 1, its sends held):
              after(h)  = h (stored_s + relay_s) + grads_s + trans_s + buffers(h, k - h done)
  interleaved stages (v > 1), per rank, at each moment (n, B, c) of its schedule
              (``schedule.running_moments``: n_c held and B_c backwards done per chunk, layer
              l of chunk c running, the forward's micro-batch or the backward's among the n_c;
              ``_rank_peak_moment``), as during(l) with the other chunks' micro-batches:
              peak_r = states_r + sum_c' n_c' kept_c' - kept_c + relay_c
                       + max_{l in c} (stored_c(<= l) + trans_l) + buffers(n, B)
              (kept_j = stored_j + relay_j; no running chunk: no transient)
  split backwards (zbv, dualpipev, interleaved-zb; ``schedule_orders``), per rank, the largest
              moment inside or after an action of torch's list (``schedule.split_moments``: n_c
              held, w_c between their I and their W, B_c done per chunk c, and what runs;
              ``_split_peak_moment``):
              peak_r = states_r + grads + sum_c (n_c kept_c + w_c dY_c) + buffers(n, B) + X,
              X = T_c (a forward's or full backward's layer of chunk c: trans_l - stored_c(> l),
              ``chunk_moment``), I_c (its input step: max_l trans_l), W_c (its weight step,
              ``weight_step_transient``) or 0 (after an action); chunk c's grads from its first
              W or B under step lifetime, dY_c the pending W's output gradients
              (``weight_output_gradients``), exactly the largest action of
              ``schedule_memory.rank_memory``
  optimizer step (with a step temporary, ``states.optimizer_step_bytes``): after the schedule no
              activation is held and every gradient exists:
              peak_s = max(the moments above, states_s + sum_l step_l + buffers(0 held))
              (``optimizer_step_moment``; torch: the m receive buffers of each direction)

Heterogeneous clusters (``Cluster.groups``): stage s runs on the t c d GPUs of one node group
k(s). Memory does not depend on the GPU type; the times use group k(s)'s
(``placed_stage_costs``), and the utilization of stage s is peak_s / capacity_k(s), counted in
parts per million, rounded up (``utilization_ppm``), so that every backend compares the same
integers. docs/cost-model.md, "Memory of one stage".
"""

from __future__ import annotations

import numpy as np

from solver.costs.boundaries import (
    boundary_bytes,
    direct_buffer_adjustments,
    stage_buffer_bytes,
)
from solver.costs.coefficients import LayerCosts
from solver.costs.schedule import split_moment_arrays
from solver.costs.schedule_orders import ZERO_BUBBLE_SCHEDULES
from solver.costs.stage_cost import StageCost

KEPT_ASSIGNMENTS = 2
"""The last assignments whose stage costs a ``LayerCosts`` keeps (``stage_costs``): a split is
checked, measured and evaluated by turns (and again by each search of a planning call), and on
10^4 stages one evaluation takes a second."""


def stage_costs(
    costs: LayerCosts,
    stage_of_layer: list[int] | np.ndarray,
    recomputed: list[bool] | np.ndarray | None = None,
) -> list[StageCost]:
    """Exact per-stage costs of an assignment (layer position -> stage index); ``recomputed``
    (a flag per layer) says which layers recompute under the "selective" mode. The last
    ``KEPT_ASSIGNMENTS`` answers are kept on ``costs`` (the same StageCost objects, a new list)."""
    stage_of = np.asarray(stage_of_layer, dtype=np.int64)
    key = (
        stage_of.tobytes(),
        None if recomputed is None else np.asarray(recomputed, dtype=bool).tobytes(),
    )
    kept = costs.__dict__.setdefault("_kept_stage_costs", {})
    if key not in kept:
        kept[key] = _stage_costs(costs, stage_of, recomputed)
        while len(kept) > KEPT_ASSIGNMENTS:
            del kept[next(iter(kept))]
    return list(kept[key])


def _stage_costs(
    costs: LayerCosts, stage_of: np.ndarray, recomputed: list[bool] | np.ndarray | None
) -> list[StageCost]:
    """``stage_costs`` computed."""
    mask = costs.recompute_mask(recomputed)
    stored_per_layer, transient_per_layer, time_per_layer = costs.coefficients(mask)
    num_stages = costs.num_stages
    into, out_of, relayed = boundary_bytes(costs, stage_of)
    adjust = direct_buffer_adjustments(costs, stage_of)
    weight, grad, optimizer, stored, time_ns, forward_ns, sync_ns, step_ns = (
        per_stage_sum(values, stage_of, num_stages)
        for values in (
            costs.weight_bytes,
            costs.grad_bytes,
            costs.optimizer_bytes,
            stored_per_layer,
            time_per_layer,
            costs.forward_ns,
            costs.dp_sync_ns,
            costs.optimizer_step_ns,
        )
    )
    buckets, inputs = _held_all_step(costs, stage_of, num_stages)
    transient = np.zeros(num_stages, dtype=np.int64)
    np.maximum.at(transient, stage_of, transient_per_layer)
    members = np.argsort(stage_of, kind="stable")
    bounds = np.searchsorted(stage_of[members], np.arange(num_stages + 1))
    kept = stored + relayed  # per micro-batch kept by each virtual stage
    split = costs.config.schedule in ZERO_BUBBLE_SCHEDULES
    if split:  # a pending W's dY per micro-batch of each virtual stage, what runs beside
        pending = pending_gradients(costs, stage_of, transient_per_layer)
        extras = split_extras(costs, stage_of, stored_per_layer, transient_per_layer, mask)
    stages = []
    for rank in range(len(costs.in_flight_vectors)):
        own = costs.stages_of_rank(rank)
        chunks = [members[bounds[j] : bounds[j + 1]].tolist() for j in own]
        layers = [layer for chunk in chunks for layer in chunk]
        grads, largest = int(grad[own].sum()), int(transient[own].max())
        moment, resharded = "forward", 0
        if split:
            grads, activations, buffers, vector, largest = _split_peak_moment(
                costs, rank, grad, (kept, pending), extras, (into, out_of, adjust)
            )
        else:
            activations, buffers, vector, largest = _rank_peak_moment(
                costs, rank, kept, (into, out_of, adjust), chunks,
                (stored_per_layer, transient_per_layer), largest,
            )  # fmt: skip
        if costs.config.virtual_stages == 1 and chunks[0] and not split:
            moments = layer_moments(
                costs, rank, chunks[0], stored_per_layer, transient_per_layer,
                int(relayed[rank]), into, out_of, adjust,
            )  # fmt: skip
            totals = [sum(moment) for moment in moments]
            best = totals.index(max(totals))  # the first of the largest
            grads, activations, buffers, largest = moments[best]
            if costs.backward_weight_bytes is not None and best < len(chunks[0]):
                # the unsharded weights resharded at layer l's moment, U(<= l)
                own_weights = costs.backward_weight_bytes[chunks[0][: best + 1]]
                resharded = -int(own_weights.sum())
                grads -= resharded
            if best >= len(chunks[0]):  # after a backward (LayerCosts.after_moments)
                _, done = costs.after_moments[rank][best - len(chunks[0])]
                first = done == 1
                moment = "after first backward" if first else "last backward"
            elif costs.grads_late[rank]:
                moment = "first backward"
        grads += int(buckets[own].sum())
        weights = int(weight[own].sum()) + resharded
        if costs.step_bytes is not None:
            step = optimizer_step_moment(costs, rank, stage_of, into, out_of, adjust)
            all_grads = int(grad[own].sum()) + int(buckets[own].sum())
            if sum(step) + all_grads > grads + activations + buffers + largest + resharded:
                buffers, largest = step
                grads, activations, vector, moment = all_grads, 0, (0,), "optimizer step"
                weights = int(weight[own].sum())
        buffers += int(inputs[own].sum())
        stages.append(
            StageCost(
                index=rank,
                layers=layers,
                recomputed=[layer for layer in layers if mask[layer]],
                weight_bytes=weights,
                grad_bytes=grads,
                optimizer_bytes=int(optimizer[own].sum()),
                activation_bytes=activations,
                buffer_bytes=buffers,
                transient_bytes=largest,
                in_flight=sum(vector),
                time_ns=int(time_ns[own].sum()),
                dp_sync_ns=int(sync_ns[own].sum()),
                constant_bytes=costs.constant_bytes,
                chunks=chunks,
                chunk_time_ns=[int(time_ns[j]) for j in own],
                chunk_forward_ns=[int(forward_ns[j]) for j in own],
                optimizer_step_ns=int(step_ns[own].sum()),
                moment=moment,
            )
        )
    return stages


def optimizer_step_moment(
    costs: LayerCosts,
    rank: int,
    stage_of: np.ndarray,
    into: np.ndarray,
    out_of: np.ndarray,
    adjust: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[int, int]:
    """(buffers, step temporary) bytes of rank r at its optimizer step, beside its weights, every
    gradient and its optimizer state: the schedule has finished, so no micro-batch is held and
    no relayed tensor either, and the step makes its temporary (``LayerCosts.step_bytes``: a
    foreach Adam's ``torch._foreach_sqrt(exp_avg_sqs)`` over all the rank's parameters at once).
    The buffers are those the runtime keeps with 0 held (``LayerCosts.copies_at``): on the torch
    runtime the m receive buffers of each direction that every PipelineStage keeps for the run
    (the outputs it held until their backward are gone, and so are an interleaved schedule's
    pending sends, waited on at the end of ``step()``); megatron's one buffer per direction.
    ``stage_of``: the (virtual) stage of each layer; ``into``, ``out_of``: per (virtual) stage,
    per micro-batch (``boundary_bytes``); ``adjust``: ``direct_buffer_adjustments``."""
    own = costs.stages_of_rank(rank)
    buffers = sum(stage_buffer_bytes(costs, stage, 0, 0, into, out_of, adjust) for stage in own)
    step = int(costs.step_bytes[np.isin(stage_of, own)].sum())
    return buffers, step


def layer_moments(
    costs: LayerCosts,
    stage: int,
    layers: list[int],
    stored: np.ndarray,
    transient: np.ndarray,
    relayed: int,
    into: np.ndarray,
    out_of: np.ndarray,
    adjust: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[tuple[int, int, int, int]]:
    """(gradients, activations, buffers, transient) bytes of a stage without interleaving at
    the moments that bound its peak. ``layers``: the stage's layer positions in forward order;
    ``stored``, ``transient``: per layer per micro-batch (recompute set applied).

    While layer l runs, the forward or the backward of micro-batch j, the other micro-batches
    in flight are at most k - 1, each kept whole (1F1B: a stage's k-th forward runs beside the
    k - 1 earlier ones, and its backward of the oldest beside the k - 1 younger; GPipe: fewer
    before the last forward or after the first backward). Micro-batch j keeps its relayed
    tensors and the stored bytes of the layers up to l: in its forward the later layers have
    not run yet, in its backward (the stage's layers in reverse) autograd has freed their
    saved tensors. l has its transient on top (on the torch runtime's stage holding the last
    layer, with the model's output the pipeline keeps for its loss until the micro-batch's
    backward ends: ``LayerCosts.moment_transient``):

        during(l) = (k - 1) (stored_s + relay_s) + relay_s + stored(<= l) + grads + transient_l
                    + buffers at k held

    so max_l during(l) bounds every moment of the schedule, and during(last layer) is the end of
    a forward with k held (interleaved ranks take the same moments per running chunk, beside the
    other chunks' held micro-batches: ``_rank_peak_moment``). ``grads`` is every gradient of the
    stage where they exist then (persistent lifetime; step lifetime where a forward follows the
    first backward, 1F1B with k < m). Where gradients appear at the first backward and no
    forward follows it (``LayerCosts.first_backward_peak``: step lifetime, k = m), the layers
    after l have theirs, and l those of its own parameters its backward made by its largest
    moment beyond what trans_l holds (``own_grads``: its weight-gradient temporary, the first
    of a parameter's gradients, has no ``.grad`` to add it to yet): grads = grads(> l) + own_l,
    and during(last layer) is the start of the first backward. After the first backward every
    gradient exists and at most k - 1 micro-batches are held (the later backwards free more; a safe bound where the buffers do
    not grow), and under torch's GPipe the buffers grow with the backwards done (its sends
    held): the moments after a backward with h held (``LayerCosts.after_moments``: k - 1 on
    the first stages; m - 1 and 1 under torch GPipe, the ends of a value linear in h), the
    next backward's micro-batch counted whole beside the largest transient:

        after(h) = h (stored_s + relay_s) + grads_s + max transient_s + buffers(h, k - h done)

    Measured on gpt-tiny (fp32, gloo, ``profiling.run``): a 1F1B stage with m = p peaks in its
    last block's backward at its first weight gradient, with no gradient accumulated yet, within
    0.2% of during(l). With the states (weights, optimizer) the largest moment is the stage's
    peak, at most the persistent one (k held with every gradient and the largest transient)."""
    k = costs.in_flight[stage]
    late = costs.first_backward_peak[stage]
    grads = costs.late_column(stage)[layers]
    stored_here = stored[layers]
    total_stored, total_grads = int(stored_here.sum()), int(grads.sum())
    before = np.cumsum(stored_here)  # stored(<= l)
    # grads(> l) where they appear at the first backward, else every gradient
    later = total_grads - np.cumsum(grads) if late else np.full(len(layers), total_grads)
    if costs.backward_weight_bytes is not None:
        # FSDP2 ZeRO 3 under PP (``LayerCosts.late_column``): the gradients (those after l at
        # a first backward), less the unsharded weights of l and the layers before it
        # (resharded; l's own is its transient): what the moment lacks of the states
        total_grads = int(costs.grad_bytes[layers].sum())
        later = later - int(costs.backward_weight_bytes[layers].sum())
        later = later + (0 if costs.grads_late[stage] else total_grads)
    if late:  # and l's own gradients made by its largest moment (``LayerCosts.late_own``)
        later = later + costs.late_own(stage)[layers]
    buffers_k = stage_buffer_bytes(costs, stage, k, 0, into, out_of, adjust)
    held = (k - 1) * (total_stored + relayed)
    # on the stage of the model's last layer its output stays held (LayerCosts.moment_transient)
    running = costs.moment_transient(transient, costs.num_layers - 1 in layers)
    moments = [
        (g, held + relayed + a, buffers_k, t)
        for g, a, t in zip(
            np.asarray(later).tolist(), before.tolist(), running[layers].tolist(), strict=True
        )
    ]
    largest = int(costs.after_transient(transient)[layers].max(initial=0))  # less FSDP2's gathers
    for h, done in costs.after_moments[stage]:  # after a backward (LayerCosts.after_moments)
        buffers_h = stage_buffer_bytes(costs, stage, h, done, into, out_of, adjust)
        moments.append((total_grads, h * (total_stored + relayed), buffers_h, largest))
    return moments


def _held_all_step(
    costs: LayerCosts, stage_of: np.ndarray, num_stages: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, bytes held all step: DDP's buckets beside .grad, and the batch a torch
    step() holds (zeros where the costs have none)."""
    zeros = np.zeros(num_stages, np.int64)
    return tuple(
        zeros if held is None else per_stage_sum(held, stage_of, num_stages)
        for held in (costs.grad_buffer_bytes, costs.input_batch_bytes)
    )


def per_stage_sum(values: np.ndarray, stage_of: np.ndarray, num_stages: int) -> np.ndarray:
    """Per (virtual) stage sums of a per-layer column, exact int64 (np.bincount would go
    through float64)."""
    total = np.zeros(num_stages, dtype=np.int64)
    np.add.at(total, stage_of, np.asarray(values, dtype=np.int64))
    return total


def chunk_moment(
    costs: LayerCosts, layers: list[int], stored: np.ndarray, transient: np.ndarray
) -> tuple[int, int]:
    """(stored(> l), transient_l) of chunk (virtual stage) ``layers`` (forward order) at its
    layer l with the largest stored(<= l) + transient_l: what its running micro-batch does not
    keep of the chunk's stored bytes and what runs beside the rest while l runs, forward or
    backward (in its backward autograd has freed the saved tensors of the layers after l),
    with the model's output the torch pipeline keeps on the chunk holding the last layer
    (``LayerCosts.moment_transient``). (0, 0) for an empty chunk. ``stored``, ``transient``:
    per layer (a recompute set applied)."""
    if not layers:
        return 0, 0
    running = costs.moment_transient(transient, costs.num_layers - 1 in layers)[layers]
    before = np.cumsum(stored[layers])
    best = int(np.argmax(before + running))
    return int(before[-1] - before[best]), int(running[best])


def _rank_peak_moment(
    costs: LayerCosts,
    rank: int,
    kept: np.ndarray,
    boundaries: tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None],
    layers: list[list[int]],
    per_layer: tuple[np.ndarray, np.ndarray],
    largest: int,
) -> tuple[int, int, tuple[int, ...], int]:
    """(activations, buffers, in-flight vector, transient) at the largest moment of the rank's
    schedule (buffers depend on the moment only on the torch runtime with interleaving; ties:
    the larger vector). Where the moments say which chunk runs (``LayerCosts.running_chunks``)
    the running micro-batch keeps its relays and stored(<= l) of its chunk (``layers``: each
    chunk's, forward order), l's transient beside it (``chunk_moment`` of ``per_layer``, the
    stored and transient bytes), none where no chunk runs; else every micro-batch whole and the
    rank's ``largest`` transient. ``boundaries``: (into, out_of, adjust) of the buffers."""
    own = costs.stages_of_rank(rank)
    into, out_of, adjust = boundaries
    chunks, running = None, None
    if costs.layer_moment_ranks:
        chunks = costs.running_chunks[rank]
        running = [chunk_moment(costs, chunk, *per_layer) for chunk in layers]
    moments = []
    for i, (vector, dones, at) in enumerate(
        zip(
            costs.in_flight_vectors[rank],
            costs.backwards_done[rank],
            costs.copies_of_moments(rank),
            strict=True,
        )
    ):
        activations = int(sum(n * kept[j] for n, j in zip(vector, own, strict=True)))
        at = at or (None,) * len(own)
        buffers = sum(
            stage_buffer_bytes(costs, stage, held, done, into, out_of, adjust, moment=moment)
            for held, done, stage, moment in zip(vector, dones, own, at, strict=True)
        )
        transient = largest if chunks is None else 0
        if chunks is not None and chunks[i] >= 0:
            # the running micro-batch keeps its relays and stored(<= l), not all of its chunk's
            fewer, transient = running[chunks[i]]
            activations -= fewer
        moments.append((activations + buffers + transient, activations, buffers, transient, vector))
    _, activations, buffers, transient, vector = max(moments)
    return activations, buffers, vector, transient


def _split_peak_moment(
    costs: LayerCosts,
    rank: int,
    grad: np.ndarray,
    held_bytes: tuple[np.ndarray, np.ndarray],
    extras: dict[str, np.ndarray],
    boundaries: tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None],
) -> tuple[int, int, int, tuple[int, ...], int]:
    """(gradients, activations, buffers, held vector, transient) at the largest moment of rank
    r's split-backward schedule (``schedule.split_moments``), as ``schedule_memory.rank_memory``
    replays it (every moment, the first largest: the backends' rows, ``costs.split_rows``,
    reach the same largest total): sum_c n_c kept_c + sum_c w_c dY_c (``held_bytes``: kept and
    dY per micro-batch of each virtual stage) in the activations, less stored_c(> l) where a
    layer of chunk c runs, the buffers at (n_c, B_c), what runs (``extras``,
    ``split_extras``) as the transient, and each chunk's gradients (``grad``, per virtual
    stage) from its first W or B under step lifetime (always under persistent). Bytes per
    GPU."""
    config = costs.config
    own = np.asarray(costs.stages_of_rank(rank), dtype=np.int64)
    into, out_of, adjust = boundaries
    kept, pending = held_bytes
    at = split_moment_arrays(
        config.num_microbatches, config.pp, config.virtual_stages, rank, config.schedule,
        costs.grad_lifetime != "step",
    )  # fmt: skip
    grads = at.started @ grad[own]
    activations = at.held @ kept[own] + at.waiting @ pending[own]
    transient = np.zeros(len(at.kind), dtype=np.int64)
    buffers = sum(
        (
            stage_buffer_bytes(
                costs, int(j), at.held[:, c], at.done[:, c], into, out_of, adjust, at.waiting[:, c]
            )
            for c, j in enumerate(own)
        ),
        np.zeros_like(transient),  # a chunk's buffers may not vary: a number
    )
    for kind in np.unique(at.kind):
        if not kind:
            continue
        rows = np.flatnonzero(at.kind == kind)
        runs = own[at.chunk[rows]]  # the virtual stage that runs beside the counts
        transient[rows] = extras[kind][runs]
        if kind == "T":
            activations[rows] -= extras["fewer"][runs]
        elif kind == "G":  # its gradients made so far in the grads column, not the transient
            made, fewer = extras["G_grads"][runs], extras["G_fewer"][runs]
            grads[rows] += made
            activations[rows] -= fewer
            transient[rows] -= made - fewer
    largest = int(np.argmax(grads + activations + buffers + transient))  # the first largest
    held = tuple(int(n) for n in at.held[largest])
    return (
        int(grads[largest]), int(activations[largest]), int(buffers[largest]), held,
        int(transient[largest]),
    )  # fmt: skip


def split_extras(
    costs: LayerCosts,
    stage_of: np.ndarray,
    stored: np.ndarray,
    transient: np.ndarray,
    recomputed: np.ndarray,
) -> dict[str, np.ndarray]:
    """Per virtual stage j, what runs beside a split-backward moment's counts
    (``schedule.split_action_moments``), bytes per GPU: "T" and "fewer", chunk j's largest
    layer moment of a forward or a full backward (``chunk_moment``: transient_l and
    stored_j(> l)); "G", its first full backward's (step lifetime: no gradient of j before
    it), max_l (transient_l - stored_j(> l) + grads_j(> l) + own_l), the layers after l with
    their gradients and l with those its backward made by its largest moment (``own_grads``,
    as ``layer_moments``' first backward), with "G_grads" and "G_fewer" the gradients and
    stored_j(> l) at that l (the breakdown's grads and activations); "I", its input step's,
    max(0, max_l X_l) (``input_step_columns``); "W" and "V", its weight step's and its first
    weight step's (``weight_step_transient``). ``stored``, ``transient``: per layer, the
    recompute set ``recomputed`` applied."""
    num = costs.num_stages
    kinds = ("T", "fewer", "G", "G_grads", "G_fewer", "I", "W", "V")
    extras = {kind: np.zeros(num, dtype=np.int64) for kind in kinds}
    members = np.argsort(stage_of, kind="stable")
    bounds = np.searchsorted(stage_of[members], np.arange(num + 1))
    columns = split_extra_columns(costs, transient, recomputed)
    inputs, grads, own = columns["X"], columns["grads"], columns["own"]
    for j in range(num):
        layers = members[bounds[j] : bounds[j + 1]]
        if not len(layers):
            continue
        fewer, top = chunk_moment(costs, layers.tolist(), stored, transient)
        extras["T"][j], extras["fewer"][j] = top, fewer
        running = costs.moment_transient(transient, costs.num_layers - 1 in layers)[layers]
        later_stored = stored[layers].sum() - np.cumsum(stored[layers])
        later_grads = grads[layers].sum() - np.cumsum(grads[layers])
        first = running - later_stored + later_grads + own[layers]
        best = int(np.argmax(first))
        extras["G"][j] = int(first[best])
        # its gradients at that layer (for the breakdown's grads column, ``_split_peak_moment``)
        extras["G_grads"][j] = int(later_grads[best] + own[layers][best])
        extras["G_fewer"][j] = int(later_stored[best])
        extras["I"][j] = max(0, int(inputs[layers].max()))
        extras["W"][j] = weight_step_transient(columns["W"], columns["End"], layers)
        extras["V"][j] = weight_step_transient(columns["W1"], columns["End1"], layers)
    return extras


def split_extra_columns(
    costs: LayerCosts, transient: np.ndarray, recomputed: np.ndarray
) -> dict[str, np.ndarray]:
    """Per layer, bytes per GPU, the columns ``split_extras`` takes per virtual stage, in one
    recompute state (``transient`` and ``recomputed`` of it; the backends' rows take both):
    "X" the input step's (``input_step_columns``), "W"/"End" and "W1"/"End1" the weight
    step's and the first weight step's (``weight_step_columns``), "own" l's own gradients
    at its largest moment of a first full backward (``own_grads``), "grads" its gradients."""
    weight, end, first_weight, first_end = weight_step_columns(costs, transient)
    grads = np.asarray(costs.grad_bytes, dtype=np.int64)
    own = grads if costs.own_grad_bytes is None else np.asarray(costs.own_grad_bytes)
    return {
        "X": input_step_columns(costs, transient, recomputed),
        "W": weight,
        "End": end,
        "W1": first_weight,
        "End1": first_end,
        "own": own,
        "grads": grads,
    }


def weight_step_columns(costs: LayerCosts, transient: np.ndarray) -> tuple[np.ndarray, ...]:
    """(W_l, End_l, W1_l, End1_l) per layer, bytes per GPU: a weight step's
    (``LayerCosts.weight_step_bytes``) and a chunk's first weight step's
    (``weight_step_first_bytes``). A layer the graph gives no ``weight_step_moments`` takes
    W_l = transient_l (its backward's transient, the earlier estimate) and End_l = 0, and in
    a first weight step its gradients beside: W1_l = transient_l + grads_l, End1_l = grads_l."""
    grads = np.asarray(costs.grad_bytes, dtype=np.int64)
    transient = np.asarray(transient, dtype=np.int64)
    if costs.weight_step_bytes is None:
        return transient, np.zeros(costs.num_layers, dtype=np.int64), transient + grads, grads
    known = costs.weight_step_known
    return (
        np.where(known, costs.weight_step_bytes, transient),
        costs.weight_step_end_bytes,
        np.where(known, costs.weight_step_first_bytes, transient + grads),
        np.where(known, costs.weight_step_first_end_bytes, grads),
    )


def input_step_columns(
    costs: LayerCosts, transient: np.ndarray, recomputed: np.ndarray
) -> np.ndarray:
    """X_l per layer, bytes per GPU: what its part of an input step holds beyond the dY it
    keeps (``LayerCosts.input_step_bytes``); a layer the graph gives none, or recomputed (its
    forward runs again first), takes its transient_l (``transient``: the recompute set
    ``recomputed`` applied)."""
    if costs.input_step_bytes is None:
        return np.asarray(transient, dtype=np.int64)
    given = (costs.input_step_bytes >= 0) & ~np.asarray(recomputed, dtype=bool)
    return np.where(given, costs.input_step_bytes, transient)


def weight_step_transient(weight: np.ndarray, end: np.ndarray, layers: np.ndarray) -> int:
    """W_j of a virtual stage holding ``layers`` (forward order): what its weight step runs
    beside the held tensors at its largest moment. torch's ``stage_backward_weight`` runs the
    param groups in parameter order, so layer l's groups run beside what the layers before it
    in the chunk left (End, their last group's weight gradients less their frees; in a first
    weight step every gradient they made):

        W_j = max(0, max_{l in j} (W_l + sum_{i in j, i < l} End_i))"""
    if not len(layers):
        return 0
    credit = np.concatenate(([0], np.cumsum(end[layers])[:-1]))
    return max(0, int((weight[layers] + credit).max()))


def weight_output_gradients(costs: LayerCosts, transient: np.ndarray) -> np.ndarray:
    """dY_l per micro-batch, bytes: the gradients at the outputs of layer l's weight ops that
    its own backward makes, which a split backward's I step keeps for its W step
    (``LayerCosts.weight_op_grad_bytes``, profiled); where the graph does not give it, the
    estimate transient_l + output_l for a layer with weights, 0 without (over: a layer's
    backward transient bounds the gradients inside it at one moment; output_l: the tensors l
    makes for later layers, ``tensor_arrays``). ``transient``: per layer, the recompute set
    applied."""
    first_edge, size, _ = costs.tensor_arrays
    output = np.zeros(costs.num_layers, dtype=np.int64)
    np.add.at(output, np.asarray(costs.edge_src)[first_edge], np.asarray(size, dtype=np.int64))
    weighted = np.asarray(costs.weight_bytes, dtype=np.int64) > 0
    estimate = np.where(weighted, np.asarray(transient, dtype=np.int64) + output, 0)
    measured = costs.weight_op_grad_bytes
    if measured is None:
        return estimate
    return np.where(measured >= 0, measured, estimate)


def output_gradient_consumers(costs: LayerCosts) -> tuple[np.ndarray, np.ndarray]:
    """(the nearest consumer of each layer's outputs, by position, -1: none; whether several
    layers read them): layer l's output gradient is a new storage on l's virtual stage when its
    nearest consumer runs there (the later ones, in a contiguous split, then too, or on later
    stages), or when several layers' gradients are summed into it; otherwise it is the stage's
    received gradient (``pending_gradients``)."""
    src = np.asarray(costs.edge_src, dtype=np.int64)
    dst = np.asarray(costs.edge_dst, dtype=np.int64)
    nearest = np.full(costs.num_layers, np.iinfo(np.int64).max)
    np.minimum.at(nearest, src, dst)
    farthest = np.full(costs.num_layers, -1)
    np.maximum.at(farthest, src, dst)
    none = farthest < 0
    return np.where(none, -1, nearest), ~none & (farthest != nearest)


def pending_gradients(
    costs: LayerCosts, stage_of: np.ndarray, transient: np.ndarray
) -> np.ndarray:
    """dY_j per micro-batch of each virtual stage j, bytes: what a micro-batch keeps between its
    I and its W step beyond its saved activations (torch 2.13 ``stage_backward_input`` keeps
    the gradients its param groups' intermediates receive for ``stage_backward_weight``):

        dY_j = sum_{l in j} own_l + sum_{l in j, a consumer of l's output in j} out_l

    own_l = ``weight_output_gradients``; out_l = ``LayerCosts.weight_op_output_grad_bytes``
    (0 where not profiled), kept only where a consumer of the output runs in j and made it
    (the last layer's output gradient is the received gradient buffer, already a boundary
    buffer). Virtual stage 0 keeps nothing: torch's ``backward_one_chunk`` skips the I step
    of the first stage (its input needs no gradient) and runs the full backward at W."""
    stage_of = np.asarray(stage_of, dtype=np.int64)
    per_layer = weight_output_gradients(costs, transient)
    if costs.weight_op_output_grad_bytes is not None:
        nearest, several = output_gradient_consumers(costs)
        local = (nearest >= 0) & (stage_of[np.maximum(nearest, 0)] == stage_of)
        per_layer = per_layer + np.where(local | several, costs.weight_op_output_grad_bytes, 0)
    pending = per_stage_sum(per_layer, stage_of, costs.num_stages)
    pending[0] = 0
    return pending


PPM = 1_000_000
"""Utilization unit: parts per million of a GPU's capacity."""


def utilization_ppm(peak_bytes: int, capacity_bytes: int) -> int:
    """ceil(10^6 peak / capacity): a stage's share of its GPU memory, in parts per million."""
    return -(-PPM * int(peak_bytes) // int(capacity_bytes))


def placed_stage_costs(
    group_costs: list[LayerCosts],
    stage_of_layer: list[int] | np.ndarray,
    group_of_stage: list[int],
    recomputed: list[bool] | np.ndarray | None = None,
) -> list[StageCost]:
    """Exact per-stage costs when stage s runs on group ``group_of_stage[s]``: ``group_costs[k]``
    are the coefficients with group k's cluster (equal memory, group-specific times, recomputed
    layers' times included)."""
    per_group = {
        k: stage_costs(group_costs[k], stage_of_layer, recomputed) for k in set(group_of_stage)
    }
    return [per_group[k][s] for s, k in enumerate(group_of_stage)]
