"""Predicted vs ``torch.cuda.max_memory_allocated`` for plans run by the executor on CUDA.

    python scripts/validate_cuda.py [--out DIR] [--model gpt2-small] [--device cuda|cpu]

(``scripts/validate_cuda.sh`` wraps it.) Profiles a small GPT preset in fp32 (what
``profiling.run`` trains: fp32 weights and gradients, Adam's two fp32 moments), plans it for the
torch runtime and runs every layout the machine can hold with ``profiling.run.run_plan`` (NCCL,
one GPU per rank): on one GPU the single-GPU layouts (gradient accumulation over 1 and 4
micro-batches, full recomputation); with 2 GPUs also 2-stage pipelines (1F1B and GPipe); with 4
also pipeline x data and pipeline x tensor parallelism. Per rank it records the plan's predicted
peak, the executor's exact live-tensor peak and ``max_memory_allocated`` of the last iteration,
and writes ``validate_cuda.json`` and ``validate_cuda.md`` into ``--out``. ``--device cpu`` runs
the same layouts on gloo (a dry run of the script; no CUDA figure).

Takes about 2-3 minutes on one H200 (process start-up and CUDA initialisation dominate).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tables import markdown_table  # noqa: E402  (scripts/ is on sys.path when run as a script)

from profiling.calibrate import SMALL_GPT, Layout  # noqa: E402

SEQ = 512
"""Sequence length of the CUDA runs (the preset's own would make gpt2-small's logits dominate)."""
LAYOUTS = [  # (layout, GPUs it needs)
    (Layout("1 GPU m1 b4", 1, {"pp": 1}, 4, 4, "1f1b"), 1),
    (Layout("1 GPU m4 b2", 1, {"pp": 1}, 8, 2, "1f1b"), 1),
    (Layout("1 GPU recompute m4 b2", 1, {"pp": 1}, 8, 2, "1f1b", 0, "full"), 1),
    (Layout("pp2 1f1b m4 b2", 2, {"pp": 2}, 8, 2, "1f1b"), 2),
    (Layout("pp2 gpipe m4 b2", 2, {"pp": 2}, 8, 2, "gpipe"), 2),
    (Layout("dp2 pp2 1f1b m4 b2", 4, {"pp": 2, "dp": 2}, 16, 2, "1f1b"), 4),
    (Layout("pp2 tp2 1f1b m4 b2", 4, {"pp": 2, "tp": 2}, 8, 2, "1f1b"), 4),
]


def pct(predicted: int, measured: int | None) -> float | None:
    return None if not measured else round(100.0 * (predicted - measured) / measured, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "validate_cuda")
    parser.add_argument("--model", default="gpt2-small", help="zoo preset (default gpt2-small)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()

    import torch

    from profiling.export import export_graph
    from profiling.run import run_plan
    from solver import Cluster, plan
    from solver.report.plan_report import plan_to_dict

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("validate_cuda: no CUDA device (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if cuda else 4
    overrides = {"dropout": 0.0, "seq_len": SEQ} if cuda else dict(SMALL_GPT)
    model = args.model if cuda else "gpt-tiny"
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    graph = export_graph(model, dtype="fp32", overrides=overrides)
    rows = []
    for layout, needs in LAYOUTS:
        if needs > gpus:
            print(f"skip {layout.label}: needs {needs} GPUs, {gpus} here", flush=True)
            continue
        chosen = plan(graph, Cluster(num_gpus=needs, gpus_per_node=needs), layout.training())
        split = "/".join(str(len(stage.layers)) for stage in chosen.stages)
        print(f"running {layout.label} (split {split})", flush=True)
        reports = run_plan(
            model,
            plan_to_dict(chosen),
            iterations=3,
            overrides=overrides,
            timeout_s=240,
            device=args.device,
        )
        for report in reports:
            predicted = report.predicted_peak_bytes
            rows.append(
                {
                    "layout": layout.label,
                    "split": split,
                    "rank": report.rank,
                    "stage": report.stage,
                    "predicted_mib": round(predicted / 2**20, 2),
                    "tracked_mib": round(report.measured_peak_bytes / 2**20, 2),
                    "cuda_max_allocated_mib": (
                        None
                        if report.cuda_max_allocated_bytes is None
                        else round(report.cuda_max_allocated_bytes / 2**20, 2)
                    ),
                    "error_vs_tracked_pct": pct(predicted, report.measured_peak_bytes),
                    "error_vs_cuda_pct": pct(predicted, report.cuda_max_allocated_bytes),
                }
            )
            print(rows[-1], flush=True)
    wall = time.perf_counter() - started
    key = "error_vs_cuda_pct" if cuda else "error_vs_tracked_pct"
    errors = [abs(row[key]) for row in rows if row[key] is not None]
    summary = (
        f"{len(rows)} ranks: median |error| {statistics.median(errors):.1f}%, max "
        f"{max(errors):.1f}% ({key}); {wall:.0f} s"
        if errors
        else "no ranks ran"
    )
    device_name = torch.cuda.get_device_name(0) if cuda else platform.machine()
    document = {
        "command": "scripts/validate_cuda.sh " + " ".join(sys.argv[1:]),
        "device": device_name,
        "gpus": gpus,
        "torch": torch.__version__,
        "model": model,
        "overrides": overrides,
        "date": time.strftime("%Y-%m-%d"),
        "summary": summary,
        "rows": rows,
    }
    (args.out / "validate_cuda.json").write_text(json.dumps(document, indent=1) + "\n")
    lines = [
        f"# Predicted vs measured peak on {device_name} ({gpus} GPU(s), torch {torch.__version__})",
        "",
        f"Command: `{document['command']}`; model {model} {overrides}, fp32 + Adam, "
        "plans for `--runtime torch`. Negative error = the plan under-predicts.",
        "",
        summary,
        "",
        *(markdown_table(rows, list(rows[0])) if rows else []),
        "",
    ]
    (args.out / "validate_cuda.md").write_text("\n".join(lines))
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
