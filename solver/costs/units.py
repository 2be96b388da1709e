"""Units and exact integer arithmetic shared by the cost model's modules."""

from __future__ import annotations

import numpy as np

NS_PER_MS = 1_000_000
"""Nanoseconds per millisecond: times are integer ns inside the model, ms in graph fields."""


def as_int(values) -> np.ndarray:
    """``values`` as an int64 array."""
    return np.asarray(values, dtype=np.int64)


def ceil_div(numerator: np.ndarray, denominator: int) -> np.ndarray:
    """ceil(numerator / denominator), exact on integers (arrays or ints)."""
    return -(-numerator // denominator)
