"""Our exact planner vs CAPSlog's own recommendation code, on CAPSlog's statistics.

    python scripts/bench_capslog.py [--capslog PATH] [--repeats 9] [--out benchmarks]

CAPSlog (henkdr/CAPSlog, ``capslog/calc_mem_stats.py``) recommends a pipeline split from two
per-layer statistics, ``mem_isolated`` (a stage's peak when the layer starts it) and
``mem_added`` (what the layer adds to a stage it joins), by a binary search on a threshold over
its ``fill_first`` greedy: predictor "bs_tb" (the search, then its tie-breaking
``fix_and_continue``, which fixes the fullest GPU and searches again on each side) and "bs" (the
search alone). Its code is loaded at run time from ``--capslog PATH`` (the folder holding
``calc_mem_stats.py``; by default extracted from the git snapshot in ``--capslog-git`` to a
temporary folder) and called through its entry point ``find_balanced_partitioning`` with the
statistics dict it builds itself (``{layer: {"mem_isolated": B, "mem_added": B}}``, layer 0
without ``mem_added``); its printed recommendation is parsed. None of its code is in this
repository.

CAPSlog has no statistics generator (it measures them on Varuna), so the statistics are drawn
as in ``scripts/bench_empirical.py``: ``mem_added`` uniform in 1..100 MB, ``mem_isolated`` =
``mem_added`` + a first-layer surplus uniform in 0..101 MB (the greedy is exact only when the
surplus is the same for every layer). L = 24..200 layers, G = 8, 16, 32 stages (G <= L), two
draws each.

Ours: ``solver.graph.graph_from_dict`` + ``solver.search.planner.plan`` in process, with
``memory_model="empirical"`` (a stage's peak = mem_isolated of its first layer + mem_added of
the others: the model CAPSlog predicts with), pinned to pp = G, tp 1, dp 1, micro-batch 1,
G micro-batches, other options default. Each time is the median of ``--repeats`` runs (wall
clock, and CPU time of this process, the steadier on a shared machine). Exactness: our peak
must equal the optimum of an independent O(G L^2) dynamic program over the same statistics;
CAPSlog's peak (its own prediction) is reported as % over that optimum.

Writes benchmarks/bench_capslog.md and .csv; :func:`headline_rows` gives the summary row.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

import harness
import numpy as np
from harness import ROOT, markdown_table

from solver import Cluster, TrainingConfig
from solver.graph import graph_from_dict
from solver.search.planner import plan

COMMAND = "python scripts/bench_capslog.py"
CAPSLOG_GIT = Path("/work/.mirror/henkdr+CAPSlog/repo")
"""The default git snapshot of henkdr/CAPSlog (a bare repository) whose ``capslog/`` is used."""
LAYERS = (24, 32, 48, 64, 96, 128, 160, 200)
STAGES = (8, 16, 32)
DRAWS = 2
SEED = 2024
MB = 10**6
CLUSTER_MEMORY_BYTES = 2**50
"""GPU memory large enough that every split fits: CAPSlog has no capacity either."""
PREDICTORS = ("bs_tb", "bs")
"""CAPSlog's binary-search predictors: with its tie-breaking (the recommendation), and without."""


class BenchError(Exception):
    """A bad option: one line, exit 2."""


# --- CAPSlog, loaded at run time ---------------------------------------------------------------


def extract_capslog(git_dir: Path, into: Path) -> Path:
    """``capslog/`` of the snapshot's HEAD, written under ``into``; its path."""
    if not git_dir.exists():
        raise BenchError(
            f"--capslog-git {git_dir}: no such git directory; pass --capslog PATH, the capslog/ "
            "folder of a checkout of henkdr/CAPSlog"
        )
    archive = subprocess.run(
        ["git", "-C", str(git_dir), "archive", "--format=tar", "HEAD", "capslog"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise BenchError(
            f"--capslog-git {git_dir}: git archive HEAD capslog failed "
            f"({archive.stderr.decode(errors='replace').strip()[:120]}); pass --capslog PATH"
        )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+ / 3.11.4+
            tar.extractall(into, filter="data")
        else:  # pragma: no cover - older Pythons: the archive is git's own output
            tar.extractall(into)  # noqa: S202
    return into / "capslog"


def load_capslog(folder: Path) -> ModuleType:
    """CAPSlog's ``calc_mem_stats`` module from ``folder`` (which also holds its import
    ``varuna_mem_stats``)."""
    folder = folder.parent if folder.is_file() else folder
    source = folder / "calc_mem_stats.py"
    if not source.is_file():
        raise BenchError(
            f"--capslog {folder}: no calc_mem_stats.py there; pass the capslog/ folder of a "
            "checkout of henkdr/CAPSlog"
        )
    sys.path.insert(0, str(folder))  # calc_mem_stats imports varuna_mem_stats by name
    try:
        spec = importlib.util.spec_from_file_location("capslog_calc_mem_stats", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    if not hasattr(module, "find_balanced_partitioning"):
        raise BenchError(f"--capslog {folder}: calc_mem_stats.py has no find_balanced_partitioning")
    return module


def capslog_statistics(isolated: list[int], added: list[int]) -> dict[int, dict]:
    """The statistics dict CAPSlog's ``average_results`` returns (layer 0 has no mem_added)."""
    return {
        layer: {"mem_isolated": iso, "mem_added": None if layer == 0 else add}
        for layer, (iso, add) in enumerate(zip(isolated, added, strict=True))
    }


def run_capslog(capslog: ModuleType, isolated, added, stages: int, predictor: str):
    """(layers per stage, its predicted peak in bytes, wall s, CPU s) of one recommendation:
    ``find_balanced_partitioning`` as CAPSlog's ``main`` calls it, its printout parsed."""
    stats = capslog_statistics(isolated, added)
    printed = io.StringIO()
    with harness.Stopwatch() as clock, contextlib.redirect_stdout(printed):
        capslog.find_balanced_partitioning(stats, len(isolated), stages, predictor)
    wall, cpu = clock.wall_s, clock.cpu_s
    lines = printed.getvalue().splitlines()
    split = ast.literal_eval(_after(lines, "Best found partitioning:"))
    predicted = ast.literal_eval(_after(lines, "Predicted memory usage (bytes):"))
    return [len(stage) for stage in split], max(predicted), wall, cpu


def _after(lines: list[str], prefix: str) -> str:
    return next(line[len(prefix) :] for line in lines if line.startswith(prefix))


# --- ours ----------------------------------------------------------------------------------------


def layer_graph_document(isolated: list[int], added: list[int]) -> dict:
    """The statistics as a layer graph (a chain; params etc. 1: the empirical model ignores
    them)."""
    layers = [
        {
            "name": f"layer{i}",
            "params": 1,
            "activation_bytes": 1,
            "output_bytes": 1,
            "mem_isolated": iso,
            "mem_added": add,
        }
        for i, (iso, add) in enumerate(zip(isolated, added, strict=True))
    ]
    return {"format": "layer-graph", "version": 1, "model": "capslog-statistics", "layers": layers}


def run_ours(document: dict, stages: int):
    """(layers per stage, peak bytes, wall s, CPU s) of graph_from_dict + plan in process."""
    cluster = Cluster(num_gpus=stages, gpu_memory_bytes=CLUSTER_MEMORY_BYTES)
    training = TrainingConfig(
        global_batch=stages,
        micro_batch_sizes=(1,),
        pp=stages,
        tp=1,
        dp=1,
        memory_model="empirical",
    )
    with harness.Stopwatch() as clock:
        result = plan(graph_from_dict(document), cluster, training)
    wall, cpu = clock.wall_s, clock.cpu_s
    assert result.config.num_microbatches == stages
    counts = np.bincount(result.stage_of_layer, minlength=stages).tolist()
    return counts, result.peak_bytes, wall, cpu


# --- the oracle ----------------------------------------------------------------------------------


def split_peak(isolated: list[int], added: list[int], counts: list[int]) -> int:
    """Largest stage peak of a split (layers per stage): mem_isolated of the first layer +
    mem_added of the others."""
    peak, start = 0, 0
    for count in counts:
        peak = max(peak, isolated[start] + sum(added[start + 1 : start + count]))
        start += count
    return peak


def optimum(isolated: list[int], added: list[int], stages: int) -> int:
    """Smallest largest stage peak over every split into ``stages`` non-empty contiguous stages:
    f_s(j) = min_i max(f_{s-1}(i - 1), iso_i + A_j - A_i), A the prefix sums of mem_added
    (a stage i..j holds iso_i + added[i+1..j]); O(stages L^2), numpy over (i, j)."""
    iso = np.asarray(isolated, dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(np.asarray(added, dtype=np.int64))])
    num_layers = len(iso)
    starts, ends = np.arange(num_layers)[:, None], np.arange(num_layers)[None, :]
    # cost[i, j] of a stage of layers i..j (inf where j < i)
    cost = iso[:, None] + prefix[ends + 1] - prefix[starts + 1]
    cost = np.where(ends >= starts, cost, np.iinfo(np.int64).max)
    best = cost[0].copy()  # one stage: layers 0..j
    for _ in range(1, stages):
        previous = np.concatenate([[np.iinfo(np.int64).max], best[:-1]])  # f(i - 1) per i
        best = np.min(np.maximum(previous[:, None], cost), axis=0)
    return int(best[num_layers - 1])


# --- the benchmark -------------------------------------------------------------------------------


def draw_statistics(num_layers: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """bench_empirical's random statistics: mem_added 1..100 MB, surplus 0..101 MB."""
    added = [rng.randint(1, 100) * MB for _ in range(num_layers)]
    isolated = [a + rng.randint(0, 2 * 505) * MB // 10 for a in added]
    return isolated, added


def measure_case(capslog: ModuleType, isolated, added, stages: int, repeats: int) -> dict:
    """One (statistics, G) case: medians of ``repeats`` interleaved runs of each method."""
    times = {name: ([], []) for name in ("ours", *PREDICTORS)}
    results = {}
    for _ in range(repeats):
        document = layer_graph_document(isolated, added)
        counts, peak, wall, cpu = run_ours(document, stages)
        results["ours"] = (counts, peak)
        times["ours"][0].append(wall)
        times["ours"][1].append(cpu)
        for predictor in PREDICTORS:
            counts, peak, wall, cpu = run_capslog(capslog, isolated, added, stages, predictor)
            results[predictor] = (counts, peak)
            times[predictor][0].append(wall)
            times[predictor][1].append(cpu)
    best = optimum(isolated, added, stages)
    ours_counts, ours_peak = results["ours"]
    row = {
        "layers": len(isolated),
        "stages": stages,
        "optimum_mb": round(best / MB, 1),
        "ours_ms": _ms(times["ours"][0]),
        "ours_cpu_ms": _ms(times["ours"][1]),
        "exact": ours_peak == best and split_peak(isolated, added, ours_counts) == best,
    }
    for predictor in PREDICTORS:
        counts, peak = results[predictor]
        assert split_peak(isolated, added, counts) == peak, "CAPSlog's prediction is its model"
        assert peak >= best, "the DP optimum is a lower bound"
        prefix = "capslog" if predictor == "bs_tb" else "bs"
        row[f"{prefix}_ms"] = _ms(times[predictor][0])
        row[f"{prefix}_cpu_ms"] = _ms(times[predictor][1])
        row[f"{prefix}_ratio"] = round(row["ours_ms"] / row[f"{prefix}_ms"], 3)
        row[f"{prefix}_cpu_ratio"] = round(row["ours_cpu_ms"] / row[f"{prefix}_cpu_ms"], 3)
        row[f"{prefix}_over_optimum_pct"] = round(100 * (peak - best) / best, 2)
    return row


def _ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def run_all(capslog: ModuleType, repeats: int) -> list[dict]:
    rng = random.Random(SEED)
    rows = []
    run_ours(layer_graph_document(*draw_statistics(24, random.Random(0))), 8)  # warm caches
    for num_layers in LAYERS:
        for stages in STAGES:
            if stages > num_layers:
                continue
            for draw in range(DRAWS):
                isolated, added = draw_statistics(num_layers, rng)
                row = measure_case(capslog, isolated, added, stages, repeats)
                rows.append({"draw": draw, **row})
                print(
                    f"L {num_layers:3d} G {stages:2d} draw {draw}: ours {row['ours_ms']:.2f} ms, "
                    f"CAPSlog bs_tb {row['capslog_ms']:.2f} ms (ratio {row['capslog_ratio']}), "
                    f"bs {row['bs_ms']:.2f} ms; exact {row['exact']}, CAPSlog "
                    f"+{row['capslog_over_optimum_pct']}%"
                )
    return rows


def summary(rows: list[dict]) -> dict:
    """Median and range of the ratios, exact counts, CAPSlog's misses."""

    def column(name: str) -> list[float]:
        return [row[name] for row in rows]

    total = {
        "cases": len(rows),
        "ours_exact": sum(row["exact"] for row in rows),
        "median_ratio": statistics.median(column("capslog_ratio")),
        "min_ratio": min(column("capslog_ratio")),
        "max_ratio": max(column("capslog_ratio")),
        "median_cpu_ratio": statistics.median(column("capslog_cpu_ratio")),
        "median_ratio_vs_bs": statistics.median(column("bs_ratio")),
        "median_cpu_ratio_vs_bs": statistics.median(column("bs_cpu_ratio")),
        "capslog_suboptimal": sum(row["capslog_over_optimum_pct"] > 0 for row in rows),
        "capslog_max_over_pct": max(column("capslog_over_optimum_pct")),
        "bs_suboptimal": sum(row["bs_over_optimum_pct"] > 0 for row in rows),
        "bs_max_over_pct": max(column("bs_over_optimum_pct")),
        "median_ours_ms": statistics.median(column("ours_ms")),
        "median_capslog_ms": statistics.median(column("capslog_ms")),
        "median_bs_ms": statistics.median(column("bs_ms")),
    }
    return {key: round(value, 3) for key, value in total.items()}


def headline_text(total: dict) -> str:
    return (
        f"median ratio ours/CAPSlog {total['median_ratio']:.2f} wall "
        f"({total['min_ratio']:.2f}-{total['max_ratio']:.2f}), {total['median_cpu_ratio']:.2f} "
        f"CPU time, against its recommendation (bs_tb); ours exact on {total['ours_exact']}/"
        f"{total['cases']}, CAPSlog sub-optimal on {total['capslog_suboptimal']}/"
        f"{total['cases']} (by up to {total['capslog_max_over_pct']}%); against its plain "
        f"binary search (bs) median {total['median_ratio_vs_bs']:.2f} wall"
    )


def headline_rows(out_dir: str | Path = ROOT / "benchmarks") -> list[dict]:
    """Issue 17 point 4's row for benchmarks/bench_search.md, from bench_capslog.csv (run this
    script first)."""
    rows = [_typed(row) for row in harness.read_csv(Path(out_dir) / "bench_capslog.csv")]
    return [
        {
            "point": "4. faster than CAPSlog on its own work",
            "command": COMMAND,
            "result": headline_text(summary(rows)),
        }
    ]


def _typed(row: dict) -> dict:
    typed = {}
    for key, value in row.items():
        if value in ("True", "False"):
            typed[key] = value == "True"
        else:
            try:
                typed[key] = float(value) if "." in value else int(value)
            except ValueError:
                typed[key] = value
    return typed


def write(rows: list[dict], out_dir: Path, capslog_source: str, run: harness.Run) -> None:
    harness.write_csv(out_dir / "bench_capslog.csv", rows, list(rows[0]))
    total = summary(rows)
    columns = [
        "layers",
        "stages",
        "draw",
        "ours_ms",
        "capslog_ms",
        "capslog_ratio",
        "capslog_over_optimum_pct",
        "ours_cpu_ms",
        "capslog_cpu_ms",
        "capslog_cpu_ratio",
        "bs_ms",
        "bs_ratio",
        "bs_over_optimum_pct",
        "exact",
    ]
    lines = [
        "# Our planner vs CAPSlog's recommendation code on its statistics",
        "",
        f"Command: {run.command_text}  ",
        f"Machine: {harness.architecture()}, Python {harness.python_version()}, run "
        f"{harness.today()}; a shared 2-core machine (other jobs running), so times "
        "are medians of interleaved repeats, wall and CPU time of this process. CAPSlog: "
        f"{capslog_source}, loaded at run time.",
        "",
        'Ours = `graph_from_dict` + `plan()` in process, `memory_model="empirical"`, pinned to '
        "pp = G, tp 1, dp 1, micro-batch 1, G micro-batches. CAPSlog = "
        "`find_balanced_partitioning(stats, L, G, predictor)`: `bs_tb` (binary search over "
        "`fill_first`, then its tie-breaking; its recommendation, the `capslog_*` columns) and "
        "`bs` (the binary search alone). Ratio = ours / CAPSlog (below 1: ours is faster). "
        "Statistics: bench_empirical's random generator (CAPSlog ships none). `exact`: our "
        "peak equals an independent DP optimum; `*_over_optimum_pct`: CAPSlog's predicted peak "
        "over it.",
        "",
        f"**{headline_text(total)}.**",
        "",
        *markdown_table([total], list(total)),
        "",
        "## Every case",
        "",
        *markdown_table(rows, columns),
        "",
    ]
    harness.write_report(out_dir, "bench_capslog.md", lines)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--capslog", type=Path, help="CAPSlog's capslog/ folder")
    parser.add_argument("--capslog-git", type=Path, default=CAPSLOG_GIT)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    try:
        if args.repeats < 1:
            raise BenchError(f"--repeats {args.repeats}: give 1 or more")
        with tempfile.TemporaryDirectory() as scratch:
            if args.capslog is not None:
                folder, source = args.capslog, f"`{args.capslog}`"
            else:
                folder = extract_capslog(args.capslog_git, Path(scratch))
                head = subprocess.run(
                    ["git", "-C", str(args.capslog_git), "rev-parse", "--short", "HEAD"],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout.strip()
                source = f"henkdr/CAPSlog at {head} (`capslog/calc_mem_stats.py`)"
            capslog = load_capslog(folder)
            rows = run_all(capslog, args.repeats)
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    write(rows, args.out, source, run)
    print(headline_text(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
