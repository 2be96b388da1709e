"""Read a user's JSON file: every problem is a one-line ``InputError`` that names the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from solver.errors import InputError


def read_json(path: str | Path, *, kind: str, fix: str) -> Any:
    """The parsed document of ``path``, a ``kind`` file (e.g. "layer-graph"); ``fix`` says what to
    do when it is missing."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise InputError(f"{path}: {kind} file not found; {fix}") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read the {kind} file ({error.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(
            f"{path}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); "
            "fix the syntax"
        ) from None
