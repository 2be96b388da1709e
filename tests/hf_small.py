"""Small versions of HF families with the features of the published models (GQA, tied
embeddings, qkv bias, sliding windows shorter than the sequence, MoE with shared experts and a
dense first layer, MLA, soft-capping, learned positions, parallel residuals, fused projections,
QK norms): 2-4 layers, hidden 64, a 512-row vocabulary, dropout 0, profiled and run at
``SEQ`` tokens as ``hf:<folder>`` (:func:`write_config`).

What runs them for real: ``tests/test_hf_validate.py`` (a subset) and
``scripts/bench_accuracy.py --hf-families`` (all of them, on torch.distributed.pipelining and,
for the families megatron-core's GPTModel expresses, on megatron-core).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEQ = 64
"""Tokens per sample: longer than every small config's sliding window (32)."""

VOCAB = 512
WINDOW = 32
"""Sliding window of the windowed families (half of SEQ: the window changes the attention)."""

_LLAMA_LIKE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

SMALL_HF: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **_LLAMA_LIKE,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2": {  # tied embeddings, q/k/v bias
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        **_LLAMA_LIKE,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
    },
    "mistral": {  # sliding window shorter than the sequence
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        **_LLAMA_LIKE,
        "sliding_window": WINDOW,
    },
    "mixtral": {  # routed experts, top 2
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        **_LLAMA_LIKE,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.0,
        "sliding_window": None,
    },
    "deepseek_v2": {  # MLA, shared experts, a dense first layer
        "model_type": "deepseek_v2",
        "architectures": ["DeepseekV2ForCausalLM"],
        **_LLAMA_LIKE,
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "routed_scaling_factor": 1.0,
    },
    "gemma2": {  # soft-capping, sliding window on every other layer, tied, head_dim set
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        **_LLAMA_LIKE,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 16,
        "tie_word_embeddings": True,
    },
    "gpt2": {  # tied, learned positions
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": 4,
        "n_embd": 64,
        "n_head": 4,
        "n_positions": 256,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    "gpt_neox": {  # parallel residual, partial rotary, untied
        "model_type": "gpt_neox",
        "architectures": ["GPTNeoXForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "rotary_pct": 0.25,
        "use_parallel_residual": True,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
    },
    "phi3": {  # fused qkv and gate_up projections
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        **_LLAMA_LIKE,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attention_dropout": 0.0,
        "sliding_window": None,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "olmo2": {  # QK norms, post-norms
        "model_type": "olmo2",
        "architectures": ["Olmo2ForCausalLM"],
        **_LLAMA_LIKE,
        "pad_token_id": 1,
        "bos_token_id": None,
        "eos_token_id": 2,
    },
    "starcoder2": {  # biases, GELU MLP, sliding window, tied
        "model_type": "starcoder2",
        "architectures": ["Starcoder2ForCausalLM"],
        **_LLAMA_LIKE,
        "sliding_window": WINDOW,
        "use_bias": True,
        "tie_word_embeddings": True,
        "residual_dropout": 0.0,
        "embedding_dropout": 0.0,
        "attention_dropout": 0.0,
    },
}
"""Small configs by family: the config.json a user's folder would hold."""

TIED = tuple(name for name, raw in SMALL_HF.items() if raw.get("tie_word_embeddings", True))
"""The families whose LM head is the token embedding."""


def write_config(folder: Path, family: str, **changes: Any) -> Path:
    """``folder/<family>/config.json`` with ``SMALL_HF[family]`` (and ``changes``); the
    folder, given to profiling as ``hf:<folder>``."""
    target = Path(folder) / family
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({**SMALL_HF[family], **changes}, indent=1))
    return target


LAYOUTS: dict[str, list[str]] = {
    "pp2": ["--gpus", "2", "--pp", "2", "--global-batch", "8"],
    "dp2": ["--gpus", "2", "--pp", "1", "--dp", "2", "--global-batch", "8"],
    "pp2 dp2": ["--gpus", "4", "--pp", "2", "--dp", "2", "--global-batch", "16"],
}
"""``solver.plan`` flags of each layout run: micro-batches of 1 (m = 8 per replica), 1F1B,
ZeRO 0, no recomputation and no expert parallelism (what the torch engine runs on traced
models), fp32 Adam."""

PLAN_FLAGS = ["--micro-batch", "1", "--zero", "0", "--recompute", "none", "--ep", "1"]
PLAN_FLAGS += ["--runtime", "torch"]


def validate_family(
    folder: Path, family: str, layout: str, recompute: str = "none"
) -> list[dict[str, Any]]:
    """Export ``family`` (``SEQ`` tokens, fp32, timed on 1 thread), plan it for ``layout`` (with
    ``--recompute recompute``) and run the plan with ``python -m profiling.validate --json``: the
    ranks' rows (``error_pct``: the plan's error against the measured peak, negative =
    under-predicted). Raises AssertionError naming the step whose CLI did not exit 0.

    The family's graph is exported once per ``folder`` (``folder/<family>.graph.json``) and
    planned for each layout, as a user plans one export for several layouts: the export has no
    layout or recompute flag, so the runs of a family shared nothing else."""
    from profiling.export import main as export_main
    from profiling.validate import main as validate_main
    from solver.cli.plan import plan_main

    model = f"hf:{write_config(folder, family)}"
    stem = Path(folder) / f"{family}-{layout.replace(' ', '-')}-{recompute}"
    graph = str(Path(folder) / f"{family}.graph.json")
    plan, report = (f"{stem}.{kind}.json" for kind in ("plan", "run"))
    flags = [*PLAN_FLAGS]
    flags[flags.index("--recompute") + 1] = recompute
    export = [model, "--seq", str(SEQ), "--dtype", "fp32", "--threads", "1"]
    steps = (
        (None if Path(graph).exists() else export_main, export),
        (plan_main, [graph, *LAYOUTS[layout], *flags, "--precision", "fp32"]),
        (validate_main, [plan, "--model", model, "--step-iterations", "0", "--tolerance", "100"]),
    )
    return _run_steps(steps, graph, plan, report)


MEGATRON_CHANGES: dict[str, dict[str, Any]] = {
    "llama": {  # Llama 3's rope scaling as megatron-core fixes it (original context 8192)
        "max_position_embeddings": 16384,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}
"""Config changes of the families run on megatron-core (what its GPTModel expresses)."""

MEGATRON_RUNS: dict[str, tuple[str, list[str], dict[str, Any]]] = {
    "llama pp2": ("llama", ["--gpus", "2", "--pp", "2"], {}),
    "qwen2 tied pp2": ("qwen2", ["--gpus", "2", "--pp", "2"], {}),
    "llama pp2 tp2 sp vocab1000": (
        "llama",
        ["--gpus", "4", "--pp", "2", "--tp", "2", "--sequence-parallel", "on"],
        {"vocab_size": 1000},
    ),
    "mixtral pp2": ("mixtral", ["--gpus", "2", "--pp", "2", "--moe-capacity-factor", "1.0"], {}),
}
"""Megatron runs: (family, ``solver.plan`` layout flags, config changes), micro-batches of 1,
global batch 8, ZeRO 0, fp32 Adam, ``--runtime megatron``."""


MEGATRON_EXPORT = ["--seq", str(SEQ), "--dtype", "fp32", "--threads", "1"]
MEGATRON_EXPORT += ["--implementation", "megatron"]
"""``profiling.export`` flags of the megatron runs: the layers megatron-core runs."""


def validate_megatron(folder: Path, run: str) -> list[dict[str, Any]]:
    """Export (``--implementation megatron``), plan (``--runtime megatron``) and run
    ``MEGATRON_RUNS[run]`` with ``python -m
    profiling.validate --engine megatron --json``: the ranks' rows (``error_pct``)."""
    from profiling.export import main as export_main
    from profiling.validate import main as validate_main
    from solver.cli.plan import plan_main

    family, layout, changes = MEGATRON_RUNS[run]
    stem = Path(folder) / run.replace(" ", "-")
    model = f"hf:{write_config(stem, family, **MEGATRON_CHANGES.get(family, {}), **changes)}"
    graph, plan, report = (f"{stem}.{kind}.json" for kind in ("graph", "plan", "run"))
    flags = ["--global-batch", "8", "--micro-batch", "1", "--zero", "0", "--ep", "1"]
    flags += ["--recompute", "none"]  # what the accuracy targets were measured on
    steps = (
        (export_main, [model, *MEGATRON_EXPORT]),
        (plan_main, [graph, *layout, *flags, "--runtime", "megatron", "--precision", "fp32"]),
        (
            validate_main,
            [plan, "--model", model, "--engine", "megatron", "--step-iterations", "0"]
            + ["--tolerance", "100"],
        ),
    )
    return _run_steps(steps, graph, plan, report)


def _run_steps(steps, graph: str, plan: str, report: str) -> list[dict]:
    """Export, plan and validate (each CLI's main, quiet; exit 0 asserted) writing ``graph``,
    ``plan`` and ``report``; the per-rank reports. A step whose main is None is skipped (a graph
    already exported)."""
    import contextlib
    import io

    outputs = (["--out", graph, "--no-progress"], ["--json", plan], ["--json", report])
    for (main, argv), output in zip(steps, outputs, strict=True):
        if main is None:
            continue
        quiet = io.StringIO()
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            code = main([*argv, *output])
        assert code == 0, f"{main.__module__} {' '.join(argv)}: exit {code}: {quiet.getvalue()}"
    return json.loads(Path(report).read_text())["ranks"]
