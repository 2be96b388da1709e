"""What-if studies over cluster sizes: sweeps, the smallest cluster, the largest model.

    from solver import load_graph, Cluster, TrainingConfig
    from solver.sweep import sweep
    rows = sweep(load_graph("examples/gpt3-175b.json"), [64, 128, 256], [40 * 2**30, 80 * 2**30],
                 TrainingConfig(global_batch=1536), Cluster(num_gpus=1))

Every (gpus, gpu_memory) point is one :func:`solver.plan` call; its row (:data:`ROW_KEYS`) keeps
the plan's config, peak, throughput and solver status next to the even and parameter-balanced
splits of the same config. Points where nothing fits are rows too (status INFEASIBLE, the best
peak found in ``peak_bytes``, the explanation in ``detail``); a GPU count no config can use is a
row with status ERROR.

What is reused across points, and what is not:

- the graph is sent once to each worker process (the pool's initializer), with the options;
  every point of a worker then only sends two integers and gets a row back;
- points are handed out longest first (most candidate configs first), so the workers finish
  together;
- per-config solutions are not shared between points: a config has pp * tp * dp = GPU count,
  so it belongs to one count only, and the memory sizes of one count differ in their throughput
  budget (``max_slowdown`` is relative to the fastest plan that fits), so their optima differ
  too. Building a count's configs and bounds again is about 5% of a point (GPT-3 175B: 10-40 ms
  of 0.1-1 s), not worth a cache that would bypass ``plan()``.

``python -m solver.sweep``: see :func:`main` (solver/sweep_cli.py).
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solver.candidates import candidate_configs, divisors
from solver.errors import InfeasibleError, InputError, NoSolutionError
from solver.graph import LayerGraph
from solver.planner import Plan, plan
from solver.report import finite_or_none
from solver.specs import Cluster, TrainingConfig

log = logging.getLogger(__name__)

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


@dataclass(kw_only=True, frozen=True)
class PointOptions:
    """What every point of a study shares (sent once to each worker)."""

    graph: LayerGraph
    training: TrainingConfig
    cluster: Cluster
    """Template: every field but num_gpus and gpu_memory_bytes applies to every point."""
    backend: str = "auto"
    time_limit_s: float | None = 60.0


def solve_point(
    options: PointOptions, gpus: int, gpu_memory_bytes: int
) -> tuple[dict, Plan | None]:
    """The row of one point, and its plan when one was found."""
    started = time.perf_counter()
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row |= {"gpus": gpus, "gpu_memory_bytes": gpu_memory_bytes, "config": "", "detail": ""}
    result = None
    try:
        cluster = dataclasses.replace(
            options.cluster, num_gpus=gpus, gpu_memory_bytes=gpu_memory_bytes
        )
        result = plan(
            options.graph,
            cluster,
            options.training,
            backend=options.backend,
            time_limit_s=options.time_limit_s,
        )
    except InfeasibleError as error:
        row |= {"status": "INFEASIBLE", "fits": False, "peak_bytes": error.best_peak_bytes}
        row["detail"] = _one_line(error)
    except NoSolutionError as error:
        row |= {"status": "NO_SOLUTION", "detail": _one_line(error)}
    except InputError as error:
        row |= {"status": "ERROR", "detail": _one_line(error)}
    else:
        config = result.config
        row |= {
            "status": result.solver.status,
            "config": config.label(),
            **{k: getattr(config, k) for k in ("pp", "tp", "dp", "micro_batch")},
            "num_microbatches": config.num_microbatches,
            "zero": config.zero,
            "recompute": config.recompute,
            "peak_bytes": result.peak_bytes,
            "throughput": finite_or_none(result.throughput),
            "gap": result.solver.gap,
            "fits": result.evaluation.fits,
        }
        for name, baseline in result.baselines.items():
            row[f"{name}_peak_bytes"] = baseline.peak_bytes
            row[f"{name}_throughput"] = finite_or_none(baseline.throughput)
    row["wall_s"] = time.perf_counter() - started
    return row, result


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
) -> list[dict]:
    """One row per (gpus, gpu_memory) point, in point order (GPU counts outer, memory inner).

    ``gpu_memory`` in bytes; ``cluster_template`` gives the other cluster fields (its num_gpus
    and gpu_memory_bytes are ignored). Points run on ``workers`` processes (default: every
    core; 1 runs them here, one by one); ``on_row(row)`` is called in this process as each row
    completes (completion order), so a caller can write rows as they come and keep them when
    interrupted. Duplicate points are solved once.
    """
    points = sweep_points(gpus, gpu_memory)
    options = PointOptions(
        graph=graph,
        training=training,
        cluster=cluster_template,
        backend=backend,
        time_limit_s=time_limit_s,
    )
    rows: dict[tuple[int, int], dict] = {}
    bar = _progress_bar(len(points)) if progress else None

    def done(row: dict) -> None:
        rows[row["gpus"], row["gpu_memory_bytes"]] = row
        if bar is not None:
            bar.update(1)
        if on_row is not None:
            on_row(row)

    try:
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
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


def _longest_first(points: list[tuple[int, int]], options: PointOptions) -> list[tuple[int, int]]:
    """Points by decreasing number of candidate configs (a point's work grows with it)."""

    def size(point: tuple[int, int]) -> int:
        cluster = dataclasses.replace(options.cluster, num_gpus=point[0])
        try:
            return len(candidate_configs(options.graph.num_layers, cluster, options.training))
        except InputError:
            return 0

    return sorted(points, key=lambda point: (-size(point), point))


_WORKER: PointOptions | None = None


def _init_worker(options: PointOptions) -> None:
    """Keep the study's options (graph included) for every point this worker solves; leave
    Ctrl-C to the parent, which cancels what is left."""
    global _WORKER
    _WORKER = options
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _solve_in_worker(gpus: int, gpu_memory_bytes: int) -> dict:
    assert _WORKER is not None, "worker not initialised"
    return solve_point(_WORKER, gpus, gpu_memory_bytes)[0]


def _progress_bar(total: int | None, *, desc: str = "sweep", unit: str = "point"):
    """points (or counts) done / total and the elapsed time, on stderr."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, dynamic_ncols=True)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


# --- CSV -------------------------------------------------------------------------------------


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


# --- the smallest cluster --------------------------------------------------------------------


@dataclass(kw_only=True)
class MinGpusResult:
    """The smallest GPU count that fits, its plan, and the rows solved to prove it."""

    gpus: int | None
    """None when no candidate fits."""
    plan: Plan | None
    rows: list[dict] = field(default_factory=list)
    """Every point solved (a binary-search probe or a scanned count), in GPU order."""
    skipped: int = 0
    """Counts below the answer ruled out by their configs' memory lower bounds alone."""


def fits(row: dict) -> bool:
    """Whether a row holds a plan that fits memory under the throughput constraint."""
    return row["status"] in ("OPTIMAL", "FEASIBLE")


def min_gpus(
    graph: LayerGraph,
    gpu_memory_bytes: int,
    training: TrainingConfig,
    cluster_template: Cluster,
    *,
    candidates: Sequence[int] | None = None,
    max_gpus: int | None = None,
    workers: int | None = None,
    progress: bool = False,
    backend: str = "auto",
    time_limit_s: float | None = 60.0,
) -> MinGpusResult:
    """The smallest GPU count on which a plan fits ``gpu_memory_bytes`` under the throughput
    constraint of ``training``.

    With ``candidates``, they are solved in increasing order, ``workers`` at a time, until one
    fits. Without, the candidates are every count some config can use (:func:`valid_gpu_counts`,
    up to ``max_gpus``) and the search is:

    1. binary search over them as if "fits" were monotone in the GPU count: a few plans find a
       count N that fits (and, usually, the answer);
    2. a brute-force check below N, because monotonicity is not guaranteed: whether a config
       exists depends on divisibility (pp <= layers, tp | gpus per node, dp * b | global batch),
       and a relative throughput constraint moves with the fastest plan. Each smaller count is
       first tested with its configs' memory lower bounds (no solve), then the survivors are
       solved in increasing order until one fits.

    The answer is therefore exact (up to the time limit of each solve: a NO_SOLUTION count is
    treated as not fitting and kept in ``rows``).
    """
    options = PointOptions(
        graph=graph,
        training=training,
        cluster=cluster_template,
        backend=backend,
        time_limit_s=time_limit_s,
    )
    rows: dict[int, dict] = {}

    def solve_all(counts: Sequence[int]) -> list[dict]:
        todo = [n for n in counts if n not in rows]
        if todo:
            found = sweep(
                graph,
                todo,
                [gpu_memory_bytes],
                training,
                cluster_template,
                workers=workers,
                on_row=None if bar is None else lambda _: bar.update(1),
                backend=backend,
                time_limit_s=time_limit_s,
            )
            rows.update((row["gpus"], row) for row in found)
        return [rows[n] for n in counts]

    def first_fit(counts: Sequence[int]) -> int | None:
        chunk = max(1, workers or os.cpu_count() or 1)
        for start in range(0, len(counts), chunk):
            fitting = [r["gpus"] for r in solve_all(counts[start : start + chunk]) if fits(r)]
            if fitting:
                return min(fitting)
        return None

    skipped = 0
    bar = _progress_bar(None, desc="min-gpus", unit="count") if progress else None
    try:
        if candidates is not None:
            answer = first_fit(sorted({g for g, _ in sweep_points(list(candidates), [1])}))
        else:
            counts = valid_gpu_counts(
                graph.num_layers, cluster_template, training, max_gpus=max_gpus
            )
            upper = _bisect_fit(counts, lambda n: fits(solve_all([n])[0]))
            below = counts[: bisect.bisect_left(counts, upper)] if upper is not None else counts
            possible = [n for n in below if _may_fit(options, n, gpu_memory_bytes)]
            skipped = len(below) - len(possible)
            answer = first_fit(possible)
            if answer is None:
                answer = upper
    finally:
        if bar is not None:
            bar.close()
    best = None
    if answer is not None:
        best = solve_point(options, answer, gpu_memory_bytes)[1]
    return MinGpusResult(
        gpus=answer, plan=best, rows=[rows[n] for n in sorted(rows)], skipped=skipped
    )


def valid_gpu_counts(
    num_layers: int, cluster: Cluster, training: TrainingConfig, *, max_gpus: int | None = None
) -> list[int]:
    """Every GPU count N <= max_gpus with at least one candidate config (candidates.py rules:
    N = pp * tp * dp, pp <= layers, tp | gpus per node, dp * b | global batch, pins), sorted."""
    dps = [
        d
        for d in divisors(training.global_batch)
        if any(training.global_batch % (d * b) == 0 for b in training.micro_batch_sizes)
    ]
    counts = {
        pp * tp * dp
        for pp in range(1, num_layers + 1)
        if training.pp in (None, pp)
        for tp in divisors(cluster.gpus_per_node)
        if training.tp in (None, tp)
        for dp in dps
        if training.dp in (None, dp)
    }
    return sorted(n for n in counts if max_gpus is None or n <= max_gpus)


def _bisect_fit(counts: list[int], fit: Callable[[int], bool]) -> int | None:
    """The smallest count that fits if fitting were monotone (None if the largest does not)."""
    if not counts or not fit(counts[-1]):
        return None
    low, high = 0, len(counts) - 1  # counts[high] fits
    while low < high:
        middle = (low + high) // 2
        if fit(counts[middle]):
            high = middle
        else:
            low = middle + 1
    return counts[high]


def _may_fit(options: PointOptions, gpus: int, gpu_memory_bytes: int) -> bool:
    """False when every config of this count has a memory lower bound over the capacity."""
    from solver.search import build_entries

    cluster = dataclasses.replace(options.cluster, num_gpus=gpus, gpu_memory_bytes=gpu_memory_bytes)
    try:
        entries = build_entries(options.graph, cluster, options.training)
    except InputError:
        return False
    return min(entry.memory_bound for entry in entries) <= gpu_memory_bytes


# --- the largest model -----------------------------------------------------------------------

SCALES = {"layers": "layers", "hidden": "hidden"}
"""--scale name -> the model config field it overrides."""


@dataclass(kw_only=True)
class MaxScaleResult:
    """The largest size that fits, the plan that proves it, and the first size that does not."""

    scale: str
    size: int | None
    """None when even the smallest size of the range does not fit (``too_big`` is then the
    smallest size)."""
    plan: Plan | None
    too_big: int | None
    """The next size (size + step), shown not to fit; None when the range's top fits."""
    too_big_detail: str = ""
    rows: dict[int, dict] = field(default_factory=dict)
    """Size -> the row of every size solved."""


def max_scale(
    graph_of: Callable[[int], LayerGraph],
    sizes: Sequence[int],
    cluster: Cluster,
    training: TrainingConfig,
    *,
    start: int = 0,
    scale: str = "size",
    backend: str = "auto",
    time_limit_s: float | None = 60.0,
) -> MaxScaleResult:
    """The largest of ``sizes`` (increasing) whose graph ``graph_of(size)`` fits ``cluster``.

    Galloping then binary search from ``sizes[start]``: up (1, 2, 4, ... steps) while it fits,
    or down while it does not, then bisection of the last gap, so the few graphs profiled stay
    near the answer. It assumes a larger model never fits where a smaller one does not. That
    holds for the memory of any one config, but a deeper model also allows more pipeline stages
    (pp <= layers), so near the small end it can fail; the result is always a proven boundary
    (``size`` fits, ``too_big`` = the next size does not, both solved), and the largest size
    whenever fitting is monotone over the range.
    """
    if not sizes:
        raise InputError("max-scale: empty size range")
    rows: dict[int, dict] = {}
    plans: dict[int, Plan | None] = {}

    def fit(index: int) -> bool:
        size = sizes[index]
        if size not in rows:
            options = PointOptions(
                graph=graph_of(size),
                training=training,
                cluster=cluster,
                backend=backend,
                time_limit_s=time_limit_s,
            )
            rows[size], plans[size] = solve_point(
                options, cluster.num_gpus, cluster.gpu_memory_bytes
            )
            log.info("%s %d: %s", scale, size, rows[size]["status"])
        return fits(rows[size])

    low, high = _gallop(len(sizes), fit, min(max(start, 0), len(sizes) - 1))
    return MaxScaleResult(
        scale=scale,
        size=None if low is None else sizes[low],
        plan=None if low is None else plans[sizes[low]],
        too_big=None if high is None else sizes[high],
        too_big_detail="" if high is None else rows[sizes[high]]["detail"],
        rows=dict(sorted(rows.items())),
    )


def _gallop(n: int, fit: Callable[[int], bool], start: int) -> tuple[int | None, int | None]:
    """(last index that fits, the next index, which does not) by galloping from ``start`` and
    bisecting; None for an end that does not exist (nothing fits / everything fits)."""
    jump = 1
    if fit(start):
        low = start
        while True:
            probe = min(low + jump, n - 1)
            if probe == low:
                return low, None
            if not fit(probe):
                high = probe
                break
            low, jump = probe, 2 * jump
    else:
        high = start
        while True:
            probe = max(high - jump, 0)
            if probe == high:
                return None, high
            if fit(probe):
                low = probe
                break
            high, jump = probe, 2 * jump
    while high - low > 1:  # low fits, high does not
        middle = (low + high) // 2
        if fit(middle):
            low = middle
        else:
            high = middle
    return low, high


def preset_graph_of(
    preset: str, scale: str, *, batch: int = 1, seq: int | None = None
) -> Callable[[int], LayerGraph]:
    """size -> the layer graph of zoo ``preset`` with its ``scale`` field set to size (profiled
    under fake tensors by ``profiling.export``; needs torch, the ``profiling`` extra)."""
    if scale not in SCALES:
        raise InputError(f"--scale {scale!r}: choose one of {', '.join(SCALES)}")
    try:
        from profiling.export import export_graph
    except ImportError as error:
        raise InputError(
            f"--find max-scale profiles the model and needs torch ({error}); "
            "install it with pip install -e '.[profiling]'"
        ) from None
    cache: dict[int, LayerGraph] = {}

    def graph_of(size: int) -> LayerGraph:
        if size not in cache:
            overrides = {SCALES[scale]: size}
            cache[size] = export_graph(preset, batch=batch, seq=seq, overrides=overrides)
        return cache[size]

    return graph_of


def preset_scale(preset: str, scale: str) -> tuple[int, int]:
    """(the preset's current value of ``scale``, the step between valid sizes): hidden sizes
    stay multiples of the head count."""
    try:
        import models
    except ImportError as error:
        raise InputError(f"--find max-scale needs torch ({error})") from None
    try:
        config = models.get(preset).config
    except ValueError as error:
        raise InputError(f"--model {preset}: {error}") from None
    name = SCALES.get(scale)
    if name is None or not hasattr(config, name):
        raise InputError(
            f"--scale {scale}: {preset} has no {name or scale!r} field; "
            f"choose one of {', '.join(s for s in SCALES if hasattr(config, SCALES[s]))}"
        )
    step = getattr(config, "heads", 1) if scale == "hidden" else 1
    return getattr(config, name), step


def main(argv: list[str] | None = None) -> int:
    """``python -m solver.sweep``: see solver/sweep_cli.py."""
    from solver.sweep_cli import sweep_main

    return sweep_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
