"""Predicted vs measured step time: the plan's ``iteration_ms`` against clean real runs.

    python scripts/bench_time.py [--quick] [--repeats 5] [--step-iterations 3] [--out benchmarks]
                                 [--plans DIR]

Profiles gpt-tiny at 6 layers x 256 hidden (``bench_clean_timing.OVERRIDES``: 4 heads, seq 128,
vocabulary 2048, fp32, dropout 0; 5.8M parameters; 6-10 ms per layer per sample on this CPU) with
``profiling.export --device cpu --threads 1`` (the layer times and ``meta.timing``'s optimizer and
micro-batch terms), then measures the gloo point-to-point link between two local ranks once: a
ping-pong of ``LINK_SIZES`` (one thread per rank), the one-way time per message fitted as latency
+ bytes / bandwidth (:func:`fit_link`). The fitted bandwidth is the cluster's
``intra_node_gb_per_s``, and the latency its ``p2p_latency_us`` when ``solver.specs.Cluster``
has that field.

For each layout of ``LAYOUTS`` (pp 1-2, 1F1B, GPipe, interleaved v 2 and the split-backward
interleaved-zb, zbv and dualpipev, even and uneven splits, with and without full recompute, 2-8
micro-batches of one sample, torch runtime) the plan is
``solver.evaluate`` of the fixed split on that cluster (``evaluation_to_dict``: a plan document
``profiling.run`` reads), and the prediction is its ``iteration_ns``, as the solver computes it.
Every layout runs ``--repeats`` times, round robin (a busy spell hits every layout), through
``profiling.run.run_plan`` (``bench_clean_timing.run_once``: 1 thread per rank, the graph's
``meta.timing.threads``; two instrumented iterations, then ``--step-iterations`` clean ones:
tracker off, barrier, the slowest rank's; ``profiling.run.step_ms``: their median). Per
layout: predicted ms, measured ms (median over the repeats) and spread (max - min), error % =
100 (predicted - measured) / measured, the busiest rank's CPU time; then median and max |error|,
even vs uneven medians, and the pairwise ranking agreement over the pairs whose measured times
differ by more than the sum of their spreads (:func:`ranking_agreement`).
Writes benchmarks/bench_time.md and .csv; :func:`headline_rows` gives issue 18's point-4 rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import harness
import numpy as np
from bench_clean_timing import FP32, OVERRIDES, run_once
from harness import ROOT, markdown_table

COMMAND = "python scripts/bench_time.py"
THREADS = 1
"""CPU threads of the profile and of every rank (2 ranks on 2 cores)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """One measured layout: micro-batch 1, tp 1, dp 1, torch runtime."""

    name: str
    pp: int
    m: int
    schedule: str = "1f1b"
    split: str | tuple[int, ...] = "even"
    """"even" (Megatron's) or layers per (virtual) stage."""
    v: int = 1
    recompute: str = "none"

    @property
    def even(self) -> bool:
        return self.split == "even" or self.pp == 1


LAYOUTS = (
    Layout(name="pp1 m2", pp=1, m=2),
    Layout(name="pp1 m4", pp=1, m=4),
    Layout(name="pp1 m2 recompute", pp=1, m=2, recompute="full"),
    Layout(name="pp2 1f1b m4", pp=2, m=4),
    Layout(name="pp2 gpipe m4", pp=2, m=4, schedule="gpipe"),
    Layout(name="pp2 1f1b m8", pp=2, m=8),
    Layout(name="pp2 1f1b m4 3+5", pp=2, m=4, split=(3, 5)),
    Layout(name="pp2 gpipe m4 3+5", pp=2, m=4, schedule="gpipe", split=(3, 5)),
    Layout(name="pp2 1f1b m4 5+3", pp=2, m=4, split=(5, 3)),
    Layout(name="pp2 1f1b m8 3+5", pp=2, m=8, split=(3, 5)),
    Layout(name="pp2 1f1b m4 recompute", pp=2, m=4, recompute="full"),
    Layout(name="pp2 1f1b m4 3+5 recompute", pp=2, m=4, split=(3, 5), recompute="full"),
    Layout(name="pp2 interleaved v2 m4", pp=2, m=4, v=2),
    Layout(name="pp2 interleaved v2 m4 1+3+2+2", pp=2, m=4, v=2, split=(1, 3, 2, 2)),
    Layout(name="pp2 interleaved-zb m4", pp=2, m=4, schedule="interleaved-zb"),
    Layout(name="pp2 zbv m4", pp=2, m=4, v=2, schedule="zbv", split=(2, 2, 2, 2)),
    Layout(name="pp2 dualpipev m4", pp=2, m=4, v=2, schedule="dualpipev", split=(2, 2, 2, 2)),
)
QUICK = ("pp1 m2", "pp2 1f1b m4", "pp2 1f1b m4 3+5", "pp2 interleaved v2 m4")
"""The layouts of ``--quick`` (with 2 repeats)."""
LINK_SIZES = (16384, 65536, 131072, 262144, 524288, 786432)
"""Message bytes of the link ping-pong: around the boundary the layouts send (128 KiB per
micro-batch of one sample, seq 128 x hidden 256 x 4 bytes). gloo over loopback is not one line
from small to large messages here: about 80-200 us up to 768 KiB, then 0.5-2 ms from 1 MiB on
(another regime, which these runs never reach), so the fit covers the sizes the runs use."""
LINK_ROUND_TRIPS = 50
"""Timed round trips per size (after 3 warm-up ones); the median is kept."""
LINK_ATTEMPTS = 3
"""Ping-pongs tried before giving up when the times do not grow with the size (noise)."""
COLUMNS = [
    "layout",
    "pp",
    "v",
    "schedule",
    "m",
    "split",
    "recompute",
    "even",
    "predicted_ms",
    "measured_ms",
    "spread_ms",
    "error_pct",
    "busiest_rank_cpu_ms",
]


# -- the pure parts (tests/test_bench_time.py) ---------------------------------------------------


def fit_link(sizes_bytes: list[int], one_way_s: list[float]) -> tuple[float, float]:
    """Fit one-way message time = latency + bytes / bandwidth: (latency in us, at least 0;
    bandwidth in GB/s, 1 GB = 1e9 bytes, as ``Cluster.intra_node_gb_per_s``).

    Theil-Sen (the median of the pairwise slopes, then the median intercept): a ping-pong on a
    shared 2-core machine has single sizes off by 2x when a rank waits for a CPU, which would
    tilt a least-squares line; the median ignores up to about 29% of such points."""
    x = np.asarray(sizes_bytes, dtype=float)
    y = np.asarray(one_way_s, dtype=float)
    i, j = np.triu_indices(len(x), k=1)
    pairs = x[j] != x[i]
    if not pairs.any():
        raise ValueError("fit_link needs at least two different message sizes")
    seconds_per_byte = float(np.median((y[j] - y[i])[pairs] / (x[j] - x[i])[pairs]))
    if seconds_per_byte <= 0:
        raise ValueError("message time does not grow with size: no bandwidth to fit")
    latency_s = float(np.median(y - seconds_per_byte * x))
    return max(0.0, latency_s * 1e6), 1.0 / seconds_per_byte / 1e9


def error_pct(predicted: float, measured: float) -> float:
    """100 (predicted - measured) / measured."""
    return 100.0 * (predicted - measured) / measured


def error_stats(errors: list[float]) -> tuple[float, float]:
    """(median |error|, max |error|) of a list of signed errors (%)."""
    magnitudes = [abs(e) for e in errors]
    return statistics.median(magnitudes), max(magnitudes)


def ranking_agreement(
    predicted: list[float], measured: list[float], spreads: list[float]
) -> tuple[int, int]:
    """(pairs the prediction orders as measured, pairs considered): over the pairs whose
    measured times differ by more than the sum of their repeat spreads (the others are ties
    within the noise); a pair agrees when the predicted difference has the measured one's sign."""
    agree = considered = 0
    for i in range(len(measured)):
        for j in range(i + 1, len(measured)):
            gap = measured[i] - measured[j]
            if abs(gap) <= spreads[i] + spreads[j]:
                continue
            considered += 1
            agree += (predicted[i] - predicted[j]) * gap > 0
    return agree, considered


# -- the link -----------------------------------------------------------------------------------


def _link_worker(rank: int, port: int, out: str) -> None:
    """Rank 0 sends each size to rank 1 and waits for it back; writes the median one-way time
    (half a round trip) per size to ``out``."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(THREADS)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    one_way = []
    for size in LINK_SIZES:
        buffer = torch.zeros(size // 4, dtype=torch.float32)
        times = []
        for trip in range(3 + LINK_ROUND_TRIPS):
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            if trip >= 3:
                times.append((time.perf_counter() - started) / 2)
        one_way.append(statistics.median(times))
    if rank == 0:
        Path(out).write_text(json.dumps(one_way))
    dist.barrier()
    dist.destroy_process_group()


def measure_link() -> tuple[list[float], float, float]:
    """The gloo ping-pong between two local ranks: one-way seconds per ``LINK_SIZES`` size, and
    the fitted (latency us, bandwidth GB/s)."""
    import torch.multiprocessing as mp

    for attempt in range(LINK_ATTEMPTS):
        with tempfile.TemporaryDirectory() as folder:
            out = str(Path(folder) / "link.json")
            mp.spawn(_link_worker, args=(_free_port(), out), nprocs=2)
            one_way = json.loads(Path(out).read_text())
        try:
            latency_us, gb_per_s = fit_link(list(LINK_SIZES), one_way)
        except ValueError:
            if attempt == LINK_ATTEMPTS - 1:
                raise
            continue
        return one_way, latency_us, gb_per_s
    raise AssertionError("unreachable")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cluster_takes_latency() -> bool:
    """Whether ``solver.specs.Cluster`` has the ``p2p_latency_us`` field (issue 18)."""
    from solver import Cluster

    return "p2p_latency_us" in {f.name for f in dataclasses.fields(Cluster)}


def link_cluster(pp: int, latency_us: float, gb_per_s: float):
    """The cluster the plans are made for: ``pp`` devices of 8 GiB, the fitted link
    (``p2p_latency_us`` only where ``Cluster`` has it)."""
    from solver import Cluster

    link = {"intra_node_gb_per_s": gb_per_s}
    if cluster_takes_latency():
        link["p2p_latency_us"] = latency_us
    return Cluster(num_gpus=pp, gpu_memory_bytes=8 * 2**30, **link)


# -- the layouts --------------------------------------------------------------------------------


def evaluation_of(graph, layout: Layout, cluster):
    """``solver.evaluate`` of the layout's fixed split: the plan and its predicted time."""
    from solver import ParallelConfig, TrainingConfig, evaluate

    config = ParallelConfig(
        pp=layout.pp,
        tp=1,
        dp=1,
        micro_batch=1,
        num_microbatches=layout.m,
        schedule=layout.schedule,
        virtual_stages=layout.v,
        recompute=layout.recompute,
    )
    training = TrainingConfig(
        global_batch=layout.m,
        micro_batch_sizes=(1,),
        pp=layout.pp,
        tp=1,
        dp=1,
        schedule=layout.schedule,
        virtual_stages=(layout.v,),
        recompute=layout.recompute,
        runtime="torch",
        max_slowdown=None,
        **FP32,
    )
    split = layout.split if isinstance(layout.split, str) else list(layout.split)
    return evaluate(graph, config, split, cluster=cluster, training=training)


def split_label(evaluation) -> str:
    """Layers per (virtual) stage, e.g. "3-5" or "1-3-2-2" (virtual stage order)."""
    from solver.parallel import rank_stages

    config = evaluation.config
    counts: dict[int, int] = {}
    for stage in evaluation.stages:
        own = rank_stages(config.schedule, config.pp, config.virtual_stages, stage.index)
        for j, chunk in zip(own, stage.chunks, strict=False):
            counts[j] = len(chunk)
    return "-".join(str(counts[j]) for j in sorted(counts))


def layout_row(layout: Layout, evaluation, runs: list[tuple]) -> dict:
    """One layout's row from its runs (``bench_clean_timing.run_once``'s tuples: instrumented
    ms, clean step ms, each rank's CPU ms in a clean step, threads)."""
    predicted = evaluation.iteration_ns / 1e6
    steps = [run[1] for run in runs]
    measured = statistics.median(steps)
    return {
        "layout": layout.name,
        "pp": layout.pp,
        "v": layout.v,
        "schedule": (
            "interleaved" if layout.v > 1 and layout.schedule == "1f1b" else layout.schedule
        ),
        "m": layout.m,
        "split": split_label(evaluation),
        "recompute": layout.recompute,
        "even": layout.even,
        "predicted_ms": round(predicted, 1),
        "measured_ms": round(measured, 1),
        "spread_ms": round(max(steps) - min(steps), 1),
        "error_pct": round(error_pct(predicted, measured), 1),
        "busiest_rank_cpu_ms": round(statistics.median(max(run[2]) for run in runs), 1),
    }


def summary(rows: list[dict]) -> dict[str, str]:
    """The headline numbers of a table of rows (as written or read back from the CSV)."""
    errors = [float(r["error_pct"]) for r in rows]
    median, worst = error_stats(errors)
    even = [abs(float(r["error_pct"])) for r in rows if str(r["even"]) == "True"]
    uneven = [abs(float(r["error_pct"])) for r in rows if str(r["even"]) != "True"]
    agree, considered = ranking_agreement(
        [float(r["predicted_ms"]) for r in rows],
        [float(r["measured_ms"]) for r in rows],
        [float(r["spread_ms"]) for r in rows],
    )
    ranking = f"{agree}/{considered}" + (
        f" ({100 * agree / considered:.0f}%)" if considered else ""
    )
    return {
        "error": f"median |error| {median:.1f}%, max {worst:.1f}% ({len(rows)} layouts)",
        "even": (
            f"even {statistics.median(even):.1f}% ({len(even)}), "
            f"uneven {statistics.median(uneven):.1f}% ({len(uneven)})"
            if even and uneven
            else "-"
        ),
        "ranking": ranking,
    }


def _write_plans(folder: Path, graph_path: Path, layouts: list[Layout], documents) -> None:
    """The graph and one plan document per layout (``<layout name>.json``, spaces as ``_``),
    the plans pointing at the copied graph."""
    folder.mkdir(parents=True, exist_ok=True)
    graph_copy = folder / graph_path.name
    graph_copy.write_text(graph_path.read_text())
    for layout, document in zip(layouts, documents, strict=True):
        document = json.loads(json.dumps(document))
        if isinstance(document.get("graph"), dict) and "path" in document["graph"]:
            document["graph"]["path"] = str(graph_copy)
        name = layout.name.replace(" ", "_").replace("+", "-")
        (folder / f"{name}.json").write_text(json.dumps(document, indent=1))


def measure(args, layouts: list[Layout], repeats: int) -> dict:
    """Profile gpt-tiny, fit the link, evaluate every layout and run each ``repeats`` times,
    round robin: the rows, the graph's timing, the link's one-way times and fit."""
    from profiling.export import export_graph
    from solver.graph import load_graph, timing_of
    from solver.report.plan_report import evaluation_to_dict

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "gpt-tiny-6x256.json"
        export_graph(
            "gpt-tiny", dtype="fp32", device="cpu", overrides=OVERRIDES, threads=THREADS
        ).save(path)
        graph = load_graph(path)  # the plans record the file
        one_way, latency_us, gb_per_s = measure_link()
        print(f"link: {latency_us:.1f} us + bytes / {gb_per_s:.2f} GB/s", flush=True)
        evaluations = [
            evaluation_of(graph, lay, link_cluster(lay.pp, latency_us, gb_per_s)) for lay in layouts
        ]
        documents = [evaluation_to_dict(e) for e in evaluations]
        if args.plans:
            _write_plans(Path(args.plans), path, layouts, documents)
        runs: list[list[tuple]] = [[] for _ in layouts]
        for repeat in range(repeats):
            for index, document in enumerate(documents):
                runs[index].append(run_once(document, args.step_iterations))
            print(f"repeat {repeat + 1}/{repeats} done", flush=True)
        rows = [layout_row(*row) for row in zip(layouts, evaluations, runs, strict=True)]
    return {
        "rows": rows,
        "timing": timing_of(graph) or {},
        "one_way": one_way,
        "latency_us": latency_us,
        "gb_per_s": gb_per_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, quick="4 layouts, 2 repeats: a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="runs per layout (default 5)")
    parser.add_argument("--step-iterations", type=int, default=3)
    parser.add_argument(
        "--plans",
        default=None,
        help="also write the graph and each layout's plan JSON here (for profiling.validate)",
    )
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    repeats = args.repeats or (2 if args.quick else 5)
    layouts = [lay for lay in LAYOUTS if not args.quick or lay.name in QUICK]
    measured = measure(args, layouts, repeats)
    rows = measured["rows"]
    harness.write_csv(
        args.out / "bench_time.csv",
        (row | {"command": run.command} for row in rows),
        [*COLUMNS, "command"],
    )
    lines = [
        "# Step time: predicted (the plan's iteration_ms) vs measured (clean real runs)",
        "",
        f"{run.command_text}",
        "",
        f"{harness.node()}: {harness.cores()} CPUs, shared with other jobs; load average (1, 5, "
        f"15 min) {run.loads_before} before, {harness.load_averages()} after; {THREADS} torch "
        f"thread per rank and in the profile; {repeats} repeats x {args.step_iterations} clean "
        f"iterations per layout, round robin; {run.elapsed_s:.0f} s.",
        "",
        *description(measured),
        "",
        *markdown_table(rows, COLUMNS),
        "",
        *conclusion(summary(rows)),
    ]
    harness.write_report(args.out, "bench_time.md", lines)
    return 0


def description(measured: dict) -> list[str]:
    """The model, the profile's timing terms, the fitted link and the columns."""
    timing = measured["timing"]
    per_size = ", ".join(
        f"{size // 1024} KiB {t * 1e6:.0f} us"
        for size, t in zip(LINK_SIZES, measured["one_way"], strict=True)
    )
    given = "`intra_node_gb_per_s` and `p2p_latency_us`"
    if not cluster_takes_latency():
        given = "`intra_node_gb_per_s` (`Cluster` has no `p2p_latency_us` yet)"
    return [
        "gpt-tiny 6 layers x 256 hidden, seq 128, vocab 2048, fp32, dropout 0, micro-batch 1, tp "
        "1, dp 1, torch runtime. Profiled with `--device cpu --threads 1`: "
        f"`optimizer_step_ns_per_param` {timing.get('optimizer_step_ns_per_param', 0):.2f}, "
        f"`microbatch_overhead_ns` {timing.get('microbatch_overhead_ns', 0):.0f}. Link (gloo, "
        f"two local ranks, one-way time per message: {per_size}): latency "
        f"{measured['latency_us']:.1f} us, bandwidth {measured['gb_per_s']:.2f} GB/s, given to "
        f"the cluster as {given}.",
        "",
        "`predicted_ms`: `solver.evaluate(...).iteration_ns` of the fixed split on that cluster; "
        "`measured_ms`: `profiling.run.step_ms` (tracker off, slowest rank, median of the clean "
        "iterations), median over the repeats; `spread_ms`: max - min over the repeats; "
        "`error_pct`: 100 (predicted - measured) / measured; `split`: layers per (virtual) stage "
        "(embedding, 6 blocks, head: 8 layers); `busiest_rank_cpu_ms`: the CPU time "
        "(`time.process_time`) of the busiest rank in a clean step, median: a step far above "
        "it waited, on a peer or for a CPU of this shared machine.",
    ]


def conclusion(stats: dict[str, str]) -> list[str]:
    return [
        f"|error|: {stats['error']}; by split: {stats['even']}. Ranking: the prediction orders "
        f"{stats['ranking']} of the pairs whose measured times differ by more than the sum of "
        "their spreads. A pp 2 run needs both cores of this machine: while other jobs run (load "
        "above 1) its ranks wait for a CPU, and its `measured_ms` rises far above "
        "`busiest_rank_cpu_ms` plus the pipeline's own waits; run it on a quiet machine.",
    ]


def headline_rows(out_dir: str | Path = ROOT / "benchmarks") -> list[dict]:
    """Issue 18 point 4: predicted vs measured step time on CPU, from the last run's
    bench_time.csv (empty without one)."""
    path = Path(out_dir) / "bench_time.csv"
    if not path.exists():
        return []
    rows = harness.read_csv(path)
    if not rows:
        return []
    stats = summary(rows)
    command = rows[0].get("command") or COMMAND
    return [
        {
            "point": "4. step time, predicted vs measured (gpt-tiny 6x256, CPU, pp 1-2, "
            "1F1B/GPipe/interleaved, even and uneven, recompute)",
            "command": command,
            "result": f"{stats['error']}; {stats['even']}; ranking {stats['ranking']}",
        }
    ]


if __name__ == "__main__":
    raise SystemExit(main())
