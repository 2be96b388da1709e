"""``solver.sweep --executor ray`` on a real local Ray instance: the local executor's rows, a
crashed or failing task retried, a point that fails for good kept as an ERROR row, Ctrl-C, the
CLI against a running cluster, and the bad-input lines.

One Ray instance (``ray.init(num_cpus=2)``) serves the module (fixture ``ray_instance``); it takes
~10 s to start, so the tests that use it are marked slow. Without ray installed they are skipped,
and the bad-input tests that need no instance still run.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from solver import Cluster, TrainingConfig
from solver.cli.sweep import sweep_main
from solver.errors import InputError
from solver.sweep import ROW_KEYS, CsvRows, read_rows, sweep
from solver.sweep.ray_address import CLIENT_HINT, IMPORT_TIMEOUT_S
from solver.sweep.ray_executor import FAULT_ENV, MAX_RETRIES
from tests.conftest import GPT_1_3B, ROOT
from tests.processes import alive, children, cli_env, descendants

GIB = 2**30
TEMPLATE = Cluster(num_gpus=1)
TRAINING = TrainingConfig(global_batch=64, zero_stages=(0, 1))
POINTS = ([1, 2, 4, 8], [12 * GIB, 40 * GIB])
"""Eight points of GPT 1.3B: OPTIMAL and INFEASIBLE ones."""


def _timeless(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


@pytest.fixture(scope="module")
def ray_instance():
    """A local Ray instance with 2 CPUs for this module; a sweep in this process uses it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def local_rows(gpt_graph) -> list[dict]:
    """The local executor's rows of :data:`POINTS`, in process (the reference)."""
    return sweep(gpt_graph, *POINTS, TRAINING, TEMPLATE, workers=1)


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


# -- on a Ray instance ---------------------------------------------------------------------


@pytest.mark.slow
def test_ray_rows_equal_the_local_executors(ray_instance, gpt_graph, local_rows):
    completed = []
    rows = sweep(gpt_graph, *POINTS, TRAINING, TEMPLATE, executor="ray", on_row=completed.append)
    assert all(tuple(row) == ROW_KEYS for row in rows)
    assert _timeless(rows) == _timeless(local_rows)  # same keys and values, in point order
    assert sorted(_timeless(completed), key=str) == sorted(_timeless(rows), key=str)
    assert {row["status"] for row in rows} == {"OPTIMAL", "INFEASIBLE"}
    assert all(row["wall_s"] > 0 for row in rows)


@pytest.mark.slow
def test_a_crashed_worker_is_retried(ray_instance, gpt_graph, local_rows, tmp_path, monkeypatch):
    """The first attempt at the 4-GPU point ends its worker process (``os._exit``, as a kill
    would): Ray runs the task again on a new worker and the rows are unchanged."""
    monkeypatch.setenv(FAULT_ENV, f"exit:1:4:{tmp_path}")
    rows = sweep(gpt_graph, [2, 4], [40 * GIB], TRAINING, TEMPLATE, executor="ray")
    expected = [r for r in local_rows if r["gpus"] in (2, 4) and r["gpu_memory_bytes"] == 40 * GIB]
    assert _timeless(rows) == _timeless(expected)
    assert [p.name for p in tmp_path.iterdir()] == [f"4-{40 * GIB}.0"]  # one attempt failed


@pytest.mark.slow
def test_a_task_that_raises_is_retried(ray_instance, gpt_graph, local_rows, tmp_path, monkeypatch):
    """Every point's task raises on its first two attempts and succeeds on its third."""
    monkeypatch.setenv(FAULT_ENV, f"raise:{MAX_RETRIES}:*:{tmp_path}")
    rows = sweep(gpt_graph, *POINTS, TRAINING, TEMPLATE, executor="ray")
    assert _timeless(rows) == _timeless(local_rows)
    assert len(list(tmp_path.iterdir())) == MAX_RETRIES * len(rows)


@pytest.mark.slow
def test_a_point_that_fails_for_good_is_an_error_row_and_the_rest_is_kept(
    ray_instance, gpt_graph, local_rows, tmp_path, monkeypatch
):
    """The 2-GPU points' tasks raise on every attempt: their rows say so, the others are the
    local executor's."""
    monkeypatch.setenv(FAULT_ENV, f"raise:{MAX_RETRIES + 1}:2:{tmp_path}")
    rows = sweep(gpt_graph, *POINTS, TRAINING, TEMPLATE, executor="ray")
    attempts = 1 + MAX_RETRIES
    for row, local in zip(rows, local_rows, strict=True):
        if row["gpus"] != 2:
            assert _timeless([row]) == _timeless([local])
            continue
        assert tuple(row) == ROW_KEYS and row["status"] == "ERROR" and row["config"] == ""
        assert row["detail"] == (
            f"ray task failed {attempts} times; last: InjectedFault: injected failure "
            f"{attempts} of {attempts} ({FAULT_ENV})"
        )
        blank = {k for k, v in row.items() if v is None}
        assert blank == set(ROW_KEYS) - {"gpus", "gpu_memory_bytes", "reserve_bytes",
                                          "usable_bytes", "status", "config", "detail"}  # fmt: skip
        assert row["usable_bytes"] == local["usable_bytes"]


@pytest.mark.slow
def test_cli_ray_csv_equals_the_local_one(ray_instance, run_cli, tmp_path):
    args = [GPT_1_3B, "--gpus", "1,2,4,8", "--gpu-memory", "16GiB,40GiB", "--global-batch", "64"]
    args += ["--quiet"]
    outputs = {}
    for executor in ("local", "ray"):
        outputs[executor] = tmp_path / f"{executor}.csv"
        code, _, err = run_cli(
            sweep_main, *args, "--executor", executor, "--workers", "1", "--out",
            str(outputs[executor]),
        )  # fmt: skip
        assert code == 0, err
    ray_rows, local_rows = (read_rows(outputs[name]) for name in ("ray", "local"))
    assert len(ray_rows) == 8 and _timeless(ray_rows) == _timeless(local_rows)
    assert {row["status"] for row in ray_rows} == {"OPTIMAL", "INFEASIBLE"}


@pytest.mark.slow
def test_interrupted_ray_sweep_keeps_rows(ray_instance, gpt_graph, tmp_path, local_rows):
    """Ctrl-C after the first row, in a session the caller owns: the row handed over stays
    written; the tasks not finished run out (the instance gets its CPUs back) and the instance
    serves the next sweep."""
    writer = CsvRows(tmp_path / "sweep.csv")

    def on_row(row):
        writer.append(row)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep(gpt_graph, *POINTS, TRAINING, TEMPLATE, executor="ray", on_row=on_row)
    writer.close()
    (kept,) = read_rows(tmp_path / "sweep.csv")
    assert kept["status"] in ("OPTIMAL", "INFEASIBLE")
    ray = ray_instance
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2
    rows = sweep(gpt_graph, *POINTS, TRAINING, TEMPLATE, executor="ray")
    assert _timeless(rows) == _timeless(local_rows)


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, code, line",
    [
        pytest.param(signal.SIGINT, 130, "interrupted", id="ctrl-c"),
        pytest.param(signal.SIGTERM, 143, "terminated", id="SIGTERM"),
        pytest.param(signal.SIGHUP, 129, "terminated", id="SIGHUP"),
    ],
)
def test_cli_on_a_running_cluster_and_its_stop_signals(ray_instance, tmp_path, signum, code, line):
    """``--ray-address`` of the running instance from another process; SIGINT, SIGTERM or SIGHUP
    to its process group (a terminal's Ctrl-C, a supervisor, a closed terminal) returns 128 +
    the signal with the rows done kept in the CSV and one line (SIGTERM was exit 1 with Ray's
    C++ stack dump: ray.init takes over the handler), and the cluster gets its CPUs back at once
    (Ray ends a disconnected driver's tasks)."""
    ray = ray_instance
    address = ray.get_runtime_context().gcs_address
    out = tmp_path / "sweep.csv"
    command = [sys.executable, "-m", "solver.sweep", "examples/gpt3-175b.json"]
    command += ["--gpus", "64,128,256,512,1024,2048,4096", "--gpu-memory", "40GiB,80GiB"]
    command += ["--global-batch", "1536", "--executor", "ray", "--ray-address", address]
    command += ["--out", str(out), "--quiet"]
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while _rows_streamed(tmp_path) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        assert process.poll() is None, process.communicate()[1]
    os.killpg(process.pid, signum)
    _, err = process.communicate(timeout=30)
    assert process.returncode == code, err[:3000]
    rows = read_rows(out)
    assert err.splitlines()[-1] == f"{line}; {len(rows)} rows kept in {out}", err[-3000:]
    assert 1 <= len(rows) < 14 and "Traceback" not in err and "SIGTERM received" not in err
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


def _rows_streamed(folder: Path) -> int:
    """Rows in the hidden temporary CSV a sweep streams into (``CsvRows``)."""
    return sum(max(0, len(p.read_text().splitlines()) - 1) for p in folder.glob(".*.tmp"))


# -- bad input (no instance needed) --------------------------------------------------------


def test_executor_ray_without_ray_installed_is_one_line_exit_2(run_cli, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    out = tmp_path / "sweep.csv"
    code, _, err = run_cli(
        sweep_main, GPT_1_3B, "--gpus", "8", "--global-batch", "64", "--executor", "ray",
        "--out", str(out),
    )  # fmt: skip
    assert code == 2 and not out.exists()
    assert err == (
        "error: --executor ray: ray is not installed; install the ray extra: "
        "pip install -e '.[ray]'\n"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--executor", "dask"], "argument --executor: invalid choice: 'dask'"),
        (["--ray-address", "auto"], "--ray-address goes with --executor ray"),
        (["--executor", "ray", "--find", "min-gpus"], "--executor ray runs sweeps"),
    ],
)
def test_cli_executor_bad_input_is_one_line_exit_2(run_cli, args, message):
    code, out, err = run_cli(sweep_main, GPT_1_3B, "--gpus", "8", "--global-batch", "64", *args)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "address, message",
    [
        ("127.0.0.1:1", "--ray-address 127.0.0.1:1: no Ray cluster answers there"),
        ("headnode", "expected HOST:PORT"),
        ("ray://10.0.0.1:99999", "expected HOST:PORT"),
    ],
)
def test_cli_unreachable_or_malformed_ray_address_is_one_line_exit_2(run_cli, address, message):
    pytest.importorskip("ray")
    started = time.monotonic()
    code, _, err = run_cli(
        sweep_main, GPT_1_3B, "--gpus", "8", "--global-batch", "64", "--executor", "ray",
        "--ray-address", address,
    )  # fmt: skip
    assert code == 2 and message in err and err.count("\n") == 1
    assert time.monotonic() - started < 6  # Ray alone would retry the address forever


@contextlib.contextmanager
def _not_ray() -> Iterator[int]:
    """A TCP server on 127.0.0.1 that accepts connections and never answers (not Ray): its
    port."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for connection in [*held, server]:
            connection.close()


@pytest.mark.slow
def test_an_address_that_accepts_tcp_but_is_not_ray_is_exit_2_within_the_bound(run_cli):
    """Ray alone retried such an address for minutes (killed at 150 s; Ctrl-C took 20 s): a Ray
    client in a child process gets --time-limit seconds after importing Ray to answer."""
    pytest.importorskip("ray")
    with _not_ray() as port:
        started = time.monotonic()
        code, out, err = run_cli(
            sweep_main, GPT_1_3B, "--gpus", "8", "--global-batch", "64", "--executor", "ray",
            "--ray-address", f"127.0.0.1:{port}", "--time-limit", "2",
        )  # fmt: skip
        took = time.monotonic() - started
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(
        f"error: --ray-address 127.0.0.1:{port}: no Ray cluster answered within 2 s (the port "
        "accepts connections but no Ray GCS replied); give the head node's GCS address HOST:PORT"
    )
    assert 2 < took < 2 + IMPORT_TIMEOUT_S  # 3-5 s here: Ray's import, then 2 s


@pytest.mark.slow
@needs_proc
def test_a_stop_signal_while_the_address_is_checked_ends_the_check(tmp_path):
    """The check's child process ends with the CLI: SIGTERM gives 143 at once."""
    pytest.importorskip("ray")
    with _not_ray() as port:
        process = subprocess.Popen(
            [sys.executable, "-m", "solver.sweep", GPT_1_3B, "--gpus", "8", "--global-batch"]
            + ["64", "--executor", "ray", "--ray-address", f"127.0.0.1:{port}"],
            cwd=ROOT,
            env=cli_env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not children(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (probe,) = children(process.pid)
        time.sleep(0.5)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
        assert (process.returncode, err) == (143, "terminated\n")
        assert time.monotonic() - sent < 2 and not Path(f"/proc/{probe}").exists()


def test_a_ray_client_address_without_ray_client_installed_says_what_to_do(run_cli, monkeypatch):
    """``ray://`` is Ray Client, which needs the ray[client] extra (grpcio): without it Ray
    raised a traceback; now one line names the extra, or the GCS address to give instead."""
    pytest.importorskip("ray")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "grpc" else find_spec(name, *args),
    )
    started = time.monotonic()
    code, out, err = run_cli(
        sweep_main, GPT_1_3B, "--gpus", "8", "--global-batch", "64", "--executor", "ray",
        "--ray-address", "ray://127.0.0.1:10001",
    )  # fmt: skip
    assert (code, out) == (2, "")
    assert err == f"error: --ray-address ray://127.0.0.1:10001: {CLIENT_HINT}\n"
    assert "pip install 'ray[client]'" in CLIENT_HINT and "HOST:PORT" in CLIENT_HINT
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_a_ray_client_address_that_is_not_ray_is_exit_2_within_the_bound(run_cli):
    """With ray[client] installed, ``ray://`` to a port that is not a Ray Client server."""
    pytest.importorskip("ray")
    pytest.importorskip("grpc")
    with _not_ray() as port:
        code, _, err = run_cli(
            sweep_main, GPT_1_3B, "--gpus", "8", "--global-batch", "64", "--executor", "ray",
            "--ray-address", f"ray://127.0.0.1:{port}", "--time-limit", "1",
        )  # fmt: skip
    assert code == 2 and err.count("\n") == 1
    assert "no Ray Client server replied" in err


@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize("when", ["starting", "running"])
def test_sigterm_on_a_sweep_with_its_own_instance_ends_it_and_ray(tmp_path, when):
    """No --ray-address: the sweep starts a local instance. SIGTERM (to the sweep alone, as
    ``kill`` sends it) was exit -6 after Ray's C++ "SIGTERM received" stack dump once the
    instance ran, and exit 15 without a line while ``ray.init`` started it (its own handler);
    now 143 and one line (the rows done kept), and every process of the instance ends with
    it."""
    pytest.importorskip("ray")
    out = tmp_path / "sweep.csv"
    process = subprocess.Popen(
        [sys.executable, "-m", "solver.sweep", "examples/gpt3-175b.json"]
        + ["--gpus", "64,128,256,512,1024,2048,4096", "--gpu-memory", "40GiB,80GiB"]
        + ["--global-batch", "1536", "--executor", "ray", "--workers", "2"]
        + ["--out", str(out), "--quiet"],
        cwd=ROOT,
        env=cli_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while (
        not descendants(process.pid) if when == "starting" else _rows_streamed(tmp_path) < 1
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
        assert process.poll() is None, process.communicate()[1]
    time.sleep(0.3 if when == "starting" else 0)
    family = descendants(process.pid)
    assert family  # Ray's processes
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err[-3000:]
    if when == "starting":
        assert err.splitlines()[-1] == f"terminated; no row done, {out} not written"
    else:
        rows = read_rows(out)
        assert err.splitlines()[-1] == f"terminated; {len(rows)} rows kept in {out}"
    assert "Traceback" not in err and "SIGTERM received" not in err
    deadline = time.monotonic() + 2
    while any(Path(f"/proc/{pid}").exists() for pid in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in family if alive(pid)]


def test_sweep_api_rejects_an_unknown_executor(gpt_graph):
    with pytest.raises(InputError, match="executor: unknown 'dask'; use one of local, ray"):
        sweep(gpt_graph, [8], [40 * GIB], TRAINING, TEMPLATE, executor="dask")
    with pytest.raises(InputError, match="ray_address goes with executor='ray'"):
        sweep(gpt_graph, [8], [40 * GIB], TRAINING, TEMPLATE, ray_address="auto")


def test_ray_is_imported_only_inside_functions_of_the_ray_executor():
    """The solver runs without the extra: no module imports ray at module level, and only the
    executor imports it at all."""
    importers = []
    for path in sorted((ROOT / "solver").rglob("*.py")):
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(name.partition(".")[0] == "ray" for name in names):
                where = "module level" if id(node) in top_level else "function"
                importers.append((path.relative_to(ROOT).as_posix(), where))
    assert importers == [("solver/sweep/ray_executor.py", "function")]
