"""bench_accuracy's "new schedules" rows (``--only-schedules``): torch's split-backward schedules
(``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, ``ScheduleInterleavedZeroBubble``) run by the
torch engine on gpt-tiny (bench_accuracy's OVERRIDES, fp32 Adam, micro-batches of 2), each rank's
measured peak against the plan's (``solver.evaluate`` of the given split, ``--runtime torch``)."""

from __future__ import annotations

from harness import markdown_table

SCHEDULE_LAYOUTS = [
    # (schedule, pp, virtual stages, micro-batches, layers per virtual stage in pipeline order)
    ("zbv", 2, 2, 4, [2, 2, 2, 2]),
    ("zbv", 2, 2, 8, [2, 2, 2, 2]),
    ("zbv", 2, 2, 4, [3, 1, 1, 3]),
    ("zbv", 3, 2, 6, [2, 1, 1, 1, 1, 2]),
    ("zbv", 4, 2, 8, [1] * 8),
    ("dualpipev", 2, 2, 4, [2, 2, 2, 2]),
    ("dualpipev", 2, 2, 8, [2, 2, 2, 2]),
    ("dualpipev", 3, 2, 6, [2, 1, 1, 1, 1, 2]),
    ("interleaved-zb", 2, 2, 4, [2, 2, 2, 2]),
    ("interleaved-zb", 2, 1, 4, [4, 4]),
    ("interleaved-zb", 4, 1, 8, [2, 2, 2, 2]),
]
"""The new-schedule layouts: gpt-tiny's 8 layers (embed, 6 blocks, head)."""


def schedule_rows(progress, overrides: dict) -> list[dict]:
    """Evaluate and run every layout; one row per rank with the analytic error."""
    from profiling.export import export_graph
    from profiling.run import run_plan
    from solver import ParallelConfig, evaluate
    from solver.report.plan_report import evaluation_to_dict
    from solver.specs import TrainingConfig

    graph = export_graph("gpt-tiny", dtype="fp32", overrides=overrides)
    rows = []
    for schedule, pp, v, m, split in SCHEDULE_LAYOUTS:
        training = TrainingConfig(
            global_batch=2 * m,
            micro_batch_sizes=(2,),
            pp=pp,
            tp=1,
            dp=1,
            schedule=schedule,
            virtual_stages=(v,),
            runtime="torch",
            max_slowdown=None,
            precision="fp32",
        )
        config = ParallelConfig(
            pp=pp,
            tp=1,
            dp=1,
            micro_batch=2,
            num_microbatches=m,
            schedule=schedule,
            virtual_stages=v,
        )
        document = evaluation_to_dict(evaluate(graph, config, split, training=training))
        label = f"{schedule} pp{pp}" + (f" v{v}" if v > 1 else "") + f" m{m}"
        split_text = "/".join(str(count) for count in split)
        progress(f"{label} ({split_text})")
        for report in run_plan("gpt-tiny", document, iterations=2, overrides=overrides):
            rows.append(
                {
                    "layout": label,
                    "split": split_text,
                    "rank": report.rank,
                    "measured_kib": round(report.measured_peak_bytes / 1024, 1),
                    "analytic_kib": round(report.predicted_peak_bytes / 1024, 1),
                    "analytic_pct": round(report.error_pct, 2),
                }
            )
    return rows


def schedule_section(rows: list[dict], overrides: dict, spread) -> list[str]:
    errors = [row["analytic_pct"] for row in rows]
    print(f"new schedules: analytic {spread(errors)}, worst {min(errors):+.2f}%")
    return [
        "## New schedules on the torch engine (`--schedule zbv|dualpipev|interleaved-zb`)",
        "",
        f"gpt-tiny {overrides}, fp32 with Adam, micro-batches of 2, the given split "
        "(layers per virtual stage in pipeline order; zbv and dualpipev place rank r's chunks "
        "at virtual stages r and 2p - 1 - r), run with torch 2.13's own schedule classes "
        "(profiling/executors/torch_zoo.py). Targets (issue 31): median |error| <= 1%, "
        "max <= 3%, never under.",
        "",
        f"Over {len(rows)} ranks of {len(SCHEDULE_LAYOUTS)} plans: analytic model "
        f"{spread(errors)}, worst under-prediction {min(errors):+.2f}%, "
        f"{sum(e < 0 for e in errors)} ranks under.",
        "",
        *markdown_table(rows, list(rows[0])),
        "",
    ]
