"""The cost model's answer for one stage (:class:`StageCost`) and the moments its peak can be at."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class StageCost:
    """Exact per-GPU cost of one stage. Bytes per GPU; times in ns."""

    index: int
    layers: list[int]
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """k_s x (stored activations + relayed edges); with split backwards (zbv, dualpipev,
    interleaved-zb) also the output gradients pending W steps keep (``stages``)."""
    buffer_bytes: int
    """Boundary tensors: receive buffers and held outputs (``boundary_copies``)."""
    transient_bytes: int
    in_flight: int
    """Micro-batches held at the peak (chunk-micro-batches with interleaving)."""
    time_ns: int
    """Per micro-batch, forward + backward (+ recompute), all chunks of the rank."""
    dp_sync_ns: int
    constant_bytes: int = 0
    """A calibration's constant per GPU (0 for the analytic model)."""
    recomputed: list[int] = field(default_factory=list)
    """Layers of the stage that are recomputed (positions, a subset of ``layers``)."""
    chunks: list[list[int]] = field(default_factory=list)
    """With interleaving: the layers of each of the rank's v chunks (virtual stages index,
    index + p, ...); [layers] without."""
    chunk_time_ns: list[int] = field(default_factory=list)
    """Per micro-batch time of each chunk, ns ([time_ns] without interleaving)."""
    chunk_forward_ns: list[int] = field(default_factory=list)
    """The forward's part of each chunk's ``chunk_time_ns``, ns (the rest is its backward,
    recompute included)."""
    optimizer_step_ns: int = 0
    """The optimizer step over the rank's parameters, ns per iteration."""
    moment: str = "forward"
    """The moment of the schedule that sets the peak (``MOMENTS``): forward (after a forward,
    k_s micro-batches held), first backward, after first backward or last backward (torch's
    GPipe with one micro-batch left; ``stages.layer_moments``, ``LayerCosts.after_moments``),
    optimizer step (``optimizer_step_moment``: no activation, the step's temporary in
    ``transient_bytes``)."""

    @property
    def peak_bytes(self) -> int:
        return (
            self.constant_bytes
            + self.weight_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + self.buffer_bytes
            + self.transient_bytes
        )

    def breakdown(self) -> dict[str, int]:
        return {
            "weights": self.weight_bytes,
            "grads": self.grad_bytes,
            "optimizer": self.optimizer_bytes,
            "activations": self.activation_bytes,
            "buffers": self.buffer_bytes,
            "transient": self.transient_bytes,
        } | ({"constant": self.constant_bytes} if self.constant_bytes else {})


MOMENTS = (
    "forward",
    "first backward",
    "after first backward",
    "last backward",
    "optimizer step",
)
"""The moments a stage's peak can be at (``StageCost.moment``)."""
