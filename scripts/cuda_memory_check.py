"""Predicted vs measured peak memory of a GPT training step on one CUDA GPU (first calibration).

Two steps, so that the GPU machine needs nothing but torch:

    python scripts/cuda_memory_check.py measure --out measured.json     # on a CUDA machine
    python scripts/cuda_memory_check.py compare measured.json           # here: cost model vs it

``measure`` builds, in plain torch, the GPT that ``scripts/make_examples.py`` describes in closed
form (LayerNorm, biased linears, explicit softmax attention with dropout, GeLU MLP, untied LM head,
fp32 cross-entropy), bf16 weights, torch Adam (its moments follow the bf16 parameter dtype: 2 + 2
bytes per parameter), and runs training steps of m micro-batches (gradient accumulation, so
gradients are alive while the second micro-batch runs, as the cost model assumes). The peak of
step 3 (after warm-up; ``torch.cuda.max_memory_allocated`` reset before it) is recorded.

``compare`` evaluates the same shapes with the planner's cost model (pp = tp = dp = 1,
bytes per parameter 2, 2, 4) and prints predicted, measured and the error, per configuration.
This is a single-GPU check of the per-layer figures and the state/activation/transient terms;
pipeline runs belong to the executor (``profiling.run``, checked by scripts/validate_cuda.py).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import harness

# (name, layers, hidden, heads, seq, vocab, micro_batch, num_microbatches)
CASES = [
    ("gpt-h1024-L8-s1024-b4", 8, 1024, 16, 1024, 50257, 4, 2),
    ("gpt-h2048-L4-s2048-b2", 4, 2048, 16, 2048, 50257, 2, 2),
    ("gpt-h4096-L4-s2048-b1", 4, 4096, 32, 2048, 50257, 1, 2),
    ("gpt-h1024-L16-s512-b8", 16, 1024, 16, 512, 50257, 8, 2),
]


def build_model(layers: int, hidden: int, heads: int, seq: int, vocab: int, dropout: float):
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
            q, k, v = (t.view(b, s, heads, h // heads).transpose(1, 2) for t in (q, k, v))
            scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(h // heads))
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            probs = F.dropout(scores.masked_fill(causal, float("-inf")).softmax(-1), dropout)
            attn = (probs @ v).transpose(1, 2).reshape(b, s, h)
            x = x + F.dropout(self.proj(attn), dropout)
            return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), dropout)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

        def forward(self, ids, targets):
            x = F.dropout(self.tok(ids) + self.pos.weight[: ids.shape[1]], dropout)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))

    return GPT()


def measure(out: Path, dropout: float, run: harness.Run, snapshots: Path | None = None) -> int:
    """Measure every case; with ``snapshots``, each case's allocator history (its step 3 marked,
    as ``cuda_profile_check.py`` does) goes to SNAPSHOTS/NAME.pickle for ``cuda_peak_tags.py``."""
    import torch

    device = torch.device("cuda")
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "cases": []}
    results |= {"command": run.command, "commit": run.commit}
    for name, layers, hidden, heads, seq, vocab, micro_batch, num_micro in CASES:
        torch.manual_seed(0)
        if snapshots is not None:
            snapshots.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        model = build_model(layers, hidden, heads, seq, vocab, dropout).to(device, torch.bfloat16)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        params = sum(p.numel() for p in model.parameters())
        peaks, step_ms = [], []
        for step in range(3):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if snapshots is not None and step == 2:
                torch.cuda.memory._snapshot()  # marks step 3's start in the history
            start = time.perf_counter()
            for _ in range(num_micro):
                ids = torch.randint(vocab, (micro_batch, seq), device=device)
                loss = model(ids, torch.randint(vocab, (micro_batch, seq), device=device))
                (loss / num_micro).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - start) * 1e3)
            peaks.append(torch.cuda.max_memory_allocated())
            if snapshots is not None and step == 2:
                torch.cuda.memory._snapshot()  # and its end
        if snapshots is not None:
            torch.cuda.memory._dump_snapshot(str(snapshots / f"{name}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        results["cases"].append(
            {
                "name": name,
                "layers": layers,
                "hidden": hidden,
                "heads": heads,
                "seq": seq,
                "vocab": vocab,
                "micro_batch": micro_batch,
                "num_microbatches": num_micro,
                "params": params,
                "dropout": dropout,
                "peak_bytes_per_step": peaks,
                "step_ms": step_ms,
                "allocated_after_bytes": torch.cuda.memory_allocated(),
            }
        )
        print(
            f"{name}: params {params:,} peak {peaks[-1] / 2**30:.3f} GiB step {step_ms[-1]:.1f} ms",
            flush=True,
        )
        del model, optimizer
        torch.cuda.empty_cache()
    out.write_text(json.dumps(results, indent=1))
    return 0


def compare(measured_path: Path) -> int:
    from make_examples import gpt

    from solver import Cluster, ParallelConfig, TrainingConfig, evaluate

    measured = json.loads(measured_path.read_text())
    print(f"measured on {measured['gpu']} with torch {measured['torch']}")
    print(
        f"{'case':26s} {'params':>12s} {'predicted GiB':>14s} {'measured GiB':>13s} "
        f"{'error %':>8s}  breakdown (GiB)"
    )
    for case in measured["cases"]:
        graph = gpt(
            case["name"],
            layers=case["layers"],
            s=case["seq"],
            h=case["hidden"],
            a=case["heads"],
            vocab=case["vocab"],
        )
        config = ParallelConfig(
            pp=1,
            tp=1,
            dp=1,
            micro_batch=case["micro_batch"],
            num_microbatches=case["num_microbatches"],
        )
        training = TrainingConfig(
            global_batch=config.global_batch,
            weight_bytes_per_param=2,
            grad_bytes_per_param=2,
            optimizer_bytes_per_param=4,
            runtime="torch",  # what measure runs: plain torch, bf16 weights, gradients and moments,
            precision="bf16",
            optimizer_impl="foreach",  # torch's default Adam on a GPU (a bf16 temporary per param)
            grad_lifetime="persistent",  # zero_grad(set_to_none=False)
        )
        result = evaluate(
            graph, config, [0] * graph.num_layers, cluster=Cluster(num_gpus=1), training=training
        )
        predicted, peak = result.peak_bytes, case["peak_bytes_per_step"][-1]
        parts = ", ".join(
            f"{k} {v / 2**30:.2f}" for k, v in result.stages[0].breakdown().items() if v
        )
        print(
            f"{case['name']:26s} {case['params']:12,d} {predicted / 2**30:14.3f} "
            f"{peak / 2**30:13.3f} {100 * (predicted - peak) / peak:+8.1f}  {parts}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, out=None)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("measure", help="run on a CUDA GPU (needs only torch)")
    run.add_argument("--out", type=Path, default=Path("measured.json"))
    run.add_argument("--dropout", type=float, default=0.1)
    run.add_argument("--snapshots", type=Path, help="folder for each case's allocator history")
    check = sub.add_parser("compare", help="cost-model prediction vs a measured.json")
    check.add_argument("measured", type=Path)
    args = parser.parse_args(argv)
    if args.command == "measure":
        return measure(args.out, args.dropout, harness.Run.start(__file__, argv), args.snapshots)
    return compare(args.measured)


if __name__ == "__main__":
    raise SystemExit(main())
