"""Solve a grid of (gpus, gpu_memory) points, one :func:`solver.plan` call each, on worker
processes or as Ray tasks: :func:`sweep`; a point's row is :func:`solver.sweep.point.solve_point`
(also importable from here)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from solver.costs.moe import num_routed_experts
from solver.engine_rules import ModelFacts
from solver.errors import InputError
from solver.graph import LayerGraph
from solver.search.candidates import candidate_configs
from solver.specs import Cluster, TrainingConfig
from solver.sweep.point import PointOptions, solve_point
from solver.workers import exit_with_parent, stop_pool

log = logging.getLogger(__name__)


EXECUTORS = ("local", "ray")
"""Where a sweep's points run: ``local`` worker processes, or ``ray`` tasks (``[ray]`` extra)."""


def sweep(
    graph: LayerGraph,
    gpus: Sequence[int],
    gpu_memory: Sequence[int],
    training: TrainingConfig,
    cluster_template: Cluster,
    *,
    workers: int | None = None,
    progress: bool = False,
    on_row: Callable[[dict], None] | None = None,
    backend: str = "auto",
    time_limit_s: float | None = 60.0,
    executor: str = "local",
    ray_address: str | None = None,
) -> list[dict]:
    """One row per (gpus, gpu_memory) point, in point order (GPU counts outer, memory inner).

    ``gpu_memory`` in bytes; ``cluster_template`` gives the other cluster fields (its num_gpus
    and gpu_memory_bytes are ignored). Points run on ``workers`` processes (default: every
    core; 1 runs them here, one by one); ``on_row(row)`` is called in this process as each row
    completes (completion order), so a caller can write rows as they come and keep them when
    interrupted. Duplicate points are solved once.

    ``executor="ray"`` solves each point as one Ray task instead (``solver.sweep.ray_executor``):
    on the Ray instance this process is already connected to, else on the cluster at
    ``ray_address`` (``"auto"``: the one running on this machine), else on a local instance
    started with ``workers`` CPUs (default: every core) and shut down at the end. The rows are
    the same as the local executor's but for ``wall_s``; a task whose worker crashed or raised is
    retried, and a point that fails for good is an ERROR row that says why.
    """
    if executor not in EXECUTORS:
        raise InputError(f"executor: unknown {executor!r}; use one of {', '.join(EXECUTORS)}")
    if ray_address is not None and executor != "ray":
        raise InputError("ray_address goes with executor='ray' (--ray-address: --executor ray)")
    points = sweep_points(gpus, gpu_memory)
    options = PointOptions(
        graph=graph,
        training=training,
        cluster=cluster_template,
        backend=backend,
        time_limit_s=time_limit_s,
    )
    rows: dict[tuple[int, int], dict] = {}
    bar = progress_bar(len(points)) if progress else None

    def done(row: dict) -> None:
        rows[row["gpus"], row["gpu_memory_bytes"]] = row
        if bar is not None:
            bar.update(1)
        if on_row is not None:
            on_row(row)

    try:
        if executor == "ray":
            from solver.sweep.ray_executor import run_on_ray  # imports ray: only when asked

            run_on_ray(
                _longest_first(points, options), options, done, address=ray_address, cpus=workers
            )
        else:
            _run(points, options, workers, done)
    finally:
        if bar is not None:
            bar.close()
    return [rows[point] for point in points]


def sweep_points(gpus: Sequence[int], gpu_memory: Sequence[int]) -> list[tuple[int, int]]:
    """(gpus, gpu_memory_bytes) pairs in order, duplicates dropped; InputError for empty lists
    or values that are not positive integers."""
    for name, values in (("gpus", gpus), ("gpu_memory", gpu_memory)):
        if len(values) == 0:
            raise InputError(f"{name}: empty list; give at least one value")
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise InputError(f"{name}: expected positive integers, got {bad}")
    return list(dict.fromkeys((g, m) for g in gpus for m in gpu_memory))


def _run(
    points: list[tuple[int, int]],
    options: PointOptions,
    workers: int | None,
    done: Callable[[dict], None],
) -> None:
    workers = min(workers or os.cpu_count() or 1, len(points))
    if workers <= 1:
        for point in points:
            done(solve_point(options, *point)[0])
        return
    pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(options,))
    try:
        pending = {
            pool.submit(_solve_in_worker, *point) for point in _longest_first(points, options)
        }
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                done(future.result())
    except BaseException:  # Ctrl-C included: the rows done were handed to ``done`` already
        stop_pool(pool)
        raise
    pool.shutdown()


def _longest_first(points: list[tuple[int, int]], options: PointOptions) -> list[tuple[int, int]]:
    """Points by decreasing number of candidate configs (a point's work grows with it)."""

    def size(point: tuple[int, int]) -> int:
        cluster = dataclasses.replace(options.cluster, num_gpus=point[0])
        try:
            return len(
                candidate_configs(
                    options.graph.num_layers,
                    cluster,
                    options.training,
                    num_experts=num_routed_experts(options.graph),
                    facts=ModelFacts.of_graph(options.graph),
                )
            )
        except InputError:
            return 0

    return sorted(points, key=lambda point: (-size(point), point))


_WORKER: PointOptions | None = None


def _init_worker(options: PointOptions) -> None:
    """Keep the study's options (graph included) for every point this worker solves; leave
    Ctrl-C to the parent, which cancels what is left and terminates the workers; end with the
    parent even when it is killed (``solver.workers.exit_with_parent``)."""
    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    _WORKER = options


def _solve_in_worker(gpus: int, gpu_memory_bytes: int) -> dict:
    assert _WORKER is not None, "worker not initialised"
    return solve_point(_WORKER, gpus, gpu_memory_bytes)[0]


def progress_bar(total: int | None, *, desc: str = "sweep", unit: str = "point"):
    """points (or counts) done / total and the elapsed time, on stderr when it is a terminal
    (nothing in a log file or a pipe)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit=unit,
        desc=desc,
        dynamic_ncols=True,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
    )
