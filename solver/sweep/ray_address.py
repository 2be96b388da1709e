"""``--ray-address``: checked before any work, in bounded time (``solver.sweep --executor ray``).

``ray.init(address=...)`` on an address where no Ray cluster answers does not fail: it retries
for minutes (Ray's GCS client reconnects; a port that accepts TCP but is not Ray hung a sweep
until it was killed at 150 s, and a Ctrl-C then took 20 s), printing C++ warnings as it goes.
:func:`check_address` asks first, and gives up after a bound:

1. the form: ``HOST:PORT`` (the head node's GCS, ``ray start --head`` prints it; port 6379 by
   default), ``auto`` (the cluster started on this machine) or ``ray://HOST:PORT`` (Ray Client,
   which needs the ``ray[client]`` extra: without it, one line says what to install or to give
   the GCS address instead);
2. a TCP connect of at most :data:`CONNECT_TIMEOUT_S` (nothing listening: fails at once);
3. a Ray client in a child process (:data:`PROBE`): Ray's own GCS client connects and reads the
   cluster id (for ``ray://``, a gRPC channel to the client server becomes ready). Once Ray is
   imported (1-3 s; up to :data:`IMPORT_TIMEOUT_S`), the child has :func:`probe_timeout_s`
   seconds (``--time-limit``, at most :data:`PROBE_TIMEOUT_S`) before its own timer ends it
   (SIGALRM, whose default action stops even Ray's C++ retry loop); its output is dropped. A
   child, not a thread: Ray's client cannot be stopped from Python and writes its warnings
   straight to stderr.

Every failure is an InputError (exit 2, one line). An address that answered is not asked again
in this process (the CLI checks it before any work, the sweep again when it connects).
"""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import sys

from solver.errors import InputError, one_line

CONNECT_TIMEOUT_S = 5.0
"""How long ``HOST:PORT`` may take to accept a TCP connection."""
PROBE_TIMEOUT_S = 20.0
"""The longest a Ray client may take to answer (``--time-limit`` shortens it): with the CLI's
start and Ray's imports, a sweep given an address that is not Ray exits within 30 s."""
MIN_PROBE_S = 1.0
"""The shortest time given to the Ray client."""
IMPORT_TIMEOUT_S = 30.0
"""How long the child may take to import Ray (2-3 s on 2 busy cores) before its timer starts."""
CLIENT_HINT = (
    "ray://HOST:PORT is a Ray Client address, which needs the ray[client] extra (pip install "
    "'ray[client]'); or give the head node's GCS address HOST:PORT (port 6379 by default, "
    "printed by 'ray start --head') to run as a driver on the cluster"
)
RETRY_HINT = (
    "give the head node's GCS address HOST:PORT (port 6379 by default, printed by 'ray start "
    "--head') or auto, or leave out --ray-address to start a local instance"
)

NO_CLUSTER, CANNOT_PROBE, FAILED = 10, 11, 12
"""Exit codes of :data:`PROBE` (0: a Ray cluster answered)."""
PROBE = f"""
import signal, sys
address, seconds = sys.argv[1], float(sys.argv[2])
try:
    if address.startswith("ray://"):
        import grpc
        signal.setitimer(signal.ITIMER_REAL, seconds)
        channel = grpc.insecure_channel(address[len("ray://"):])
        grpc.channel_ready_future(channel).result()
    else:
        from ray._private.services import canonicalize_bootstrap_address
        from ray._raylet import GcsClient
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            target = canonicalize_bootstrap_address(address)
        except ConnectionError:
            target = None
        if target is None:
            sys.exit({NO_CLUSTER})
        GcsClient(address=target).cluster_id
except (ImportError, AttributeError) as error:
    print(type(error).__name__, error)
    sys.exit({CANNOT_PROBE})
except Exception as error:
    print(type(error).__name__, error)
    sys.exit({FAILED})
"""
"""The child's script, ``ADDRESS SECONDS``: exit 0 when a Ray cluster answered at ADDRESS
within SECONDS of Ray's import (else SIGALRM ends it); the reason of a failure on its stdout."""

_answered: set[str] = set()
"""Addresses that answered in this process."""


def probe_timeout_s(time_limit_s: float | None = None) -> float:
    """How long the Ray client may take to answer: ``time_limit_s`` (``--time-limit``) when
    given, at most :data:`PROBE_TIMEOUT_S`, at least :data:`MIN_PROBE_S`."""
    limit = PROBE_TIMEOUT_S if time_limit_s is None else min(time_limit_s, PROBE_TIMEOUT_S)
    return max(MIN_PROBE_S, limit)


def check_address(address: str, *, time_limit_s: float | None = None) -> None:
    """InputError (one line) unless a Ray cluster answers at ``address`` (``auto``,
    ``HOST:PORT`` or ``ray://HOST:PORT``) within :func:`probe_timeout_s` seconds of
    ``time_limit_s`` (``--time-limit``), Ray's import apart. See the module docstring."""
    if address in _answered:
        return
    if address != "auto":
        host, port = _host_port(address)
        if address.startswith("ray://") and importlib.util.find_spec("grpc") is None:
            raise InputError(f"--ray-address {address}: {CLIENT_HINT}")
        _connect(address, host, port)
    _probe(address, probe_timeout_s(time_limit_s))
    _answered.add(address)


def _host_port(address: str) -> tuple[str, int]:
    """(host, port) of ``[ray://]HOST:PORT``; InputError for another form."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(
            f"--ray-address {address!r}: expected HOST:PORT (the head node's GCS, e.g. "
            "10.0.0.1:6379), ray://HOST:PORT or auto"
        )
    return host.strip("[]"), int(port)


def _connect(address: str, host: str, port: int) -> None:
    """InputError unless ``host:port`` accepts a TCP connection within CONNECT_TIMEOUT_S."""
    try:
        with socket.create_connection((host, port), CONNECT_TIMEOUT_S):
            pass
    except OSError as error:
        raise InputError(
            f"--ray-address {address}: no Ray cluster answers there ({error}); start one with "
            "'ray start --head', or leave out --ray-address to start a local instance"
        ) from None


def _probe(address: str, seconds: float) -> None:
    """Run :data:`PROBE` on ``address``; InputError unless it answers within ``seconds`` of
    importing Ray."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, address, repr(seconds)],
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S + seconds,
            check=False,
        )
        timed_out = done.returncode == -signal.SIGALRM
    except subprocess.TimeoutExpired:
        timed_out = True
    if timed_out:
        what = "the port accepts connections but " if address != "auto" else ""
        raise InputError(
            f"--ray-address {address}: no Ray cluster answered within {seconds:g} s ({what}no "
            f"Ray {'Client server' if address.startswith('ray://') else 'GCS'} replied); "
            + RETRY_HINT
        )
    reason = one_line(done.stdout.strip() or done.stderr.strip()[-300:])
    if done.returncode == 0 or done.returncode == CANNOT_PROBE:
        return  # CANNOT_PROBE: another Ray whose client is not where we look; ray.init decides
    if done.returncode == NO_CLUSTER:
        raise InputError(
            f"--ray-address {address}: no Ray cluster runs on this machine; start one with 'ray "
            "start --head', give its HOST:PORT, or leave out --ray-address to start a local "
            "instance"
        )
    raise InputError(f"--ray-address {address}: Ray could not connect ({reason}); {RETRY_HINT}")


__all__ = ["CLIENT_HINT", "CONNECT_TIMEOUT_S", "PROBE_TIMEOUT_S", "check_address"]
