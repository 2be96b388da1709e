"""The one writing path of every output: plan, evaluation and Pareto JSON, sweep CSV, plots,
layer graphs from profiling.export, calibrations, profiling.validate reports.

Where the bytes go (:func:`check_output` decides, before any work):

- **a regular file or a new path** is written atomically: a temporary file in the same folder
  (created as ``open()`` would create the file: mode ``0o666`` less the umask, so default ACLs
  apply too), written, flushed, fsynced and renamed over the target. A replaced file keeps its
  mode (and its owner where permitted). On any failure, Ctrl-C included, the temporary file is
  removed and an existing file is left exactly as it was.
- **a symbolic link** is never replaced: its target is written, atomically when the target is a
  regular file (or does not exist yet: a dangling link creates it), so the link stays a link.
  A link through ``/proc`` (``/dev/stdout``, ``/dev/fd/N``) names an open file, not a path:
  it is written through (one of this process's descriptors through a duplicate, so a file a
  shell redirected stdout into gets the output in order with what else is printed).
- **anything else that exists** (a character device such as ``/dev/null``, a FIFO, a block
  device) is opened for writing and written through; it is never replaced. Opening a FIFO waits
  for a reader, as a shell redirection does.

Errors are one line naming the flag and the path. A bad path (a folder, a missing or read-only
folder, no permission, a name too long, a socket, an input file, the path of another output) is
an ``InputError`` (exit code 2) from :func:`check_output`, which the CLIs call before their
work; a failure while writing (a full disk, ``/dev/full``, an I/O error) is an ``OutputError``
(exit code 7): the work was done but its output was not written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from solver.errors import InputError, OutputError

TEMPORARY_STEM_BYTES = 200
"""Bytes of the target's name kept in the temporary file's name (``.NAME.1a2b3c4d.tmp``), so the
temporary name stays under NAME_MAX (255) whatever the target's length."""
_IGNORED_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS)
"""fsync errors of descriptors that cannot be synced (pipes, character devices)."""


@dataclass(frozen=True, kw_only=True)
class Destination:
    """Where an output goes, as :func:`check_output` found it."""

    path: Path
    """The path as given (messages show it)."""
    target: Path
    """The file the bytes go to: ``path``, or a symbolic link's target."""
    atomic: bool
    """True: a temporary file renamed over ``target``; False: ``target`` written through."""
    replaces: os.stat_result | None
    """The regular file an atomic write replaces (its mode is kept); None for a new file."""
    label: str
    """'--json out.json' (the flag and the path, printable), how messages name it."""
    descriptor: int | None = None
    """This process's open descriptor the path names (``/dev/stdout`` -> 1): written through a
    duplicate of it, so the output shares its file offset (in order with what else is printed)."""


def check_output(
    path: str | os.PathLike,
    *,
    flag: str = "",
    protect: Iterable[str | os.PathLike] = (),
    others: Sequence[Destination] = (),
) -> Destination:
    """Where ``path`` would be written, or ``InputError`` (one line) when it cannot be: a
    folder, a socket, a missing folder or one that is not a folder, a folder that is not
    writable (for a new or regular file), a file that is not writable, a name too long, a
    symbolic-link loop, one of the input files ``protect``, or the target of one of ``others``
    (the outputs already checked). ``flag`` ('--json') starts every message."""
    text = os.fspath(path)
    if not text:
        raise InputError(f"{flag or 'output'}: empty path; give a file name")
    given = Path(text)
    label = f"{flag} {_printable(text)}" if flag else _printable(text)
    try:
        is_link = stat.S_ISLNK(os.lstat(given).st_mode)
    except FileNotFoundError:
        is_link = False
    except OSError as error:
        raise InputError(f"{label}: {_reason(error)}") from None
    try:
        status: os.stat_result | None = os.stat(given)
    except FileNotFoundError:
        status = None  # new, or a dangling link (its target is created)
    except OSError as error:
        raise InputError(f"{label}: {_reason(error)}") from None
    if status is not None and stat.S_ISDIR(status.st_mode):
        raise InputError(f"{label}: is a folder; give a file name")
    if status is not None and stat.S_ISSOCK(status.st_mode):
        raise InputError(f"{label}: is a socket; give a file, a device or a FIFO")
    through_proc, descriptor = _through_proc(given) if is_link else (False, None)
    regular = status is None or stat.S_ISREG(status.st_mode)
    if regular and not through_proc:
        target = Path(os.path.realpath(given)) if is_link else given
        if is_link:
            label += f" (a link to {_printable(str(target))})"
        _check_folder(target.parent, label)
        if status is not None and not os.access(target, os.W_OK):
            raise InputError(f"{label}: no permission to write it")
        destination = Destination(
            path=given, target=target, atomic=True, replaces=status, label=label
        )
        _check_not_an_input(destination, protect)
    else:
        if status is None:
            raise InputError(f"{label}: a link to a file descriptor that is not open")
        if not os.access(given, os.W_OK):
            raise InputError(f"{label}: no permission to write it")
        destination = Destination(
            path=given,
            target=given,
            atomic=False,
            replaces=None,
            label=label,
            descriptor=descriptor,
        )
    for other in others:
        if _same_file(destination.target, other.target):
            raise InputError(f"{label}: same file as {other.label}; choose another path")
    return destination


class OutputFile:
    """An output being written: ``stream`` (binary) goes to a temporary file next to a regular
    target, published by :meth:`commit`, or straight to anything else (written through).
    :meth:`discard` drops the temporary file. As a context manager: commit on success, discard on
    any exception. Write errors raise ``OutputError`` (exit code 7)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        flag: str = "",
        protect: Iterable[str | os.PathLike] = (),
    ):
        self.destination = check_output(path, flag=flag, protect=protect)
        self._temporary: Path | None = None
        target = self.destination.target
        with self._discarding_on_failure():
            if self.destination.atomic:
                handle, self._temporary = _create_temporary(target, self.destination.replaces)
                self.stream: BinaryIO = os.fdopen(handle, "wb")
            elif self.destination.descriptor is not None:  # /dev/stdout, /dev/fd/N
                for printed in (sys.stdout, sys.stderr):  # what was printed first comes first
                    with contextlib.suppress(AttributeError, OSError, ValueError):
                        if printed.fileno() == self.destination.descriptor:
                            printed.flush()
                self.stream = os.fdopen(os.dup(self.destination.descriptor), "wb")
            else:  # a device or a FIFO (append: no-op), or another process's open file
                self.stream = open(target, "ab")  # noqa: SIM115 (closed in commit/discard)

    def commit(self) -> Path:
        """Flush, fsync and (atomic) rename over the target; returns the path as given."""
        with self._discarding_on_failure():
            self.stream.flush()
            _fsync(self.stream.fileno())
            self.stream.close()
            if self._temporary is not None:
                os.replace(self._temporary, self.destination.target)
                self._temporary = None
                _fsync_folder(self.destination.target.parent)
        return self.destination.path

    @contextlib.contextmanager
    def _discarding_on_failure(self) -> Iterator[None]:
        """Any failure inside (Ctrl-C included) drops the temporary file; an OSError becomes this
        output's one-line ``OutputError``."""
        try:
            yield
        except OSError as error:
            self.discard()
            raise self.error(error) from None
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Close and remove the temporary file (an existing target stays as it was)."""
        stream = getattr(self, "stream", None)
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
        if self._temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._temporary)
            self._temporary = None

    def error(self, error: OSError) -> OutputError:
        """The one-line OutputError for ``error`` while writing."""
        kept = "; the existing file is unchanged" if self.destination.replaces else ""
        return OutputError(f"{self.destination.label}: cannot write: {_reason(error)}{kept}")

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()
            if isinstance(value, OSError):
                raise self.error(value) from None


def write_output(
    path: str | os.PathLike,
    content: bytes | Callable[[BinaryIO], Any],
    *,
    flag: str = "",
    protect: Iterable[str | os.PathLike] = (),
) -> Path:
    """Write ``content`` (bytes, or a function writing to a binary stream, e.g. matplotlib's
    ``savefig``) to ``path`` by the rules of this module; returns the path as given."""
    with OutputFile(path, flag=flag, protect=protect) as output:
        if isinstance(content, bytes):
            output.stream.write(content)
        else:
            content(output.stream)
    return output.destination.path


def json_bytes(document: Any) -> bytes:
    """The JSON text every output file holds: indent 1, a final newline, ASCII (escapes keep
    any name, a lone surrogate included, encodable)."""
    return (json.dumps(document, indent=1) + "\n").encode("ascii")


def write_json_file(
    path: str | os.PathLike,
    document: Any,
    *,
    flag: str = "",
    protect: Iterable[str | os.PathLike] = (),
) -> Path:
    """``document`` as JSON (:func:`json_bytes`, serialised before the file is touched)."""
    return write_output(path, json_bytes(document), flag=flag, protect=protect)


# -- helpers ----------------------------------------------------------------------------------


def _check_folder(folder: Path, label: str) -> None:
    """The folder of a new or replaced file: it exists, is a folder and is writable."""
    try:
        status = os.stat(folder)
    except FileNotFoundError:
        raise InputError(
            f"{label}: folder {_printable(str(folder))} does not exist; create it first"
        ) from None
    except OSError as error:
        raise InputError(f"{label}: folder {_printable(str(folder))}: {_reason(error)}") from None
    if not stat.S_ISDIR(status.st_mode):
        raise InputError(f"{label}: {_printable(str(folder))} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        read_only = _read_only_file_system(folder)
        why = "is on a read-only file system" if read_only else "is not writable"
        raise InputError(f"{label}: folder {_printable(str(folder))} {why}")


def _check_not_an_input(destination: Destination, protect: Iterable[str | os.PathLike]) -> None:
    if destination.replaces is None:
        return  # a new file is no input
    for given in protect:
        if _same_file(destination.target, Path(given)):
            raise InputError(
                f"{destination.label}: is the input file {_printable(os.fspath(given))}; "
                "choose another output path"
            )


def _same_file(first: Path, second: Path) -> bool:
    """Same resolved path, or the same existing file (hard links, links)."""
    if os.path.realpath(first) == os.path.realpath(second):
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:
        return False


def _through_proc(path: Path) -> tuple[bool, int | None]:
    """Whether resolving the link ``path`` passes through /proc (``/dev/stdout`` ->
    ``/proc/self/fd/1``), and the descriptor number when it names one of this process's. Such a
    link names an open file (a pipe, a terminal, the file a shell redirected into), which is
    written through, never replaced."""
    current = Path(os.path.abspath(path))
    for _ in range(40):  # the kernel's limit of links followed
        folder = Path(os.path.realpath(current.parent))
        if folder.parts[1:2] == ("proc",):
            own = folder == Path(f"/proc/{os.getpid()}/fd") and current.name.isdigit()
            return True, int(current.name) if own else None
        if not current.is_symlink():
            return False, None
        current = Path(os.path.abspath(current.parent / os.readlink(current)))
    return False, None


def _create_temporary(target: Path, replaces: os.stat_result | None) -> tuple[int, Path]:
    """A new file ``.NAME.RANDOM.tmp`` next to ``target``, created with mode 0o666 less the
    umask (as open() would create the target), or with the mode and owner of the file it
    replaces."""
    stem = os.fsdecode(os.fsencode(target.name)[:TEMPORARY_STEM_BYTES])
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        temporary = target.parent / f".{stem}.{secrets.token_hex(4)}.tmp"
        try:
            handle = os.open(temporary, flags, 0o666)
        except FileExistsError:
            continue
        try:
            if replaces is not None:
                if (replaces.st_uid, replaces.st_gid) != (os.geteuid(), os.getegid()):
                    with contextlib.suppress(OSError):  # only root or the group's member may
                        os.fchown(handle, replaces.st_uid, replaces.st_gid)
                os.fchmod(handle, stat.S_IMODE(replaces.st_mode))  # after chown (clears setuid)
        except BaseException:
            os.close(handle)
            os.unlink(temporary)
            raise
        return handle, temporary
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(target.parent))


def _fsync(handle: int) -> None:
    try:
        os.fsync(handle)
    except OSError as error:
        if error.errno not in _IGNORED_FSYNC:
            raise


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable; not every system can sync a folder (ignored then)."""
    with contextlib.suppress(OSError):
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def _read_only_file_system(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def _reason(error: OSError) -> str:
    """'No space left on device' (strerror), or the error's text."""
    if error.errno == errno.ENOTDIR:
        return "a part of the path is not a folder"
    return error.strerror or str(error)


def _printable(text: str) -> str:
    """``text`` with control characters, newlines and undecodable bytes escaped (one line), its
    middle cut when longer than 160 characters."""
    shown = text if text.isprintable() else repr(text)[1:-1]
    return shown if len(shown) <= 160 else f"{shown[:70]}...{shown[-70:]}"


__all__ = [
    "Destination",
    "OutputFile",
    "check_output",
    "json_bytes",
    "write_json_file",
    "write_output",
]
