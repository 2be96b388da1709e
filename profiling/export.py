"""``python -m profiling.export MODEL --batch 1 --seq 2048 --dtype bf16 --out graph.json``.

MODEL is a zoo preset (``models.presets()``), ``hf:NAME`` (a transformers model built as trained
from a config: a local directory or config.json, a bundled name, or ORG/NAME from the HF cache or
the Hub; ``profiling.hf.config``) or ``package.module:factory`` (a function returning a
``models.ModelSpec``). The default ``--device meta`` profiles with fake tensors: no memory, no
GPU, any size. ``--device cpu|cuda`` runs real tensors and also measures per-layer times.
Errors: one line on stderr, exit code 2 (a bad --out path: before profiling; a config field
``profiling.hf.checks`` refuses; a config of more than ``--max-layers`` blocks, before building
it; whatever a factory or the model's code raises, ``sys.exit()`` included:
``profiling.guard``), 4 at ``--time-limit``, 7 when --out could not be written. The exit is 0
only when a graph was made.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import json
import logging
import math
import sys
import time
import types
from typing import Any

from profiling.architecture import architecture_meta
from profiling.guard import time_limit, user_code
from solver.console import (
    OneLineErrorParser,
    check_outputs,
    comma_items,
    int_in,
    interrupted,
    positive_float,
    positive_int,
    print_error,
    run_main,
    write_json,
)
from solver.errors import InputError, PlannerError, quote
from solver.files.jsonfile import check_document
from solver.graph import LayerGraph
from solver.units import format_bytes

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

MAX_LAYERS = 1024
"""Default of ``--max-layers``: most blocks a config may ask to profile (GPT-3 has 96, Llama-3
405B 126; at ``PROFILE_S_PER_LAYER`` about 2 min)."""
PROFILE_S_PER_LAYER = 0.1
"""Fake-tensor profiling time per block, seconds (measured on 2 cores: GPT-2 blocks 0.07 s,
Llama-2-70B 0.13 s, Qwen1.5-MoE 0.2 s, T5 0.47 s)."""
PROFILE_MB_PER_LAYER = 0.3
"""Memory the profile takes per block, MB (measured: GPT-2 blocks 0.25 MB)."""
DEFAULT_TIME_LIMIT_S = 600.0
"""Default of ``--time-limit``, seconds: the whole export (GPT-3 175B profiles in about 10 s)."""

IMPLEMENTATIONS = ("transformers", "megatron")
"""``--implementation``: whose modules an hf: model's graph profiles (``meta.implementation``);
the megatron runtime runs megatron-core's, the other runtimes transformers'."""

MAX_THREADS = 4096
"""Most CPU threads (``--threads`` here and in profiling.run / validate; the graph schema's
``meta.timing.threads``)."""


def resolve_spec(name: str, overrides: dict[str, Any]):
    """The ModelSpec named on the command line. A factory runs under
    :func:`profiling.guard.user_code`: what it raises (its module's SyntaxError or ImportError
    included) or a ``sys.exit()`` in it is an InputError."""
    import models

    if name.startswith("hf:"):
        from profiling.hf.models import hf_spec

        return hf_spec(name[3:], overrides)
    if ":" in name:
        return _factory_spec(name, overrides)
    try:
        return models.get(name, **overrides)
    except ValueError as error:
        raise InputError(f"{name}: {error}") from None


def _factory_spec(name: str, overrides: dict[str, Any]):
    """The ModelSpec ``package.module:factory(**overrides)`` returns."""
    import models

    module_name, _, factory_name = name.partition(":")
    fix = "give package.module:factory, a function returning a models.ModelSpec"
    what = f"factory {name}"
    with user_code(what):
        try:
            module = importlib.import_module(module_name)
        except (ModuleNotFoundError, ValueError, TypeError) as error:
            if isinstance(error, ModuleNotFoundError) and not _names_module(error, module_name):
                raise  # a module the factory's module imports: the factory's own error
            raise InputError(
                f"{name}: cannot import {factory_name} from {module_name} ({error}); {fix}"
            ) from None
        factory = getattr(module, factory_name, None)
    if factory is None:
        raise InputError(
            f"{name}: cannot import {factory_name} from {module_name} (module {module_name!r} "
            f"has no attribute {factory_name!r}); {fix}"
        )
    if isinstance(factory, types.ModuleType) or not callable(factory):
        kind = "a module" if isinstance(factory, types.ModuleType) else type(factory).__name__
        raise InputError(f"{name}: {factory_name} is {kind}, not a function; {fix}")
    try:
        inspect.signature(factory).bind(**overrides)
    except TypeError as error:
        raise InputError(
            f"{name}: {factory_name}() cannot be called with the --set fields given "
            f"({error}); {fix}"
        ) from None
    except ValueError:  # no signature to check (a builtin): call it
        pass
    with user_code(what):
        spec = factory(**overrides)
    if not isinstance(spec, models.ModelSpec):
        raise InputError(
            f"{name}: {factory_name}() returned {type(spec).__name__}, not a "
            f"models.ModelSpec; {fix}"
        )
    return spec


def _names_module(error: ModuleNotFoundError, module_name: str) -> bool:
    """Whether the module not found is ``module_name`` or a package above it (a typo on the
    command line), not a module that ``module_name`` imports."""
    missing = error.name or ""
    return module_name == missing or module_name.startswith(missing + ".")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """--set layers=4 --set norm=rmsnorm -> {"layers": 4, "norm": "rmsnorm"}."""
    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise InputError(f"--set {quote(item)}: write FIELD=VALUE, e.g. --set layers=4")
        try:
            overrides[key] = json.loads(text, parse_constant=_not_finite, parse_float=_finite)
        except json.JSONDecodeError:
            overrides[key] = text
        except (RecursionError, ValueError):  # deep nesting, 5000-digit integers
            raise InputError(f"--set {quote(item)}: not a value a model field takes") from None
    check_document(overrides, "--set")  # nesting at most 64 levels, as in a file
    return overrides


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not finite")
    return value


def _not_finite(text: str) -> float:
    raise ValueError(f"{text} is not finite")


def export_graph(
    name: str,
    *,
    batch: int = 1,
    seq: int | None = None,
    dtype: str = "bf16",
    device: str = "meta",
    layers: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    progress=None,
    threads: int | None = None,
    max_layers: int | None = None,
    implementation: str | None = None,
) -> LayerGraph:
    """Profile a preset / hf: model / factory into a layer graph (the CLI's work, as an API).
    ``threads``: CPU threads to time the layers with (``torch.set_num_threads`` for the
    profile, restored after; default: the process's), recorded in ``meta.timing.threads``.
    ``max_layers``: refuse, before building, a config with more blocks (``--max-layers``; None:
    no limit). ``implementation`` (``--implementation``, hf: models only): whose modules to
    profile, transformers' (the default) or megatron-core's (:func:`implementation_spec`),
    recorded in ``meta.implementation``. What the model's own code raises while it is built,
    given its inputs or profiled is an InputError naming the model (and, for hf:, the config
    fields the message is about)."""
    import torch

    from profiling.trace.layers import default_layer_paths
    from profiling.trace.profile import profile_module

    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS
    ):
        raise InputError(f"threads must be an integer in 1..{MAX_THREADS}, got {threads!r}")
    spec = resolve_spec(name, overrides or {})
    if max_layers is not None:  # before implementation_spec, which builds the model on meta
        check_layer_count(name, spec.config, max_layers)
    spec = implementation_spec(name, spec, implementation, seq)
    what, hint = _model_code(name, spec, overrides or {})
    torch_dtype = getattr(torch, DTYPES[dtype])
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(
            "--device cuda: no CUDA device here; use --device meta (fake tensors) or cpu"
        )
    build_device = "meta" if device == "meta" else device
    previous = torch.get_default_dtype()
    previous_threads = torch.get_num_threads()
    torch.set_default_dtype(torch_dtype)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with user_code(f"{what}: building the model", hint), torch.device(build_device):
            module = spec.build()
        with user_code(f"{what}: making its inputs", hint):
            with torch.device("cpu" if device == "meta" else device):
                try:
                    inputs = spec.example_inputs(batch, seq)
                except ValueError as error:
                    raise InputError(f"{name}: {error}") from None
        started = time.perf_counter()
        with user_code(f"{what}: profiling its forward and backward", hint), _quiet_fake_log():
            graph = profile_module(
                module,
                inputs,
                layers or spec.layers or default_layer_paths(module),
                model_name=spec.name,
                mode="fake" if device == "meta" else "real",
                progress=progress,
                meta={
                    "batch": batch,
                    "seq_len": seq or spec.seq_len,
                    "dtype": dtype,
                    "device": device,
                    "preset": spec.name,
                    "overrides": overrides or {},
                    "torch": torch.__version__,
                    **architecture_meta(spec.config),
                    **spec.meta,
                    **_seq_source(seq, spec),
                },
            )
        if spec.meta.get("implementation") == "megatron":
            from profiling.executors.megatron_hf import tie_head

            graph = tie_head(graph, spec.config)
        graph.meta["profile_s"] = round(time.perf_counter() - started, 3)
        return graph
    finally:
        torch.set_default_dtype(previous)
        torch.set_num_threads(previous_threads)


def implementation_spec(name: str, spec, implementation: str | None, seq: int | None):
    """The spec to profile for ``--implementation``: an hf: model's own (``transformers``, the
    default) or the modules megatron-core runs for it (``megatron``:
    :func:`profiling.executors.megatron_hf.megatron_profile_spec`), named in the graph's
    ``meta.implementation``; InputError for another model or one GPTModel does not express."""
    from profiling.executors.megatron_hf import megatron_profile_spec

    if not name.startswith("hf:"):
        if implementation is None:
            return spec
        raise InputError(
            f"--implementation {implementation}: {name} is not an hf: model; only hf: models "
            "have another implementation (zoo presets are profiled as megatron-core runs them)"
        )
    if implementation != "megatron":
        meta = {"implementation": "transformers", "megatron_expressible": _expressible(spec, seq)}
        return dataclasses.replace(spec, meta={**spec.meta, **meta})
    try:
        return megatron_profile_spec(spec, seq)
    except InputError as error:
        text = (
            str(error).removeprefix("engine megatron: ").removeprefix("--implementation megatron: ")
        )
        text = text.replace(
            "run it with --engine torch", "export it with --implementation transformers"
        )
        raise InputError(f"--implementation megatron: {text}") from None


def _expressible(spec, seq: int | None) -> bool:
    """``meta.megatron_expressible``: whether megatron-core's GPTModel expresses the hf: model
    (``--implementation megatron`` would profile it)."""
    from profiling.executors.megatron_hf import megatron_hf_spec

    try:
        megatron_hf_spec(spec, seq)
    except (InputError, ValueError):  # a refusal, or a GPTConfig value out of its range
        return False
    return True


def _seq_source(seq: int | None, spec) -> dict[str, str]:
    """``meta.seq_len_source``: ``--seq`` when given, else the model's own account of its default
    (an hf: model's ``min(max_position_embeddings N, 2048)``); nothing without a sequence."""
    if seq is not None:
        return {"seq_len_source": "--seq"}
    source = spec.meta.get("seq_len_source")
    return {"seq_len_source": source} if source and spec.seq_len else {}


def seq_line(graph: LayerGraph) -> str | None:
    """The stderr line naming the sequence length a model chose itself (not ``--seq``)."""
    source = graph.meta.get("seq_len_source")
    if not source or source == "--seq" or not graph.meta.get("seq_len"):
        return None
    return f"seq {graph.meta['seq_len']} ({source}); pass --seq to change"


@contextlib.contextmanager
def _quiet_fake_log():
    """torch's fake-tensor mode logs the traceback of an op that fails (``failed while attempting
    to run meta``) before it raises; the profiler turns the error into one line, so the log is
    dropped while it runs."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _model_code(name: str, spec, overrides: dict[str, Any]):
    """(what to call the model's code in an error line, a hint naming config fields or None)."""
    if name.startswith("hf:"):
        from profiling.hf.checks import field_hint

        return name, lambda error: field_hint(spec.config, str(error), overrides)
    return (f"factory {name}" if ":" in name else name), None


def check_layer_count(name: str, config: Any, max_layers: int) -> None:
    """InputError when ``config`` asks for more than ``max_layers`` blocks (counted by
    :func:`planned_layers`): the figure, the time it would take and the flags that change it."""
    planned = planned_layers(config)
    if planned is None or planned[0] <= max_layers:
        return
    count, fields = planned
    field = fields.split()[0]
    hours = count * PROFILE_S_PER_LAYER / 3600
    raise InputError(
        f"{name}: {count:,} blocks to profile ({fields}), over --max-layers {max_layers}: the "
        f"profile takes about {PROFILE_S_PER_LAYER} s and {PROFILE_MB_PER_LAYER} MB per block "
        f"(about {hours:.3g} h and {count * PROFILE_MB_PER_LAYER / 1024:.3g} GiB); profile "
        f"fewer (--set {field}=N) or raise --max-layers"
    )


def planned_layers(config: Any) -> tuple[int, str] | None:
    """(blocks the config builds, the fields counted, e.g. ``n_layer 12``) from its layer counts:
    ``num_hidden_layers`` (transformers' standard name, GPT-2's ``n_layer``) or ``layers`` (zoo
    presets), plus the decoder's ``num_decoder_layers`` / ``decoder_layers`` of an
    encoder-decoder; None when the config names no layer count (a factory's model)."""
    aliases = dict(getattr(type(config), "attribute_map", {}) or {})
    total, fields = 0, []
    for group in (("num_hidden_layers", "layers"), ("num_decoder_layers", "decoder_layers")):
        for key in group:
            value = getattr(config, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                total += value
                fields.append(f"{aliases.get(key, key)} {value:,}")
                break
    return (total, " + ".join(fields)) if fields else None


def format_summary(graph: LayerGraph) -> str:
    """Per-layer table (per sample) with totals."""
    header = [
        "layer",
        "params",
        "tp_params",
        "activations",
        "tp_acts",
        "output",
        "transient",
        "fwd GFLOP",
        "in edges",
    ]
    incoming: dict[str, int] = {}
    for edge in graph.edges:
        incoming[edge.dst] = incoming.get(edge.dst, 0) + 1
    rows = [
        [
            layer.name,
            f"{layer.params:,}",
            f"{layer.tp_params:,}",
            format_bytes(layer.activation_bytes),
            format_bytes(layer.tp_activation_bytes),
            format_bytes(layer.output_bytes),
            format_bytes(layer.transient_bytes),
            f"{layer.fwd_flops / 1e9:.3g}",
            str(incoming.get(layer.name, 0)),
        ]
        for layer in graph.layers
    ]
    total = lambda key: sum(getattr(layer, key) for layer in graph.layers)  # noqa: E731
    rows.append(
        [
            "TOTAL",
            f"{total('params'):,}",
            f"{total('tp_params'):,}",
            format_bytes(total("activation_bytes")),
            format_bytes(total("tp_activation_bytes")),
            "",
            "",
            f"{total('fwd_flops') / 1e9:.4g}",
            str(len(graph.edges)),
        ]
    )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"{graph.model}: {graph.num_layers} layers, {len(graph.edges)} edges "
        f"({'chain' if graph.is_chain else 'DAG'}); bytes and FLOPs per sample"
    ]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    return "\n".join(line.rstrip() for line in lines)


@contextlib.contextmanager
def progress_bar(enabled: bool):
    """A tqdm bar fed by the profiler's progress messages (stderr; nothing when disabled)."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(desc="profiling", unit="step", file=sys.stderr, leave=False)

    def update(message: str) -> None:
        bar.set_postfix_str(message[:40])
        bar.update(1)

    try:
        yield update
    finally:
        bar.close()


def parser() -> argparse.ArgumentParser:
    result = OneLineErrorParser(
        prog="python -m profiling.export",
        description="Profile a PyTorch model into a layer graph (docs/layer-graph.md).",
    )
    result.add_argument(
        "model",
        help="zoo preset, hf:NAME (hf:path/to/dir, hf:config.json, hf:gpt2, hf:ORG/NAME), "
        "or package.module:factory",
    )
    result.add_argument("--batch", type=positive_int, default=1, help="micro-batch to profile")
    result.add_argument("--seq", type=positive_int, help="sequence length (default: preset's)")
    result.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="default dtype the model is built and run in (default bf16)",
    )
    result.add_argument(
        "--device",
        choices=["meta", "cpu", "cuda"],
        default="meta",
        help="meta: fake tensors, any size, no timing (default); cpu/cuda: real "
        "run with per-layer times",
    )
    result.add_argument(
        "--threads",
        type=int_in(1, MAX_THREADS),
        help="CPU threads to time the layers with (default: torch's, all cores); recorded in "
        "the graph's meta.timing.threads, and profiling.run gives each rank as many",
    )
    result.add_argument(
        "--layers",
        type=comma_items,
        help="comma-separated module paths (default: the repeated "
        "blocks plus the parts around them)",
    )
    result.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field, e.g. --set layers=4 (repeatable)",
    )
    result.add_argument(
        "--config-only",
        action="store_true",
        help="hf: models: config only, no weights (always so; kept for old command lines)",
    )
    result.add_argument(
        "--max-layers",
        type=int_in(1, 10**6),
        default=MAX_LAYERS,
        metavar="N",
        help=f"refuse, before building it, a config of more than N blocks (default {MAX_LAYERS}; "
        f"profiling takes about {PROFILE_S_PER_LAYER} s a block)",
    )
    result.add_argument(
        "--time-limit",
        type=positive_float,
        default=DEFAULT_TIME_LIMIT_S,
        metavar="S",
        help="wall-clock limit of the whole export, seconds, the factory's and model's code "
        f"included (default {DEFAULT_TIME_LIMIT_S:g}); past it: exit 4, no graph",
    )
    result.add_argument(
        "--implementation",
        choices=IMPLEMENTATIONS,
        help="hf: models: whose modules to profile: transformers' (default) or megatron-core's "
        "(plan it with --runtime megatron); recorded in the graph's meta.implementation",
    )
    result.add_argument("--out", help="write the graph JSON here")
    result.add_argument("--summary", action="store_true", help="print the per-layer table")
    result.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (otherwise shown when stderr is a terminal)",
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        check_outputs(args)  # --out, before profiling
        with (
            time_limit(args.time_limit, what=f"profiling {args.model}"),
            progress_bar(not args.no_progress and sys.stderr.isatty()) as progress,
        ):
            graph = export_graph(
                args.model,
                batch=args.batch,
                seq=args.seq,
                dtype=args.dtype,
                device=args.device,
                layers=args.layers.split(",") if args.layers else None,
                overrides=parse_overrides(args.set),
                progress=progress,
                threads=args.threads,
                max_layers=args.max_layers,
                implementation=args.implementation,
            )
        if (line := seq_line(graph)) is not None:
            print(line, file=sys.stderr)
        if args.out:
            write_json(args.out, graph.to_dict(), protect=[], flag="--out")
        if args.summary or not args.out:
            print(format_summary(graph))
        if args.out:
            print(
                f"wrote {args.out}: {graph.num_layers} layers, {len(graph.edges)} edges, "
                f"{sum(layer.params for layer in graph.layers):,} parameters "
                f"({graph.meta.get('profile_s')} s)"
            )
    except PlannerError as error:
        print_error(error)
        return error.exit_code
    except KeyboardInterrupt:
        return interrupted()
    return 0


if __name__ == "__main__":
    run_main(main)
