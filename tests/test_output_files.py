"""The one writing path (``solver.files.output_file``, docs/planning.md#output-files) on special
output paths made in ``tmp_path``: a FIFO, links, private character devices like /dev/null and
/dev/full (``os.mknod``, where permitted), folders, a full disk; the umask; and every CLI's
writing flag on them (exit code, one line on stderr, nothing replaced, no temporary file left).
System paths (/dev/*) are never touched."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from solver.cli import evaluate_main, plan_main
from solver.cli.sweep import sweep_main
from solver.errors import InputError, OutputError
from solver.files import output_file
from solver.files.output_file import check_output, write_json_file, write_output
from solver.sweep import CsvRows, read_rows
from solver.sweep.rows import ROW_KEYS
from tests.conftest import GPT_1_3B

OLD = b"the existing file\n"


# -- special files --------------------------------------------------------------------------


class FifoReader:
    """A FIFO at ``path`` with a thread reading it to the end (``data()`` after the write)."""

    def __init__(self, path: Path):
        os.mkfifo(path)
        self.path = path
        self._data = b""
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with open(self.path, "rb") as stream:
            self._data = stream.read()

    def data(self, timeout_s: float = 10.0) -> bytes:
        self._thread.join(timeout_s)
        for _ in range(100):  # nothing opened it for writing: let the reader see end of file
            if not self._thread.is_alive():
                break
            try:
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            self._thread.join(0.05)
        return self._data


def char_device(path: Path, minor: int) -> Path:
    """A private character device with major 1 (mem): minor 3 acts like /dev/null, 7 like
    /dev/full (every write: ENOSPC). Skips where mknod or opening devices is not permitted."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, minor))
        os.close(os.open(path, os.O_WRONLY))
    except OSError as error:
        pytest.skip(f"a character device in tmp_path is not permitted here ({error.strerror})")
    return path


def read_only_folder(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o555)
    if os.access(path, os.W_OK):
        pytest.skip("folder permissions are not enforced (running as root)")
    return path


def temporaries(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob(".*.tmp")]


def _enospc(handle: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def failing_fsync(monkeypatch) -> None:
    """Every fsync of an output fails as on a full disk (after the whole file was written)."""
    monkeypatch.setattr(output_file, "_fsync", _enospc)


# -- the module -----------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_new_file_gets_the_umask_and_a_replaced_file_keeps_its_mode(tmp_path, umask):
    previous = os.umask(umask)
    try:
        write_output(tmp_path / "new.json", b"{}")
        existing = tmp_path / "existing.json"
        existing.write_bytes(OLD)
        existing.chmod(0o640)
        write_output(existing, b"new")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(existing.stat().st_mode) == 0o640 and existing.read_bytes() == b"new"
    assert temporaries(tmp_path) == []


def test_a_regular_file_is_replaced_atomically(tmp_path):
    path = tmp_path / "out.json"
    path.write_bytes(OLD)
    before = path.stat().st_ino
    write_json_file(path, {"a": 1, "name": "\udc80"})  # a lone surrogate stays encodable
    assert path.read_text() == '{\n "a": 1,\n "name": "\\udc80"\n}\n'
    assert path.stat().st_ino != before  # a new file renamed over the old one


def test_a_long_name_gets_a_short_enough_temporary_name(tmp_path):
    path = tmp_path / ("n" * 250)
    write_output(path, b"x")
    assert path.read_bytes() == b"x" and temporaries(tmp_path) == []


def test_a_link_stays_a_link_and_its_target_gets_the_content(tmp_path):
    (tmp_path / "sub").mkdir()
    target = tmp_path / "sub" / "target.json"
    target.write_bytes(OLD)
    target.chmod(0o604)
    link = tmp_path / "link.json"
    link.symlink_to("sub/target.json")
    write_output(link, b"through the link", flag="--json")
    assert link.is_symlink() and os.readlink(link) == "sub/target.json"
    assert target.read_bytes() == b"through the link"
    assert stat.S_IMODE(target.stat().st_mode) == 0o604
    assert temporaries(tmp_path) == []


def test_a_dangling_link_creates_its_target(tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to("missing.json")
    write_output(link, b"created")
    assert link.is_symlink() and (tmp_path / "missing.json").read_bytes() == b"created"


def test_a_fifo_is_written_through_not_replaced(tmp_path):
    reader = FifoReader(tmp_path / "fifo")
    write_output(reader.path, b"piped", flag="--json")
    assert reader.data() == b"piped" and stat.S_ISFIFO(os.lstat(reader.path).st_mode)


def test_a_null_device_is_written_through_not_replaced(tmp_path):
    device = char_device(tmp_path / "null", 3)
    write_output(device, b"x" * 100_000, flag="--json")
    assert stat.S_ISCHR(os.lstat(device).st_mode)


def test_a_full_device_is_one_line_output_error_and_stays_a_device(tmp_path):
    device = char_device(tmp_path / "full", 7)
    for size in (10, 100_000):  # the error at flush, or at write
        with pytest.raises(OutputError, match="No space left on device") as caught:
            write_output(device, b"x" * size, flag="--json")
        assert caught.value.exit_code == 7 and "\n" not in str(caught.value)
        assert str(caught.value).startswith(f"--json {device}: cannot write")
    assert stat.S_ISCHR(os.lstat(device).st_mode)


def test_a_link_through_proc_writes_to_the_open_file(tmp_path):
    """Like ``--json /dev/stdout`` with stdout redirected to a file: the open file is written
    through a duplicate of its descriptor, not replaced by a new one."""
    real = tmp_path / "redirected.txt"
    with open(real, "w") as stream:
        stream.write("table\n")
        stream.flush()
        link = tmp_path / "stdout"
        link.symlink_to(f"/proc/self/fd/{stream.fileno()}")
        if not link.exists():
            pytest.skip("no /proc/self/fd here")
        before = real.stat().st_ino
        write_output(link, b"json\n")
        stream.write("more\n")  # the same file offset: in order
    assert real.read_text() == "table\njson\nmore\n" and real.stat().st_ino == before


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d, "is a folder; give a file name"),
        (lambda d: d / "missing" / "out.json", "folder .*missing does not exist"),
        (lambda d: d / "file.txt" / "out.json", "a part of the path is not a folder"),
        (lambda d: d / ("n" * 300), "File name too long"),
        (lambda d: read_only_folder(d / "ro") / "out.json", "folder .*ro is not writable"),
        (lambda d: d / "loop", "Too many levels of symbolic links"),
        (lambda d: d / "input.json", "is the input file"),
        (lambda d: d / "hard.json", "is the input file"),
        (lambda d: "", "empty path"),
    ],
    ids=["folder", "missing", "under-a-file", "long", "read-only", "loop", "input", "hard-link",
         "empty"],
)  # fmt: skip
def test_bad_paths_are_one_line_input_errors_and_change_nothing(tmp_path, make, message):
    (tmp_path / "file.txt").write_bytes(OLD)
    (tmp_path / "input.json").write_bytes(OLD)
    os.link(tmp_path / "input.json", tmp_path / "hard.json")
    (tmp_path / "loop").symlink_to("loop")
    path = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(InputError, match=message) as caught:
        write_output(path, b"new", flag="--json", protect=[str(tmp_path / "input.json")])
    assert "\n" not in str(caught.value) and str(caught.value).startswith("--json")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "input.json").read_bytes() == OLD and temporaries(tmp_path) == []


def test_same_file_as_another_output(tmp_path):
    (tmp_path / "link.json").symlink_to("out.json")
    first = check_output(tmp_path / "out.json", flag="--json")
    with pytest.raises(InputError, match="same file as --json"):
        check_output(tmp_path / "link.json", flag="--plot", others=[first])


@pytest.mark.parametrize("failure", [OSError(errno.EIO, "Input/output error"), KeyboardInterrupt])
def test_a_failed_write_leaves_the_file_as_it_was_and_nothing_behind(tmp_path, failure):
    path = tmp_path / "out.json"
    path.write_bytes(OLD)

    def write_then_fail(stream) -> None:
        stream.write(b"half a docu")
        raise failure

    expected = OutputError if isinstance(failure, OSError) else KeyboardInterrupt
    with pytest.raises(expected):
        write_output(path, write_then_fail, flag="--json")
    assert path.read_bytes() == OLD and temporaries(tmp_path) == []


def test_a_failed_fsync_leaves_the_file_as_it_was(tmp_path, failing_fsync):
    path = tmp_path / "out.json"
    path.write_bytes(OLD)
    with pytest.raises(OutputError, match="the existing file is unchanged"):
        write_output(path, b"new", flag="--json")
    assert path.read_bytes() == OLD and temporaries(tmp_path) == []


# -- sweep CSV rows -------------------------------------------------------------------------


def row(gpus: int) -> dict:
    return {"gpus": gpus, "gpu_memory_bytes": 2**30, "status": "ERROR", "detail": f"p{gpus}"}


def test_csv_interrupted_before_any_row_leaves_an_existing_file(tmp_path):
    path = tmp_path / "sweep.csv"
    path.write_bytes(OLD)
    writer = CsvRows(path)
    writer.close()  # as the CLI does after Ctrl-C
    assert path.read_bytes() == OLD and temporaries(tmp_path) == []


def test_csv_interrupted_keeps_its_rows_and_finish_writes_point_order(tmp_path):
    path = tmp_path / "sweep.csv"
    path.write_bytes(OLD)
    writer = CsvRows(path)
    writer.append(row(4))
    assert path.read_bytes() == OLD  # the rows stream into the temporary file
    writer.close()
    assert [r["gpus"] for r in read_rows(path)] == [4] and temporaries(tmp_path) == []
    writer = CsvRows(path)
    for gpus in (4, 1, 2):
        writer.append(row(gpus))
    writer.finish([row(1), row(2), row(4)])
    writer.close()
    assert [r["gpus"] for r in read_rows(path)] == [1, 2, 4] and temporaries(tmp_path) == []


def test_csv_to_a_fifo_streams_rows_once(tmp_path):
    reader = FifoReader(tmp_path / "fifo")
    writer = CsvRows(reader.path)
    writer.append(row(2))
    writer.append(row(1))
    writer.finish([row(1), row(2)])  # already out, in completion order: not written again
    blanks = "," * (len(ROW_KEYS) - 5)  # reserve_bytes, usable_bytes and the results blank
    assert reader.data().decode().splitlines()[1:] == [
        f"2,1073741824,,,ERROR{blanks}p2",
        f"1,1073741824,,,ERROR{blanks}p1",
    ]


def test_csv_to_a_full_device_fails_at_once(tmp_path):
    device = char_device(tmp_path / "full", 7)
    with pytest.raises(OutputError, match="--out .*No space left on device"):
        CsvRows(device)


def test_csv_write_failure_drops_the_rows_and_keeps_the_file(tmp_path, failing_fsync):
    path = tmp_path / "sweep.csv"
    path.write_bytes(OLD)
    writer = CsvRows(path)
    writer.append(row(1))
    with pytest.raises(OutputError):
        writer.finish([row(1)])
    writer.close()
    assert path.read_bytes() == OLD and temporaries(tmp_path) == []


@pytest.mark.parametrize("rows_done, fsync", [(0, "works"), (2, "works"), (2, "fails")])
def test_cli_interrupted_sweep_keeps_rows_or_the_old_file(
    rows_done, fsync, tmp_path, run_cli, monkeypatch
):
    append = CsvRows.append

    def interrupted(self, row):
        if self.count == rows_done:
            raise KeyboardInterrupt
        append(self, row)

    monkeypatch.setattr(CsvRows, "append", interrupted)
    if fsync == "fails":
        monkeypatch.setattr(output_file, "_fsync", _enospc)
    out = tmp_path / "sweep.csv"
    out.write_bytes(OLD)
    code, _, err = run_cli(
        sweep_main, GPT_1_3B, "--gpus", "1,2,4,8", "--global-batch", "64", "--out", str(out),
        "--workers", "1", "--quiet",
    )  # fmt: skip
    assert code == 130 and err.count("\n") == 1 and temporaries(tmp_path) == []
    if rows_done and fsync == "works":
        assert "2 rows kept" in err and len(read_rows(out)) == 2
    else:
        assert ("not kept: --out" if rows_done else "no row done") in err
        assert out.read_bytes() == OLD


# -- every CLI's writing flag ---------------------------------------------------------------


def export_main(argv: list[str]) -> int:
    from profiling.export import main

    return main(argv)


def plan_args(graph: str) -> list[str]:
    return [graph, "--gpus", "8", "--global-batch", "64", "--pp", "2", "--tp", "1",
            "--micro-batch", "1", "--quiet"]  # fmt: skip


CLIS: dict[str, tuple[Callable[[list[str]], int], str, Callable[[str, str], list[str]]]] = {
    "plan --json": (plan_main, ".json", lambda g, out: [*plan_args(g), "--json", out]),
    "plan --plot": (plan_main, ".png", lambda g, out: [*plan_args(g), "--plot", out]),
    "evaluate --json": (
        evaluate_main,
        ".json",
        lambda g, out: [
            g,
            "--pp",
            "2",
            "--tp",
            "1",
            "--dp",
            "4",
            "--global-batch",
            "64",
            "--split",
            "even",
            "--micro-batch",
            "1",
            "--quiet",
            "--json",
            out,
        ],
    ),  # fmt: skip
    "sweep --out": (
        sweep_main,
        ".csv",
        lambda g, out: [
            g,
            "--gpus",
            "2,4",
            "--global-batch",
            "64",
            "--pp",
            "2",
            "--micro-batch",
            "1",
            "--workers",
            "1",
            "--quiet",
            "--out",
            out,
        ],
    ),  # fmt: skip
    "sweep --json": (
        sweep_main,
        ".json",
        lambda g, out: [
            g,
            "--find",
            "min-gpus",
            "--gpus",
            "2,4",
            "--global-batch",
            "64",
            "--pp",
            "2",
            "--micro-batch",
            "1",
            "--workers",
            "1",
            "--quiet",
            "--json",
            out,
        ],
    ),  # fmt: skip
    "export --out": (
        export_main,
        ".json",
        lambda g, out: ["gpt-tiny", "--no-progress", "--out", out],
    ),  # fmt: skip
}
TARGETS = {
    "folder": (2, "is a folder"),
    "missing folder": (2, "does not exist"),
    "under a file": (2, "not a folder"),
    "read-only folder": (2, "is not writable"),
    "the input": (2, "is the input file"),
    "a link to the input": (2, "is the input file"),
    "fifo": (0, None),
    "link": (0, None),
    "dangling link": (0, None),
    "null device": (0, None),
    "full device": (7, "No space left on device"),
    "failed write over a file": (7, "the existing file is unchanged"),
}
"""Output targets: (exit code, what the one line says)."""


def cases() -> list:
    return [
        pytest.param(cli, target, id=f"{cli}-{target}")
        for cli in CLIS
        for target in TARGETS
        if not ("input" in target and cli in ("export --out", "plan --plot"))
    ]  # export reads no file; a plot's extension differs from the input's


@pytest.mark.parametrize("cli, target", cases())
def test_cli_writing_flag_on_special_targets(cli, target, tmp_path, run_cli, monkeypatch):
    main, suffix, argv = CLIS[cli]
    graph = tmp_path / "graph.json"
    shutil.copyfile(GPT_1_3B, graph)
    original = graph.read_bytes()
    name = f"out{suffix}"
    reader = None
    if target == "folder":
        out = tmp_path / name
        out.mkdir()
    elif target == "missing folder":
        out = tmp_path / "missing" / name
    elif target == "under a file":
        (tmp_path / "file").write_bytes(OLD)
        out = tmp_path / "file" / name
    elif target == "read-only folder":
        out = read_only_folder(tmp_path / "ro") / name
    elif target == "the input":
        out = graph
    elif target == "a link to the input":
        out = tmp_path / name
        out.symlink_to(graph)
    elif target == "fifo":
        reader = FifoReader(tmp_path / name)
        out = reader.path
    elif target in ("link", "dangling link"):
        out = tmp_path / name
        out.symlink_to(f"target{suffix}")
        if target == "link":
            (tmp_path / f"target{suffix}").write_bytes(OLD)
    elif target == "null device":
        out = char_device(tmp_path / name, 3)
    elif target == "full device":
        out = char_device(tmp_path / name, 7)
    else:
        out = tmp_path / name
        out.write_bytes(OLD)
        monkeypatch.setattr(output_file, "_fsync", _enospc)
    code, _, err = run_cli(main, *argv(str(graph), str(out)))
    expected, message = TARGETS[target]
    assert code == expected, err
    if code:
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert message in err and cli.split()[1] in err and "Traceback" not in err
    assert graph.read_bytes() == original and temporaries(tmp_path) == []
    if target == "fifo":
        assert len(reader.data()) > 100 and stat.S_ISFIFO(os.lstat(out).st_mode)
    elif target in ("link", "dangling link"):
        assert out.is_symlink() and (tmp_path / f"target{suffix}").read_bytes() not in (OLD, b"")
    elif target.endswith("device"):
        assert stat.S_ISCHR(os.lstat(out).st_mode)
    elif target == "failed write over a file":
        assert out.read_bytes() == OLD


@pytest.mark.parametrize(
    "target, message",
    [("folder", "is a folder"), ("missing", "does not exist"), ("input", "is the input file")],
)
def test_validate_checks_json_before_the_run(target, message, tmp_path, run_cli):
    from profiling.validate import main

    plan = tmp_path / "plan.json"
    plan.write_bytes(OLD)  # never read: the output path is checked first
    out = {"folder": tmp_path, "missing": tmp_path / "no" / "r.json", "input": plan}[target]
    code, _, err = run_cli(main, str(plan), "--model", "gpt-tiny", "--json", str(out))
    assert code == 2 and err.count("\n") == 1 and message in err and "--json" in err
    assert plan.read_bytes() == OLD and temporaries(tmp_path) == []


@pytest.mark.parametrize(
    "target, message",
    [
        ("folder", "is a folder"),
        ("missing", "does not exist"),
        ("under a file", "not a folder"),
        ("existing", "already exists; pass --force"),
        ("fifo", "stopped after the check"),
        ("null device", "stopped after the check"),
    ],
)
def test_calibrate_checks_out_before_any_run(target, message, tmp_path, run_cli, monkeypatch):
    from profiling import calibrate

    def stop(*args, **kwargs):
        raise InputError("stopped after the check")

    monkeypatch.setattr(calibrate, "calibrate", stop)
    (tmp_path / "file").write_bytes(OLD)
    out = {
        "folder": tmp_path,
        "missing": tmp_path / "no" / "c.json",
        "under a file": tmp_path / "file" / "c.json",
        "existing": tmp_path / "file",
    }.get(target)
    if target == "fifo":
        out = tmp_path / "fifo"
        os.mkfifo(out)  # checked, not opened: no reader needed
    elif target == "null device":
        out = char_device(tmp_path / "null", 3)  # not a file to protect: no --force needed
    code, _, err = run_cli(calibrate.main, "--model", "gpt-tiny", "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert (tmp_path / "file").read_bytes() == OLD and temporaries(tmp_path) == []
