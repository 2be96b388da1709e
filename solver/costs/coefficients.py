"""The per-layer integer coefficients of one config (:class:`LayerCosts`): what every backend,
the baselines, the evaluation and the reports read. ``layers.layer_costs`` computes them;
``stages.stage_costs`` sums them over an assignment. The boundary tensors' views are
``boundaries.BoundaryTensors``, the time views ``times.TimeViews``.

Recomputation (``ParallelConfig.recompute``): "none" recomputes no layer, "full" every layer,
"selective" the layers a solver chooses; :class:`LayerCosts` carries both states of every layer
(``stored_bytes`` / ``recompute_stored_bytes``, and likewise transient and time) and
``stage_costs`` takes the chosen set. Only recomputable layers are recomputed
(``LayerCosts.recomputable``): on the megatron runtime the transformer blocks (Megatron-LM's
``--recompute-granularity full`` checkpoints the layers of its TransformerBlock, never the
embedding or the output layer and loss; measured, tests/test_megatron.py); on the torch runtime
every layer. A layer that cannot be recomputed has the same coefficients in both states.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from solver.costs.boundaries import BoundaryTensors
from solver.costs.schedule import stage_boundary_copies
from solver.costs.schedule_orders import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, rank_stages
from solver.costs.times import PipelineLinks, TimeViews
from solver.specs import ParallelConfig


class RecomputeStates:
    """The recompute views of ``LayerCosts`` (mixed into it): each layer's coefficients with or
    without recomputation, for a given recompute set, and their bounds over every set."""

    @property
    def selective(self) -> bool:
        """Recomputation is a per-layer decision (config.recompute == "selective"): the plain
        coefficients are a layer's without recomputation, the ``recompute_*`` ones with it."""
        return self.config.recompute == "selective"

    def uniform(self, recompute: bool) -> LayerCosts:
        """These coefficients with no layer (False) or every layer (True) recomputed, as a plain
        "none" / "full" config (what the chain algorithm takes); themselves unless selective."""
        if not self.selective:
            return self
        stored, transient, time_ns = self.coefficients([recompute] * self.num_layers)
        return dataclasses.replace(
            self,
            config=dataclasses.replace(self.config, recompute="full" if recompute else "none"),
            stored_bytes=stored,
            transient_bytes=transient,
            time_ns=time_ns,
            recompute_stored_bytes=None,
            recompute_transient_bytes=None,
            recompute_time_ns=None,
        )

    def recompute_mask(self, recomputed: list[bool] | np.ndarray | None) -> np.ndarray:
        """Which layers are recomputed: every recomputable one under "full", none under "none",
        the given recomputable ones (default none) under "selective"."""
        n = self.num_layers
        recomputable = np.ones(n, dtype=bool) if self.recomputable is None else self.recomputable
        if self.config.recompute == "full":
            return recomputable.copy()
        if recomputed is None or not self.selective:
            assert recomputed is None or not np.any(recomputed), "recompute set without selective"
            return np.zeros(n, dtype=bool)
        mask = np.asarray(recomputed, dtype=bool)
        assert mask.shape == (n,), f"{mask.shape} recompute flags for {n} layers"
        return mask & recomputable

    def bounding_coefficients(self, pick=np.minimum) -> tuple[np.ndarray, ...]:
        """(stored_bytes, transient_bytes, time_ns) per layer, the smaller (``np.minimum``) or
        larger (``np.maximum``) of the two states under "selective": bounds over every
        recompute set."""
        if not self.selective:
            return self.stored_bytes, self.transient_bytes, self.time_ns
        return (
            pick(self.stored_bytes, self.recompute_stored_bytes),
            pick(self.transient_bytes, self.recompute_transient_bytes),
            pick(self.time_ns, self.recompute_time_ns),
        )

    def coefficients(self, recomputed: list[bool] | np.ndarray | None) -> tuple[np.ndarray, ...]:
        """(stored_bytes, transient_bytes, time_ns) per layer with the given layers recomputed."""
        if not self.selective:
            return self.stored_bytes, self.transient_bytes, self.time_ns
        mask = self.recompute_mask(recomputed)
        return (
            np.where(mask, self.recompute_stored_bytes, self.stored_bytes),
            np.where(mask, self.recompute_transient_bytes, self.transient_bytes),
            np.where(mask, self.recompute_time_ns, self.time_ns),
        )


@dataclass(kw_only=True)
class LayerCosts(RecomputeStates, BoundaryTensors, TimeViews):
    """Per-layer integer coefficients of one config (arrays indexed by topological position)."""

    config: ParallelConfig
    weight_bytes: np.ndarray
    """Weights per GPU, bytes."""
    grad_bytes: np.ndarray
    """Gradients per GPU, bytes."""
    optimizer_bytes: np.ndarray
    """Optimizer state per GPU, bytes."""
    stored_bytes: np.ndarray
    """Activations kept per in-flight micro-batch per GPU, bytes."""
    transient_bytes: np.ndarray
    """Extra peak while the layer runs, per micro-batch per GPU, bytes."""
    time_ns: np.ndarray
    """Forward + backward (+ recompute) time per micro-batch, ns."""
    dp_sync_ns: np.ndarray
    """Data-parallel gradient synchronisation time per step, ns."""
    edge_src: np.ndarray
    """Edge source positions."""
    edge_dst: np.ndarray
    """Edge destination positions."""
    edge_bytes: np.ndarray
    """Bytes an edge carries per micro-batch per GPU (b bytes, / t with sequence parallelism)."""
    edge_tensor: np.ndarray | None = None
    """The tensor each edge carries, as an index (edges of one tensor share it: the graph's
    ``Edge.tensor``); None: a tensor per edge. A stage receives, sends and relays each tensor
    once (``boundary_bytes``, ``tensor_groups``)."""
    edge_requires_grad: np.ndarray | None = None
    """Per edge, the tensor requires grad when sent (``Edge.requires_grad``); None: all do."""
    edge_saved: np.ndarray | None = None
    """Per edge: 1 the consumer saves the tensor, 0 it does not, -1 unknown (``Edge.saved``);
    None: all unknown."""
    edge_charged: np.ndarray | None = None
    """Per edge, the consumer's stored bytes count the tensor's storage (``Edge.charged``);
    None: none."""
    edge_src_charged: np.ndarray | None = None
    """Per edge, the producer's stored bytes count the tensor's storage (``Edge.src_charged``);
    None: none."""
    in_flight: list[int]
    """k_j for each (virtual) stage j: the most micro-batches whose activations it holds at once
    (``in_flight_vectors``; k_s of ``schedule`` without interleaving)."""
    in_flight_vectors: list[list[tuple[int, ...]]] = field(default_factory=list)
    """For each rank r, the vectors (n_0 .. n_{v-1}) of micro-batches held per chunk at the
    moments that can be its peak (``in_flight_vectors``); [(k_r,)] without interleaving (the
    default, from ``in_flight``)."""
    backwards_done: list[list[tuple[int, ...]]] = field(default_factory=list)
    """Parallel to ``in_flight_vectors``: backwards each chunk has done at that moment (only
    the torch runtime's interleaved buffers depend on it; zeros by default)."""
    running_chunks: list[list[int]] = field(default_factory=list)
    """Parallel to ``in_flight_vectors`` (interleaved 1F1B): the chunk whose layer runs at that
    moment, -1 none (``schedule.running_moments``; ``stages._rank_peak_moment`` adds that
    chunk's largest layer moment). Empty: the persistent moment, every moment with the rank's
    largest transient (the split-backward schedules; one chunk per rank has its own layer
    moments, ``stages.layer_moments``)."""
    moment_copies: list[list[tuple[tuple[int, int], ...]]] = field(default_factory=list)
    """Parallel to ``in_flight_vectors`` (megatron-core with interleaving): the (R, S) each
    chunk keeps at that moment (``megatron_buffers.megatron_moment_copies``), which
    ``copies_at`` returns for it; empty otherwise."""
    pending_vectors: list[list[tuple[int, ...]]] = field(default_factory=list)
    """Parallel to ``in_flight_vectors``: per chunk the held micro-batches between their I and
    their W (split-backward schedules, ``split_rows``; zeros by default)."""
    split_extras: list[list[tuple[str, int]]] = field(default_factory=list)
    """Per rank, per moment of ``split_rows``: (kind, chunk) of what runs beside its counts
    (``schedule.SplitMoment``; split-backward schedules only)."""
    grads_started: list[list[tuple[bool, ...]]] = field(default_factory=list)
    """Parallel to ``in_flight_vectors``: per chunk, its gradients exist at that moment (a W
    or B of the chunk has run: split-backward schedules under step lifetime, ``split_rows``;
    True by default)."""
    receive_copies: list[int] = field(default_factory=list)
    """R_s for each stage: copies of a received edge's bytes (``boundary_copies``; the megatron
    runtime's when not given). With interleaving on the torch runtime they depend on the
    in-flight vector (``copies_at``) and these are their largest values (for bounds)."""
    send_copies: list[int] = field(default_factory=list)
    """S_s for each stage: copies of a sent edge's bytes."""
    runtime: str = "megatron"
    """The pipeline runtime whose buffers ``copies_at`` describes; torch also sends each
    boundary tensor straight to its consumers (``direct_sends``)."""
    deallocate_pipeline_outputs: bool = True
    """megatron runtime: sent outputs are freed at once (``TrainingConfig``'s field of that
    name); False keeps those of the in-flight micro-batches (``copies_at``)."""
    constant_bytes: int = 0
    """Added to every stage's peak (a calibration's constant per GPU), bytes."""
    held_output_bytes: int = 0
    """torch runtime: the model's output the pipeline keeps for its ``loss_fn`` (b
    unsaved_output_bytes per micro-batch, bytes, part of the last layer's stored bytes), which
    stays live through the backward of every layer of the stage holding the last layer
    (``moment_transient``); 0 on megatron (its loss frees the logits inside the last layer)."""
    recompute_stored_bytes: np.ndarray | None = None
    """stored_bytes of a recomputed layer (b output_bytes); None: the same as stored_bytes."""
    recompute_transient_bytes: np.ndarray | None = None
    """transient_bytes of a recomputed layer (its saved tensors re-materialised too)."""
    recompute_time_ns: np.ndarray | None = None
    """time_ns of a recomputed layer (the forward runs twice)."""
    recomputable: np.ndarray | None = None
    """Which layers the runtime can recompute (``recomputable_layers``); None: every layer."""
    grad_lifetime: str = "persistent"
    """When the ``.grad`` gradients (``grad_bytes``) exist: persistent (all step) or step (from
    each layer's first backward of the step; ``first_backward_peak``)."""
    own_grad_bytes: np.ndarray | None = None
    """Per GPU, bytes: the gradients of layer l's own parameters at its largest moment of a
    first backward, beside its transient (``own_grads``; at most ``grad_bytes``); None: all of
    them (``grad_bytes``). Added to l's moment where its gradients appear at the first
    backward (``late_own``)."""
    backward_weight_bytes: np.ndarray | None = None
    """Per GPU, bytes: the part of ``weight_bytes`` a layer holds only from its backward to its
    next forward (FSDP2 ZeRO 3 under pipelining, ``fsdp.backward_weight_bytes``); at layer l's
    moment the stage holds those of its layers after l (``late_column``). None: none."""
    gather_bytes: np.ndarray | None = None
    """Per GPU, bytes: the part of ``transient_bytes`` (both recompute states) that is the
    layer's gathered weights while others are resharded (with ``backward_weight_bytes``); the
    moment after a backward, where every one of them is live, counts the rest
    (``after_transient``). None: none."""
    grad_buffer_bytes: np.ndarray | None = None
    """Gradient buffers kept for the whole run beside ``.grad``, per GPU, bytes: DDP's buckets
    when ``zero_grad(set_to_none=True)`` frees ``.grad`` (``ddp_bucket_bytes``); None: none.
    Part of ``state_bytes`` and of a stage's ``grad_bytes``."""
    input_batch_bytes: np.ndarray | None = None
    """The model inputs a torch pipeline's ``step()`` holds for the whole step on the stage
    that reads them, per GPU, bytes (``states.input_batch_bytes``: m b model_input_bytes);
    None: none. Part of ``state_bytes`` and of a stage's ``buffer_bytes``."""
    step_bytes: np.ndarray | None = None
    """The optimizer step's temporary per GPU, bytes (``optimizer_step_bytes``: a foreach Adam's
    square root of ``exp_avg_sq``, sharded like the optimizer state); None: no temporary (fused,
    or an optimizer without one), and no optimizer-step moment."""
    weight_op_grad_bytes: np.ndarray | None = None
    """Per micro-batch per layer, bytes: the gradients at the outputs of its weight ops its own
    backward makes, which a split backward's input step keeps for the weight step (the graph's
    ``weight_op_grad_bytes``); -1 where the graph does not give it, None: no layer does
    (``stages.weight_output_gradients`` estimates those)."""
    weight_op_output_grad_bytes: np.ndarray | None = None
    """Per micro-batch per layer, bytes: its output's gradient among them, kept where a consumer
    runs in the same virtual stage (``stages.pending_gradients``); None: 0."""
    weight_step_bytes: np.ndarray | None = None
    """Per micro-batch per layer, bytes per GPU: W_l, the largest moment of its part of a split
    backward's weight step beside the held tensors (the graph's ``weight_step_moments``,
    ``layers.weight_step_columns``; may be negative: the frees so far); None: no layer gives
    it (``stages.weight_step_transients`` takes ``transient_bytes``)."""
    weight_step_end_bytes: np.ndarray | None = None
    """End_l, the same at the end of its part (what the next layer's W runs beside); 0 where
    not given."""
    weight_step_first_bytes: np.ndarray | None = None
    """W_l of a chunk's first weight step (step lifetime: no ``.grad`` yet, each group's
    dweights become its gradients, so the groups so far of l count, none of the later ones);
    None with ``weight_step_bytes``."""
    weight_step_first_end_bytes: np.ndarray | None = None
    """End_l of a chunk's first weight step (every gradient of l, its frees)."""
    weight_step_known: np.ndarray | None = None
    """Which layers give ``weight_step_bytes`` (the others take their transient)."""
    input_step_bytes: np.ndarray | None = None
    """Per micro-batch per layer, bytes per GPU: what its part of a split backward's input step
    holds beyond the dY it keeps (the graph's ``input_step_transient_bytes``); -1 where not
    given and for a recomputed layer (``stages.split_extras`` takes its transient then)."""
    forward_ns: np.ndarray | None = None
    """The forward's part of ``time_ns`` per micro-batch, ns, the same in both recompute states
    (``layer_time_ns``); the rest is the backward (``backward_ns``). None: time_ns // 3 (a backward
    of twice the forward's FLOPs, the model's default)."""
    optimizer_step_ns: np.ndarray | None = None
    """The optimizer step over each layer's parameters on one GPU (its ZeRO shard), ns per
    iteration (``layer_optimizer_step_ns``); None: no step time."""
    microbatch_overhead_ns: int = 0
    """The pipeline runtime's own time per micro-batch and (virtual) stage, ns (profiled:
    ``meta.timing.microbatch_overhead_ns``): charged once per forward action."""
    step_overhead_ns: int = 0
    """The runtime's own time per step and rank beside its micro-batches and optimizer step, ns
    (profiled: ``meta.timing.step_overhead_ns``): part of every rank's tail."""
    link_gb_per_s: Mapping[tuple[int, int], float] | PipelineLinks | None = None
    """Bandwidth of each directed link between pipeline ranks, GB/s == bytes/ns, looked up as
    ``links[(x, y)]`` (``pipeline_links``); None: transfers take no time."""
    p2p_latency_ns: int = 0
    """Added to every pipeline transfer between two ranks, ns (``Cluster.p2p_latency_us``)."""
    dp_overlap: str = "none"
    """When a rank's data-parallel gradient sync runs (``schedule_time.DP_OVERLAPS``,
    ``dp_overlap_of``): after its last backward ("none"), or launched during it
    ("last_backward")."""

    def __post_init__(self) -> None:
        if self.edge_tensor is None:
            self.edge_tensor = np.arange(len(self.edge_src), dtype=np.int64)
        if not self.in_flight_vectors:
            self.in_flight_vectors = [[(k,)] for k in self.in_flight]
        if not self.backwards_done:
            self.backwards_done = [
                [(0,) * len(vector) for vector in vectors] for vectors in self.in_flight_vectors
            ]
        if not self.pending_vectors:
            self.pending_vectors = [
                [(0,) * len(vector) for vector in vectors] for vectors in self.in_flight_vectors
            ]
        if not self.grads_started:
            self.grads_started = [
                [(True,) * len(vector) for vector in vectors] for vectors in self.in_flight_vectors
            ]
        if not self.receive_copies and not self.send_copies:
            self.receive_copies, self.send_copies = stage_boundary_copies(
                "megatron",
                self.config,
                deallocate_pipeline_outputs=self.deallocate_pipeline_outputs,
                in_flight=self.in_flight,
            )
        if self.recompute_stored_bytes is None:
            self.recompute_stored_bytes = self.stored_bytes
        if self.recompute_transient_bytes is None:
            self.recompute_transient_bytes = self.transient_bytes
        if self.recompute_time_ns is None:
            self.recompute_time_ns = self.time_ns
        if self.forward_ns is None:
            self.forward_ns = self.time_ns // 3
        if self.optimizer_step_ns is None:
            self.optimizer_step_ns = np.zeros(len(self.time_ns), dtype=np.int64)

    @cached_property
    def first_backward_peak(self) -> list[bool]:
        """Per (virtual) stage: its gradients appear during its first backward and no forward
        follows it, so its peak is one of the moments of ``stages.layer_moments`` with grads(> l)
        rather than every gradient. True where the gradient lifetime is "step" and every forward
        of the step runs before the stage's first backward: GPipe, or 1F1B with m <= p - s
        (k_s = m). Under 1F1B with m > p - s a forward follows the first backward, holding k_s
        micro-batches and every gradient: the moments with every gradient, exactly. Interleaved
        stages keep every gradient at every moment (an upper bound: fewer gradients never take
        memory)."""
        if self.backward_weight_bytes is not None and self.config.virtual_stages == 1:
            return [True] * len(self.in_flight)  # late_column: every stage, every schedule
        return self.grads_late

    def copies_of_moments(self, rank: int) -> list[tuple[tuple[int, int], ...] | None]:
        """Parallel to ``in_flight_vectors[rank]``: the moment's (R, S) per chunk
        (``moment_copies``), None where ``copies_at`` follows (held, done)."""
        if self.moment_copies:
            return list(self.moment_copies[rank])
        return [None] * len(self.in_flight_vectors[rank])

    @cached_property
    def after_moments(self) -> list[tuple[tuple[int, int], ...]]:
        """Per (virtual) stage without interleaving (() with ``rank_rows``): (h, k_s - h), the
        micro-batches held and the backwards done at each moment after a backward that can set
        its peak (``stages.layer_moments``: every gradient, those h micro-batches whole, the
        stage's largest transient, the buffers ``copies_at(s, h, k_s - h)``), largest h first.

        k_s - 1 where gradients appear at the first backward and no forward follows it
        (``first_backward_peak``: after the first backward every gradient exists). Under torch's
        GPipe (m >= 2) also m - 1 and 1 at every stage: its send works hold the outputs and sent
        input gradients of the micro-batches already back-propagated until ``step()`` returns
        (``schedule.boundary_copies``), so in the backward phase the buffers grow by two
        received copies per backward as one micro-batch's activations go; the moment with h
        held, h kept + buffers(h), is linear in h over 1 <= h <= m - 1 and its largest is at
        an end. The moment after a backward with h held bounds the next backward's moments
        (its micro-batch counted whole, with the stage's largest transient: over by what its
        backward has freed); the last backward (h = 1) is the largest where a stage stores less
        than two copies of its input (full recomputation)."""
        if self.rank_rows:
            return [() for _ in self.in_flight]
        m = self.config.num_microbatches
        gpipe = self.runtime == "torch" and self.config.schedule == "gpipe" and m >= 2
        moments = []
        for late, k in zip(self.first_backward_peak, self.in_flight, strict=True):
            held = ({k - 1} if late else set()) | ({m - 1, 1} if gpipe else set())
            moments.append(tuple((h, k - h) for h in sorted(held, reverse=True)))
        return moments

    @cached_property
    def after_table(self) -> np.ndarray:
        """``after_moments`` as an array [stage, moment, (h, R, S)]: the micro-batches held and
        the copies then (``copies_at``), each stage's last moment repeated to as many as any
        stage has (zeros where a stage has none), for vectorised backends."""
        most = max(map(len, self.after_moments), default=0)
        table = np.zeros((self.num_stages, most, 3), dtype=np.int64)
        for stage, moments in enumerate(self.after_moments):
            for i in range(most if moments else 0):
                h, done = moments[min(i, len(moments) - 1)]
                table[stage, i] = (h, *self.copies_at(stage, h, done))
        return table

    @cached_property
    def most_copies(self) -> tuple[int, int]:
        """(R, S): the most copies of a received and of a sent boundary tensor any stage keeps
        at a moment of ``stages.layer_moments`` (at k_s or ``after_moments``), for bounds."""
        copies = [(r, s) for r, s in zip(self.receive_copies, self.send_copies, strict=True)]
        copies += [
            self.copies_at(stage, h, done)
            for stage, moments in enumerate(self.after_moments)
            for h, done in moments
        ]
        return max(r for r, _ in copies), max(s for _, s in copies)

    @cached_property
    def grads_late(self) -> list[bool]:
        """Per (virtual) stage: its gradients appear at its first backward, which no forward
        follows (``first_backward_peak``'s rule for the gradients)."""
        m = self.config.num_microbatches
        late = self.grad_lifetime == "step" and not self.rank_rows
        return [late and k == m for k in self.in_flight]

    def after_transient(self, transient: np.ndarray) -> np.ndarray:
        """transient_l (per layer, a recompute set applied) as the moment after a first backward
        (``first_backward_peak``) takes it, bytes: less ``gather_bytes``, whose weights that
        moment counts whole among the states."""
        if self.gather_bytes is None:
            return transient
        return np.asarray(transient, dtype=np.int64) - self.gather_bytes

    def late_column(self, stage: int) -> np.ndarray:
        """Per layer, the states that at layer l's moment of (virtual) stage ``stage``, if it is
        a ``first_backward_peak`` stage, exist only for the stage's layers after l, bytes: the
        gradients where they appear at its first backward (no forward follows it), plus where
        FSDP2 ZeRO 3 runs under pipelining the unsharded weights (``backward_weight_bytes``)."""
        grads = self.grads_late[stage]
        if self.backward_weight_bytes is None:
            return self.grad_bytes
        return self.backward_weight_bytes + (self.grad_bytes if grads else 0)

    def late_own(self, stage: int) -> np.ndarray:
        """Per layer, what layer l's moment of (virtual) stage ``stage`` adds beside its
        transient, bytes: where its gradients appear at the first backward (``grads_late``),
        those of l's own parameters made by then (``own_grad_bytes``), else 0 (every gradient
        is in the moment already, or none)."""
        return self._late_own[stage]

    @cached_property
    def _late_own(self) -> list[np.ndarray]:
        own = self.grad_bytes if self.own_grad_bytes is None else self.own_grad_bytes
        own = np.asarray(own, dtype=np.int64)
        none = np.zeros(len(self.grad_bytes), dtype=np.int64)
        return [own if late else none for late in self.grads_late]

    @cached_property
    def state_lower_bytes(self) -> np.ndarray:
        """Per layer, states a stage holding it keeps at its peak at least: the weights and
        optimizer state, plus the gradients unless some stage's peak can come before them
        (``first_backward_peak``), bytes (for lower bounds)."""
        if any(self.first_backward_peak) or (
            self.split_backward
            and not all(all(g) for rank in self.grads_started for g in rank)
        ):
            late = [self.late_column(s) for s in range(self.num_stages)]
            return self.state_bytes - np.max(late, axis=0)
        return self.state_bytes

    @property
    def split_backward(self) -> bool:
        """A split-backward schedule (zbv, dualpipev, interleaved-zb): each rank's peak is a row
        per moment of ``split_rows`` (held, pending W, done, gradients started)."""
        return self.config.schedule in ZERO_BUBBLE_SCHEDULES

    @property
    def layer_moment_ranks(self) -> bool:
        """Interleaved ranks whose moments say which chunk runs (``running_chunks``): each
        running chunk adds its largest layer moment over its kept micro-batch (``T_v`` rows of
        ``formulation_moments``), not the rank's largest transient."""
        return bool(self.running_chunks)

    @property
    def rank_rows(self) -> bool:
        """A rank's peak is a row per in-flight vector over its chunks' sums (interleaving, or a
        split-backward schedule even at one chunk per rank), not per layer moment."""
        return self.config.virtual_stages > 1 or self.split_backward

    def moment_transient(self, transient: np.ndarray, holds_last: bool = True) -> np.ndarray:
        """transient_l as layer l's moment ``during(l)`` takes it on a stage: on the stage holding
        the model's last layer (``holds_last``) + ``held_output_bytes`` for every layer before
        the last (the micro-batch in backward still has its output held; at the last layer that
        output is in its stored bytes), bytes."""
        if not holds_last or not self.held_output_bytes:
            return transient
        extra = np.full(len(transient), self.held_output_bytes, dtype=np.int64)
        extra[-1:] = 0
        return transient + extra

    @property
    def num_layers(self) -> int:
        return len(self.weight_bytes)

    @property
    def num_stages(self) -> int:
        """Stages a layer can be assigned to: p v virtual stages (p without interleaving)."""
        return self.config.pp * self.config.virtual_stages

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks p (GPUs along the pipeline); virtual stage j runs on rank j mod p."""
        return self.config.pp

    def stages_of_rank(self, rank: int) -> list[int]:
        """Virtual stages of rank r, chunk order: r, r + p, ..., r + (v - 1) p; r and 2p - 1 - r
        under a V schedule (``schedule_orders.rank_stages``)."""
        config = self.config
        if config.schedule not in V_SCHEDULES:
            return list(range(rank, self.num_stages, self.num_ranks))
        return rank_stages(config.schedule, config.pp, config.virtual_stages, rank)

    @property
    def least_held(self) -> int:
        """A count every rank holds of each of its chunks at one of its peaks: max over its
        vectors of the smallest entry, minimised over ranks (k_min without interleaving)."""
        return min(max(min(vector) for vector in vectors) for vectors in self.in_flight_vectors)

    @cached_property
    def state_bytes(self) -> np.ndarray:
        """Weights + gradients (+ gradient buffers) + optimizer (+ the step's input batch) per
        GPU, bytes: what a layer adds to its stage at every moment."""
        states = self.weight_bytes + self.grad_bytes + self.optimizer_bytes
        for held in (self.grad_buffer_bytes, self.input_batch_bytes):
            if held is not None:
                states = states + held
        return states

    def is_chain(self) -> bool:
        """Layer i feeds layer i + 1 only, each boundary with the plain copies
        (``plain_boundaries``): the chain methods (``backends.chain``, ``capslog_statistics``)
        apply."""
        n = self.num_layers
        return (
            self.plain_boundaries
            and len(self.edge_src) == n - 1
            and bool(
                np.all(self.edge_src == np.arange(n - 1))
                and np.all(self.edge_dst == np.arange(1, n))
            )
        )
