"""One point of a study: the options every point shares (:class:`PointOptions`) and a point's
row (:func:`solve_point`), the unit of work of every executor (local processes, Ray tasks)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from solver.errors import InfeasibleError, InputError, NoSolutionError
from solver.graph import LayerGraph
from solver.parallel import check_searched
from solver.report.plan_report import finite_or_none
from solver.search.planner import Plan, plan
from solver.specs import Cluster, TrainingConfig
from solver.sweep.rows import ROW_KEYS


@dataclass(kw_only=True, frozen=True)
class PointOptions:
    """What every point of a study shares (sent once to each worker)."""

    graph: LayerGraph
    training: TrainingConfig
    cluster: Cluster
    """Template: every field but num_gpus and gpu_memory_bytes applies to every point."""
    backend: str = "auto"
    time_limit_s: float | None = 60.0

    def __post_init__(self) -> None:
        check_searched(self.training.schedule)  # before any point: one error, not a row each


def solve_point(
    options: PointOptions, gpus: int, gpu_memory_bytes: int
) -> tuple[dict, Plan | None]:
    """The row of one point, and its plan when one was found."""
    started = time.perf_counter()
    row = empty_row(options, gpus, gpu_memory_bytes)
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
            suggest_gpus=False,  # a study searches the counts itself
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
            **{k: getattr(config, k) for k in ("pp", "tp", "cp", "dp", "micro_batch")},
            "num_microbatches": config.num_microbatches,
            "zero": config.zero,
            "recompute": config.recompute,
            "peak_bytes": result.peak_bytes,
            "throughput": finite_or_none(result.throughput),
            "gap": result.solver.gap,
            "fits": result.evaluation.fits,
            "ep": config.ep,
        }
        for name, baseline in result.baselines.items():
            row[f"{name}_peak_bytes"] = baseline.peak_bytes
            row[f"{name}_throughput"] = finite_or_none(baseline.throughput)
    row["wall_s"] = time.perf_counter() - started
    return row, result


def empty_row(options: PointOptions, gpus: int, gpu_memory_bytes: int) -> dict[str, Any]:
    """A point's row before it is solved: the point, its reserve and usable memory (bytes), the
    rest None (``config`` and ``detail`` empty)."""
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row |= {"gpus": gpus, "gpu_memory_bytes": gpu_memory_bytes, "config": "", "detail": ""}
    reserved = options.training.memory_reserve.bytes_for(gpu_memory_bytes)
    row |= {"reserve_bytes": reserved, "usable_bytes": gpu_memory_bytes - reserved}
    return row


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())
