"""Native solves that Ctrl-C can stop.

Python runs a signal handler in the main thread only, between bytecodes: while the main thread
sits in a long C++ call (a CP-SAT or HiGHS solve) a Ctrl-C waits until the call returns, and
CP-SAT even catches SIGINT itself and ends the solve as if its time limit had been reached, so
the search went on with the next config. :func:`run_stoppable` runs the native call on a helper
thread while the main thread waits in short, interruptible joins; on KeyboardInterrupt it asks
the solver to stop (``CpSolver.stop_search``, ``Highs.cancelSolve``), waits for it briefly and
raises, so the caller unwinds within a second or two.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

STOP_WAIT_S = 2.0
"""How long an interrupted solve may take to stop before KeyboardInterrupt is raised anyway (the
helper thread is a daemon: it does not keep the process alive)."""
POLL_S = 0.1


def run_stoppable(run: Callable[[], T], stop: Callable[[], None]) -> T:
    """``run()``, stoppable by Ctrl-C: ``stop()`` must make it return soon (thread-safe). Off the
    main thread, where no signal arrives, ``run()`` is called directly."""
    if threading.current_thread() is not threading.main_thread():
        return run()
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = run()
        except BaseException as error:  # handed to the caller below
            outcome["error"] = error

    thread = threading.Thread(target=target, name="memplan-solve", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(POLL_S)
    except KeyboardInterrupt:
        stop()
        thread.join(STOP_WAIT_S)
        raise
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


__all__ = ["run_stoppable"]
