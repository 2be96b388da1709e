"""Processes seen from /proc, for the tests that signal a CLI and check that nothing it started
is left (tests/test_interrupts.py, tests/test_sweep_ray.py), and the environment of a CLI run as
a subprocess of this checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def run_export(
    *args: str, cwd: Path, timeout: float = 300, on_path: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    """``python -m profiling.export ARGS --no-progress`` in ``cwd``, offline (HF_HUB_OFFLINE), this
    checkout (and ``on_path``: a folder of factories) on the path."""
    environment = cli_env(HF_HUB_OFFLINE="1", **env)
    if on_path is not None:
        environment["PYTHONPATH"] += os.pathsep + str(on_path)
    return subprocess.run(
        [sys.executable, "-m", "profiling.export", *args, "--no-progress"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environment,
        timeout=timeout,
    )


def run_driver(
    driver: str, manifest: list[dict], work: Path, *args: str, timeout: float, **env: str
) -> dict[str, Any]:
    """Many CLI runs in one interpreter: ``driver`` (Python source) runs with the paths of
    ``manifest`` (written as work/manifest.json) and of its results file, then ``args``; returns
    the results it wrote (work/results.json). Fails the test when the driver itself fails."""
    (work / "manifest.json").write_text(json.dumps(manifest))
    done = subprocess.run(
        [sys.executable, "-c", driver, str(work / "manifest.json"), str(work / "results.json")]
        + list(args),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=cli_env(**env),
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((work / "results.json").read_text())
