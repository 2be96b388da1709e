"""The user's code under the CLI's error handling: a model factory (``package.module:factory``),
the model it builds, an ``hf:`` config that transformers builds, all run inside
``profiling.export``.

- :func:`user_code`: whatever the code raises (an exception, a RecursionError, a SyntaxError or an
  ImportError of the factory's module) becomes one ``InputError`` line (exit 2) naming what ran
  and the exception's type and message; a ``sys.exit(n)`` inside it (``SystemExit``, even with
  code 0) is an ``InputError`` too: no graph was made, so the exit is never 0. The project's own
  errors (``PlannerError``) and Ctrl-C pass through.
- :func:`time_limit`: a wall-clock limit (``--time-limit``) on the main thread, by ``SIGALRM``: at
  the limit the running Python code is stopped by an exception that ``except Exception`` does not
  catch (raised again every second until it ends), and the CLI exits 4 with one line. Code stuck
  inside one native call is stopped when that call returns.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from solver.errors import InputError, NoSolutionError, PlannerError

MESSAGE_CHARS = 200
"""Longest piece of an exception's message quoted in the error line."""


def short_message(error: BaseException) -> str:
    """``error``'s message on one line, whitespace collapsed, at most MESSAGE_CHARS."""
    text = " ".join(str(error).split())
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + "..."


@contextlib.contextmanager
def user_code(what: str, hint=None) -> Iterator[None]:
    """Run the body as the user's code ``what`` (e.g. ``factory my.models:spec``): an exception
    or SystemExit from it is an InputError ``<what> raised <Type>: <message>`` / ``<what> exited
    ...``. ``hint(error) -> str``: more words for the line (the config field it is about)."""
    try:
        yield
    except PlannerError:
        raise
    except SystemExit as exit_:
        raise InputError(
            f"{what} exited (SystemExit with code {exit_.code!r}) before a graph was made; a "
            "factory returns a models.ModelSpec and never calls sys.exit()"
        ) from None
    except Exception as error:  # noqa: BLE001 - the user's code: one line, not a traceback
        extra = hint(error) if hint else ""
        raise InputError(
            f"{what} raised {type(error).__name__}: {short_message(error)}{extra}"
        ) from None


class _TimeUp(BaseException):
    """Raised by SIGALRM at the time limit; a BaseException, so ``except Exception`` in the
    user's code does not swallow it."""


@contextlib.contextmanager
def time_limit(
    seconds: float | None, *, what: str = "profiling", flag: str = "--time-limit"
) -> Iterator[None]:
    """Stop the body after ``seconds`` of wall-clock time (NoSolutionError, exit 4: ``<what>
    stopped at the time limit ...``). None, or off the main thread (no signals there): no
    limit."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    state = {"active": True}

    def on_alarm(signum, frame):
        if state["active"]:
            raise _TimeUp

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)  # again every second
            yield
        finally:
            state["active"] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    except _TimeUp:
        raise NoSolutionError(
            f"{what} stopped at the time limit ({flag} {seconds:g} s) before a graph was made; "
            f"raise {flag}, or profile a smaller model"
        ) from None
