"""Command-line plumbing every CLI of the project shares, solver's and profiling's: the
one-line-error parser and argument types, error and output printing, checking and writing output
files (by the one writing path, ``solver.files.output_file``), and the stop signals: Ctrl-C
(SIGINT, exit 130), SIGTERM (143) and SIGHUP (129).

Errors: one line on stderr, exit code 2 (bad input, a bad output path included), 3 (infeasible),
4 (time limit without a solution), 7 (an output could not be written after the work); never a
traceback. The solver's own option groups (cluster, training, search) are in ``solver/cli/``.

Signals: :func:`run_main` runs a CLI's ``main`` with SIGTERM and SIGHUP raising
:class:`Terminated`, a ``KeyboardInterrupt``, so the one ``except KeyboardInterrupt`` path of
each CLI stops its work, children and temporary files alike for all three; :func:`interrupted`
prints the line (``interrupted`` or ``terminated``) and returns 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from solver.errors import one_line, quote

INTERRUPTED = 128 + signal.SIGINT
"""Exit code after Ctrl-C (130): 128 + SIGINT, as a shell reports a process killed by it."""
TERMINATED = 128 + signal.SIGTERM
"""Exit code after SIGTERM (143)."""
HUNG_UP = 128 + 1
"""Exit code after SIGHUP (129: 128 + POSIX's SIGHUP), e.g. the terminal closed."""
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)
"""The signals :func:`run_main` turns into :class:`Terminated` (SIGINT is Python's own
KeyboardInterrupt); Windows has no SIGHUP."""
STOP_CODES = (INTERRUPTED, TERMINATED, HUNG_UP)
STOP_GRACE_S = 5.0
"""After the first SIGTERM or SIGHUP, how long more of them are ignored (the first one's cleanup
takes a second or two); one after that ends the process at once."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so every
    ``except KeyboardInterrupt`` (stop the pool, the ranks, the native solve; keep or drop the
    rows written) handles it the same way. ``signum``: the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupted(detail: str = "") -> int:
    """The stop signal being handled (called in ``except KeyboardInterrupt``): one line on
    stderr, ``interrupted`` after Ctrl-C, ``terminated`` after SIGTERM or SIGHUP (then
    ``detail``), and the exit code to return, 128 + the signal's number (130, 143, 129). A stderr
    that is gone (a closed terminal after SIGHUP) is not an error."""
    signum = stop_signal()
    word = "interrupted" if signum == signal.SIGINT else "terminated"
    try:
        sys.stderr.write(f"{word}{detail}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    return 128 + signum


_received: list[int] = []
"""The stop signal :func:`install_stop_handlers`' handler received (at most one)."""


def stop_signal(error: BaseException | None = None) -> int:
    """The number of the signal behind ``error`` (default: the exception being handled):
    :class:`Terminated`'s; else the SIGTERM or SIGHUP this process received (native code may
    turn it into a plain KeyboardInterrupt: Ray's ``ray.wait`` does); else SIGINT."""
    if error is None:
        error = sys.exc_info()[1]
    signum = getattr(error, "signum", None)
    if signum is None:
        signum = _received[0] if _received else signal.SIGINT
    return signum


IMPORT_RETRY_S = 0.05
"""A stop signal that arrives during an import is delivered again this much later (until the
import is over): raised inside one, :class:`Terminated` can be lost or abort the process (torch's
first import runs Python code under its C++ initialisation: a SIGHUP there ended ``export`` with
-6 under load, and one at 0.3 s into ``import torch`` was swallowed)."""


def _importing(frame: Any) -> bool:
    """Whether ``frame`` (the main thread's, where a handler runs) is inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def install_stop_handlers() -> None:
    """From now on (in this process, not in its forked children) SIGTERM and SIGHUP raise
    :class:`Terminated` in the main thread. Only the first does: the ones after it (a supervisor
    may send SIGTERM and SIGHUP together) are ignored for :data:`STOP_GRACE_S` while the first
    one's cleanup runs, and end the process at once after that. One that comes during an import
    waits for its end (:data:`IMPORT_RETRY_S`). Main thread only (Python's rule for handlers)."""
    owner = os.getpid()
    first: list[float] = []

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != owner:  # a forked child that kept the handler: die as by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if first:
            if time.monotonic() - first[0] > STOP_GRACE_S:
                os._exit(128 + signum)
            return
        if _importing(frame):  # again once the import is over
            threading.Timer(IMPORT_RETRY_S, os.kill, (owner, signum)).start()
            return
        first.append(time.monotonic())
        _received.append(signum)
        raise Terminated(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


def run_main(main: Callable[[], int]) -> NoReturn:
    """A CLI's ``python -m`` entry: ``main()`` with the stop handlers installed, then
    :func:`exit_process` with its code. A stop signal that reaches here (``main`` handles its own;
    this is for one during argument parsing) is its one line and code too."""
    if threading.current_thread() is threading.main_thread():
        install_stop_handlers()
    try:
        code = main()
    except KeyboardInterrupt:
        code = interrupted()
    exit_process(code)


def exit_process(code: int) -> NoReturn:
    """End a ``python -m`` CLI with ``code``. After a stop signal (:data:`STOP_CODES`) the process
    ends with ``os._exit`` once the standard streams are flushed: a native solver stopped
    mid-solve may still have threads running (CP-SAT's workers, HiGHS's scheduler), and the C++
    runtime's static destructors would abort under them at a normal exit ("terminate called
    without an active exception": exit -6 instead of 130, about one Ctrl-C in ten on a large DAG
    search)."""
    if code in STOP_CODES:
        _finish_multiprocessing()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def _finish_multiprocessing() -> None:
    """What a normal exit would do for ``multiprocessing`` and ``os._exit`` skips: end the
    children still registered (none, after a stop: the CLIs stop theirs) and run its finalizers,
    which remove its temporary folder (``pymp-*``: on Python < 3.12 the ranks' fork server
    listens on a socket there). ``multiprocessing.util._exit_function`` is the function a normal
    exit calls (an atexit handler), private but in every CPython 3."""
    util = sys.modules.get("multiprocessing.util")
    finish = getattr(util, "_exit_function", None)
    if finish is None:
        return
    try:
        finish()
    except Exception:  # noqa: S110  a failed cleanup must not hide the exit code or add a line
        pass


def shows_progress(quiet: bool) -> bool:
    """A progress display goes to stderr only when it is a terminal (never into a log file or
    a pipe) and the user did not ask for quiet."""
    return not quiet and sys.stderr.isatty()


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line with exit code 2 (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(one_line(f"{self.prog}: error: {message} (see --help)") + "\n")
        raise SystemExit(2)


def print_error(error: BaseException | str) -> None:
    """A CLI's error: ``error: <message>`` as one line on stderr, at most a few hundred
    characters, control characters escaped (``solver.errors.one_line``), whatever it quotes."""
    sys.stderr.write(one_line(f"error: {error}") + "\n")
    sys.stderr.flush()


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers; an empty item (``1,,2``, ``4,``) is an
    error, as every comma-list option's."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip():
        raise argparse.ArgumentTypeError("expected at least one integer")
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"empty item in {quote(text)}; write comma-separated integers like 1,2,4"
        )
    try:
        values = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {quote(text)}"
        ) from None
    return values


def comma_items(text: str) -> str:
    """An argparse type: comma-separated names (module paths, ...) as given, after checking
    that no item is empty (``a,,b``, ``a,``)."""
    if not all(part.strip() for part in text.split(",")):
        raise argparse.ArgumentTypeError(
            f"empty item in {quote(text)}; write comma-separated names like a,b"
        )
    return text


def int_list_in(low: int, high: int):
    """An argparse type: comma-separated integers, each in low..high."""

    def parse(text: str) -> list[int]:
        values = int_list(text)
        bad = [value for value in values if not low <= value <= high]
        if bad:
            raise argparse.ArgumentTypeError(
                f"each value must be in {low}..{format_count(high)}, got {quote(bad[0])}"
            )
        return values

    return parse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {quote(text)}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {quote(value)}")
    return value


def int_in(low: int, high: int):
    """An argparse type: an integer in low..high."""

    def parse(text: str) -> int:
        value = positive_int(text) if low == 1 else _integer(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be in {low}..{format_count(high)}, got {quote(value)}"
            )
        return value

    return parse


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {quote(text)}") from None


def format_count(value: int) -> str:
    """2^24 rather than 16777216."""
    if value >= 2**16 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return str(value)


def float_or_nan(text: str) -> float:
    """The number of ``text``, NaN when it is none (then every range check fails)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def positive_float(text: str) -> float:
    """A finite number > 0 (NaN, inf and 1e400 are errors)."""
    value = float_or_nan(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {quote(text)}")
    return value


def number_in(low: float, high: float, *, low_open: bool = False, unit: str = ""):
    """An argparse type: a finite number in [low, high] ((low, high] with ``low_open``)."""

    def parse(text: str) -> float:
        value = float_or_nan(text)
        if not ((value > low if low_open else value >= low) and value <= high):
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(
                f"must be a number in {bracket}{low:g}, {high:g}]{unit}, got {quote(text)}"
            )
        return value

    return parse


def input_files(args: argparse.Namespace) -> list[str]:
    """Files the CLI reads (no output may replace them): the graph, --calibration, --cluster
    and --plan, where given."""
    names = ("graph", "calibration", "cluster", "plan")
    return [getattr(args, name) for name in names if getattr(args, name, None)]


OUTPUT_FLAGS = (
    ("json", "--json"),
    ("out", "--out"),
    ("plot", "--plot"),
    ("plot_schedule", "--plot-schedule"),
)
"""(argument, flag) of the outputs a CLI may have, in the order they are checked."""


def check_outputs(args: argparse.Namespace) -> None:
    """Fail on a bad output path before any work (InputError, exit 2, one line): every given
    --json, --out, --plot and --plot-schedule (solver.files.output_file.check_output: a folder,
    a missing or read-only folder, no permission, an input file, the same file as another
    output; the plots also need .png, .pdf or .svg)."""
    from solver.files.output_file import check_output

    checked = []
    for name, flag in OUTPUT_FLAGS:
        path = getattr(args, name, None)
        if path is None:
            continue
        if name in ("plot", "plot_schedule"):
            from solver.report.plots import check_plot_extension

            check_plot_extension(path, flag=flag)
        checked.append(check_output(path, flag=flag, protect=input_files(args), others=checked))


def write_json(
    path: str, document: dict[str, Any], *, protect: list[str], flag: str = "--json"
) -> None:
    """Write ``document`` by the one writing path (solver.files.output_file: atomic for a regular
    file, written through for a device, a FIFO or a link's target); a bad path is an
    InputError (exit 2), a failed write an OutputError (exit 7) that leaves an existing file
    as it was. ``protect``: the input files it must not be."""
    from solver.files.output_file import write_json_file

    write_json_file(path, document, flag=flag, protect=protect)


def print_output(text: str) -> None:
    """Print, tolerating a closed pipe (``... | head``) and a stdout that cannot encode a name
    (``PYTHONIOENCODING=ascii``: such characters are written as backslash escapes)."""
    try:
        try:
            print(text, flush=True)
        except UnicodeEncodeError:
            encoding = sys.stdout.encoding or "ascii"
            print(text.encode(encoding, "backslashreplace").decode(encoding), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
