"""Profiling benchmark: wall time and peak RSS of fake-tensor profiles of big presets (no GPU).

    python scripts/bench_profile.py [--out benchmarks]

Every preset (and bundled hf: config) is profiled by ``python -m profiling.export PRESET`` in a
fresh process (so its peak resident memory is its own), then planned with ``python -m
solver.plan``. Targets: GPT-3 175B and Llama-2 70B shapes under 60 s and 4 GiB each on
2 cores.
Writes benchmarks/bench_profile.md and .csv.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import harness
from harness import markdown_table

TARGETS = ("gpt3-175b", "llama2-70b")
"""The presets with a target: under 60 s and 4 GiB each."""


def cases() -> list[tuple[str, list[str]]]:
    """Every zoo preset but the tiny ones (tests cover those), plus the bundled hf: configs."""
    import models
    from profiling.hf.models import bundled_configs

    zoo = [(name, []) for name in models.presets() if not name.endswith("-tiny")]
    return zoo + [(f"hf:{name}", []) for name in bundled_configs()]


def cluster_for(params: int) -> tuple[int, int]:
    """(GPUs, global batch) for planning: enough 80 GiB GPUs for 4x the 16 B/param states."""
    gpus = 8
    while gpus * 80 * 2**30 < 4 * 16 * params:
        gpus *= 2
    return gpus, 2 * gpus


def profile_row(preset: str, extra: list[str], scratch: Path) -> dict:
    """Profile ``preset`` in a fresh process (wall time, its own peak RSS), then plan it."""
    graph_path = scratch / f"{preset.replace(':', '_')}.json"
    export = [sys.executable, "-m", "profiling.export", preset, *extra, "--no-progress"]
    profiled = harness.run_process([*export, "--out", str(graph_path)])
    if profiled.returncode != 0:
        raise SystemExit(f"{preset}: export failed: {profiled.stderr.strip()}")
    graph = json.loads(graph_path.read_text())
    params = sum(layer["params"] for layer in graph["layers"])
    gpus, batch = cluster_for(params)
    plan_path = graph_path.with_suffix(".plan.json")
    planned = harness.run_process(
        [sys.executable, "-m", "solver.plan", str(graph_path), "--gpus", str(gpus)]
        + ["--global-batch", str(batch), "--json", str(plan_path), "--quiet"]
    )
    plan = json.loads(plan_path.read_text()) if planned.returncode == 0 else None
    return {
        "preset": preset + (" (target)" if preset in TARGETS else ""),
        "layers": len(graph["layers"]),
        "params_billions": params / 1e9,
        "seq": graph["meta"]["seq_len"],
        "profile_wall_s": round(profiled.wall_s, 2),
        "profile_peak_rss_gib": round(profiled.peak_rss_bytes / 2**30, 3),
        "plan_gpus": gpus,
        "plan_wall_s": round(planned.wall_s, 2),
        "plan": (
            f"exit {planned.returncode}: {planned.stderr.strip()[:80]}"
            if plan is None
            else f"pp{plan['config']['pp']} tp{plan['config']['tp']} "
            f"dp{plan['config']['dp']}, peak {plan['peak_bytes'] / 2**30:.1f} GiB"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    run = harness.Run.start(__file__, argv)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for preset, extra in cases():
            rows.append(profile_row(preset, extra, Path(scratch)))
            print(rows[-1], flush=True)
    columns = list(rows[0])
    harness.write_csv(args.out / "bench_profile.csv", rows, columns)
    lines = [
        "# Profiling benchmark",
        "",
        f"Command: {run.command_text}  ",
        f"Machine: {harness.architecture()}, {harness.python_version()}, run "
        f"{harness.today()}; fake tensors (--device meta), batch 1, bf16, no GPU. "
        "Peak RSS is the export process's own (os.wait4 ru_maxrss). Plans: default options, "
        "80 GiB GPUs; plan_wall_s includes the solver's start-up.",
        "",
        *markdown_table(rows, columns),
        "",
    ]
    harness.write_report(args.out, "bench_profile.md", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
