"""The wall-clock budget of one command (``--time-limit``, from its start: reading the inputs
included): ``Deadline``, which every phase of a planning call shares, and ``checked``, which
stops a long loop over items (layers, configs, stages) when it passes."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from solver.errors import NoSolutionError

T = TypeVar("T")

CHECK_EVERY = 4096
"""Items a ``checked`` loop runs between two looks at the clock (a look costs about 0.1 us; 4096
layers of the slowest per-layer loop take a few ms)."""


@dataclass(kw_only=True)
class Deadline:
    """Wall-clock budget shared by all phases and solves of one planning call; ``end`` is a
    ``time.perf_counter()`` value, s."""

    end: float

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        return cls(end=math.inf if seconds is None else time.perf_counter() + seconds)

    def remaining(self) -> float:
        """Seconds left, >= 0."""
        return max(0.0, self.end - time.perf_counter())

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def capped(self, seconds: float) -> Deadline:
        """This deadline, or ``seconds`` from now if that comes first."""
        return Deadline(end=min(self.end, time.perf_counter() + seconds))

    def check(self, doing: str | Callable[[], str]) -> None:
        """NoSolutionError (exit 4: no plan within the limit) once the deadline has passed;
        ``doing`` says what was under way ("reading the graph g.json (layer 4096 of 10^6)"), or
        makes that text when called."""
        if self.expired():
            text = doing() if callable(doing) else doing
            raise NoSolutionError(f"time limit reached while {text}; raise --time-limit")


def checked(
    items: Iterable[T], deadline: Deadline | None, doing: Callable[[int], str]
) -> Iterator[T]:
    """``items``, with a look at ``deadline`` every ``CHECK_EVERY`` of them (``Deadline.check``;
    ``doing(count)`` says what was under way after ``count`` items)."""
    if deadline is None or deadline.end == math.inf:
        yield from items
        return
    for count, item in enumerate(items):
        if count % CHECK_EVERY == 0:
            deadline.check(lambda count=count: doing(count))
        yield item
