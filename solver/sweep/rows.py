"""A sweep's rows on disk: the CSV columns (:data:`ROW_KEYS`), writing rows as they come
(:class:`CsvRows`) and reading them back with their types (:func:`read_rows`)."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from solver.errors import InputError

ROW_KEYS = (
    "gpus",
    "gpu_memory_bytes",
    "status",
    "config",
    "pp",
    "tp",
    "dp",
    "micro_batch",
    "num_microbatches",
    "zero",
    "recompute",
    "peak_bytes",
    "throughput",
    "gap",
    "fits",
    "wall_s",
    "even_peak_bytes",
    "even_throughput",
    "parameters_peak_bytes",
    "parameters_throughput",
    "detail",
)
"""The columns of a sweep row, in CSV order (``solver.plots.plot_sweep`` reads them)."""


STATUSES = ("OPTIMAL", "FEASIBLE", "INFEASIBLE", "NO_SOLUTION", "ERROR")
"""OPTIMAL / FEASIBLE: a plan (FEASIBLE: time limit, see gap); INFEASIBLE: nothing fits memory
or the throughput constraint; NO_SOLUTION: time limit before any plan; ERROR: bad point (e.g. a
GPU count no config can use)."""


_INT = ("gpus", "gpu_memory_bytes", "pp", "tp", "dp", "micro_batch", "num_microbatches", "zero")


_INT += ("peak_bytes", "even_peak_bytes", "parameters_peak_bytes")


_FLOAT = ("throughput", "gap", "wall_s", "even_throughput", "parameters_throughput")


class CsvRows:
    """A sweep CSV written row by row (flushed), so an interrupted run keeps what it wrote.

    ``append`` each row as it completes; ``finish(rows)`` rewrites the file with every row in
    point order (atomically)."""

    def __init__(self, path: str | os.PathLike, *, protect: Sequence[str] = ()):
        self.path = check_output_path(path, flag="--out", protect=protect)
        self.count = 0
        self._stream = open(self.path, "w", newline="")  # noqa: SIM115 (closed in finish/close)
        self._writer = csv.DictWriter(self._stream, fieldnames=ROW_KEYS)
        self._writer.writeheader()
        self._stream.flush()

    def append(self, row: dict) -> None:
        self._writer.writerow(_csv_cells(row))
        self._stream.flush()
        self.count += 1

    def close(self) -> None:
        self._stream.close()

    def finish(self, rows: Sequence[dict]) -> None:
        self.close()
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        with open(temporary, "w", newline="") as stream:
            writer = csv.DictWriter(stream, fieldnames=ROW_KEYS)
            writer.writeheader()
            writer.writerows(_csv_cells(row) for row in rows)
        os.replace(temporary, self.path)


def read_rows(path: str | os.PathLike) -> list[dict]:
    """The rows of a sweep CSV with their types back (ints, floats, bools, None for blanks)."""
    with open(path, newline="") as stream:
        reader = csv.DictReader(stream)
        missing = [key for key in ROW_KEYS if key not in (reader.fieldnames or [])]
        if missing:
            raise InputError(f"{path}: not a sweep CSV; missing columns {missing}")
        return [_typed(cells) for cells in reader]


def _csv_cells(row: dict) -> dict:
    return {key: "" if row.get(key) is None else row[key] for key in ROW_KEYS}


def _typed(cells: dict[str, str]) -> dict:
    row: dict[str, Any] = {}
    for key in ROW_KEYS:
        text = cells[key]
        if key in ("config", "detail", "status"):
            row[key] = text
        elif text == "":
            row[key] = None
        elif key in _INT:
            row[key] = int(text)
        elif key in _FLOAT:
            row[key] = float(text)
        elif key == "fits":
            row[key] = text == "True"
        else:
            row[key] = text
    return row


def check_output_path(path: str | os.PathLike, *, flag: str, protect: Sequence[str] = ()) -> Path:
    """An output path whose folder exists and that is not an input file (InputError otherwise)."""
    target = Path(path)
    if not target.parent.exists():
        raise InputError(f"{flag} {path}: folder {target.parent} does not exist; create it first")
    if target.is_dir():
        raise InputError(f"{flag} {path}: is a folder; give a file name")
    for given in protect:
        if target.exists() and Path(given).exists() and target.resolve() == Path(given).resolve():
            raise InputError(f"{flag} {path}: is an input file; choose another output path")
    return target


def fits(row: dict) -> bool:
    """Whether a row holds a plan that fits memory under the throughput constraint."""
    return row["status"] in ("OPTIMAL", "FEASIBLE")
