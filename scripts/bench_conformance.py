"""Conformance table: each published HF architecture of tests/hf_families.py through
profiling.export (default flags), a pinned pp 2 x tp 2 plan and its exports (issue 28).

    python scripts/bench_conformance.py             # every family: benchmarks/conformance.md
    python scripts/bench_conformance.py --only qwen # the families whose name holds "qwen"

The checks are tests/hf_conformance.py's (tests/test_hf_conformance.py asserts them): `params`
the graph's parameters equal those of the model transformers builds from the config (meta
device), `tied` the graph marks a tied head (tied_params) exactly when transformers' output
layer shares the input embedding's weight, `export` exit 0 with default flags, `plan` the pinned
plan (pp 2 x tp 1 after the one-line refusal where Megatron-core refuses tp 2 for the heads),
`megatron` --num-layers and the blocks per stage are the family's transformer blocks and --bf16
is there, `torchtitan` only modules of torchtitan's model named (or none, where torchtitan has
no such model), `deepspeed` every graph layer is a module of the model.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import harness

from tests.hf_conformance import CHECKS, check_family
from tests.hf_families import FAMILIES, REFUSED

COLUMNS = ("family", "hub_name", "transformers_params", *CHECKS, "config", "seconds")


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--only", default="", help="the families whose name holds this text")
    args = parser.parse_args(argv)
    run = harness.Run.start(__file__, argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in FAMILIES:
            if args.only not in name:
                continue
            started = time.perf_counter()
            row = check_family(name, Path(folder))
            row["seconds"] = round(time.perf_counter() - started, 1)
            if (
                name in REFUSED
                and row["export"].startswith("exit 2")
                and REFUSED[name] in row["export"]
            ):
                row["export"] = "refused as documented: " + row["export"]
            rows.append(row)
            print(name, {check: row[check] for check in CHECKS}, flush=True)
    passing = sum(all(str(row[c]).startswith("ok") for c in CHECKS) for row in rows)
    refused = sum(str(row["export"]).startswith("refused as documented") for row in rows)
    lines = [
        "# Conformance: published HF architectures, as a new user runs them",
        "",
        f"Command: {run.command_text}  ",
        f"Machine: {harness.machine()}, {harness.today()}; {run.elapsed_s:.0f} s",
        "",
        (__doc__ or "").split("\n\n")[2].replace("\n", " "),
        "",
        f"{passing} of {len(rows)} families pass every check; {refused} refused with the "
        "documented one line (tests/hf_families.py REFUSED).",
        "",
    ]
    lines += harness.markdown_table(rows, list(COLUMNS))
    harness.write_report(args.out, "conformance.md", lines)
    return 0 if passing + refused == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
