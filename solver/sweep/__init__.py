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

``python -m solver.sweep``: solver/cli/sweep.py. Modules: ``point`` (one point's row),
``runner`` (the points, on local worker processes), ``ray_executor`` (the points as Ray tasks:
``sweep(..., executor="ray")``, the optional ``[ray]`` extra, imported only then), ``rows``
(CSV), ``studies`` (smallest cluster, largest model)."""

from solver.sweep.rows import ROW_KEYS, STATUSES, CsvRows, check_output_path, fits, read_rows
from solver.sweep.runner import EXECUTORS, PointOptions, solve_point, sweep, sweep_points
from solver.sweep.studies import (
    SCALES,
    MaxScaleResult,
    MinGpusResult,
    max_scale,
    min_gpus,
    valid_gpu_counts,
)

__all__ = [
    "EXECUTORS",
    "ROW_KEYS",
    "SCALES",
    "STATUSES",
    "CsvRows",
    "MaxScaleResult",
    "MinGpusResult",
    "PointOptions",
    "check_output_path",
    "fits",
    "max_scale",
    "min_gpus",
    "read_rows",
    "solve_point",
    "sweep",
    "sweep_points",
    "valid_gpu_counts",
]
