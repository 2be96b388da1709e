"""Worker processes that never outlive their parent, and stopping a pool of them now.

A parent killed with SIGKILL runs no cleanup: its pool workers would go on solving, orphaned,
holding the files they inherited (a sweep's CSV). :func:`exit_with_parent`, called first in each
worker, ends the worker with its parent: on Linux the kernel sends it SIGKILL when the parent
dies (``prctl(PR_SET_PDEATHSIG)``), and everywhere a daemon thread polls the parent's pid. A
process started through a fork server (``profiling.run``'s ranks) has the server as its parent
and the process that asked for it as its launcher (``multiprocessing.parent_process()``); the
thread also ends it when the launcher ends (its sentinel pipe closes), whether or not the server
does.
:func:`stop_pool` is the parent's side on Ctrl-C: queued work is cancelled and running workers
are terminated instead of finishing their point.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
"""From <linux/prctl.h>."""
PARENT_POLL_S = 0.5
"""How often a worker checks that its parent is alive (the portable fallback)."""
STOP_WAIT_S = 1.0
"""How long a terminated worker may take to exit before it is killed."""


def exit_with_parent(*, use_prctl: bool = True) -> None:
    """Make this (child) process end when its parent does, however the parent ends
    (``use_prctl=False``: the portable fallback alone, for tests)."""
    parent = os.getppid()
    if use_prctl and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError) as error:  # no libc prctl: the thread below still works
            log.debug("prctl(PR_SET_PDEATHSIG) unavailable: %s", error)
    if parent == 1:  # the parent died before we asked
        os._exit(1)
    launcher = multiprocessing.parent_process()
    watcher = threading.Thread(
        target=_watch_parent,
        args=(parent, None if launcher is None else launcher.sentinel),
        name="memplan-parent-watch",
        daemon=True,
    )
    watcher.start()


def _watch_parent(parent: int, launcher_sentinel: int | None) -> None:
    """Exit at once (no cleanup: the parent holds the results) when the parent is gone (the
    process is then re-parented, so its parent pid changes) or the launcher is (its sentinel, a
    pipe only it writes to, reads end of file)."""
    while True:
        if launcher_sentinel is None:
            time.sleep(PARENT_POLL_S)
        elif multiprocessing.connection.wait([launcher_sentinel], PARENT_POLL_S):
            os._exit(1)
        if os.getppid() != parent:
            os._exit(1)


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Cancel the pool's queued work and end its running workers now (SIGTERM, then SIGKILL
    after ``STOP_WAIT_S``); ``pool.shutdown(wait=False)`` alone lets every running worker
    finish its task, and the interpreter waits for them at exit. Python 3.14 has
    ``ProcessPoolExecutor.terminate_workers``; before it, the processes are only in the pool's
    private ``_processes``."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    end = time.monotonic() + STOP_WAIT_S
    for process in processes:
        process.join(max(0.0, end - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(STOP_WAIT_S)


__all__ = ["exit_with_parent", "stop_pool"]
