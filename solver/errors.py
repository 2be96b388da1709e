"""Typed planner errors and the exit codes the CLIs return for them.

Only a CLI's ``main()`` catches these: it prints ``str(error)`` as one line on stderr and returns
``error.exit_code``. Library code raises; it never prints or exits.
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base class; ``exit_code`` is what a CLI returns for it."""

    exit_code = 1


class InputError(PlannerError):
    """Bad user input: a graph file, an option, a CLI value. Exit code 2."""

    exit_code = 2


class InfeasibleError(PlannerError):
    """No configuration fits the constraints. Exit code 3.

    ``best_peak_bytes`` is the smallest peak found (or a lower bound) and ``suggested_gpus`` the
    smallest GPU count that fits (``solver.planner.smallest_fitting_gpus``; when its search
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
    (``solver.output_file``). A bad output path found before the work is an ``InputError``.
    Exit code 7."""

    exit_code = 7
