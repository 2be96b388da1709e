"""Read a user's JSON file: the one reading path of every input file (layer graphs, plans,
cluster files, calibrations). Every problem is a one-line ``InputError`` that names the file.

The rules, in order (docs/layer-graph.md, "Reading rules and limits"):

1. The file is at most :data:`MAX_FILE_BYTES` (256 MiB; a 20,000-layer graph is about 6 MB).
2. Its bytes are checked before they are decoded: a compressed or binary format (gzip, zip,
   bzip2, xz, zstd, pickle, PNG, PDF, ...) is named by its magic number, UTF-16/UTF-32 text by its
   byte-order mark or its NUL pattern, a NUL byte and invalid UTF-8 by their byte offset. A UTF-8
   byte-order mark is skipped.
3. JSON syntax (line and column of the first error).
4. The top level is an object (``{...}``); the message says what it is instead, never the
   document itself.
5. Nesting is at most :data:`MAX_DEPTH` levels; every number is finite (JSON has no NaN or
   Infinity, and ``1e400`` is beyond a double); no string holds a lone UTF-16 surrogate (a
   ``\\ud800`` escape without its pair, which no UTF-8 output can print).

What the fields mean and which values they may take is each format's own check (``solver.graph``,
``solver.files.plan_file``, ``solver.files.cluster_file``, ``solver.calibration``);
:func:`schema_message` and :func:`check_name` are what they share.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

import jsonschema

from solver.deadline import CHECK_EVERY, Deadline
from solver.errors import InputError, quote

MAX_FILE_BYTES = 256 * 2**20
"""Largest input file read, bytes (256 MiB)."""
MAX_DEPTH = 64
"""Deepest nesting of objects and arrays (a layer graph needs 4: document, layers, layer, ...)."""
MAX_NAME_CHARS = 256
"""Longest name (layer, node group, model), characters."""
_HEAD_BYTES = 64 * 1024
"""Bytes read and checked before the rest of the file is read."""

_MAGIC = (
    (b"\x1f\x8b", "a gzip file", "decompress it first (gunzip)"),
    (b"PK\x03\x04", "a zip archive (or a torch.save file)", "extract the JSON file from it"),
    (b"BZh", "a bzip2 file", "decompress it first (bunzip2)"),
    (b"\xfd7zXZ\x00", "an xz file", "decompress it first (unxz)"),
    (b"\x28\xb5\x2f\xfd", "a zstd file", "decompress it first (unzstd)"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", "extract the JSON file from it"),
    (b"\x89PNG", "a PNG image", "pass the JSON file"),
    (b"%PDF", "a PDF document", "pass the JSON file"),
    (b"\x7fELF", "an executable", "pass the JSON file"),
    (b"SQLite format 3\x00", "an SQLite database", "pass the JSON file"),
    (b"\x93NUMPY", "a NumPy array file", "pass the JSON file"),
    (b"\x89HDF", "an HDF5 file", "pass the JSON file"),
    *(
        (b"\x80" + bytes([protocol]), "a Python pickle", "pass the JSON file")
        for protocol in (2, 3, 4, 5)
    ),
)
"""(magic number, what the file looks like, the fix)."""
_BOMS = (
    (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
    (b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"),
    (b"\xfe\xff", "UTF-16 (big-endian)"),
    (b"\xff\xfe", "UTF-16 (little-endian)"),
)
_UTF8_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")
_NOT_A_NAME = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
"""Control characters (C0, DEL, C1), line/paragraph separators, bidirectional overrides and lone
surrogates: what a name may not hold."""


def read_json(
    path: str | Path, *, kind: str, fix: str, deadline: Deadline | None = None
) -> dict[str, Any]:
    """The parsed document (an object) of ``path``, a ``kind`` file (e.g. "layer-graph"); ``fix``
    says what to do when it is missing. Applies the rules of the module docstring. With a
    ``deadline``: NoSolutionError (exit 4) when it passes before the document is checked (the
    parse itself, one C call, about 1 s per 50 MB, is not interrupted)."""
    data = _read_bytes(path, kind, fix)
    if deadline is not None:
        deadline.check(f"reading {path} ({len(data)} bytes read)")
    text = _decode(data, path, kind)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(
            f"{path}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); "
            "fix the syntax"
        ) from None
    except RecursionError:
        raise InputError(
            f"{path}: nested deeper than the JSON reader can follow; a {kind} file nests at "
            f"most {MAX_DEPTH} levels"
        ) from None
    except ValueError:  # an integer literal over sys.get_int_max_str_digits() (4300) digits
        raise InputError(
            f"{path}: holds an integer literal of thousands of digits; no field takes such a number"
        ) from None
    if not isinstance(document, dict):
        raise InputError(
            f"{path}: the top level is {_json_type(document)}, not an object; a {kind} file is "
            f"one JSON object {{...}}"
        )
    _check_values(document, path, deadline)
    return document


def _read_bytes(path: str | Path, kind: str, fix: str) -> bytes:
    """At most MAX_FILE_BYTES of ``path``; the first _HEAD_BYTES are checked before the rest is
    read, so a large binary file fails at once."""
    try:
        with _open(path) as stream:
            info = os.fstat(stream.fileno())
            if stat.S_ISREG(info.st_mode) and info.st_size > MAX_FILE_BYTES:
                raise InputError(_too_large(path, info.st_size))
            head = stream.read(_HEAD_BYTES)
            if not head and stat.S_ISFIFO(info.st_mode):
                raise InputError(
                    f"{path}: a FIFO (named pipe) with no writer, nothing to read; start what "
                    f"writes it first, or pass a regular {kind} file"
                )
            _check_head(head, path, kind)
            data = head + stream.read(MAX_FILE_BYTES + 1 - len(head))
    except FileNotFoundError:
        raise InputError(f"{path}: {kind} file not found; {fix}") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a {kind} file; {fix}") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read the {kind} file ({error.strerror})") from None
    except ValueError:  # open() refuses a path with a NUL character
        raise InputError(
            f"{quote(str(path))}: not a file name (it holds a NUL character)"
        ) from None
    if len(data) > MAX_FILE_BYTES:
        raise InputError(_too_large(path, None))
    if not data.strip():
        raise InputError(f"{path}: the file is empty; {fix}")
    return data


def _open(path: str | Path) -> BinaryIO:
    """``path`` opened for reading without waiting for a writer: a FIFO opens at once (open()
    would block until something opens it for writing), then reads as usual (blocking), so a
    FIFO whose writer is there (``<(cat graph.json)``) is read, and one with none reads as empty
    at once instead of hanging."""
    nonblocking = getattr(os, "O_NONBLOCK", 0)
    descriptor = os.open(path, os.O_RDONLY | nonblocking | getattr(os, "O_CLOEXEC", 0))
    try:
        if nonblocking:
            import fcntl  # POSIX, as O_NONBLOCK

            flags = fcntl.fcntl(descriptor, fcntl.F_GETFL)
            fcntl.fcntl(descriptor, fcntl.F_SETFL, flags & ~nonblocking)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def _too_large(path: str | Path, size: int | None) -> str:
    given = f"{size} bytes" if size is not None else "more"
    return (
        f"{path}: {given}, over the limit of {MAX_FILE_BYTES // 2**20} MiB for an input file; "
        "is it the right file?"
    )


def _check_head(head: bytes, path: str | Path, kind: str) -> None:
    """What the first bytes say: a known binary format, text in another encoding than UTF-8, or
    a NUL byte (a binary file: /dev/zero fails here, without reading 256 MiB)."""
    for magic, looks_like, fix in _MAGIC:
        if head.startswith(magic):
            raise InputError(f"{path}: looks like {looks_like}, not JSON; {fix}")
    for bom, encoding in _BOMS:
        if head.startswith(bom):
            raise InputError(
                f"{path}: {encoding} text (byte-order mark {bom.hex(' ')}), not UTF-8; save it "
                "as UTF-8"
            )
    # JSON text starts with an ASCII character; the NULs around it tell UTF-16/32 (RFC 4627)
    first = head[:4]
    if len(first) == 4 and first[0] != 0 and first[1:] == b"\0\0\0":
        encoding = "UTF-32 (little-endian)"
    elif len(first) == 4 and first[:3] == b"\0\0\0" and first[3] != 0:
        encoding = "UTF-32 (big-endian)"
    elif len(first) >= 2 and first[0] == 0 and first[1] != 0:
        encoding = "UTF-16 (big-endian)"
    elif len(first) >= 2 and first[0] != 0 and first[1] == 0:
        encoding = "UTF-16 (little-endian)"
    else:
        _check_nul(head, path, kind)
        return
    raise InputError(f"{path}: looks like {encoding} text, not UTF-8; save it as UTF-8")


def _check_nul(data: bytes, path: str | Path, kind: str) -> None:
    nul = data.find(b"\0")
    if nul >= 0:
        raise InputError(
            f"{path}: NUL byte at offset {nul}: a binary file, not JSON text; pass a {kind} file"
        )


def _decode(data: bytes, path: str | Path, kind: str) -> str:
    """UTF-8 text of the file (a UTF-8 byte-order mark skipped); NUL bytes and invalid UTF-8
    are errors with their byte offset."""
    _check_nul(data, path, kind)
    try:
        return data.decode("utf-8-sig" if data.startswith(_UTF8_BOM) else "utf-8")
    except UnicodeDecodeError as error:
        offset = error.start + (len(_UTF8_BOM) if data.startswith(_UTF8_BOM) else 0)
        raise InputError(
            f"{path}: not UTF-8 text (byte 0x{data[offset]:02x} at offset {offset} does not "
            "decode); a binary file, or text in another encoding: save it as UTF-8"
        ) from None


def _json_type(value: Any) -> str:
    """A parsed JSON value in words, never the value itself when it is a container or long."""
    if isinstance(value, list):
        return f"an array of {len(value)} item(s)"
    if isinstance(value, str):
        return f"a string ({len(value)} characters)"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return f"a number ({quote(value)})"


def check_document(document: dict[str, Any], where: str | Path) -> None:
    """Rule 5 of the module docstring for a document read by another reader (a config.json that
    transformers read from the HF cache): InputError naming ``where``."""
    _check_values(document, where)


def _check_values(
    document: dict[str, Any], path: str | Path, deadline: Deadline | None = None
) -> None:
    """Nesting depth, finite numbers and strings without lone surrogates, anywhere."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(document, ())]
    visited = 0
    while stack:
        visited += 1
        if deadline is not None and visited % CHECK_EVERY == 0:
            deadline.check(f"reading {path} (checking its values: {visited} objects)")
        node, where = stack.pop()
        if len(where) >= MAX_DEPTH:
            raise InputError(
                f"{path}: {json_path(where[:8])}...: nested deeper than {MAX_DEPTH} levels; no "
                "field of this format nests that deep"
            )
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                raise InputError(f"{path}: {json_path(where)}: key {quote(key)} {_SURROGATE_TEXT}")
            if isinstance(value, (dict, list)):
                stack.append((value, (*where, key)))
            elif isinstance(value, float) and not math.isfinite(value):
                raise InputError(
                    f"{path}: {json_path((*where, key))}: {value} is not a finite number (JSON "
                    "has no NaN or Infinity, and a literal beyond 1.8e308 reads as infinite)"
                )
            elif isinstance(value, str) and not value.isascii() and _SURROGATE.search(value):
                raise InputError(f"{path}: {json_path((*where, key))}: {_SURROGATE_TEXT}")


_SURROGATE_TEXT = (
    "holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), which is not "
    "text; fix the escape"
)


def json_path(parts: tuple[Any, ...] | list[Any]) -> str:
    """``$.layers[3].name`` from ("layers", 3, "name"); odd keys quoted."""
    text = "$"
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and len(part) <= 64:
            text += f".{part}"
        else:
            text += f"[{quote(part, 40)}]"
    return text


def check_name(value: str, where: str, *, what: str = "name") -> None:
    """InputError unless ``value`` can serve as a name: at most MAX_NAME_CHARS characters, no
    control characters, line separators, bidirectional overrides or lone surrogates (names are
    identifiers: they are printed in tables, split specs and error messages)."""
    if len(value) > MAX_NAME_CHARS:
        raise InputError(
            f"{where}: {what} {quote(value, 40)} is longer than {MAX_NAME_CHARS} characters; "
            "use a shorter name"
        )
    bad = _NOT_A_NAME.search(value)
    if bad:
        raise InputError(
            f"{where}: {what} {quote(value, 60)} holds the control character "
            f"U+{ord(bad.group()):04X} at position {bad.start()}; names are identifiers: use "
            "printable characters"
        )


def schema_message(error: jsonschema.ValidationError, limit: int = 160) -> str:
    """jsonschema's message for ``error`` with the offending value quoted short (its messages
    quote the whole instance, which may be a large document)."""
    message = error.message
    try:
        full = repr(error.instance)
    except RecursionError:  # pragma: no cover - read_json bounds the depth
        full = ""
    if len(full) > 60 and full in message:
        message = message.replace(full, quote(error.instance, 40))
    if len(message) > limit:
        message = message[:limit] + "..."
    return message
