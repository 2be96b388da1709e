"""Parse and format byte sizes. User text is converted here once; everything inside is int bytes."""

from __future__ import annotations

import re

from solver.errors import InputError

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
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float, *, what: str = "size") -> int:
    """'80GiB' -> 85899345920 (GiB = 2**30, GB = 10**9); plain numbers are bytes."""
    if isinstance(text, bool):
        raise InputError(f"{what}: expected a size like 80GiB, got {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(text)
        if not match or match.group(2).lower() not in _UNITS:
            raise InputError(
                f"{what}: cannot read {text!r} as a size; write e.g. 80GiB, 40GB or 1e9 (bytes)"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise InputError(f"{what}: must be positive, got {text!r}")
    return size


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size for display only: 85899345920 -> '80.00 GiB'."""
    magnitude = abs(num_bytes)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if magnitude >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"
