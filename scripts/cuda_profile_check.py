"""Profiled layer graphs against a real CUDA run (run on a GPU machine; needs torch + the repo).

    python scripts/cuda_profile_check.py --out cuda_profile.json [--device cuda] [--presets ...]

For each case (zoo presets, bf16):
1. run three training steps of a freshly built model (two micro-batches each, torch's foreach Adam:
   bf16 weights, gradients and moments, bytes per parameter 2, 2, 4, and the step's bf16
   temporary) and record ``torch.cuda.max_memory_allocated`` of the third;
2. profile the model in real mode on the device (saved bytes, transients and per-layer times
   measured on the device's own kernels) and in fake mode (meta model, CPU kernels, what a user
   without a GPU gets), and compare their per-layer saved bytes; record what the real-mode
   profile leaves allocated (``left_by_real_profile_bytes``);
3. predict that peak with the planner's cost model (pp = tp = dp = 1) from each graph, and the
   step time from the real graph's per-layer times.
With several presets each runs in a fresh interpreter (``allocated_at_start_bytes`` is then 0): in
one process an earlier case's model stayed allocated and inflated the later cases' peaks by up to
3.4 GiB (what made Llama and T5 look 12-28% under-predicted on 2026-12-04).
``--snapshots DIR`` records the allocator's history over steps 1-3 and the profile (CUDA) into
DIR/CASE.pickle for ``scripts/cuda_peak_tags.py``. ``--device cpu`` is a dry run of the script
(memory is then not measured).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

CASES = {
    "gpt2-small": ({}, 4),
    "gpt3-xl": ({"layers": 8}, 2),
    "llama2-7b": ({"layers": 4, "seq_len": 2048}, 1),
    "t5-base": ({}, 8),
}


def measure_step(
    model, inputs, num_microbatches: int, device, mark: bool = False
) -> tuple[int | None, float]:
    """(peak bytes of step 3, its wall ms) of Adam training with gradient accumulation. ``mark``:
    step 3's start and end are marked in the allocator's recorded history (``_snapshot`` adds a
    "snapshot" event), where ``scripts/cuda_peak_tags.py`` looks for the step's peak."""
    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    peak, wall = None, 0.0
    for step in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if mark and step == 2:
                torch.cuda.memory._snapshot()
        start = time.perf_counter()
        for _ in range(num_microbatches):
            (model(*inputs) / num_microbatches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            if mark and step == 2:
                torch.cuda.memory._snapshot()
        wall = (time.perf_counter() - start) * 1e3
    return peak, wall


def check(name: str, overrides: dict, batch: int, device, snapshots: Path | None = None) -> dict:
    import torch

    import models
    from profiling.trace.profile import profile_module
    from solver import Cluster, ParallelConfig, TrainingConfig, evaluate

    spec = models.get(name, **overrides)
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(0)
    cuda = torch.device(device).type == "cuda"
    allocated_at_start = torch.cuda.memory_allocated() if cuda else None
    snapshot = None if snapshots is None or not cuda else snapshots / f"{name}.pickle"
    if snapshot is not None:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    with torch.device(device):
        model = spec.build()
        inputs = spec.example_inputs(batch, None)
    # The step first, on the fresh model: nothing the profiler leaves behind is in its peak.
    peak, step_ms = measure_step(model, inputs, 2, torch.device(device), snapshot is not None)
    model.zero_grad(set_to_none=True)
    before_profile = torch.cuda.memory_allocated() if cuda else None
    real = profile_module(model, inputs, spec.layers, model_name=name, mode="real")
    left_by_profile = None if not cuda else torch.cuda.memory_allocated() - before_profile
    if snapshot is not None:
        torch.cuda.memory._dump_snapshot(str(snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)
    with torch.device("meta"):
        shapes_only = spec.build()
    with torch.device("cpu"):
        cpu_inputs = spec.example_inputs(batch, None)
    fake = profile_module(shapes_only, cpu_inputs, spec.layers, model_name=name, mode="fake")
    config = ParallelConfig(pp=1, tp=1, dp=1, micro_batch=batch, num_microbatches=2)
    training = TrainingConfig(
        global_batch=2 * batch,
        weight_bytes_per_param=2,
        grad_bytes_per_param=2,
        optimizer_bytes_per_param=4,
        runtime="torch",
        precision="bf16",  # what measure_step runs: bf16 weights, gradients and Adam moments,
        optimizer_impl="foreach",  # torch's default Adam on a GPU (a bf16 temporary per param)
        grad_lifetime="persistent",  # zero_grad(set_to_none=False)
    )
    cluster = Cluster(num_gpus=1, gpu_memory_bytes=2**40)

    def predicted(graph) -> dict:
        result = evaluate(graph, config, [0] * graph.num_layers, cluster=cluster, training=training)
        return {"peak_bytes": result.peak_bytes, "breakdown": result.stages[0].breakdown()}

    per_layer = [
        {
            "layer": a.name,
            "fake_activation_bytes": a.activation_bytes,
            "real_activation_bytes": b.activation_bytes,
            "fake_transient": a.transient_bytes,
            "real_transient": b.transient_bytes,
            "fwd_ms": b.fwd_ms,
            "bwd_ms": b.bwd_ms,
        }
        for a, b in zip(fake.layers, real.layers, strict=True)
    ]
    torch.set_default_dtype(torch.float32)
    return {
        "case": name,
        "overrides": overrides,
        "batch": batch,
        "device": str(device),
        "params": sum(layer.params for layer in real.layers),
        "measured_peak_bytes": peak,
        "allocated_at_start_bytes": allocated_at_start,
        "left_by_real_profile_bytes": left_by_profile,
        "measured_step_ms": step_ms,
        "profiled_step_ms": 2 * batch * sum(x.fwd_ms + x.bwd_ms for x in real.layers),
        "predicted_from_real_graph": predicted(real),
        "predicted_from_fake_graph": predicted(fake),
        "layers": per_layer,
    }


def check_alone(name: str, args) -> dict:
    """``check`` of one preset in a fresh interpreter: nothing an earlier case left allocated (a
    model its profile still references, the allocator's workspaces) is in this case's peak."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "case.json"
        command = [sys.executable, __file__, "--presets", name, "--out", str(out)]
        command += ["--device", args.device]
        if args.snapshots is not None:
            command += ["--snapshots", str(args.snapshots)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["cases"][0]


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, out=None)
    parser.add_argument("--out", type=Path, default=Path("cuda_profile.json"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--presets", nargs="*", default=list(CASES))
    parser.add_argument(
        "--snapshots",
        type=Path,
        help="folder for each case's allocator snapshot of step 3 (CUDA; see cuda_peak_tags.py)",
    )
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)

    import torch

    results = {"torch": torch.__version__, "device": args.device, "cases": []}
    results |= {"command": run.command, "commit": run.commit}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    if args.snapshots is not None:
        args.snapshots.mkdir(parents=True, exist_ok=True)
    for name in args.presets:
        if len(args.presets) > 1:
            row = check_alone(name, args)
        else:
            overrides, batch = CASES.get(name, ({}, 2))
            row = check(name, overrides, batch, torch.device(args.device), args.snapshots)
        results["cases"].append(row)
        args.out.write_text(json.dumps(results, indent=1))
        peak = row["measured_peak_bytes"]
        for source in ("real", "fake"):
            guess = row[f"predicted_from_{source}_graph"]["peak_bytes"]
            error = "" if peak is None else f" ({100 * (guess - peak) / peak:+.1f}%)"
            print(f"{name}: predicted from {source} graph {guess / 2**30:.3f} GiB{error}")
        print(
            f"{name}: measured {'-' if peak is None else f'{peak / 2**30:.3f} GiB'}, step "
            f"{row['measured_step_ms']:.1f} ms vs profiled {row['profiled_step_ms']:.1f} ms",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
