"""The benchmarks' shared harness: timing (wall and CPU seconds), Markdown and CSV tables written
into benchmarks/, the command line and git commit that produced them, and the common flags.

A script under scripts/ imports it before the API (importing it puts the repository root on
``sys.path``, so ``python scripts/bench_x.py`` finds solver, profiling and models), and is then
its cases and its table::

    import harness
    from solver import plan

    def main(argv=None) -> int:
        args = harness.parser(__doc__).parse_args(argv)   # --out, default benchmarks/
        run = harness.Run.start(__file__, argv)           # command line, commit, clock, load
        rows = [case(...) for ...]
        harness.write_csv(args.out / "bench_x.csv", rows, COLUMNS)
        lines = ["# Title", "", f"Command: {run.command_text}  ", ...]
        lines += harness.markdown_table(rows, COLUMNS)
        harness.write_report(args.out, "bench_x.md", lines)

Scripts import the API (solver, profiling, models); nothing there imports a script.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (scripts/ is one of its folders)."""
BENCHMARKS = ROOT / "benchmarks"
"""Where the committed result tables live: every script's default ``--out``."""
GIB = 2**30
"""Bytes per GiB."""

if str(ROOT) not in sys.path:  # a script run as `python scripts/x.py` has only scripts/ there
    sys.path.insert(1, str(ROOT))

T = TypeVar("T")


# -- command line ---------------------------------------------------------------------------------


def parser(doc: str | None, *, out: Path | None = BENCHMARKS, quick: str | None = None):
    """An ``ArgumentParser`` described by the first line of ``doc`` (the script's docstring) with
    the flags scripts share: ``--out`` (a folder, default ``out``; none when ``out`` is None) and,
    when ``quick`` is given, ``--quick`` (``quick`` is its help: what the smoke run keeps)."""
    made = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    if out is not None:
        made.add_argument("--out", type=Path, default=out, help=f"output folder (default {out})")
    if quick is not None:
        made.add_argument("--quick", action="store_true", help=quick)
    return made


def git_commit(root: Path = ROOT) -> str:
    """The checkout's short commit hash, with "+changes" when tracked files differ from it;
    "unknown" outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if changed else "")


@dataclass
class Run:
    """One run of a script: the exact command line that started it, the commit, its clock and
    the machine's load averages when it started."""

    script: str
    """The script's path relative to the repository root, e.g. "scripts/bench_solver.py"."""
    argv: list[str]
    """Its arguments (``sys.argv[1:]`` when run from the shell)."""
    commit: str
    clock: Stopwatch = field(default_factory=lambda: Stopwatch())
    load_before: float = field(default_factory=lambda: load_average())
    """The 1-minute load average when the run started."""
    loads_before: str = field(default_factory=lambda: load_averages())
    """The 1-, 5- and 15-minute load averages when the run started."""

    @classmethod
    def start(cls, script_file: str | Path, argv: Sequence[str] | None = None) -> Run:
        """The run of ``script_file`` (pass ``__file__``) with ``argv`` (None: the shell's)."""
        path = Path(script_file).resolve()
        script = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        arguments = list(sys.argv[1:] if argv is None else argv)
        return cls(script=script, argv=arguments, commit=git_commit())

    @property
    def command(self) -> str:
        """The command as typed in the repository root, e.g. "python scripts/bench_solver.py
        --quick"."""
        return shlex.join(["python", self.script, *self.argv])

    @property
    def command_text(self) -> str:
        """The command in backticks and the commit, for a result file's "Command:" line."""
        return f"`{self.command}` (commit {self.commit})"

    @property
    def elapsed_s(self) -> float:
        """Wall seconds since the run started."""
        return self.clock.wall_s


# -- machine facts --------------------------------------------------------------------------------


def machine() -> str:
    """The processor's name, or the architecture when the platform gives none (e.g. "x86_64")."""
    return platform.processor() or platform.machine()


def architecture() -> str:
    """The machine's architecture, e.g. "x86_64"."""
    return platform.machine()


def node() -> str:
    """The machine's network name."""
    return platform.node()


def python_version() -> str:
    return platform.python_version()


def today() -> str:
    """The date as YYYY-MM-DD."""
    return time.strftime("%Y-%m-%d")


def cores() -> int | None:
    """CPUs of the machine (``os.cpu_count``)."""
    return os.cpu_count()


def usable_cores() -> int:
    """CPUs this process may run on (its affinity)."""
    return len(os.sched_getaffinity(0))


def load_average() -> float:
    """The 1-minute load average (other jobs on a shared machine slow every timing down)."""
    return os.getloadavg()[0]


def load_averages() -> str:
    """The 1-, 5- and 15-minute load averages, e.g. "0.52 0.61 0.70"."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- timing ---------------------------------------------------------------------------------------


class Stopwatch:
    """Wall and CPU seconds (this process's, all threads) since it was made; ``stop()`` (or the
    end of a ``with`` block) freezes them.

        with Stopwatch() as clock:
            work()
        clock.wall_s, clock.cpu_s
    """

    def __init__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        self._stopped: tuple[float, float] | None = None

    def stop(self) -> Stopwatch:
        if self._stopped is None:
            self._stopped = (time.perf_counter() - self._wall, time.process_time() - self._cpu)
        return self

    @property
    def wall_s(self) -> float:
        """Wall seconds (``time.perf_counter``)."""
        return self._stopped[0] if self._stopped else time.perf_counter() - self._wall

    @property
    def cpu_s(self) -> float:
        """CPU seconds of this process (``time.process_time``)."""
        return self._stopped[1] if self._stopped else time.process_time() - self._cpu

    def __enter__(self) -> Stopwatch:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def repeat(function: Callable[[], T], repeats: int) -> tuple[T, list[float]]:
    """Call ``function`` ``repeats`` times: (its last result, the wall seconds of each call)."""
    walls, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        walls.append(time.perf_counter() - start)
    return result, walls


@dataclass(frozen=True)
class Process:
    """A finished child process and what it cost: wall seconds from start to exit, its CPU
    seconds (user + system, its waited-for children included) and peak resident bytes."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    peak_rss_bytes: int


def run_process(
    argv: Sequence[str], *, cwd: str | Path = ROOT, env: dict[str, str] | None = None
) -> Process:
    """Run ``argv`` to its end, its output captured (text), timed and measured with ``os.wait4``
    (so the peak resident memory and CPU time are that child's own, not this process's)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(list(argv), stdout=out, stderr=err, text=True, cwd=cwd, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Process(
            argv=list(argv),
            returncode=child.returncode,
            stdout=out.read(),
            stderr=err.read(),
            wall_s=wall,
            cpu_s=usage.ru_utime + usage.ru_stime,
            peak_rss_bytes=usage.ru_maxrss * 1024,  # ru_maxrss is in KiB on Linux
        )


# -- tables ---------------------------------------------------------------------------------------


def markdown_table(rows: list[dict], columns: list[str], float_format: str = "") -> list[str]:
    """Lines of a Markdown table; floats use ``float_format`` (e.g. ".3f") when given."""

    def cell(value) -> str:
        if isinstance(value, float) and float_format:
            return format(value, float_format)
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return lines


def write_report(out_dir: str | Path, name: str, lines: list[str], *, note: str = "") -> Path:
    """Write ``lines`` as ``out_dir/name`` (creating the folder), say where (and ``note``),
    return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text("\n".join(lines))
    print(f"wrote {path}{note}")
    return path


def write_csv(
    path: str | Path,
    rows: Iterable[dict[str, Any]],
    columns: Sequence[str],
    *,
    extrasaction: str = "raise",
) -> Path:
    """Write ``rows`` as CSV with a header of ``columns`` (``csv.DictWriter``: a missing key is an
    empty cell; a key not in ``columns`` is an error unless ``extrasaction="ignore"``); creates
    the folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(columns), extrasaction=extrasaction)
        writer.writeheader()
        writer.writerows(rows)
    return path


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """The rows of a CSV written by :func:`write_csv` (every value a string)."""
    with open(path, newline="") as stream:
        return list(csv.DictReader(stream))
