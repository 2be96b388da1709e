"""Non-decreasing combinations of prefix sums, U[x] = sum_b c_b P_b[x] (x = 0..L), as the chain
algorithm's relaxation reads them (``chain._Chain.sums``): a table when memory allows, else
evaluated where read, so that a chain's tables stay O(L) however many stages it has; and the
sparse table of range maxima the chain reads transients from."""

from __future__ import annotations

import numpy as np

SLICED_WINDOW = 64
"""An untabled ``PrefixSums`` search evaluates U over the first this many positions of its window
and searches them at once (a few numpy calls); the rare answers beyond, a bisection finds."""


class PrefixSums:
    """A non-decreasing sequence U[x] = sum_b c_b P_b[x], x = 0..L, of prefix sums P_b (bytes or
    ns) with integer coefficients c_b, evaluated where read (O(1) memory beyond the P_b; a search
    looks at a window), or made into its ``table``."""

    __slots__ = ("terms", "num_layers")

    def __init__(self, terms: tuple[tuple[int, np.ndarray], ...], num_layers: int) -> None:
        self.terms = terms
        self.num_layers = num_layers

    def table(self) -> np.ndarray:
        """U as an array (8 (L + 1) bytes): reads and searches at numpy speed."""
        return self.at(slice(None))

    def at(self, positions: np.ndarray | slice) -> np.ndarray:
        """U at ``positions`` (int64)."""
        if not self.terms:  # U = 0
            return np.zeros(self.num_layers + 1, dtype=np.int64)[positions]
        (coefficient, basis), *others = self.terms
        value = coefficient * basis[positions]
        for coefficient, basis in others:
            value = value + coefficient * basis[positions]
        return value

    def searchsorted(
        self, values: np.ndarray, side: str, low: np.ndarray | int, high: np.ndarray | int
    ) -> np.ndarray:
        """``np.searchsorted(U, values, side)`` inside the window [low, high] (0 <= low <= high
        <= L + 1, each a scalar or one per value): a result r with clip(r, low, high) equal to
        the searchsorted's clipped (here the clipped one: U over the window's first
        ``SLICED_WINDOW`` positions searched at once, where the answers of most searches lie,
        then a bisection of the rest of the window for the others)."""
        values = np.asarray(values)
        first = int(np.min(low))
        near = min(int(np.max(high)), first + SLICED_WINDOW)  # U[first..near] at once
        found = self.at(slice(first, near + 1)).searchsorted(values, side) + first
        clipped = np.clip(found, low, high)  # the answer unless U[first..near] < value < high
        beyond = (found == near + 1) & (high > near + 1)
        if not beyond.any():
            return clipped
        rest = self._bisect(values, side, np.maximum(low, near + 1), high)
        return np.where(beyond, rest, clipped)

    __getitem__ = at

    def _bisect(
        self, values: np.ndarray, side: str, low: np.ndarray | int, high: np.ndarray | int
    ) -> np.ndarray:
        """The searchsorted of ``values`` in U clipped to [low, high], by bisection."""
        low = np.array(np.broadcast_to(low, values.shape), dtype=np.int64)
        high = np.array(np.broadcast_to(high, values.shape), dtype=np.int64)
        # invariant: the answer is in [low, high]; every x < low is below values (left: U[x] <
        # value; right: U[x] <= value) or outside the window, every x >= high is not
        while True:
            active = low < high
            if not active.any():
                return low
            middle = (low + high) >> 1  # < high <= L + 1 where active: a position of U
            found = self.at(np.minimum(middle, self.num_layers))
            below = (found < values if side == "left" else found <= values) & active
            low = np.where(below, middle + 1, low)
            high = np.where(active & ~below, middle, high)


Sums = np.ndarray | PrefixSums
"""A non-decreasing prefix combination: its table, or a ``PrefixSums`` read where needed."""


def search(sums: Sums, values: np.ndarray, side: str, low, high) -> np.ndarray:
    """``PrefixSums.searchsorted`` of either kind of ``Sums`` (a table's answer unclipped: the
    same once clipped to the window [low, high])."""
    if isinstance(sums, np.ndarray):
        return sums.searchsorted(values, side)
    return sums.searchsorted(values, side, low, high)


def sparse_max_table(values: np.ndarray) -> np.ndarray:
    """table[k, x] = max values[x .. x + 2^k - 1] (zero-padded where the window runs out)."""
    rows = [values]
    width = 1
    while 2 * width <= len(values):
        previous = rows[-1]
        row = np.zeros_like(values)
        row[: len(values) - 2 * width + 1] = np.maximum(
            previous[: len(values) - 2 * width + 1], previous[width : len(values) - width + 1]
        )
        rows.append(row)
        width *= 2
    return np.stack(rows)
