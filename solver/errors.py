"""Typed planner errors and the exit codes the CLIs return for them.

Only a CLI's ``main()`` catches these: it prints ``str(error)`` as one line on stderr and returns
``error.exit_code``. Library code raises; it never prints or exits.
"""

from __future__ import annotations

import reprlib


class PlannerError(Exception):
    """Base class; ``exit_code`` is what a CLI returns for it."""

    exit_code = 1


class InputError(PlannerError):
    """Bad user input: a graph file, an option, a CLI value. Exit code 2."""

    exit_code = 2


class InfeasibleError(PlannerError):
    """No configuration fits the constraints. Exit code 3.

    ``best_peak_bytes`` is the smallest peak found (or a lower bound) and ``suggested_gpus`` the
    smallest GPU count that fits (``solver.search.planner.smallest_fitting_gpus``; when its search
    stopped at the time limit, the smallest count it found to fit; None when none was).
    """

    exit_code = 3

    def __init__(
        self,
        message: str,
        *,
        best_peak_bytes: int | None = None,
        capacity_bytes: int | None = None,
        suggested_gpus: int | None = None,
    ):
        super().__init__(message)
        self.best_peak_bytes = best_peak_bytes
        self.capacity_bytes = capacity_bytes
        self.suggested_gpus = suggested_gpus


class NoSolutionError(PlannerError):
    """The time limit ran out before any feasible plan was found. Exit code 4."""

    exit_code = 4


class StalePlanError(PlannerError):
    """Evaluating a plan file again gives other numbers than it records (the cost model changed
    since it was written). Exit code 6."""

    exit_code = 6


class RunError(PlannerError):
    """A rank of a real run failed or the run timed out; every process of the run has been
    stopped. Exit code 5."""

    exit_code = 5

    def __init__(self, message: str, *, pids: list[int]):
        super().__init__(message)
        self.pids = pids
        """Process ids of the ranks (all ended when this is raised)."""


class OutputError(PlannerError):
    """An output file could not be written after the work was done (a full disk, ``/dev/full``,
    an I/O error); an existing file is left as it was and no temporary file remains
    (``solver.files.output_file``). A bad output path found before the work is an ``InputError``.
    Exit code 7."""

    exit_code = 7


QUOTE_CHARS = 80
"""Longest piece of user data an error message quotes (longer text is cut, its length said)."""
MESSAGE_CHARS = 399
"""Longest error line a CLI prints, "error: " included (:func:`one_line`)."""


def quote(value: object, limit: int = QUOTE_CHARS, *, bare: bool = False) -> str:
    """User data made safe to put in a message: a string as its Python repr (control characters,
    newlines, ANSI escapes and lone surrogates escaped, so it prints on one line on any terminal
    and any stream encoding), anything else as its repr; cut to ``limit`` characters with its
    full length said. Every message that quotes a name, a value or a path from a file uses it.
    ``bare``: a short string of printable ASCII without spaces or quotes is given as it is (a
    field name in a list)."""
    if isinstance(value, str) and bare and _plain(value, limit):
        return value
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return repr(value[:limit]) + f"... ({len(value)} characters)"
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring = 2, 4, 4, 20
    text = short.repr(value)  # a container's first items only, however large it is
    if len(text) > limit:
        text = text[:limit] + "..."
    return one_line(text)


def one_line(message: str, limit: int = MESSAGE_CHARS) -> str:
    """``message`` as one printable line of at most ``limit`` characters (plus a marker when
    cut): control characters (newlines, tabs, escape sequences) escaped, lone surrogates escaped.
    The last guard of every CLI's error line (``solver.console.print_error``)."""
    head = message[: limit + 1]  # escaping only lengthens the text
    text = "".join(char if char.isprintable() else _escape(char) for char in head)
    if len(text) > limit:
        marker = f"... [cut; {len(message)} characters]"
        text = text[: limit - len(marker)] + marker
    return text


def _plain(text: str, limit: int) -> bool:
    return (
        0 < len(text) <= limit
        and text.isascii()
        and text.isprintable()
        and not any(char in text for char in " '\"\\")
    )


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
