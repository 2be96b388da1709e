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

import json
import statistics
import sys

import harness
from harness import ROOT, markdown_table

from profiling.calibrate import SMALL_GPT, Layout

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


def rank_row(layout: Layout, split: str, report) -> dict:
    """One rank of a run: the plan's peak against the tracker's and CUDA's (MiB, error %)."""
    predicted = report.predicted_peak_bytes
    cuda_bytes = report.cuda_max_allocated_bytes
    return {
        "layout": layout.label,
        "split": split,
        "rank": report.rank,
        "stage": report.stage,
        "predicted_mib": round(predicted / 2**20, 2),
        "tracked_mib": round(report.measured_peak_bytes / 2**20, 2),
        "cuda_max_allocated_mib": None if cuda_bytes is None else round(cuda_bytes / 2**20, 2),
        "error_vs_tracked_pct": pct(predicted, report.measured_peak_bytes),
        "error_vs_cuda_pct": pct(predicted, cuda_bytes),
    }


def run_layouts(graph, model: str, overrides: dict, gpus: int, device: str) -> list[dict]:
    """Plan and run every layout the ``gpus`` can hold; one row per rank."""
    from profiling.run import run_plan
    from solver import Cluster, plan
    from solver.report.plan_report import plan_to_dict

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
            device=device,
        )
        for report in reports:
            rows.append(rank_row(layout, split, report))
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, out=ROOT / "out" / "validate_cuda")
    parser.add_argument("--model", default="gpt2-small", help="zoo preset (default gpt2-small)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)

    import torch

    from profiling.export import export_graph

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("validate_cuda: no CUDA device (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if cuda else 4
    overrides = {"dropout": 0.0, "seq_len": SEQ} if cuda else dict(SMALL_GPT)
    model = args.model if cuda else "gpt-tiny"
    graph = export_graph(model, dtype="fp32", overrides=overrides)
    rows = run_layouts(graph, model, overrides, gpus, args.device)
    key = "error_vs_cuda_pct" if cuda else "error_vs_tracked_pct"
    errors = [abs(row[key]) for row in rows if row[key] is not None]
    summary = (
        f"{len(rows)} ranks: median |error| {statistics.median(errors):.1f}%, max "
        f"{max(errors):.1f}% ({key}); {run.elapsed_s:.0f} s"
        if errors
        else "no ranks ran"
    )
    device_name = torch.cuda.get_device_name(0) if cuda else harness.architecture()
    document = {
        "command": "scripts/validate_cuda.sh " + " ".join(run.argv),
        "commit": run.commit,
        "device": device_name,
        "gpus": gpus,
        "torch": torch.__version__,
        "model": model,
        "overrides": overrides,
        "date": harness.today(),
        "summary": summary,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "validate_cuda.json").write_text(json.dumps(document, indent=1) + "\n")
    lines = [
        f"# Predicted vs measured peak on {device_name} ({gpus} GPU(s), torch {torch.__version__})",
        "",
        f"Command: `{document['command']}` (commit {run.commit}); model {model} {overrides}, "
        "fp32 + Adam, plans for `--runtime torch`. Negative error = the plan under-predicts.",
        "",
        summary,
        "",
        *(markdown_table(rows, list(rows[0])) if rows else []),
        "",
    ]
    harness.write_report(args.out, "validate_cuda.md", lines)
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
