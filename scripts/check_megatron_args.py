"""Exported plans read by Megatron-LM itself: does Megatron build the planned model?

For each graph (bundled hf: configs and zoo presets, profiled on the meta device) and each pinned
config (pp, tp, dp, virtual stages, ZeRO, recompute), plan, take ``exports.megatron.args`` and
run them through a pinned Megatron-LM release's own code on the CPU:

1. ``megatron.training.arguments.parse_args`` and ``validate_args`` (world size = the plan's
   GPUs; no ``torch.distributed``);
2. ``core_transformer_config_from_args`` (``TransformerConfig.__post_init__``: the rules of
   ``--decoder-first/last-pipeline-num-layers`` and of the layout);
3. the layer assignment ``get_num_layers_to_build`` for every pipeline rank and virtual stage
   (``parallel_state``'s rank getters stubbed to that rank).

and check that what Megatron would build is the plan: transformer layers per (virtual) stage =
the plan's blocks per stage (and ``--num-layers`` = the graph's blocks), ``--bf16`` for a
bf16-mixed plan, the recomputed transformer layers per stage (``--recompute-method block``
recomputes the first N of every stage, ``uniform`` all) = the plan's (or, where the export says
``recompute.exact`` false, the layers it declares), the distributed optimizer iff ZeRO 1, and the
MoE layers (experts, dense blocks of ``--moe-layer-freq``, shared experts).

The export leaves the model's shape to the user (``--hidden-size``, heads); this script adds a
fixed one (hidden 1024, 16 heads, no biases: megatron-core refuses biased MoE layers under expert
tensor parallelism; the graph's sequence length), which the checks do not depend on. Stubs, and
nothing else: ``six`` (imported by the BERT tokenizer, unused), the Triton-only modules
``batch_invariant_kernels`` and (core_v0.19) ``moe/ops/paged_stash``,
``get_device_arch_version`` (9, Hopper: there is no GPU) and ``CUDA_DEVICE_MAX_CONNECTIONS=1``
(validate_args asserts it for tp > 1); on Python 3.11, ``typing.override`` (3.12's no-op
decorator, which core_v0.19 imports).

    python scripts/check_megatron_args.py --megatron-git /path/to/Megatron-LM --ref core_v0.16.1
    python scripts/check_megatron_args.py --megatron /path/to/Megatron-LM   # a source tree
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import typing
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import harness

from solver import Cluster, TrainingConfig, plan
from solver.costs.graph_inputs import layer_roles
from solver.errors import InputError
from solver.exports.megatron_flags import MEGATRON_FSDP_STRATEGY

SHAPE_ARGS = ["--hidden-size", "1024", "--num-attention-heads", "16", "--disable-bias-linear"]
"""The model shape the export leaves to the user (module docstring)."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One pinned config of one graph."""

    pp: int
    tp: int = 1
    dp: int = 1
    v: int = 1
    zero: int = 0
    recompute: str = "none"
    sp: bool = False
    ep: int = 1

    @property
    def label(self) -> str:
        extra = f" v{self.v}" if self.v > 1 else ""
        extra += f" ep{self.ep}" if self.ep > 1 else ""
        extra += " sp" if self.sp else ""
        return f"pp{self.pp} tp{self.tp} dp{self.dp}{extra} zero{self.zero} {self.recompute}"


DENSE_CASES = (
    Case(pp=2, tp=2, dp=2, zero=1),
    Case(pp=3, dp=2, recompute="full"),
    Case(pp=4, tp=2, zero=1, recompute="selective"),
    Case(pp=4, v=2, dp=2),
    Case(pp=1, tp=2, dp=4, zero=2),
    Case(pp=1, dp=4, zero=3, recompute="full"),
)
MOE_CASES = (
    Case(pp=2, tp=2, dp=4, ep=4, sp=True, zero=1),
    Case(pp=4, dp=2, ep=2, recompute="selective"),
)
GRAPHS = (
    ("hf:llama-2-7b", {}),
    ("hf:llama-2-70b", {}),
    ("hf:gpt2-xl", {}),
    ("hf:mixtral-8x7b", {}),
    ("hf:qwen1.5-moe-a2.7b", {}),
    ("llama2-7b", {}),
    ("gpt3-xl", {}),
    ("deepseek-moe-16b", {}),
)
QUICK_GRAPHS = (("hf:llama-2-7b", {}), ("hf:qwen1.5-moe-a2.7b", {}), ("gpt3-xl", {}))


# --- Megatron-LM, imported from a source tree ---------------------------------------------------


class _Anything(types.ModuleType):
    """A stub module: every attribute is a no-op callable."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


def load_megatron(tree: Path) -> types.SimpleNamespace:
    """Megatron-LM's arguments, transformer block and parallel_state from ``tree`` (a directory
    holding ``megatron/``), ahead of any installed megatron-core, with the module docstring's
    stubs."""
    sys.path.insert(0, str(tree))
    if not hasattr(typing, "override"):  # core_v0.19 imports it; Python 3.12's no-op decorator
        typing.override = lambda function: function
    for name in list(sys.modules):
        if name == "megatron" or name.startswith("megatron."):
            del sys.modules[name]
    for name in (
        "six",
        "megatron.core.transformer.custom_layers.batch_invariant_kernels",
        "megatron.core.transformer.moe.ops.paged_stash",  # core_v0.19: Triton kernels
    ):
        stub = _Anything(name)
        stub.__path__ = []
        sys.modules[name] = stub
    from megatron.core import parallel_state
    from megatron.core.transformer import transformer_block
    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: 9
    return types.SimpleNamespace(
        arguments=arguments, block=transformer_block, parallel_state=parallel_state
    )


def megatron_view(megatron, args: list[str], *, world: int, seq: int) -> dict[str, Any]:
    """What Megatron-LM makes of ``args``: accepted or the error, and the layers per (virtual)
    stage in pipeline order, precision, recompute, distributed optimizer and MoE settings."""
    argv = ["pretrain_gpt.py", *SHAPE_ARGS]
    argv += ["--seq-length", str(seq), "--max-position-embeddings", str(seq), *args]
    connections = "8" if "--use-megatron-fsdp" in args else "1"  # FSDP asserts it is not 1
    os.environ.update(WORLD_SIZE=str(world), RANK="0", CUDA_DEVICE_MAX_CONNECTIONS=connections)
    old_argv = sys.argv
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115
            parsed = megatron.arguments.parse_args()
            megatron.arguments.validate_args(parsed, {})
            config = megatron.arguments.core_transformer_config_from_args(parsed)
            stages = _layers_per_stage(megatron, config)
    except (AssertionError, ValueError, SystemExit, TypeError) as error:
        return {"accepted": False, "error": f"{type(error).__name__}: {error}"}
    finally:
        sys.argv = old_argv
    return {
        "accepted": True,
        "num_layers": parsed.num_layers,
        "blocks_per_stage": stages,
        "bf16": bool(parsed.bf16),
        "fp16": bool(parsed.fp16),
        "recompute": (
            parsed.recompute_granularity,
            parsed.recompute_method,
            parsed.recompute_num_layers,
        ),
        "distributed_optimizer": bool(parsed.use_distributed_optimizer),
        "megatron_fsdp": (
            parsed.data_parallel_sharding_strategy
            if getattr(parsed, "use_megatron_fsdp", False)
            else None
        ),
        "num_experts": parsed.num_experts,
        "moe_layer_freq": parsed.moe_layer_freq,
        "shared_expert": parsed.moe_shared_expert_intermediate_size,
    }


def _layers_per_stage(megatron, config) -> list[int]:
    """``get_num_layers_to_build`` of every (virtual) stage in pipeline order (virtual stage j
    on rank j mod p), the rank getters of parallel_state stubbed."""
    state = megatron.parallel_state
    p = config.pipeline_model_parallel_size
    v = config.virtual_pipeline_model_parallel_size
    saved = {
        name: getattr(state, name)
        for name in (
            "get_pipeline_model_parallel_rank",
            "get_pipeline_model_parallel_world_size",
            "get_virtual_pipeline_model_parallel_world_size",
        )
    }
    counts = []
    try:
        state.get_pipeline_model_parallel_world_size = lambda *a, **k: p
        state.get_virtual_pipeline_model_parallel_world_size = lambda *a, **k: v
        for j in range(p * (v or 1)):
            rank, stage = j % p, (j // p if v else None)
            state.get_pipeline_model_parallel_rank = lambda *a, rank=rank, **k: rank
            counts.append(
                megatron.block.get_num_layers_to_build(config, vp_stage=stage, pp_rank=rank)
            )
    finally:
        for name, function in saved.items():
            setattr(state, name, function)
    return counts


# --- the plan's side ----------------------------------------------------------------------------


def planned_view(result, graph) -> dict[str, Any]:
    """What the plan says Megatron should build (per virtual stage in pipeline order)."""
    roles = dict(zip(graph.names, layer_roles(graph), strict=True))
    stages = result.evaluation.virtual_stage_layer_names()
    recomputed = result.evaluation.virtual_stage_recomputed_names() or [[] for _ in stages]
    config = result.config
    blocks = [[n for n in stage if roles[n] == "block"] for stage in stages]
    if config.recompute == "full":
        chosen = [len(b) for b in blocks]
    else:
        chosen = [sum(roles[n] == "block" for n in names) for names in recomputed]
    moe = graph.meta.get("moe") or {}
    all_blocks = [graph.layers[i] for i, n in enumerate(graph.names) if roles[n] == "block"]
    return {
        "num_layers": len(all_blocks),
        "blocks_per_stage": [len(b) for b in blocks],
        "recomputed_per_stage": chosen,
        "distributed_optimizer": config.zero == 1,
        "megatron_fsdp": MEGATRON_FSDP_STRATEGY.get(config.zero),
        "moe_layer_freq": [int(layer.expert_params > 0) for layer in all_blocks],
        "shared_expert": moe.get("shared_expert_ffn_hidden") or None,
    }


def megatron_recomputed(view: dict[str, Any]) -> list[int]:
    """Transformer layers Megatron recomputes per stage (whole layers; selective: none)."""
    granularity, method, count = view["recompute"]
    if granularity != "full":
        return [0 for _ in view["blocks_per_stage"]]
    if method == "uniform":
        return list(view["blocks_per_stage"])
    return [min(count, b) for b in view["blocks_per_stage"]]


def compare(result, graph, view: dict[str, Any]) -> tuple[list[str], str]:
    """(mismatches between Megatron's view and the plan, a note on declared deviations)."""
    if not view["accepted"]:
        return [f"refused: {view['error']}"], ""
    want = planned_view(result, graph)
    export = result.exports["megatron"]
    problems, notes = [], []
    for key in ("num_layers", "blocks_per_stage", "distributed_optimizer", "megatron_fsdp"):
        if key == "distributed_optimizer" and want["megatron_fsdp"]:
            continue  # core_v0.19's validate_args sets it with Megatron-FSDP, which shards more
        if view[key] != want[key]:
            problems.append(f"{key} {view[key]} != plan {want[key]}")
    precision = export["precision"]
    if view["bf16"] != precision.startswith("bf16") or view["fp16"] != (precision == "fp16-mixed"):
        problems.append(f"bf16={view['bf16']} fp16={view['fp16']} for precision {precision}")
    recomputed = megatron_recomputed(view)
    record = export["recompute"]
    if record is not None and not record["exact"]:
        declared = [len(names) for names in record["exported_per_stage"]]
        if recomputed != declared:
            problems.append(f"recomputed {recomputed} != declared {declared}")
        notes.append(
            f"recompute declared inexact: {recomputed} vs planned {want['recomputed_per_stage']}"
        )
    elif recomputed != want["recomputed_per_stage"]:
        problems.append(f"recomputed {recomputed} != plan {want['recomputed_per_stage']}")
    if any(want["moe_layer_freq"]):
        freq = view["moe_layer_freq"]
        freq = (
            [1 if i % freq == 0 else 0 for i in range(view["num_layers"])]
            if isinstance(freq, int)
            else freq
        )
        if freq != want["moe_layer_freq"]:
            problems.append(f"moe_layer_freq {freq} != plan {want['moe_layer_freq']}")
        if view["shared_expert"] != want["shared_expert"]:
            problems.append(f"shared expert {view['shared_expert']} != {want['shared_expert']}")
    if export["refused"]:
        notes.append("export refused: " + export["refused"].split(":")[0])
    return problems, "; ".join(notes)


# --- cases and report ---------------------------------------------------------------------------


def plan_case(graph, case: Case):
    """The planner's plan for ``case`` (pins; 8 micro-batches per data-parallel rank)."""
    gpus = case.pp * case.tp * case.dp
    training = TrainingConfig(
        global_batch=8 * case.dp,
        micro_batch_sizes=(1,),
        zero_stages=(case.zero,),
        recompute=case.recompute,
        virtual_stages=(case.v,),
        pp=case.pp,
        tp=case.tp,
        dp=case.dp,
        ep=(case.ep,),
        sequence_parallel="on" if case.sp else "off",
    )
    cluster = Cluster(num_gpus=gpus, gpu_memory_bytes=2**43)  # fits DeepSeek-V3 at pp 2 tp 2
    return plan(graph, cluster, training, time_limit_s=30.0, suggest_gpus=False)


FAMILY_CASES = (Case(pp=2, tp=2, zero=1, sp=True), Case(pp=2, recompute="full"))
"""The conformance suite's pinned pp 2 x tp 2 (a tp 1 twin for families whose heads refuse tp 2)."""


def family_graphs(folder: Path) -> list[tuple[str, dict, tuple[Case, ...], str]]:
    """The decoder-only families of the conformance suite (tests/hf_families.py, the ones
    Megatron's GPTModel builds), their configs written into ``folder``."""
    from tests.hf_conformance import write_config
    from tests.hf_families import FAMILIES, REFUSED

    found = []
    for name, family in FAMILIES.items():
        causal = family.config["architectures"][0].endswith(("ForCausalLM", "LMHeadModel"))
        if causal and name not in REFUSED:
            found.append((f"hf:{write_config(name, folder)}", {}, FAMILY_CASES, name))
    return found


def run_cases(megatron, graphs, *, seq: int | None, progress=print) -> list[dict[str, Any]]:
    """One row per (graph, case): Megatron's verdict and the checks (``seq``: the profile's
    sequence length; None: each model's default). ``graphs``: (source, overrides) pairs, or
    (source, overrides, cases, label)."""
    from profiling.export import export_graph

    rows = []
    for source, overrides, *given in graphs:
        name = given[1] if given else source
        graph = export_graph(source, seq=seq, overrides=overrides)
        length = graph.meta.get("seq_len") or 1024
        cases = given[0] if given else MOE_CASES if graph.meta.get("moe") else DENSE_CASES
        for case in cases:
            try:
                result = plan_case(graph, case)
            except InputError as error:  # the engine rules refuse the pins: nothing to export
                rows.append(_refused_row(name, graph, case, str(error)))
                progress(f"{name} {case.label}: refused by the engine rules")
                continue
            export = result.exports["megatron"]
            view = megatron_view(megatron, export["args"], world=result.config.num_gpus, seq=length)
            problems, note = compare(result, graph, view)
            rows.append(
                {
                    "graph": name,
                    "config": case.label,
                    "blocks": planned_view(result, graph)["num_layers"],
                    "split": export["split_method"],
                    "megatron_layers": view.get("blocks_per_stage", "-"),
                    "accepted": view["accepted"],
                    "builds_the_plan": not problems,
                    "problems": "; ".join(problems),
                    "note": note,
                }
            )
            progress(f"{name} {case.label}: {'ok' if not problems else problems}")
    return rows


def _refused_row(name: str, graph, case: Case, error: str) -> dict[str, Any]:
    """The row of a case the planner refuses by the engines' rules (solver.engine_rules): no
    export exists for Megatron to read, which is the check's point (never proposed)."""
    blocks = sum(role == "block" for role in layer_roles(graph))
    return {
        "graph": name,
        "config": case.label,
        "blocks": blocks,
        "split": "-",
        "megatron_layers": "-",
        "accepted": "-",
        "builds_the_plan": "-",
        "problems": "",
        "note": "refused by the engine rules: " + error.split(": ", 1)[-1],
    }


def megatron_tree(args, stack: contextlib.ExitStack) -> tuple[Path, str]:
    """(the Megatron-LM source tree, its commit) from --megatron or --megatron-git/--ref."""
    if args.megatron:
        tree = Path(args.megatron)
        commit = _git(tree, "rev-parse", "HEAD") if (tree / ".git").exists() else "unknown"
        return tree, commit
    git_dir = Path(args.megatron_git)
    commit = _git(git_dir, "rev-parse", f"{args.ref}^{{commit}}")
    archive = subprocess.run(
        ["git", "--git-dir", str(git_dir), "archive", commit, "megatron"],
        capture_output=True,
        check=True,
    ).stdout
    tree = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="megatron-lm-")))
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree, commit


def _git(path: Path, *args: str) -> str:
    where = ["--git-dir", str(path)] if not (path / ".git").exists() else ["-C", str(path)]
    return subprocess.run(
        ["git", *where, *args], capture_output=True, text=True, check=True
    ).stdout.strip()


COLUMNS = (
    "graph",
    "config",
    "blocks",
    "split",
    "megatron_layers",
    "accepted",
    "builds_the_plan",
    "problems",
    "note",
)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, quick="three graphs")
    parser.add_argument("--megatron", help="a Megatron-LM source tree (holding megatron/)")
    parser.add_argument("--megatron-git", help="a Megatron-LM git directory (with --ref)")
    parser.add_argument(
        "--ref", default="core_v0.16.1", help="tag or commit (default core_v0.16.1)"
    )
    parser.add_argument(
        "--seq", type=int, default=None, help="sequence length (default: each model's)"
    )
    parser.add_argument("--report", default="megatron_args.md", help="file name under --out")
    parser.add_argument(
        "--families",
        action="store_true",
        help="also the conformance suite's decoder-only families (tests/hf_families.py)",
    )
    args = parser.parse_args(argv)
    if not args.megatron and not args.megatron_git:
        parser.error("give --megatron DIR or --megatron-git DIR [--ref TAG]")
    run = harness.Run.start(__file__, argv)
    with contextlib.ExitStack() as stack:
        tree, commit = megatron_tree(args, stack)
        megatron = load_megatron(tree)
        graphs = list(QUICK_GRAPHS if args.quick else GRAPHS)
        if args.families:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            graphs += family_graphs(folder)
        rows = run_cases(megatron, graphs, seq=args.seq)
    exported = [row for row in rows if row["builds_the_plan"] != "-"]
    good = sum(row["builds_the_plan"] for row in exported)
    refused = len(rows) - len(exported)
    lines = [
        "# Exports read by Megatron-LM's own argument code",
        "",
        f"Command: {run.command_text}  ",
        f"Megatron-LM: {args.ref if not args.megatron else tree} at commit {commit}  ",
        f"Machine: {harness.machine()}, {harness.today()}; {run.elapsed_s:.0f} s",
        "",
        "Each plan's `exports.megatron.args` through `parse_args`, `validate_args`, "
        "`core_transformer_config_from_args` and `get_num_layers_to_build` per (virtual) stage "
        "(scripts/check_megatron_args.py says how). `builds_the_plan`: transformer layers per "
        "stage, `--num-layers`, precision, recomputed layers per stage, distributed optimizer "
        "iff ZeRO 1, Megatron-FSDP's sharding iff ZeRO 2/3 and the MoE layers are the plan's. "
        "A pinned config the engines' rules refuse (solver/engine_rules.py) is planned by no "
        "one: its row says the rule.",
        "",
        f"{good} of {len(exported)} exported plans build exactly the plan; {refused} pinned "
        "configs refused by the engine rules.",
        "",
    ]
    lines += harness.markdown_table(rows, list(COLUMNS))
    harness.write_report(args.out, args.report, lines)
    return 0 if good == len(exported) else 1


if __name__ == "__main__":
    sys.exit(main())
