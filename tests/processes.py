"""Processes seen from /proc, for the tests that signal a CLI and check that nothing it started
is left (tests/test_interrupts.py, tests/test_sweep_ray.py), and the environment of a CLI run as
a subprocess of this checkout."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    """Live (not zombie) child processes of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def descendants(pid: int) -> set[int]:
    """Live descendants of ``pid``: children, theirs, and so on."""
    found: set[int] = set()
    front = [pid]
    while front:
        for child in children(front.pop()):
            if child not in found:
                found.add(child)
                front.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: this checkout first on the path (Ray's workers and
    the ranks' fork server import ``solver`` and ``profiling`` from it too)."""
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), **extra}
