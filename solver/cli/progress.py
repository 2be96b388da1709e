"""The config search's progress on a terminal: one tqdm bar per search step, on stderr."""

from __future__ import annotations

from typing import Any


class SearchProgress:
    """A ``solver.search.config_search.Progress`` that draws one tqdm bar per search step on
    stderr: configs
    visited / total and the incumbent. The bar appears only after a second (short plans print
    nothing) and is erased when the step ends."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        """False: draws nothing (``shows_progress``)."""
        self.bar: Any = None
        self.step: str | None = None

    def __call__(self, step: str, visited: int, total: int, best: str) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if self.bar is None or step != self.step:
            self.close()
            self.step = step
            self.bar = tqdm(
                total=total, desc=step, unit="config", delay=1.0, leave=False, dynamic_ncols=True
            )
        self.bar.total = total
        self.bar.set_postfix_str(best, refresh=False)
        self.bar.update(visited - self.bar.n)  # draws once the delay has passed

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
