"""What a new user gets for each published HF architecture (tests/hf_families.py), checked the
way issue 28 asks: the CLIs with default flags, then a pinned pp 2 x tp 2 plan and its exports.
Shared by tests/test_hf_conformance.py (asserts every check) and scripts/bench_conformance.py
(the family x checks table in benchmarks/).

Each check is judged against facts taken from the config and from transformers itself, never
from the project's own output: the parameter count of the model transformers builds on the meta
device, its module names, the transformer blocks the family has, and the engines' divisibility
rules restated here (Megatron-core: attention heads % tp == 0, KV heads a multiple or a divisor
of tp).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

from tests.hf_families import FAMILIES, Family

PINNED = {"pp": 2, "tp": 2}
"""The pinned layout of the export checks (issue 28: "a pinned pp 2 x tp 2 plan")."""
CHECKS = ("params", "tied", "export", "plan", "megatron", "torchtitan", "deepspeed")
"""The table's columns after the family: each "ok", or what went wrong."""
TORCHTITAN_BLOCK = re.compile(r"^layers\.(\d+)$")
TORCHTITAN_OTHER = {"tok_embeddings", "norm", "output", "lm_head"}
"""The module names of torchtitan's decoder models (tok_embeddings, layers.<i>, norm, output
in 0.2 / lm_head in 0.3)."""


def write_config(family: str, folder: Path) -> Path:
    """The family's config.json in ``folder / family``; the folder."""
    path = folder / family
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(FAMILIES[family].config))
    return path


def transformers_model_facts(config_dir: Path) -> tuple[int, set[str], bool]:
    """(parameters, module names, whether the output layer shares the input embedding's weight)
    of the model transformers builds from the config on the meta device (a tied parameter counted
    once, as ``model.parameters()`` gives it)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_dir)
    architecture = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        model = architecture(config)
    count = sum(parameter.numel() for parameter in model.parameters())
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = output is not None and inputs is not None and output.weight is inputs.weight
    return count, {name for name, _ in model.named_modules()}, tied


def expected_tp_refusal(family: Family, tp: int) -> bool:
    """Whether Megatron-core refuses ``tp`` for the family's attention (the default runtime's
    rule): heads % tp != 0, or KV heads neither a multiple nor a divisor of tp."""
    config = family.config.get("text_config") or family.config
    heads = next(config[k] for k in ("num_attention_heads", "n_head", "num_heads") if k in config)
    if config.get("multi_query"):
        kv = 1
    else:
        kv = config.get("num_key_value_heads") or heads
    return heads % tp != 0 or (kv % tp != 0 and tp % kv != 0)


def run_cli(main, argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of a CLI's ``main(argv)`` run in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue()


def check_family(name: str, folder: Path) -> dict[str, Any]:
    """The family's row: every check "ok" or what went wrong, and the figures behind them."""
    from profiling.export import main as export_main
    from solver.cli import plan_main

    family = FAMILIES[name]
    config_dir = write_config(name, folder)
    params, modules, tied = transformers_model_facts(config_dir)
    row: dict[str, Any] = {"family": name, "hub_name": family.hub_name, "params": params}
    row |= {check: "not run" for check in CHECKS}
    graph_path = folder / f"{name}.graph.json"
    code, err = run_cli(
        export_main, [f"hf:{config_dir}", "--out", str(graph_path), "--no-progress"]
    )
    if code != 0:
        row["export"] = f"exit {code}: {err.strip().splitlines()[-1] if err.strip() else ''}"
        return row
    row["export"] = "ok"
    graph = json.loads(graph_path.read_text())
    graph_params = sum(layer["params"] for layer in graph["layers"])
    row["graph_params"] = graph_params
    row["params"] = "ok" if graph_params == params else f"graph {graph_params:,} != {params:,}"
    row["transformers_params"] = params
    marked = [layer["name"] for layer in graph["layers"] if layer.get("tied_params")]
    row["tied"] = (
        "ok" + (f" ({', '.join(marked)})" if marked else "")
        if bool(marked) == tied
        else f"model tied: {tied}, graph marks {marked or 'none'}"
    )
    unknown = [layer["name"] for layer in graph["layers"] if layer["name"] not in modules]
    row["plan"], plan = _pinned_plan(plan_main, family, graph_path, folder / f"{name}.plan.json")
    if plan is None:
        return row
    exports = plan["exports"]
    row["megatron"] = _megatron_check(exports["megatron"], family, graph)
    row["torchtitan"] = _torchtitan_check(exports["torchtitan"], family)
    row["deepspeed"] = (
        "ok" if not unknown else f"layers not modules of the model: {', '.join(unknown[:3])}"
    )
    row["config"] = plan["config"]
    return row


def _pinned_plan(plan_main, family: Family, graph_path: Path, out: Path) -> tuple[str, dict | None]:
    """("ok" or what went wrong, the plan) of pp 2 x tp 2, or of pp 2 x tp 1 when the engines'
    rules refuse tp 2 for the family (which must then be the one-line exit 2 naming the rule)."""
    argv = [str(graph_path), "--gpus", "4", "--pp", "2", "--tp", "2", "--gpu-memory", "4TiB"]
    argv += ["--global-batch", "8", "--json", str(out), "--quiet"]
    code, err = run_cli(plan_main, argv)
    refused = expected_tp_refusal(family, PINNED["tp"])
    if refused:
        lines = err.strip().splitlines()
        if code != 2 or len(lines) != 1 or "divisible by tp" not in lines[0]:
            return f"tp 2 should be refused by the heads rule: exit {code}: {err.strip()}", None
        argv[argv.index("--tp") + 1] = "1"
        argv[argv.index("--gpus") + 1] = "2"
        code, err = run_cli(plan_main, argv)
    if code != 0:
        return f"exit {code}: {err.strip()}", None
    verdict = "ok (tp 2 refused: heads rule; pp 2 x tp 1)" if refused else "ok"
    return verdict, json.loads(out.read_text())


def _megatron_check(section: dict, family: Family, graph: dict) -> str:
    """--num-layers and the blocks per stage are the family's transformer blocks."""
    causal = family.config["architectures"][0].endswith(("ForCausalLM", "LMHeadModel"))
    if "args" not in section:
        reason = str(section.get("refused"))
        if not causal and "not a decoder-only language model" in reason:
            return "ok (refused: not a decoder-only LM)"
        return f"refused: {reason}"
    if not causal:
        return "exported pretrain_gpt.py arguments for a model GPTModel does not build"
    blocks = sum(layer.get("kind") == "block" for layer in graph["layers"])
    problems = []
    if blocks != family.blocks:
        problems.append(f"graph has {blocks} blocks, the model {family.blocks}")
    args = section["args"]
    exported = int(args[args.index("--num-layers") + 1])
    if exported != family.blocks or sum(section["blocks_per_stage"]) != family.blocks:
        problems.append(f"--num-layers {exported}, blocks per stage {section['blocks_per_stage']}")
    precision = "--bf16" in args
    if not precision:
        problems.append("no --bf16 for a bf16-mixed plan")
    return "ok" if not problems else "; ".join(problems)


def _torchtitan_check(section: dict, family: Family) -> str:
    """Every module the torchtitan export names is one of torchtitan's model (its decoder
    names, layers below the family's blocks); none named where torchtitan has no such model."""
    parts = section.get("module_fqns_per_model_part") or _fqns_in(section)
    if not parts:
        return "ok (no torchtitan model: no modules named)"
    names = [name for part in parts for name in part]
    wrong = [
        name
        for name in names
        if name not in TORCHTITAN_OTHER
        and not ((match := TORCHTITAN_BLOCK.match(name)) and int(match.group(1)) < family.blocks)
    ]
    blocks = sorted(int(m.group(1)) for n in names if (m := TORCHTITAN_BLOCK.match(n)))
    if wrong:
        return f"names no module of torchtitan's model: {', '.join(wrong[:3])}"
    if blocks != list(range(family.blocks)):
        return f"names blocks {blocks[:3]}... not each of the {family.blocks} once"
    return f"ok ({section.get('model')})"


def _fqns_in(section: dict) -> list[list[str]]:
    """module_fqns_per_model_part wherever the export keeps it (its TOML fragment's values)."""
    for value in section.values():
        if isinstance(value, dict) and "module_fqns_per_model_part" in value:
            return value["module_fqns_per_model_part"]
    return []
