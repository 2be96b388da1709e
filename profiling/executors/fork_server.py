"""The ranks' fork server (``multiprocessing``'s, one per launching process; ``profiling.run``
starts every rank from it): started so that Ctrl-C cannot reach its imports, and stopped at once
when a run is stopped by a signal.

Why both. The fork server is a child of the launcher that first imports torch and the rank code
(``profiling.run.RANK_PRELOAD``: seconds), and only then ignores SIGINT, so a Ctrl-C to the
process group during those imports printed its KeyboardInterrupt traceback. It ends by itself
when every holder of its "alive" pipe has closed it: the launcher and every rank, and also a
fork request still queued on its socket (the request carries that pipe). A launcher stopped
while the server was importing therefore left a server that, once its imports were done, forked
the queued rank, which then waited for peers that never came, and the two kept each other (and
``multiprocessing``'s resource tracker, whose pipe the rank holds) alive for minutes.
:func:`stop_fork_server` kills the server instead of waiting for it; a rank it forked ends with it
(``solver.workers.exit_with_parent``: the kernel's parent-death signal, and a watch on the
launcher).

Both use ``multiprocessing.forkserver``: ``ensure_running`` is public; the server's pid and its
``_stop`` (which closes the pipe, reaps the server and forgets it, so the next run starts a new
one) are private to CPython 3.8-3.14, and looked up defensively.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.forkserver
import os
import signal

log = logging.getLogger(__name__)


def start_fork_server() -> None:
    """Start the fork server now, unless it runs, with SIGINT blocked: the server inherits the
    mask, so a Ctrl-C never interrupts its imports (its ranks leave Ctrl-C to the launcher
    anyway); one that reaches this thread meanwhile is delivered when the mask is restored."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_fork_server() -> None:
    """Kill the fork server (SIGKILL: it may still be importing), reap it and forget it; nothing
    when none runs. Its ranks end with it (they set a parent-death signal)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    try:
        server._stop()  # type: ignore[union-attr]
    except (AttributeError, OSError) as error:  # another CPython: at least reap it
        log.debug("fork server stop: %s", error)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


__all__ = ["start_fork_server", "stop_fork_server"]
