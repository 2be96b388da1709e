"""The tensors that cross stage boundaries and the buffers a runtime keeps for them, per
(virtual) stage and micro-batch.

  relay     = b bytes of every edge u->v with stage(u) < s < stage(v)  (passed along by stage s;
              megatron runtime: p2p between neighbours only. The torch runtime sends each
              tensor straight to every consuming stage: no relay, ``direct_boundary_bytes``)
  buffers_s = R_s b (bytes of edges entering s) + S_s b (bytes of edges leaving s)
              (a relayed edge does both), with the copies R_s, S_s the pipeline runtime keeps
              (``schedule.boundary_copies``, ``BoundaryTensors.copies_at``), + the torch
              runtime's per-tensor adjustments (``direct_buffer_adjustments``)
  edges naming one tensor (Edge.tensor) count once per stage: it crosses every boundary from its
              producer's stage to its farthest consumer's (``boundary_bytes``); on the torch
              runtime it goes from its producer's stage to each consuming stage

With sequence parallelism an edge carries ceil(b bytes / t) per micro-batch, / c more with
context parallelism. docs/cost-model.md, "Boundary buffers" and "Runtime torch: direct sends".
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from solver.costs.schedule import boundary_copies
from solver.costs.schedule_orders import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES


class BoundaryTensors:
    """The boundary-tensor views of ``LayerCosts`` (mixed into it; they read its ``edge_*``
    fields, runtime and copies): which tensors cross a boundary, their roles, the copies kept.
    The functions of this module take a ``LayerCosts``, typed by this base class of it (the
    coefficients module imports this one)."""

    def copies_at(
        self,
        stage: int,
        held: int,
        done: int = 0,
        pending: int = 0,
        moment: tuple[int, int] | None = None,
    ) -> tuple[int, int]:
        """(R_j, S_j) of (virtual) stage j while it holds ``held`` micro-batches in flight and
        has done ``done`` backwards (``pending`` of the held ones between their I and W steps
        of a split backward); ``moment``: the (R_j, S_j) a moment of megatron-core's
        interleaved schedule gives (``LayerCosts.moment_copies``), returned as is.

        Without interleaving the stage's constants (``boundary_copies`` at held = k_s), or
        ``boundary_copies`` at another moment (torch's GPipe keeps its sends: + ``done``).
        megatron: (1, 1) inside the pipeline, or (1, 1 + held) without
        ``deallocate_pipeline_outputs``: the sent outputs of the ``held`` in-flight
        micro-batches stay alive until their backward. With interleaving its moments give their
        own (``moment``; ``megatron_buffers``: up to 5 boundary tensors per rank after a
        backward); elsewhere (the optimizer step) those constants. torch: each PipelineStage
        allocates a receive buffer per micro-batch for the run (m on a non-first stage, of which
        the ``held`` in-flight ones are its saved inputs, already in the activations) and m
        gradient receive buffers plus the outputs of its ``held`` in-flight micro-batches (on a
        non-last stage): (m - held, m + held). With interleaving torch's runtime schedule
        (``_PipelineScheduleRuntime``) waits on its sends only at the end of the step, so every
        output sent and every input gradient sent back stays alive until then: (m - held + done,
        m + held + done) (measured, ``benchmarks/bench_accuracy.md``). The split-backward
        schedules run on the same runtime at any v; their I step sends the input gradient, which
        stays alive until the step's end too: R_j + ``pending`` (tagged at the peaks of
        ``benchmarks/bench_accuracy_schedules.md``). ``held``, ``done`` and ``pending`` may be
        int64 arrays of a moment each (``stage_buffer_bytes``): arrays of (R_j, S_j)."""
        if moment is not None:
            return moment
        split = self.config.schedule in ZERO_BUBBLE_SCHEDULES and self.runtime == "torch"
        if self.config.virtual_stages == 1 and not split:
            if isinstance(held, np.ndarray):  # a value per moment: each distinct one once
                pairs, inverse = np.unique(np.stack([held, done]), axis=1, return_inverse=True)
                copies = [self.copies_at(stage, int(h), int(d)) for h, d in pairs.T.tolist()]
                values = np.asarray(copies, dtype=np.int64)[inverse.reshape(-1)]
                return values[:, 0], values[:, 1]
            if held == self.in_flight[stage] and not done:
                return self.receive_copies[stage], self.send_copies[stage]
            return boundary_copies(  # a later moment of the schedule (``after_moments``)
                self.runtime,
                self.config.schedule,
                self.config.num_microbatches,
                self.num_stages,
                stage,
                deallocate_pipeline_outputs=self.deallocate_pipeline_outputs,
                held=held,
                done=done,
            )
        m, last = self.config.num_microbatches, self.num_stages - 1
        if self.runtime == "megatron":  # R_j, S_j are the moments' largest (for bounds)
            kept_outputs = 0 if self.deallocate_pipeline_outputs else held
            return int(stage > 0), (0 if stage == last else 1 + kept_outputs)
        turn = self.v_turn
        if stage == turn:  # its inputs come by function call: m storages, the held stored
            return m - held, m + held + done
        if turn is not None and stage == turn - 1:  # its gradients: m storages, outputs in turn's
            return m - held + done + pending, m
        return (
            (0 if stage == 0 else m - held + done + pending),
            (0 if stage == last else m + held + done),
        )

    @property
    def v_turn(self) -> int | None:
        """The V's turn-around of a zbv or dualpipev run on the torch runtime: virtual stage
        p, whose neighbour p - 1 runs on the same rank (p - 1), so torch passes the boundary
        tensors between them by function call (``set_local_fwd_input``: p's receive buffer i
        becomes p - 1's output; ``set_local_bwd_input``: p - 1's gradient buffer i becomes p's
        input gradient, each freeing the fresh buffer): m storages each way, whatever the
        schedule has run. So R_p = m - held (the held inputs are stored) and S_{p-1} = m (its
        outputs are p's buffers), with no sent copies kept to the step's end. None otherwise.
        Tagged at the peaks of benchmarks/bench_accuracy_schedules.md."""
        if self.runtime != "torch" or self.config.schedule not in V_SCHEDULES:
            return None
        return self.num_stages // 2

    @property
    def direct_sends(self) -> bool:
        """Each boundary tensor goes straight from its producer's stage to every consuming
        stage, nothing relayed (torch.distributed.pipelining; ``direct_boundary_bytes``); False:
        from neighbour to neighbour (Megatron-LM's and DeepSpeed's p2p, ``boundary_bytes``)."""
        return self.runtime == "torch"

    @cached_property
    def tensor_groups(self) -> list[tuple[list[int], int]]:
        """(edges, bytes per micro-batch) of every tensor that edges carry, in order of first
        edge; one edge each unless the graph names a tensor sent to several consumers."""
        groups: dict[int, list[int]] = {}
        for edge, tensor in enumerate(self.edge_tensor.tolist()):
            groups.setdefault(tensor, []).append(edge)
        return [(edges, int(self.edge_bytes[edges[0]])) for edges in groups.values()]

    @cached_property
    def tensor_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``tensor_groups`` as arrays: (each tensor's first edge, its bytes per micro-batch,
        each edge's tensor index), tensors in the same order (of first edge)."""
        _, first_edge, of_edge = np.unique(self.edge_tensor, return_index=True, return_inverse=True)
        order = np.argsort(first_edge, kind="stable")  # tensors by first edge
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        first_edge = first_edge[order]
        return first_edge, np.asarray(self.edge_bytes, dtype=np.int64)[first_edge], rank[of_edge]

    @cached_property
    def tensor_roles(self) -> list[tuple[bool, bool, list[int]]]:
        """Parallel to ``tensor_groups``: (requires grad, whether its consumers' saving is known,
        the layers whose stored bytes count its storage) of every tensor, for the torch
        runtime's buffers (``direct_buffer_adjustments``)."""
        roles = []
        for edges, _ in self.tensor_groups:
            grad = self.edge_requires_grad is None or bool(self.edge_requires_grad[edges[0]])
            known = self.edge_saved is not None and bool((self.edge_saved[edges] >= 0).any())
            charged = set()
            if self.edge_charged is not None:
                charged = {int(self.edge_dst[e]) for e in edges if self.edge_charged[e]}
            if self.edge_src_charged is not None and self.edge_src_charged[edges[0]]:
                charged.add(int(self.edge_src[edges[0]]))
            roles.append((grad, known, sorted(charged)))
        return roles

    @cached_property
    def plain_boundaries(self) -> bool:
        """Every tensor requires grad and goes to one consumer whose stored bytes count it (or
        its saving is unknown), so each boundary takes today's R_s and S_s copies and no
        adjustment (``direct_buffer_adjustments``): what the chain methods assume."""
        return not self.direct_sends or all(
            grad
            and (
                not known
                or charged
                == [int(self.edge_dst[edges[0]])]
                == [int(self.edge_dst[e]) for e in edges]
            )
            for (edges, _), (grad, known, charged) in zip(
                self.tensor_groups, self.tensor_roles, strict=True
            )
        )


def boundary_bytes(
    costs: BoundaryTensors, stage_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(into, out_of, relayed) per (virtual) stage, per micro-batch: the bytes a stage
    receives, the bytes it sends, and those it relays, each tensor counted once per stage
    (``LayerCosts.tensor_groups``). A tensor made on stage a whose farthest consumer is on
    stage c > a crosses every boundary between them: a sends it, c receives it, and every stage
    in between receives it, keeps it in flight and sends it on (relay), whatever it consumes
    itself. With ``LayerCosts.direct_sends`` (the torch runtime) nothing is relayed
    (:func:`direct_boundary_bytes`)."""
    if costs.direct_sends:
        return direct_boundary_bytes(costs, stage_of)
    num_stages = costs.num_stages
    sent = np.zeros(num_stages, dtype=np.int64)
    received = np.zeros(num_stages, dtype=np.int64)
    relay_steps = np.zeros(num_stages + 1, dtype=np.int64)  # relayed = its prefix sum
    first_edge, size, tensor_of_edge = costs.tensor_arrays
    made = np.asarray(stage_of, dtype=np.int64)[costs.edge_src[first_edge]]
    farthest = np.full(len(first_edge), np.iinfo(np.int64).min)
    np.maximum.at(farthest, tensor_of_edge, np.asarray(stage_of, dtype=np.int64)[costs.edge_dst])
    crossing = (farthest != made) & (size != 0)
    np.add.at(sent, made[crossing], size[crossing])
    np.add.at(received, farthest[crossing], size[crossing])
    # stages made + 1 .. farthest - 1 relay it: + at made + 1, - at farthest
    through = crossing & (farthest > made + 1)
    np.add.at(relay_steps, made[through] + 1, size[through])
    np.add.at(relay_steps, farthest[through], -size[through])
    relayed = np.cumsum(relay_steps[:num_stages])
    return received + relayed, sent + relayed, relayed


def direct_boundary_bytes(
    costs: BoundaryTensors, stage_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(into, out_of, relayed = 0) per (virtual) stage, per micro-batch, when each tensor goes
    straight from its producer's stage to every stage that consumes it, as
    torch.distributed.pipelining sends it: a ``PipelineStage`` maps each output to all its
    destination stages (``act_send_info``) and a consumer stage allocates its receive buffers
    for it (``args_recv_info``); no stage in between sees it. Per tensor t and stage s:

      receive(t, s) = stage(producer) < s and some consumer of t is on s
      send(t, s)    = stage(producer) = s and some consumer of t is after s

    each counted once per stage however many of its layers read t."""
    num_stages = costs.num_stages
    sent = np.zeros(num_stages, dtype=np.int64)
    received = np.zeros(num_stages, dtype=np.int64)
    first_edge, size, tensor_of_edge = costs.tensor_arrays
    stage_of = np.asarray(stage_of, dtype=np.int64)
    made = stage_of[costs.edge_src[first_edge]]
    consumer = stage_of[costs.edge_dst]
    # each (tensor, later consuming stage) once
    later = (consumer > made[tensor_of_edge]) & (size[tensor_of_edge] != 0)
    pairs = np.unique(tensor_of_edge[later] * num_stages + consumer[later])
    tensors, readers = pairs // num_stages, pairs % num_stages
    np.add.at(received, readers, size[tensors])
    read = np.unique(tensors)
    np.add.at(sent, made[read], size[read])
    return received, sent, np.zeros(num_stages, dtype=np.int64)


def direct_buffer_adjustments(
    costs: BoundaryTensors, stage_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(per held micro-batch, per micro-batch of the run) bytes per (virtual) stage that the
    torch runtime's buffers differ from R_s into + S_s out_of (``boundary_copies``), from what
    the graph says of each tensor (``LayerCosts.tensor_roles``; zeros on the megatron runtime
    and for graphs without these fields). Per tensor t of size n and stage s:

      received, saving known, no layer of s counts t   + held n  (R = m: every receive buffer
                                                                 holds t, none is a stored input)
      sent, a layer of s counts t                       - held n  (the held outputs are stored;
                                                                 not on a V's p - 1, ``v_turn``)
      sent, t does not require grad                     - m n     (no gradient receive buffers)

    (docs/cost-model.md, "Runtime torch: direct sends")."""
    num_stages = costs.num_stages
    per_held = np.zeros(num_stages, dtype=np.int64)
    no_grad = np.zeros(num_stages, dtype=np.int64)
    if not costs.direct_sends or costs.plain_boundaries:
        return per_held, no_grad
    producer, consumer = stage_of[costs.edge_src], stage_of[costs.edge_dst]
    roles = costs.tensor_roles
    for (edges, size), (grad, known, charged) in zip(costs.tensor_groups, roles, strict=True):
        made = int(producer[edges[0]])
        readers = {int(s) for s in consumer[edges].tolist() if s > made}
        if not readers or not size:
            continue
        counted = {int(stage_of[layer]) for layer in charged}
        turn = costs.v_turn  # its S counts no held outputs (``v_turn``)
        if made in counted and (turn is None or made != turn - 1):
            per_held[made] -= size
        if not grad:
            no_grad[made] += size
        for s in readers:
            if known and s not in counted:
                per_held[s] += size
    return per_held, no_grad


def stage_buffer_bytes(
    costs: BoundaryTensors,
    stage: int,
    held: int,
    done: int,
    into: np.ndarray,
    out_of: np.ndarray,
    adjust: tuple[np.ndarray, np.ndarray] | None = None,
    pending: int = 0,
    moment: tuple[int, int] | None = None,
) -> int:
    """Boundary buffers of (virtual) stage j holding ``held`` micro-batches after ``done``
    backwards (``pending`` between a split backward's I and W), bytes: R into + S out_of
    (``LayerCosts.copies_at``) plus the torch runtime's per-tensor adjustments
    (``direct_buffer_adjustments``; None: none); ``moment``: ``copies_at``'s. Under a
    split-backward schedule ``held``, ``done`` and ``pending`` may be int64 arrays (a value per
    moment, ``schedule.split_moment_arrays``): an array of the bytes at each."""
    receive, send = costs.copies_at(stage, held, done, pending, moment)
    total = receive * int(into[stage]) + send * int(out_of[stage])
    if adjust is not None:
        per_held, no_grad = adjust
        total = (
            total
            + held * int(per_held[stage])
            - costs.config.num_microbatches * int(no_grad[stage])
        )
    return total if isinstance(total, np.ndarray) else int(total)
