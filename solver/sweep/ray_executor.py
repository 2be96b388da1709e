"""A sweep's points as Ray tasks (``solver.sweep --executor ray``): one task per point, on a local
Ray instance or an existing cluster.

Ray is the optional ``[ray]`` extra and is imported only here, only when a sweep asks for it:
``import solver`` never needs it. What the executor does, against the local one
(``solver.sweep.runner``):

- the study's options (graph included) are stored once with ``ray.put`` and every task gets the
  reference (Ray fetches the object once per node); a task returns the row of
  :func:`solver.sweep.point.solve_point`, so the rows are the local executor's (but ``wall_s``);
- a task whose worker process dies (killed, out of memory) or that raises is run again, up to
  :data:`MAX_RETRIES` times (Ray's ``max_retries`` and ``retry_exceptions``); a point that fails
  for good is an ERROR row whose ``detail`` says why, and the other points go on;
- rows reach ``done`` as tasks finish (the caller writes them and draws the progress bar); on
  Ctrl-C (or any error) the rows already handed over stay written and the connection this
  module made is closed, which ends the tasks not finished: Ray kills a job's workers when its
  driver disconnects, and a local instance shuts down. ``ray.cancel`` is not used: in Ray 2.60
  it races with a task that is finishing and aborts the driver ("Check failed: it !=
  submissible_tasks_.end() Tried to complete task that was not pending", seen here 1 run in
  ~5; the race of ray-project/ray#54798, also #54846);
- an instance the process was already connected to (``ray.init`` by the caller, as the tests
  do) is used and left running; after Ctrl-C its tasks not finished run to their end (each is
  one bounded ``plan`` call) and their rows are dropped.

Test hook: :data:`FAULT_ENV` makes chosen points' tasks fail on purpose (their worker process
exits, or the task raises) for a set number of attempts; it injects failures into the real
solver run, nothing is mocked.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solver.console import STOP_SIGNALS, Terminated
from solver.errors import InputError
from solver.sweep.point import PointOptions, empty_row, solve_point
from solver.sweep.ray_address import check_address

log = logging.getLogger(__name__)

MAX_RETRIES = 2
"""Times a failed point's task is run again (3 attempts in all)."""
WAIT_S = 0.5
"""How often the driver wakes up while waiting for tasks (Ctrl-C is seen within it)."""
DETAIL_CHARS = 300
"""The longest reason an ERROR row of a failed task quotes."""
INSTALL_HINT = "install the ray extra: pip install -e '.[ray]'"
FAULT_ENV = "MEMPLAN_SWEEP_FAULT"
"""Test hook, ``KIND:TIMES:GPUS:DIR``: the first TIMES attempts of every point with GPUS GPUs
(``*``: every point) fail; KIND ``exit`` ends the worker process (a crash), ``raise`` raises
:class:`InjectedFault`. Attempts are counted with marker files in DIR (shared by the workers)."""


class InjectedFault(RuntimeError):
    """The failure :data:`FAULT_ENV` asked for."""


@dataclass(frozen=True)
class PointFault:
    """A parsed :data:`FAULT_ENV`."""

    kind: str
    times: int
    gpus: int | None
    directory: str

    @classmethod
    def from_env(cls) -> PointFault | None:
        text = os.environ.get(FAULT_ENV)
        if not text:
            return None
        try:
            kind, times, gpus, directory = text.split(":", 3)
            fault = cls(kind, int(times), None if gpus == "*" else int(gpus), directory)
        except ValueError:
            fault = None
        if fault is None or fault.kind not in ("exit", "raise") or not fault.directory:
            raise InputError(
                f"{FAULT_ENV}={text!r}: expected KIND:TIMES:GPUS:DIR, e.g. exit:1:*:/tmp/faults "
                "(KIND exit or raise; GPUS a count or *)"
            )
        return fault

    def strike(self, gpus: int, gpu_memory_bytes: int) -> None:
        """In the worker, before the point is solved: fail if this attempt is one to fail."""
        if self.gpus is not None and gpus != self.gpus:
            return
        attempts = Path(self.directory)
        attempts.mkdir(parents=True, exist_ok=True)
        done = len(list(attempts.glob(f"{gpus}-{gpu_memory_bytes}.*")))
        if done >= self.times:
            return
        (attempts / f"{gpus}-{gpu_memory_bytes}.{done}").touch()
        if self.kind == "exit":
            os._exit(1)  # as a killed worker: no cleanup, no reply to Ray
        raise InjectedFault(f"injected failure {done + 1} of {self.times} ({FAULT_ENV})")


def import_ray() -> Any:
    """The ray module; InputError naming the extra when it is not installed."""
    try:
        import ray
    except ImportError:
        raise InputError(f"--executor ray: ray is not installed; {INSTALL_HINT}") from None
    return ray


@contextmanager
def ray_session(address: str | None, cpus: int | None) -> Iterator[Any]:
    """The ray module, connected: to the instance this process already joined (left as it is),
    else to ``address``, else to a new local instance with ``cpus`` CPUs (default: every core);
    a connection made here is closed on exit (a local instance shut down). InputError when ray
    is missing or the cluster cannot be reached."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    handlers = _python_handlers()
    try:
        _connect(ray, address, cpus)
    except SystemExit as stop:  # ray.init's SIGTERM handler (sys.exit(15)) ran meanwhile
        ray.shutdown()
        if stop.code == signal.SIGTERM and signal.SIGTERM in handlers:
            raise Terminated(signal.SIGTERM) from None  # the caller's stop, as after ray.init
        raise
    except BaseException:  # a local instance half started: stop what it started
        ray.shutdown()
        raise
    finally:
        _restore_handlers(handlers)
    try:
        yield ray
    finally:
        ray.shutdown()


def _connect(ray: Any, address: str | None, cpus: int | None) -> None:
    """``ray.init``: to ``address`` (checked first), else a new local instance."""
    if address is None:
        ray.init(
            address="local",  # a new instance, whatever RAY_ADDRESS says
            num_cpus=cpus or os.cpu_count() or 1,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
        return
    check_address(address)
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except ConnectionError as error:  # "auto" with no cluster on this machine
        found = (
            "no Ray cluster runs on this machine"
            if address == "auto"
            else " ".join(str(error).split())
        )
        raise InputError(
            f"--ray-address {address}: {found}; start one with 'ray start --head', give "
            "its HOST:PORT, or leave out --ray-address to start a local instance"
        ) from None


HANDLED_SIGNALS = (signal.SIGINT, *STOP_SIGNALS)
"""Signals whose Python handlers ``ray.init`` must not take over."""


def _python_handlers() -> dict[int, Any]:
    """The signals of :data:`HANDLED_SIGNALS` that have a Python handler (a CLI's, see
    ``solver.console.run_main``), with it."""
    handlers = {signum: signal.getsignal(signum) for signum in HANDLED_SIGNALS}
    return {signum: handler for signum, handler in handlers.items() if callable(handler)}


def _restore_handlers(handlers: dict[int, Any]) -> None:
    """Put back ``handlers``: ``ray.init`` sets its own SIGTERM handler (``sys.exit``) and its
    core worker a C++ one that prints a stack dump and aborts, where the caller's ends the sweep
    as Ctrl-C does (exit 143, the rows done kept)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def run_on_ray(
    points: Sequence[tuple[int, int]],
    options: PointOptions,
    done: Callable[[dict], None],
    *,
    address: str | None = None,
    cpus: int | None = None,
    max_retries: int = MAX_RETRIES,
) -> None:
    """Solve every (gpus, gpu_memory_bytes) point as a Ray task, submitted in ``points`` order;
    ``done(row)`` in this process as each finishes. See the module docstring."""
    fault = PointFault.from_env()
    with ray_session(address, cpus) as ray:
        task = ray.remote(num_cpus=1, max_retries=max_retries, retry_exceptions=True)(_solve_task)
        options_ref = ray.put(options)
        pending = {task.remote(options_ref, *point, fault): point for point in points}
        try:
            while pending:
                finished, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT_S)
                for ref in finished:
                    point = pending.pop(ref)
                    try:
                        row = ray.get(ref)
                    except ray.exceptions.RayError as error:
                        row = _failed_row(options, point, error, attempts=1 + max_retries)
                    done(row)
        except BaseException:  # Ctrl-C included: the rows done were handed to ``done`` already
            log.debug("sweep stopped with %d points not finished", len(pending))
            raise  # ray_session disconnects, which ends them (see the module docstring)


def _solve_task(
    options: PointOptions, gpus: int, gpu_memory_bytes: int, fault: PointFault | None
) -> dict:
    """One point's row, in a Ray worker."""
    if fault is not None:
        fault.strike(gpus, gpu_memory_bytes)
    return solve_point(options, gpus, gpu_memory_bytes)[0]


def _failed_row(
    options: PointOptions, point: tuple[int, int], error: Exception, *, attempts: int
) -> dict:
    """The ERROR row of a point whose task failed for good."""
    cause = getattr(error, "cause", None)  # RayTaskError: the exception the task raised
    reason = " ".join(f"{type(cause or error).__name__}: {cause or error}".split())
    if len(reason) > DETAIL_CHARS:
        reason = reason[: DETAIL_CHARS - 3] + "..."
    row = empty_row(options, *point)
    row |= {"status": "ERROR", "detail": f"ray task failed {attempts} times; last: {reason}"}
    return row


__all__ = [
    "FAULT_ENV",
    "INSTALL_HINT",
    "MAX_RETRIES",
    "InjectedFault",
    "PointFault",
    "check_address",
    "import_ray",
    "ray_session",
    "run_on_ray",
]
