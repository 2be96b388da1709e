"""Usable GPU memory: the capacity less what a GPU never gives the training job.

A stage's peak (``solver.costs``) counts the tensors the job allocates. The GPU also holds
memory the cost model does not see, so the memory a plan may fill is

    usable = capacity - reserve,  reserve = fixed_bytes + ceil(fraction * capacity)

and every feasibility check (plan, evaluate, sweep, the GPU-count search, the Pareto front)
compares peaks with ``usable``. The default, :data:`DEFAULT_RESERVE` = 1 GiB + 5 %, adds up:

- **CUDA context** (fixed): created by the first CUDA call, outside the caching allocator;
  PyTorch's maintainers put it at "~700+MB" depending on the CUDA version and device, a user
  measured 723 MiB for one 4-byte tensor (discuss.pytorch.org, "High gpu memory overhead" and
  "What is the reason for pytorch's GPU memory floor?"); CUDA's lazy module loading (CUDA 11.7+)
  lowers it, loading many kernels raises it.
- **NCCL buffers** (fixed): ``NCCL_BUFFSIZE`` (default 4 MiB) per channel per peer and
  direction, for each communicator (NCCL user guide, "Environment Variables"); a few
  communicators (dp, tp, pp) with several channels each take some hundreds of MiB.
- **cuBLAS workspaces** (fixed): PyTorch gives cuBLASLt 32 MiB per handle and stream on Hopper,
  4 MiB before it (``aten/src/ATen/cuda/CUDABlas.cpp``, pytorch#120925, after the cuBLAS
  guide's ``cublasSetWorkspace`` recommendation).
- **Caching-allocator fragmentation** (proportional): the allocator rounds and splits blocks
  (2 MiB rounding of large blocks, 20 MiB segments) and can fail to serve a request while
  enough memory is free in pieces ("When does fragmentation occur in the CUDA caching
  allocator?", PyTorch devlog, E. Yang 2026); it grows with the memory in use.

1 GiB covers the context (~0.7 GiB) with the NCCL and cuBLAS buffers of a usual job; 5 % is a
margin for fragmentation, not a measurement: a calibration fitted to real runs (``--calibration``,
its per-GPU constant) replaces the default, and ``--reserve`` sets any other (``--reserve 0``:
the whole capacity, the planner's behaviour before the reserve).

The CLIs apply the default (:func:`default_reserve`); the Python API's ``TrainingConfig.reserve``
defaults to none, as its ``Cluster.gpu_memory_bytes`` has always meant memory usable for
training: pass ``reserve=default_reserve(calibration)`` to plan as the CLIs do.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from solver.errors import InputError, quote
from solver.units import format_bytes, parse_bytes

GIB = 2**30
MAX_RESERVE_FRACTION = 0.99
"""The largest fraction --reserve takes (100 % leaves nothing)."""


@dataclass(frozen=True, kw_only=True)
class MemoryReserve:
    """Memory per GPU the job never gets: ``fixed_bytes`` plus ``fraction`` of the capacity."""

    fixed_bytes: int = 0
    """Bytes per GPU (CUDA context, NCCL buffers, cuBLAS workspaces)."""
    fraction: float = 0.0
    """Share of each GPU's capacity (allocator fragmentation), 0 <= fraction < 1."""
    source: str = field(default="", compare=False)
    """Where it came from, for reports: "default", "--reserve", "calibration"."""

    def __post_init__(self) -> None:
        fixed, fraction = self.fixed_bytes, self.fraction
        if isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 0:
            raise InputError(f"reserve: fixed_bytes must be an integer >= 0, got {quote(fixed)}")
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not 0 <= fraction <= MAX_RESERVE_FRACTION
        ):
            raise InputError(
                f"reserve: fraction must be a number in [0, {MAX_RESERVE_FRACTION}], got "
                f"{quote(fraction)}"
            )

    def bytes_for(self, capacity_bytes: int) -> int:
        """The reserve on a GPU of ``capacity_bytes``: fixed + ceil(fraction * capacity)."""
        return self.fixed_bytes + math.ceil(self.fraction * capacity_bytes)

    def usable_bytes(self, capacity_bytes: int) -> int:
        """capacity - reserve (may be <= 0: :func:`check_usable` says so)."""
        return capacity_bytes - self.bytes_for(capacity_bytes)

    def label(self) -> str:
        """'1.00 GiB + 5%', '3.00 GiB', '8%' or '0'."""
        parts = []
        if self.fixed_bytes:
            parts.append(format_bytes(self.fixed_bytes))
        if self.fraction:
            parts.append(f"{100 * self.fraction:g}%")
        return " + ".join(parts) or "0"

    def to_dict(self) -> dict:
        return {"fixed_bytes": self.fixed_bytes, "fraction": self.fraction}


DEFAULT_RESERVE = MemoryReserve(fixed_bytes=1 * GIB, fraction=0.05, source="default")
"""1 GiB (CUDA context, NCCL buffers, cuBLAS workspaces) + 5 % (fragmentation); module doc."""

NO_RESERVE = MemoryReserve(source="none")
"""The whole capacity is usable (the planner before the reserve; the Python API's default)."""


def default_reserve(calibration=None) -> MemoryReserve:
    """The CLIs' reserve when --reserve is not given: none under a calibration whose per-GPU
    constant is not 0 (fitted to real runs, it stands for what the job does not see), else
    :data:`DEFAULT_RESERVE`."""
    if calibration is not None and calibration.constant_bytes != 0:
        return MemoryReserve(source="replaced by the calibration's per-GPU constant")
    return DEFAULT_RESERVE


_PART = re.compile(r"^\s*([0-9.eE+-]+)\s*%\s*$")


def parse_reserve(text: str) -> MemoryReserve:
    """'3GiB' -> 3 GiB fixed; '8%' -> 8 % of each GPU; '1GiB+5%' -> both; '0' -> none.
    InputError for a negative size, a share of 100 % or more, or unreadable text."""
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"cannot read {quote(text)}: write e.g. 3GiB, 8% or 1GiB+5%")
    fixed, fraction = 0, 0.0
    for part in text.split("+"):
        part = part.strip()
        if not part:
            raise InputError(f"cannot read {quote(text)}: write e.g. 3GiB, 8% or 1GiB+5%")
        if part.startswith("-"):
            raise InputError(f"{quote(text)}: a reserve cannot be negative")
        match = _PART.match(part)
        if match:
            try:
                share = float(match.group(1)) / 100
            except ValueError:
                raise InputError(f"cannot read {quote(part)} as a percentage") from None
            if not 0 <= share <= MAX_RESERVE_FRACTION:
                raise InputError(
                    f"{quote(part)}: a share must be within 0%..{100 * MAX_RESERVE_FRACTION:g}% "
                    "of the GPU memory"
                )
            fraction += share
        elif part in ("0", "0.0"):
            continue
        else:
            fixed += parse_bytes(part, what="size")
    if fraction > MAX_RESERVE_FRACTION:
        raise InputError(
            f"{quote(text)}: the shares add up to over {100 * MAX_RESERVE_FRACTION:g}%"
        )
    return MemoryReserve(fixed_bytes=fixed, fraction=fraction, source="--reserve")


def check_usable(reserve: MemoryReserve, capacities: dict[str, int]) -> None:
    """InputError when the reserve leaves nothing of a GPU: ``capacities`` maps a name ("GPU",
    or a node group's) to its memory in bytes."""
    for name, capacity in capacities.items():
        if reserve.usable_bytes(capacity) <= 0:
            raise InputError(
                f"reserve {reserve.label()} ({format_bytes(reserve.bytes_for(capacity))}) leaves "
                f"nothing of the {format_bytes(capacity)} of {name} memory; lower --reserve "
                "(e.g. --reserve 0) or give the GPUs' real memory"
            )


def usable_text(reserve: MemoryReserve, capacity_bytes: int) -> str:
    """'usable 75.00 GiB = capacity 80.00 GiB - reserve 5.00 GiB (1.00 GiB + 5%, default)';
    '80.00 GiB (no reserve)' when the reserve is 0."""
    if reserve.bytes_for(capacity_bytes) == 0:
        return f"{format_bytes(capacity_bytes)} (no reserve)"
    source = f", {reserve.source}" if reserve.source else ""
    usable, reserved = reserve.usable_bytes(capacity_bytes), reserve.bytes_for(capacity_bytes)
    return (
        f"usable {format_bytes(usable)} = capacity {format_bytes(capacity_bytes)} - reserve "
        f"{format_bytes(reserved)} ({reserve.label()}{source})"
    )
