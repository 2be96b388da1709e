"""A sweep's rows on disk: the CSV columns (:data:`ROW_KEYS`), writing rows as they come
(:class:`CsvRows`) and reading them back with their types (:func:`read_rows`)."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from solver.errors import InputError, OutputError
from solver.files.output_file import OutputFile, check_output

ROW_KEYS = (
    "gpus",
    "gpu_memory_bytes",
    "reserve_bytes",
    "usable_bytes",
    "status",
    "config",
    "pp",
    "tp",
    "cp",
    "dp",
    "ep",
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
"""The columns of a sweep row, in CSV order (``solver.report.plots.plot_sweep`` reads them).
``reserve_bytes``: the memory per GPU the job never gets (``TrainingConfig.memory_reserve``);
``usable_bytes`` = gpu_memory_bytes - reserve_bytes, what a plan's peak must fit in. ``cp``: the
context-parallel degree (pp x tp x cp x dp = gpus). ``ep``: the expert-parallel degree (1 on a
dense graph)."""


OPTIONAL_KEYS = ("reserve_bytes", "usable_bytes", "cp", "ep")
"""Columns a sweep CSV written before the reserve (or context or expert parallelism) lacks (read as
blanks)."""


STATUSES = ("OPTIMAL", "FEASIBLE", "INFEASIBLE", "NO_SOLUTION", "ERROR")
"""OPTIMAL / FEASIBLE: a plan (FEASIBLE: time limit, see gap); INFEASIBLE: nothing fits memory
or the throughput constraint; NO_SOLUTION: time limit before any plan; ERROR: bad point (e.g. a
GPU count no config can use)."""


_INT = (
    "gpus",
    "gpu_memory_bytes",
    "reserve_bytes",
    "usable_bytes",
    "pp",
    "tp",
    "cp",
    "dp",
    "ep",
    "micro_batch",
    "num_microbatches",
    "zero",
)


_INT += ("peak_bytes", "even_peak_bytes", "parameters_peak_bytes")


_FLOAT = ("throughput", "gap", "wall_s", "even_throughput", "parameters_throughput")


class CsvRows:
    """A sweep CSV written row by row (flushed), so an interrupted run keeps what it wrote.

    ``append`` each row as it completes; ``finish(rows)`` writes every row in point order;
    ``close()`` without ``finish`` keeps the rows appended so far. The file goes through the one
    writing path (``solver.files.output_file``):

    - to a regular file (or a new path) the rows stream into a temporary file next to it; ``finish``
      rewrites it in point order and renames it over the path; ``close`` after an interrupt
      renames it with the rows appended so far when there is at least one (with none, an
      existing file stays as it was); a failed write removes it and leaves the path as it was. A
      killed process leaves its rows in the hidden ``.NAME.XXXXXXXX.tmp`` file next to the path;
    - to a device, a FIFO or ``/dev/stdout`` the rows go out as they complete (completion order)
      and are not written again by ``finish`` (which writes them all only when none was appended).
    """

    def __init__(self, path: str | os.PathLike, *, protect: Sequence[str] = ()):
        self._output = OutputFile(path, flag="--out", protect=protect)
        self.path = self._output.destination.path
        self.count = 0
        self._open = True
        self._text = io.TextIOWrapper(self._output.stream, encoding="utf-8", newline="")
        self._writer = csv.DictWriter(self._text, fieldnames=ROW_KEYS)
        self._write(self._writer.writeheader)

    def append(self, row: dict) -> None:
        self._write(lambda: self._writer.writerow(_csv_cells(row)))
        self.count += 1

    def finish(self, rows: Sequence[dict]) -> None:
        """Write every row in point order and publish the file."""
        atomic = self._output.destination.atomic
        if atomic or self.count == 0:

            def rewrite() -> None:
                if atomic:  # the temporary file: start again
                    self._text.seek(0)
                    self._text.truncate()
                    self._writer.writeheader()
                self._writer.writerows(_csv_cells(row) for row in rows)

            self._write(rewrite)
            self.count = len(rows)
        self._publish()

    def close(self) -> str:
        """Publish the rows appended so far (none: drop them, an existing file stays as it was);
        nothing after :meth:`finish`. Never raises (a failed write leaves the path as it was):
        returns what became of the rows, for a message ('; 2 rows kept in sweep.csv')."""
        if not self._open:
            return ""
        if self.count == 0 and self._output.destination.atomic:
            self._drop()
            return f"; no row done, {self.path} not written"
        try:
            self._publish()
        except OutputError as error:
            return f"; {self.count} rows not kept: {error}"
        return f"; {self.count} rows kept in {self.path}"

    def discard(self) -> None:
        """Drop the rows: the temporary file is removed and an existing file stays as it was
        (to a FIFO or a device, what was streamed is out). Nothing after ``finish``."""
        if self._open:
            self._drop()

    def _write(self, write) -> None:
        """Run ``write`` and flush; a failure drops the output (OutputError, exit code 7)."""
        try:
            write()
            self._text.flush()
        except OSError as error:
            self._drop()
            raise self._output.error(error) from None

    def _publish(self) -> None:
        self._open = False
        try:
            self._text.detach()  # flushes; the binary stream stays open for commit
        except OSError as error:
            self._output.discard()
            raise self._output.error(error) from None
        self._output.commit()

    def _drop(self) -> None:
        self._open = False
        self._output.discard()


def read_rows(path: str | os.PathLike) -> list[dict]:
    """The rows of a sweep CSV with their types back (ints, floats, bools, None for blanks)."""
    with open(path, newline="") as stream:
        reader = csv.DictReader(stream)
        missing = [
            key
            for key in ROW_KEYS
            if key not in (reader.fieldnames or []) and key not in OPTIONAL_KEYS
        ]
        if missing:
            raise InputError(f"{path}: not a sweep CSV; missing columns {missing}")
        return [_typed(cells) for cells in reader]


def _csv_cells(row: dict) -> dict:
    return {key: "" if row.get(key) is None else row[key] for key in ROW_KEYS}


def _typed(cells: dict[str, str]) -> dict:
    row: dict[str, Any] = {}
    for key in ROW_KEYS:
        text = cells.get(key) or ""
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
    """An output path the one writing path accepts (``solver.files.output_file.check_output``); a
    folder, a missing or read-only folder, no permission or an input file is an InputError."""
    return check_output(path, flag=flag, protect=protect).path


def fits(row: dict) -> bool:
    """Whether a row holds a plan that fits memory under the throughput constraint."""
    return row["status"] in ("OPTIMAL", "FEASIBLE")
