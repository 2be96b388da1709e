"""Parse and format byte sizes (and format throughputs). User text is converted here once;
everything inside is int bytes."""

from __future__ import annotations

import math
import re

from solver.errors import InputError, quote

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_CHARS = 64
"""Longest size text read ("85899345920 B" is 14)."""


def parse_bytes(text: str | int | float, *, what: str = "size", maximum: int | None = None) -> int:
    """'80GiB' -> 85899345920 (GiB = 2**30, GB = 10**9); plain numbers are bytes. Sizes must be
    finite, positive and at most ``maximum`` bytes (when given)."""
    if isinstance(text, bool):
        raise InputError(f"{what}: expected a size like 80GiB, got {quote(text)}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(text) if len(text) <= _SIZE_CHARS else None
        if not match or match.group(2).lower() not in _UNITS:
            raise InputError(
                f"{what}: cannot read {quote(text)} as a size; write e.g. 80GiB, 40GB or 1e9 "
                "(bytes)"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(value):
        raise InputError(f"{what}: {quote(text)} is not a finite size")
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise InputError(f"{what}: must be positive, got {quote(text)}")
    if maximum is not None and size > maximum:
        raise InputError(
            f"{what}: {quote(text)} is {size:.3g} bytes, over the limit of {format_limit(maximum)}"
        )
    return size


def format_limit(num_bytes: int) -> str:
    """A byte limit as the docs write it: '2^50 bytes (1 PiB)'."""
    power = num_bytes.bit_length() - 1
    if num_bytes != 2**power or power < 10:
        return f"{num_bytes} bytes"
    unit_power = min(power // 10, 5) * 10
    unit = {10: "KiB", 20: "MiB", 30: "GiB", 40: "TiB", 50: "PiB"}[unit_power]
    return f"2^{power} bytes ({2 ** (power - unit_power)} {unit})"


def format_throughput(samples_per_s: float, *, why: bool = True) -> str:
    """For display: '1234 samples/s', or 'n/a' for the infinite throughput of an iteration of
    0 ns (a graph without FLOPs or measured times: the time model has nothing to count), with
    the reason unless ``why`` is False (table cells)."""
    if math.isfinite(samples_per_s):
        return f"{samples_per_s:.4g} samples/s"
    return "n/a (the graph has no FLOPs or times)" if why else "n/a"


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size for display only: 85899345920 -> '80.00 GiB'."""
    magnitude = abs(num_bytes)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if magnitude >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"
