"""Range checks of user input: each raises one :class:`InputError` line that names the field,
the accepted range and the value given (the specs and the parallel dimensions share them)."""

from __future__ import annotations

import math
import numbers
from typing import Any

from solver.errors import InputError, quote


def require(condition: bool, message: str) -> None:
    """InputError(message) unless ``condition``."""
    if not condition:
        raise InputError(message)


def is_int(value: Any) -> bool:
    """An integer of any integral type (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_integer(name: str, value: Any, low: int, high: int | None) -> None:
    """InputError unless ``value`` is an integer in low..high (high None: no upper limit)."""
    within = is_int(value) and low <= value and (high is None or value <= high)
    if not within:
        accepted = f">= {low}" if high is None else f"in {low}..{count_text(high)}"
        raise InputError(f"{name} must be an integer {accepted}, got {quote(value)}")


def count_text(value: int) -> str:
    """A limit as written in the docs: 2^24 rather than 16777216."""
    if value >= 2**16 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return str(value)


def check_real(
    name: str,
    value: Any,
    low: float,
    high: float | None,
    *,
    low_open: bool = False,
    note: str = "",
) -> None:
    """InputError unless ``value`` is a finite number in [low, high] ((low, high] with
    ``low_open``; high None: no upper limit)."""
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (high is None or value <= high)
    )
    if not ok:
        bracket = "(" if low_open else "["
        accepted = f"{bracket}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
        shown = f"{value:g}" if isinstance(value, float) else quote(value)
        extra = f" ({note})" if note else ""
        raise InputError(f"{name} must be a finite number in {accepted}{extra}, got {shown}")
