"""Small HF families run for real (``python -m profiling.validate``, torch.distributed.pipelining
on gloo) against the plan's per-rank prediction, with the accuracy targets of issue 28: median
|error| over the ranks 1% or less, every rank within 3%, none under-predicted by more than 1%.

The configs are ``tests/hf_small.py``'s (the same features as the published models: GQA, MoE,
MLA with shared experts and a dense first layer, sliding windows, soft-capping, tied
embeddings); ``scripts/bench_accuracy.py --hf-families`` runs every family and layout.
Families with tied embeddings run at pp 2 too: each stage keeps a copy of the table and the
copies' gradients are all-reduced before the step (``profiling/executors/tied.py``).
"""

from __future__ import annotations

import statistics

import pytest

from profiling.export import main as export_main
from profiling.validate import main as validate_main
from solver.cli.plan import plan_main
from tests.hf_small import PLAN_FLAGS, SEQ, validate_family, write_config

RUNS = [
    ("llama", "pp2"),  # GQA, llama3 rope scaling
    ("llama", "pp2", "full"),  # torch's checkpoint of every layer: inputs and the loss kept
    ("gpt2", "dp2", "full"),
    ("mixtral", "pp2"),  # routed experts
    ("deepseek_v2", "pp2"),  # MLA, shared experts, dense first layer
    ("gpt_neox", "pp2"),  # parallel residual, partial rotary
    ("mixtral", "pp2 dp2"),  # DDP over each stage
    ("qwen2", "dp2"),  # tied, qkv bias
    ("gemma2", "dp2"),  # tied, soft-capping, sliding window
    ("gpt2", "dp2"),  # tied, learned positions
    ("qwen2", "pp2"),  # tied across stages: a copy of the table on each
    ("gpt2", "pp2"),  # tied across stages, learned positions
    # the last stage peaks in a block's recomputation, the logits the pipeline keeps still held
    ("gpt2", "pp2", "full"),
    ("deepseek_v2", "pp2", "full"),
]
"""A representative subset (about 2 minutes on 2 cores): (family, layout[, recompute]), without
recomputation unless a third item says ``full`` (what ``--recompute auto`` picks on these small
models)."""

MEDIAN_PCT, MAX_PCT, UNDER_PCT = 1.0, 3.0, 1.0
"""Issue 28's targets: median |error| over the ranks, largest |error|, largest under-prediction."""


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> dict[tuple[str, ...], list[float]]:
    """Each run's per-rank errors (%), every run once for the module."""
    folder = tmp_path_factory.mktemp("hf-validate")
    return {run: [row["error_pct"] for row in validate_family(folder, *run)] for run in RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=["-".join(run) for run in RUNS])
def test_every_rank_within_3_percent_and_none_under_by_more_than_1(errors, run):
    assert errors[run], "no rank reported"
    assert max(abs(e) for e in errors[run]) <= MAX_PCT, errors[run]
    assert min(errors[run]) >= -UNDER_PCT, errors[run]


@pytest.mark.slow
def test_median_rank_error_is_at_most_1_percent(errors):
    ranks = [abs(e) for run in RUNS for e in errors[run]]
    assert statistics.median(ranks) <= MEDIAN_PCT, errors


@pytest.mark.slow
def test_a_plan_with_expert_parallelism_is_refused_by_the_torch_engine(tmp_path, run_cli):
    """The torch engine runs every expert on every data-parallel rank: a plan with ep 2 would
    measure another model (-30% on the small Mixtral at dp 2), so it is one line, exit 2, before
    any rank starts."""
    model = f"hf:{write_config(tmp_path, 'mixtral')}"
    graph, plan = str(tmp_path / "g.json"), str(tmp_path / "p.json")
    code, _, err = run_cli(export_main, model, "--seq", str(SEQ), "--out", graph, "--no-progress")
    assert code == 0, err
    at = PLAN_FLAGS.index("--ep")
    flags = [*PLAN_FLAGS[:at], "--ep", "2", *PLAN_FLAGS[at + 2 :]]
    code, _, err = run_cli(
        plan_main, graph, "--gpus", "2", "--dp", "2", "--global-batch", "8", *flags,
        "--precision", "fp32", "--json", plan,
    )  # fmt: skip
    assert code == 0, err
    code, out, err = run_cli(validate_main, plan, "--model", model)
    assert code == 2
    assert err == (
        "error: plan config: ep=2: traced models run every expert on every data-parallel rank; "
        "plan with --ep 1\n"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["g.json", "mixtral", "p.json"]
