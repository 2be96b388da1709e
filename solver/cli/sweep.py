"""``python -m solver.sweep``: sweeps, ``--find min-gpus`` and ``--find max-scale`` from the shell.

    python -m solver.sweep GRAPH.json --gpus 64,128,256 --gpu-memory 40GiB,80GiB \\
        --global-batch 1536 --out sweep.csv [--plot sweep.png] [--workers N]
        [--executor ray [--ray-address HOST:PORT|auto]]
    python -m solver.sweep GRAPH.json --find min-gpus --gpus auto --gpu-memory 80GiB ...
    python -m solver.sweep --find max-scale --model gpt3-175b --scale layers --gpus 64 ...

Every training, search and cluster flag of ``python -m solver.plan`` applies (the same helpers
in solver/cli/common.py build them).
Only parses, calls solver.sweep, prints and writes; errors are one
line with exit code 2 (bad input, a bad --out/--json/--plot path: before any work); a sweep whose
every point is an ERROR row also returns 2; 7: an output could not be written;
Ctrl-C, SIGTERM and SIGHUP return 130, 143 and 129 and keep the CSV rows already written.
"""

from __future__ import annotations

import argparse
import logging
from importlib.metadata import entry_points
from typing import Any

from solver import console
from solver.cli import common
from solver.console import interrupted
from solver.errors import InputError, PlannerError
from solver.graph import LayerGraph, load_graph
from solver.sweep import (
    EXECUTORS,
    SCALES,
    CsvRows,
    max_scale,
    min_gpus,
    sweep,
)
from solver.units import format_bytes


def gpu_list(text: str) -> list[int] | str:
    """'8,16,32' -> [8, 16, 32]; 'auto' stays 'auto'; empty items and non-integers are errors."""
    if text.strip().lower() == "auto":
        return "auto"
    parts = [part.strip() for part in text.split(",")]
    if any(not part for part in parts):
        raise argparse.ArgumentTypeError(
            f"empty item in {text!r}; write comma-separated GPU counts like 8,16,32"
        )
    return [console.positive_int(part) for part in parts]


def size_range(text: str) -> tuple[int, int]:
    """'LO:HI' -> (LO, HI) with 1 <= LO <= HI."""
    low, sep, high = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected LO:HI, e.g. 24:192, got {text!r}")
    low_value, high_value = console.positive_int(low), console.positive_int(high)
    if low_value > high_value:
        raise argparse.ArgumentTypeError(f"LO must be <= HI, got {text!r}")
    return low_value, high_value


def sweep_parser() -> argparse.ArgumentParser:
    parser = console.OneLineErrorParser(
        prog="python -m solver.sweep",
        description="What-if studies: the memory-optimal plan at every (GPU count, GPU memory) "
        "point, the smallest GPU count that fits, or the largest model of a preset that fits.",
    )
    parser.add_argument(
        "graph", nargs="?", help="layer-graph JSON file (not with --find max-scale)"
    )
    parser.add_argument(
        "--gpus",
        type=gpu_list,
        required=True,
        help="GPU counts, e.g. 8,16,32; with --find min-gpus also 'auto' (every count some "
        "config can use); with --find max-scale one count",
    )
    study = parser.add_argument_group("study")
    study.add_argument("--find", choices=["min-gpus", "max-scale"], help="instead of a sweep")
    study.add_argument("--max-gpus", type=console.positive_int, help="--gpus auto: largest count")
    study.add_argument("--model", metavar="PRESET", help="--find max-scale: zoo preset")
    study.add_argument("--scale", choices=list(SCALES), help="--find max-scale: what grows")
    study.add_argument(
        "--range",
        type=size_range,
        metavar="LO:HI",
        help="--find max-scale: sizes to search (default: 1 step .. 16x the preset's)",
    )
    study.add_argument(
        "--workers",
        type=console.positive_int,
        help="processes (default: every core; 1: in-process); --executor ray: the local Ray "
        "instance's CPUs",
    )
    study.add_argument(
        "--executor",
        choices=list(EXECUTORS),
        default="local",
        help="sweep: where the points run: local worker processes (default), or one Ray task "
        "per point (needs the ray extra: pip install -e '.[ray]')",
    )
    study.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="--executor ray: the cluster to run on, HOST:PORT of its head node or auto (the one "
        "started on this machine with 'ray start --head'); default: start a local instance",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--out", metavar="CSV", help="sweep: write one row per point")
    output.add_argument("--plot", metavar="FILE", help="sweep: draw peak and throughput vs GPUs")
    output.add_argument("--json", metavar="OUT", help="--find: write the plan that proves it")
    output.add_argument("--quiet", action="store_true", help="no table, no progress bar")
    common.add_cluster_options(parser, memory_list=True)
    common.add_training_options(parser)
    common.add_plan_options(parser, cpsat_workers=False)
    return parser


def sweep_main(argv: list[str] | None = None) -> int:
    args = sweep_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    writer = None
    try:
        _check_args(args)
        if args.find == "max-scale":
            return _max_scale(args)
        if args.find == "min-gpus":
            return _min_gpus(args)
        graph = _read_graph(args)
        training = _training(args)
        if args.out:
            writer = CsvRows(args.out, protect=_inputs(args))
        rows = sweep(
            graph,
            args.gpus,
            args.gpu_memory,
            training,
            common.cluster_from_flags(args, 1, args.gpu_memory[0]),
            workers=args.workers,
            progress=not args.quiet,
            on_row=None if writer is None else writer.append,
            backend=args.backend,
            time_limit_s=args.time_limit,
            executor=args.executor,
            ray_address=args.ray_address,
        )
        if all(row["status"] == "ERROR" for row in rows):
            # bad input at every point: the one error line, no table, CSV or plot of failures
            if writer is not None:
                writer.discard()
            raise InputError(f"no point can be solved; first: {rows[0]['detail']}")
        if writer is not None:
            writer.finish(rows)
        if args.plot:
            from solver.report.plots import plot_sweep

            plot_sweep(rows, args.plot, title=_title(graph.model, training))
        if not args.quiet:
            console.print_output(format_rows(rows))
    except PlannerError as error:
        console.print_error(error)
        return error.exit_code
    except KeyboardInterrupt:
        return interrupted("" if writer is None else writer.close())
    finally:
        if writer is not None:
            writer.close()
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """Every combination error, before any work."""
    if args.find == "max-scale":
        if args.graph is not None:
            raise InputError("--find max-scale builds the graph from --model; do not give GRAPH")
        if args.model is None or args.scale is None:
            raise InputError("--find max-scale needs --model PRESET and --scale layers|hidden")
    elif args.graph is None:
        raise InputError("give the layer-graph JSON file (GRAPH)")
    elif args.model or args.scale or args.range:
        raise InputError("--model, --scale and --range go with --find max-scale")
    if args.gpus == "auto" and args.find != "min-gpus":
        raise InputError("--gpus auto goes with --find min-gpus; give GPU counts, e.g. 8,16,32")
    if args.find is not None:
        if len(args.gpu_memory) != 1:
            raise InputError(f"--find {args.find}: give one --gpu-memory size")
        if args.out or args.plot:
            raise InputError(f"--find {args.find}: --out and --plot are for sweeps; use --json")
    elif args.json:
        raise InputError("--json goes with --find; a sweep writes --out CSV")
    if args.find == "max-scale" and len(args.gpus) != 1:
        raise InputError("--find max-scale: give one GPU count (--gpus N)")
    if args.executor == "ray":
        if args.find is not None:
            raise InputError(
                f"--executor ray runs sweeps; --find {args.find} solves on local workers "
                "(leave out --executor)"
            )
        from solver.sweep.ray_executor import check_address, import_ray

        import_ray()
        if args.ray_address is not None:
            check_address(args.ray_address, time_limit_s=args.time_limit)
    elif args.ray_address is not None:
        raise InputError("--ray-address goes with --executor ray")
    console.check_outputs(args)  # --json, --out, --plot: before any graph is read or solved


def _inputs(args: argparse.Namespace) -> list[str]:
    return [p for p in (args.graph, args.calibration) if p]


def _training(args: argparse.Namespace) -> Any:
    """The training options of the flags; InputError (exit 2) when --reserve leaves nothing of
    one of the --gpu-memory sizes."""
    from solver.reserve import check_usable

    training = common.training_from_args(args)
    check_usable(training.memory_reserve, {"each GPU's": min(args.gpu_memory)})
    return training


def _title(model: str, training: Any) -> str:
    return f"{model}, global batch {training.global_batch}"


def _read_graph(args: argparse.Namespace) -> LayerGraph:
    """The graph file, read within ``--time-limit`` (exit 4 past it: a graph too big to read in
    the time one point may take)."""
    from solver.deadline import Deadline

    return load_graph(args.graph, deadline=Deadline.after(args.time_limit))


def _min_gpus(args: argparse.Namespace) -> int:
    from solver.report.plan_report import format_plan, plan_to_dict

    graph = _read_graph(args)
    training = _training(args)
    memory = args.gpu_memory[0]
    result = min_gpus(
        graph,
        memory,
        training,
        common.cluster_from_flags(args, 1, memory),
        candidates=None if args.gpus == "auto" else args.gpus,
        max_gpus=args.max_gpus,
        workers=args.workers,
        progress=not args.quiet,
        backend=args.backend,
        time_limit_s=args.time_limit,
    )
    searched = (
        "every GPU count some config can use"
        + ("" if args.max_gpus is None else f" up to {args.max_gpus}")
        if args.gpus == "auto"
        else f"candidates {','.join(map(str, sorted(set(args.gpus))))}"
    )
    solved = f"{len(result.rows)} counts solved, {result.skipped} ruled out by bounds"
    if result.gpus is None:
        detail = next((r["detail"] for r in reversed(result.rows) if r["detail"]), "")
        raise _infeasible(f"no GPU count fits ({searched}; {solved}): {detail}")
    if args.json:
        console.write_json(args.json, plan_to_dict(result.plan), protect=_inputs(args))
    if not args.quiet:
        console.print_output(
            f"smallest GPU count that fits {format_bytes(memory)} per GPU: {result.gpus} "
            f"({searched}; {solved})\n" + format_plan(result.plan)
        )
    return 0


GRAPH_SOURCES = "memplan.graph_sources"
"""Entry-point group of what ``--find max-scale`` builds its graphs from: a module (or object)
with ``preset_scale(model, scale) -> (current size, step)`` and ``preset_graph_of(model, scale)
-> (size -> LayerGraph)``. pyproject.toml installs ``zoo = "profiling.presets"`` (the zoo
presets, profiled under fake tensors: needs torch), so the solver imports nothing of profiling."""


def graph_source(name: str = "zoo"):
    """The installed graph source ``name`` of :data:`GRAPH_SOURCES`, loaded; InputError when it
    is not installed."""
    found = [point for point in entry_points(group=GRAPH_SOURCES) if point.name == name]
    if not found:
        raise InputError(
            f"--find max-scale profiles the model and needs torch and the profiling package "
            f"(no {GRAPH_SOURCES} entry point {name!r} is installed); install them with "
            "pip install -e '.[profiling]'"
        )
    return found[0].load()


def _max_scale(args: argparse.Namespace) -> int:
    from solver.report.plan_report import format_plan, plan_to_dict

    source = graph_source()  # profiles: needs torch
    current, step = source.preset_scale(args.model, args.scale)
    low, high = args.range if args.range else (step, 16 * current)
    sizes = [size for size in range(low, high + 1) if size % step == 0]
    if not sizes:
        raise InputError(f"--range {low}:{high}: no {args.scale} size that is a multiple of {step}")
    start = min(range(len(sizes)), key=lambda i: abs(sizes[i] - current)) if not args.range else 0
    training = _training(args)
    result = max_scale(
        source.preset_graph_of(args.model, args.scale),
        sizes,
        common.cluster_from_flags(args, args.gpus[0], args.gpu_memory[0]),
        training,
        start=start,
        scale=args.scale,
        backend=args.backend,
        time_limit_s=args.time_limit,
    )
    where = f"{args.gpus[0]} GPUs x {format_bytes(args.gpu_memory[0])}"
    if result.size is None:
        raise _infeasible(
            f"{args.model} with {args.scale}={result.too_big} (the smallest searched) does "
            f"not fit on {where}: {result.too_big_detail}"
        )
    if args.json:
        console.write_json(args.json, plan_to_dict(result.plan), protect=_inputs(args))
    if not args.quiet:
        above = (
            f"the top of the range ({sizes[-1]}) fits"
            if result.too_big is None
            else f"{args.scale}={result.too_big} does not fit: {result.too_big_detail}"
        )
        console.print_output(
            f"largest {args.model} that fits on {where}: {args.scale}={result.size} (preset: "
            f"{current}; {len(result.rows)} sizes profiled and planned); {above}\n"
            + format_plan(result.plan)
        )
    return 0


def _infeasible(message: str) -> PlannerError:
    from solver.errors import InfeasibleError

    return InfeasibleError(message)


def format_rows(rows: list[dict]) -> str:
    """The sweep as a text table (display only); "usable" is the memory minus the reserve
    (``--reserve``), what the peaks must fit in."""
    header = [
        "gpus",
        "memory",
        "usable",
        "status",
        "config",
        "peak",
        "samples/s",
        "even",
        "params",
        "wall",
    ]

    def size(value: int | None) -> str:
        return "-" if value is None else format_bytes(value)

    def number(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    table = [
        [
            str(row["gpus"]),
            size(row["gpu_memory_bytes"]),
            size(row.get("usable_bytes")),
            row["status"] + ("" if not row["gap"] else f" gap {100 * row['gap']:.2f}%"),
            row["config"] or row["detail"][:60],
            size(row["peak_bytes"]),
            number(row["throughput"], ".4g"),
            size(row["even_peak_bytes"]),
            size(row["parameters_peak_bytes"]),
            "-" if row["wall_s"] is None else f"{row['wall_s']:.2f} s",
        ]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *table]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [header, *table]
    )
