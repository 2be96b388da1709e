"""What a CLI shows while it works and when it is stopped: a progress display of the config
search (on stderr, only when stderr is a terminal) and the one line of a Ctrl-C (exit 130)."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

INTERRUPTED = 130
"""Exit code after Ctrl-C: 128 + SIGINT, as a shell reports a process killed by it."""


def interrupted(detail: str = "") -> int:
    """Ctrl-C: one line on stderr, and the exit code to return."""
    sys.stderr.write(f"interrupted{detail}\n")
    return INTERRUPTED


def exit_process(code: int) -> NoReturn:
    """End a ``python -m`` CLI with ``code``. After a Ctrl-C (:data:`INTERRUPTED`) the process ends
    with ``os._exit`` once the standard streams are flushed: a native solver stopped mid-solve may
    still have threads running (CP-SAT's workers, HiGHS's scheduler), and the C++ runtime's static
    destructors would abort under them at a normal exit ("terminate called without an active
    exception": exit -6 instead of 130, about one Ctrl-C in ten on a large DAG search)."""
    if code == INTERRUPTED:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def shows_progress(quiet: bool) -> bool:
    """A progress display goes to stderr only when it is a terminal (never into a log file or
    a pipe) and the user did not ask for quiet."""
    return not quiet and sys.stderr.isatty()


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


__all__ = ["INTERRUPTED", "SearchProgress", "interrupted", "shows_progress"]
