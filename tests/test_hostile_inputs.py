"""Hostile input files for every CLI that reads one.

The cases are generated from the bundled examples (``examples/gpt-1.3b.json``,
``examples/t5-dag.json``, ``examples/clusters/a100-40g-80g.json``), a plan that
``solver.plan`` writes and a calibration document: other encodings and compressed or binary
files, deep nesting and large documents, top-level types, numbers beyond the limits
(docs/layer-graph.md, "Limits"), NaN and Infinity literals, field deletions, type swaps, control
characters, ANSI escapes, newlines and lone surrogates in names, and seeded random byte flips.

``solver.plan``, ``solver.evaluate`` (with ``--plan``, ``--cluster`` and ``--calibration``),
``solver.sweep`` and ``profiling.validate`` run on them through their ``main(argv)`` in ONE
subprocess (a driver that loops over the cases and records exit code, stdout and stderr; about
10 s on two cores), so a crash of the interpreter fails the test instead of pytest. A hostile
case must exit 2 with exactly one line on stderr (no traceback, under 400 characters), print no
"fits", and leave its input file as it was; a random byte flip may also give a valid file (any
code of docs/planning.md, one line when it fails). A handful of real ``python -m`` runs with an
ASCII-only stdout and stderr (``PYTHONIOENCODING=ascii``) are in the slow tier.
"""

from __future__ import annotations

import bz2
import copy
import gzip
import hashlib
import io
import json
import lzma
import math
import os
import pickle
import random
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from solver import Cluster, InputError, TrainingConfig
from solver.calibration import COMPONENTS, Calibration
from solver.errors import quote
from tests.conftest import GPT_1_3B, MIXED_CLUSTER, ROOT, T5_DAG
from tests.processes import run_driver

MAX_LINE = 400
"""An error line is shorter than this (characters)."""
FLIPS = {"graph": 24, "plan": 12, "cluster": 8, "calibration": 8}
"""Seeded random byte-flip variants per kind of file."""
SEED = 13

Mutation = Callable[[bytes], bytes]


@dataclass(frozen=True)
class Case:
    """One hostile file and the command lines that read it."""

    id: str
    kind: str
    """graph, plan, cluster or calibration: which base document ``mutate`` changes."""
    mutate: Mutation
    clis: tuple[str, ...]
    strict: bool = True
    """Exit code ``code`` required (False: a random flip, which may leave the file valid)."""
    extra: tuple[str, ...] = ()
    """Extra flags for every command line of the case."""
    code: int = 2
    """The exit code a strict case gives: 2 (bad input), or 6 for a plan whose numbers are
    consistent in the file but differ from a new evaluation (``solver.evaluate --plan``)."""


# -- mutations ---------------------------------------------------------------------------------


def as_json(edit: Callable[[Any], Any]) -> Mutation:
    """A mutation of the parsed document (``edit`` changes it in place or returns a new one)."""

    def mutate(data: bytes) -> bytes:
        document = json.loads(data)
        result = edit(document)
        return json.dumps(document if result is None else result, indent=1).encode()

    return mutate


def raw_text(edit: Callable[[str], str]) -> Mutation:
    """A mutation of the JSON text (for literals json.dumps would not write)."""
    return lambda data: edit(data.decode()).encode()


def setter(path: tuple[Any, ...], value: Any) -> Mutation:
    def edit(document: Any) -> None:
        target = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return as_json(edit)


def deleter(path: tuple[Any, ...]) -> Mutation:
    def edit(document: Any) -> None:
        target = document
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return as_json(edit)


def literal(path: tuple[Any, ...], text: str) -> Mutation:
    """Set a field to a raw JSON literal (NaN, Infinity, a 5000-digit integer)."""
    marker = "__HOSTILE_LITERAL__"
    return lambda data: setter(path, marker)(data).replace(f'"{marker}"'.encode(), text.encode())


def zipped(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("graph.json", data)
    return buffer.getvalue()


ENCODINGS: dict[str, Mutation] = {
    "gzip": lambda d: gzip.compress(d, mtime=0),
    "zip": zipped,
    "bzip2": bz2.compress,
    "xz": lzma.compress,
    "pickle": lambda d: pickle.dumps(json.loads(d)),
    "png-header": lambda d: b"\x89PNG\r\n\x1a\n" + d,
    "utf16-bom": lambda d: d.decode().encode("utf-16"),
    "utf16le-no-bom": lambda d: d.decode().encode("utf-16-le"),
    "utf32-be": lambda d: d.decode().encode("utf-32-be"),
    "nul-byte": lambda d: d[: len(d) // 2] + b"\0" + d[len(d) // 2 :],
    "invalid-utf8": lambda d: d.replace(b'"format"', b'"form\xffat"', 1),
    "latin1-text": lambda d: d.replace(b'"version"', '"versi\u00f6n"'.encode("latin-1"), 1),
    "empty": lambda d: b"",
    "whitespace": lambda d: b" \n\t\n",
    "truncated": lambda d: d[: len(d) // 2],
    "two-documents": lambda d: d + d,
    "trailing-garbage": lambda d: d + b"\n}}}",
    "integer-5000-digits": lambda d: b'{"a": ' + b"7" * 5000 + b"}",
}
"""Whole-file mutations: what the bytes are, before any field is read."""

DEEP = 2**16
TOP_LEVEL: dict[str, Mutation] = {
    "top-list": lambda d: json.dumps([json.loads(d)] * 2 + [1] * 20000).encode(),
    "top-string": lambda d: json.dumps("x" * 100_000).encode(),
    "top-number": lambda d: b"1e400",
    "top-null": lambda d: b"null",
    "top-true": lambda d: b"true",
    "deep-array": lambda d: b"[" * DEEP + b"]" * DEEP,
    "deep-object": lambda d: b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "deep-in-document": raw_text(
        lambda t: t.replace("{", '{"deep": ' + "[" * 200 + "]" * 200 + ",", 1)
    ),
}
"""The document's shape: not an object, or nested far deeper than any format."""

HUGE_INTS = {"2^48+1": 2**48 + 1, "2^60": 2**60, "2^62": 2**62, "2^64": 2**64}
BAD_NUMBERS = {
    "1e300": "1e300",
    "1e400": "1e400",
    "minus1": "-1",
    "NaN": "NaN",
    "Infinity": "Infinity",
    "-Infinity": "-Infinity",
}
TYPE_SWAPS = {"string": "12", "true": True, "null": None, "list": [], "object": {}}


# -- the cases ---------------------------------------------------------------------------------

GRAPH_CLIS = ("evaluate", "plan", "sweep")
LAYER = 3
"""The layer of gpt-1.3b.json the field cases change ("layers.2")."""


def graph_cases() -> list[Case]:
    cases = [
        Case(f"graph-{name}", "graph", mutate, GRAPH_CLIS) for name, mutate in ENCODINGS.items()
    ]
    cases += [
        Case(f"graph-{name}", "graph", mutate, ("evaluate",)) for name, mutate in TOP_LEVEL.items()
    ]
    cases += [Case("graph-deep-sweep", "graph", TOP_LEVEL["deep-array"], ("sweep",))]
    cases += [Case("graph-gzip-sweep", "graph", ENCODINGS["gzip"], ("sweep",))]
    ints = ("params", "activation_bytes", "output_bytes", "transient_bytes", "tp_comm_bytes")
    for field in ints:
        where = ("layers", LAYER, field)
        for name, value in HUGE_INTS.items():
            cases.append(
                Case(f"graph-{field}-{name}", "graph", setter(where, value), ("evaluate",))
            )
        for name, text in BAD_NUMBERS.items():
            cases.append(
                Case(f"graph-{field}-{name}", "graph", literal(where, text), ("evaluate",))
            )
        for name, value in {"1.5": 1.5, **TYPE_SWAPS}.items():
            cases.append(
                Case(f"graph-{field}-{name}", "graph", setter(where, value), ("evaluate",))
            )
    for field in ("fwd_flops", "bwd_flops"):
        where = ("layers", LAYER, field)
        for name, text in {**BAD_NUMBERS, "1e22": "1e22"}.items():
            cases.append(Case(f"graph-{field}-{name}", "graph", literal(where, text), GRAPH_CLIS))
        for name, value in TYPE_SWAPS.items():
            cases.append(
                Case(f"graph-{field}-{name}", "graph", setter(where, value), ("evaluate",))
            )
    for name, text in {"NaN": "NaN", "1e300": "1e300", "minus1": "-1"}.items():
        both = raw_text(
            lambda t, text=text: t.replace(
                '"name": "layers.2",', f'"name": "layers.2", "fwd_ms": {text}, "bwd_ms": 1.0,', 1
            )
        )
        cases.append(Case(f"graph-fwd_ms-{name}", "graph", both, GRAPH_CLIS))
    # the runtime terms a profile measured (meta.timing): ranges, and the iteration they make
    for field, values in {
        "optimizer_step_ns_per_param": {"1e300": 1e300, "1e7": 1e7, "zero": 0, "minus1": -1},
        "microbatch_overhead_ns": {"1e300": 1e300, "1e13": 1e13, "minus1": -1},
        "step_overhead_ns": {"1e300": 1e300, "1e13": 1e13},
    }.items():
        for name, value in values.items():
            timing = setter(("meta", "timing"), {"threads": 1, field: value})
            cases.append(Case(f"graph-timing-{field}-{name}", "graph", timing, GRAPH_CLIS))
    cases.append(
        Case(
            "graph-timing-overhead-at-limit-huge-batch",
            "graph",
            setter(("meta", "timing"), {"threads": 1, "microbatch_overhead_ns": 1e12}),
            ("evaluate",),
            extra=("--global-batch", str(2**24)),
        )
    )
    # the empirical statistics (mCAP/CAPSlog) of one layer
    stats = ("layers", LAYER, "mem_isolated")
    cases.append(Case("graph-mem_isolated-2^64", "graph", setter(stats, 2**64), ("evaluate",)))
    for field in ("params", "activation_bytes", "output_bytes", "name"):
        cases.append(
            Case(f"graph-delete-{field}", "graph", deleter(("layers", LAYER, field)), ("evaluate",))
        )
    for field in ("format", "version", "model", "layers"):
        cases.append(Case(f"graph-delete-top-{field}", "graph", deleter((field,)), ("evaluate",)))
    swaps = {
        "layers-object": (("layers",), {}),
        "layers-string": (("layers",), "x" * 1000),
        "layers-empty": (("layers",), []),
        "layer-list": (("layers", LAYER), [1, 2, 3]),
        "layer-null": (("layers", LAYER), None),
        "format-number": (("format",), 1),
        "version-string": (("version",), "1"),
        "version-2^64": (("version",), 2**64),
        "model-number": (("model",), 5),
        "model-empty": (("model",), ""),
        "meta-list": (("meta",), []),
        "unknown-field": (("layers", LAYER, "\x1b[31mparamz\n"), 1),
    }
    for name, (where, value) in swaps.items():
        cases.append(Case(f"graph-{name}", "graph", setter(where, value), ("evaluate",)))
    names = {
        "ansi": "\x1b[31mred\x1b[0m",
        "newline": "block\nfits",
        "tab": "a\tb",
        "nul-escape": "a\x00b",
        "lone-surrogate": "x\ud800y",
        "bidi-override": "a\u202eb",
        "line-separator": "a\u2028b",
        "overlong": "n" * 10_000,
        "empty": "",
        "duplicate": "embed",
    }
    for name, value in names.items():
        where = ("layers", LAYER, "name")
        cases.append(Case(f"graph-name-{name}", "graph", setter(where, value), GRAPH_CLIS))
    cases.append(
        Case("graph-model-newline", "graph", setter(("model",), "gpt\n\x1b[2J"), ("evaluate",))
    )
    cases.append(
        Case("graph-model-surrogate", "graph", setter(("model",), "\udfff"), ("evaluate",))
    )
    cases.append(Case("graph-no-memory", "graph", as_json(_zero_memory), GRAPH_CLIS))
    # every field at the limit: fine alone, beyond int64 with the largest global batch
    cases.append(
        Case(
            "graph-at-limit-huge-batch",
            "graph",
            as_json(_at_limit),
            ("evaluate",),
            extra=("--global-batch", str(2**24), "--micro-batch", str(2**20)),
        )
    )
    return cases


def dag_cases() -> list[Case]:
    """Edge fields (examples/t5-dag.json lists its edges)."""
    cases = []
    for name, value in {**HUGE_INTS, "1.5": 1.5, "string": "1"}.items():
        cases.append(
            Case(
                f"dag-edge-bytes-{name}", "dag", setter(("edges", 0, "bytes"), value), ("evaluate",)
            )
        )
    for name, text in BAD_NUMBERS.items():
        cases.append(
            Case(
                f"dag-edge-bytes-{name}", "dag", literal(("edges", 0, "bytes"), text), ("evaluate",)
            )
        )
    cases.append(
        Case(
            "dag-edge-unknown-ansi",
            "dag",
            setter(("edges", 0, "dst"), "\x1b[1m" + "z" * 500),
            ("evaluate",),
        )
    )
    cases.append(Case("dag-edge-self-loop", "dag", as_json(_self_loop), ("evaluate",)))
    cases.append(Case("dag-edges-object", "dag", setter(("edges",), {"src": "a"}), ("evaluate",)))
    return cases


PLAN_CLIS = ("evaluate-plan",)


def plan_cases() -> list[Case]:
    chosen = ("gzip", "utf16-bom", "invalid-utf8", "nul-byte", "empty", "truncated", "pickle")
    cases = [
        Case(f"plan-{name}", "plan", ENCODINGS[name], PLAN_CLIS + ("validate",))
        for name in chosen[:3]
    ]
    cases += [Case(f"plan-{name}", "plan", ENCODINGS[name], PLAN_CLIS) for name in chosen[3:]]
    cases += [
        Case(f"plan-{name}", "plan", TOP_LEVEL[name], PLAN_CLIS)
        for name in ("top-list", "top-string", "deep-array", "deep-in-document")
    ]
    cases.append(Case("plan-top-list-validate", "plan", TOP_LEVEL["top-list"], ("validate",)))
    # a plan of gpt-1.3b run as gpt-tiny: the model does not match, before anything is spawned
    cases.append(Case("plan-other-model", "plan", lambda data: data, ("validate",)))
    required = (
        "format",
        "version",
        "config",
        "stages",
        "stage_of_layer",
        "peak_bytes",
        "cluster",
        "runtime",
        "memory_model",
        "graph",
        "training",
    )
    cases += [Case(f"plan-delete-{key}", "plan", deleter((key,)), PLAN_CLIS) for key in required]
    for field in ("pp", "tp", "dp", "micro_batch", "num_microbatches", "virtual_stages"):
        for name, value in {
            **HUGE_INTS,
            "2^40": 2**40,
            "zero": 0,
            "minus1": -1,
            "1.5": 1.5,
            "string": "2",
            "null": None,
        }.items():
            cases.append(
                Case(
                    f"plan-config-{field}-{name}",
                    "plan",
                    setter(("config", field), value),
                    PLAN_CLIS,
                )
            )
        for name in ("NaN", "1e400"):
            cases.append(
                Case(
                    f"plan-config-{field}-{name}",
                    "plan",
                    literal(("config", field), BAD_NUMBERS[name]),
                    PLAN_CLIS,
                )
            )
    for field, values in {
        "gpu_memory_bytes": {"2^64": 2**64, "1e30": 10**30, "zero": 0},
        "gpu_flops": {"minus1": -1, "1e300": 1e300, "zero": 0},
        "intra_node_gb_per_s": {"1e300": 1e300, "tiny": 1e-300},
        "num_gpus": {"1.5": 1.5, "2^64": 2**64},
    }.items():
        for name, value in values.items():
            cases.append(
                Case(
                    f"plan-cluster-{field}-{name}",
                    "plan",
                    setter(("cluster", field), value),
                    PLAN_CLIS,
                )
            )
    cases.append(
        Case(
            "plan-cluster-gpu_flops-NaN",
            "plan",
            literal(("cluster", "gpu_flops"), "NaN"),
            PLAN_CLIS,
        )
    )
    for field, values in {
        "global_batch": {"2^64": 2**64, "2^30": 2**30},
        "max_slowdown": {"1e300": 1e300},
        "min_throughput": {"1e-300": 1e-300, "1e300": 1e300},
        "weight_bytes_per_param": {"2^60": 2**60, "minus1": -1},
    }.items():
        for name, value in values.items():
            cases.append(
                Case(
                    f"plan-training-{field}-{name}",
                    "plan",
                    setter(("training", field), value),
                    PLAN_CLIS,
                )
            )
    cases += [
        Case(
            "plan-calibration-scale-1e300",
            "plan",
            setter(("calibration",), {"scales": {"weights": 1e300}, "constant_bytes": 0}),
            PLAN_CLIS,
        ),
        Case("plan-stage-peak-2^70", "plan", setter(("stages", 0, "peak_bytes"), 2**70), PLAN_CLIS),
        Case(
            "plan-stage-layer-ansi", "plan", as_json(_stage_layer_ansi), PLAN_CLIS + ("validate",)
        ),
        Case("plan-stage_of_layer-2^64", "plan", setter(("stage_of_layer", 0), 2**64), PLAN_CLIS),
        Case("plan-stage_of_layer-minus1", "plan", setter(("stage_of_layer", 0), -1), PLAN_CLIS),
        Case("plan-stages-empty", "plan", setter(("stages",), []), PLAN_CLIS),
        Case("plan-format-pareto", "plan", setter(("format",), "pareto"), PLAN_CLIS),
        Case("plan-version-99", "plan", setter(("version",), 99), PLAN_CLIS),
        Case("plan-version-list", "plan", setter(("version",), list(range(10_000))), PLAN_CLIS),
        Case("plan-runtime-ansi", "plan", setter(("runtime",), "\x1b[2Jtorch"), PLAN_CLIS),
        Case(
            "plan-graph-path-missing",
            "plan",
            setter(("graph", "path"), "no-such-graph.json"),
            PLAN_CLIS,
        ),
        Case("plan-graph-path-gzip", "plan", as_json(_graph_path("graph.json.gz")), PLAN_CLIS),
        Case("plan-graph-path-folder", "plan", as_json(_graph_path(".")), PLAN_CLIS),
        Case("plan-graph-path-nul", "plan", as_json(_graph_path("graph\x00.json")), PLAN_CLIS),
        Case("plan-graph-path-long", "plan", as_json(_graph_path("g" * 5000)), PLAN_CLIS),
        Case("plan-graph-sha-other", "plan", setter(("graph", "sha256"), "0" * 64), PLAN_CLIS),
        Case("plan-graph-path-fifo", "plan", as_json(_graph_path("../graph.fifo")), PLAN_CLIS),
        Case("plan-version-2.0", "plan", setter(("version",), 2.0), PLAN_CLIS + ("validate",)),
        Case("plan-version-true", "plan", setter(("version",), True), PLAN_CLIS),
        Case("plan-version-1-with-graph", "plan", setter(("version",), 1), PLAN_CLIS),
        Case("plan-fits-flipped", "plan", setter(("fits",), False), PLAN_CLIS + ("validate",)),
        Case(
            "plan-usable-below-peak",
            "plan",
            setter(("stages", 1, "usable_bytes"), 1),
            PLAN_CLIS,
        ),
        Case(
            "plan-fits-and-usable-edited",
            "plan",
            as_json(_does_not_fit),
            PLAN_CLIS,
            code=6,
        ),
        Case("plan-throughput-edited", "plan", setter(("throughput",), 1e9), PLAN_CLIS, code=6),
        Case(
            "plan-moment-edited",
            "plan",
            setter(("stages", 0, "peak_moment"), "optimizer step"),
            PLAN_CLIS,
            code=6,
        ),
    ]
    for name, constant in {"minus-2^40": -(2**40), "minus-2^48": -(2**48)}.items():
        cases.append(
            Case(
                f"plan-calibration-constant-{name}",
                "plan",
                setter(
                    ("calibration",),
                    {"scales": dict.fromkeys(COMPONENTS, 1.0)} | {"constant_bytes": constant},
                ),
                PLAN_CLIS,
            )
        )
    cases.append(
        Case(
            "plan-calibration-scales-zero",
            "plan",
            setter(("calibration",), {"scales": dict.fromkeys(COMPONENTS, 0), "constant_bytes": 0}),
            PLAN_CLIS,
        )
    )
    return cases


def cluster_cases() -> list[Case]:
    clis = ("plan-cluster",)
    chosen = ("gzip", "utf16-bom", "invalid-utf8", "nul-byte", "empty", "truncated")
    cases = [Case(f"cluster-{name}", "cluster", ENCODINGS[name], clis) for name in chosen]
    cases += [
        Case(f"cluster-{name}", "cluster", TOP_LEVEL[name], clis)
        for name in ("top-list", "deep-array")
    ]
    group = ("groups", 0)
    fields: dict[str, dict[str, Any]] = {
        "gpu_memory": {
            "1e400": "1e400",
            "1e30": "1e30",
            "2^64": 2**64,
            "minus1": -1,
            "zero": 0,
            "1.5": 1.5,
            "word": "lots",
            "long": "9" * 20_000,
        },
        "gpu_tflops": {"1e300": 1e300, "minus1": -1, "zero": 0, "string": "312", "tiny": 1e-300},
        "num_nodes": {"2^64": 2**64, "zero": 0, "1.5": 1.5, "minus1": -1},
        "gpus_per_node": {"2^20": 2**20, "zero": 0},
        "flops_efficiency": {"five": 5, "zero": 0},
        "intra_node_gb_per_s": {"zero": 0, "1e300": 1e300},
        "inter_node_gb_per_s": {"minus1": -1},
        "name": {
            "ansi": "\x1b[31mred",
            "surrogate": "\ud800",
            "empty": "",
            "overlong": "g" * 5000,
            "number": 5,
        },
    }
    for field, values in fields.items():
        for name, value in values.items():
            cases.append(
                Case(f"cluster-{field}-{name}", "cluster", setter((*group, field), value), clis)
            )
    for field in ("gpu_tflops", "flops_efficiency", "inter_node_gb_per_s"):
        for name in ("NaN", "Infinity"):
            cases.append(
                Case(
                    f"cluster-{field}-{name}",
                    "cluster",
                    literal((*group, field), BAD_NUMBERS[name]),
                    clis,
                )
            )
    for field in ("name", "num_nodes", "gpus_per_node", "gpu_memory", "gpu_tflops"):
        cases.append(Case(f"cluster-delete-{field}", "cluster", deleter((*group, field)), clis))
    for field in ("format", "version", "groups"):
        cases.append(Case(f"cluster-delete-top-{field}", "cluster", deleter((field,)), clis))
    cases += [
        Case("cluster-groups-empty", "cluster", setter(("groups",), []), clis),
        Case("cluster-groups-object", "cluster", setter(("groups",), {}), clis),
        Case(
            "cluster-duplicate-names",
            "cluster",
            as_json(lambda d: d["groups"].append(d["groups"][0])),
            clis,
        ),
        Case("cluster-format-plan", "cluster", setter(("format",), "plan"), clis),
    ]
    return cases


def calibration_cases() -> list[Case]:
    clis = ("evaluate-calibration", "plan-calibration", "sweep-calibration")
    chosen = ("gzip", "utf32-be", "invalid-utf8", "nul-byte", "empty", "truncated")
    cases = [Case(f"calibration-{name}", "calibration", ENCODINGS[name], clis) for name in chosen]
    cases += [
        Case(f"calibration-{name}", "calibration", TOP_LEVEL[name], clis)
        for name in ("top-list", "top-number", "deep-object")
    ]
    scale = ("scales", "weights")
    for name, value in {
        "1e300": 1e300,
        "1e7": 1e7,
        "101": 101,
        "zero": 0,
        "0.001": 0.001,
        "minus1": -1,
        "string": "x",
        "null": None,
        "list": [1],
    }.items():
        cases.append(Case(f"calibration-scale-{name}", "calibration", setter(scale, value), clis))
    for name in ("NaN", "Infinity", "1e400"):
        cases.append(
            Case(
                f"calibration-scale-{name}", "calibration", literal(scale, BAD_NUMBERS[name]), clis
            )
        )
    for name, value in {
        "2^64": 2**64,
        "2^60": 2**60,
        "2^41": 2**41,
        "minus-2^41": -(2**41),
        "minus-2^48": -(2**48),
        "minus-2^40": -(2**40),  # in the file's range: what the plan's stages admit refuses it
        "minus-2^35": -(2**35),  # more than a gpt-1.3b stage's activations and buffers
        "1.5": 1.5,
        "1e300": 1e300,
        "string": "100",
    }.items():
        cases.append(
            Case(
                f"calibration-constant-{name}",
                "calibration",
                setter(("constant_bytes",), value),
                clis,
            )
        )
    every_scale = ("scales",)
    for name, value in {"zero": 0, "minus1": -1, "NaN": math.nan}.items():
        if name == "NaN":
            mutate = literal(every_scale, "{" + ", ".join(f'"{c}": NaN' for c in COMPONENTS) + "}")
        else:
            mutate = setter(every_scale, dict.fromkeys(COMPONENTS, value))
        cases.append(Case(f"calibration-every-scale-{name}", "calibration", mutate, clis))
    cases += [
        Case(
            "calibration-unknown-component",
            "calibration",
            setter(("scales", "\x1b[31mweight"), 1.0),
            clis,
        ),
        Case("calibration-unknown-field", "calibration", setter(("w" * 3000,), 1), clis),
        Case("calibration-scales-list", "calibration", setter(("scales",), [1.0]), clis),
        Case("calibration-format", "calibration", setter(("format",), "layer-graph"), clis),
        Case("calibration-version", "calibration", setter(("version",), 2), clis),
        Case("calibration-delete-scales", "calibration", deleter(("scales",)), clis),
        Case("calibration-delete-constant", "calibration", deleter(("constant_bytes",)), clis),
    ]
    return cases


JSON_BYTES = b'0123456789-+.eE"{}[],:ntfxa \\'
"""Replacements that keep a file ASCII, so that a flip reaches the parser and the checks."""


def flip_cases() -> list[Case]:
    """Seeded random changes of 1 to 3 bytes, half to another JSON character and half to any
    byte: the file may stay valid, or not."""
    clis = {
        "graph": GRAPH_CLIS,
        "plan": PLAN_CLIS,
        "cluster": ("plan-cluster",),
        "calibration": ("evaluate-calibration",),
    }
    rng = random.Random(SEED)
    cases = []
    for kind, count in FLIPS.items():
        for i in range(count):
            flips = [
                (
                    rng.random(),
                    rng.choice(JSON_BYTES) if i % 2 == 0 else None,
                    rng.randrange(1, 256),
                )
                for _ in range(rng.randint(1, 3))
            ]
            cases.append(Case(f"{kind}-flip-{i}", kind, _flipper(flips), clis[kind], strict=False))
    return cases


def _flipper(flips: list[tuple[float, int | None, int]]) -> Mutation:
    """Each flip: at a fraction of the file, put ``byte`` (or, when None, XOR with ``mask``)."""

    def mutate(data: bytes) -> bytes:
        changed = bytearray(data)
        for where, byte, mask in flips:
            at = int(where * len(changed))
            changed[at] = byte if byte is not None else changed[at] ^ mask
        return bytes(changed)

    return mutate


def _zero_memory(document: dict) -> None:
    for layer in document["layers"]:
        for key in list(layer):
            if key not in ("name", "kind"):
                layer[key] = 0


def _at_limit(document: dict) -> None:
    for layer in document["layers"]:
        layer.pop("tp_activation_bytes", None)
        layer["activation_bytes"] = 2**48


def _self_loop(document: dict) -> None:
    document["edges"][0]["dst"] = document["edges"][0]["src"]


def _stage_layer_ansi(document: dict) -> None:
    document["stages"][0]["layers"][0] = "\x1b[2J\x1b[31mfits"


def _does_not_fit(document: dict) -> None:
    """fits false and stage 1's usable bytes 1: consistent in the file, not with the model."""
    document["fits"] = False
    document["stages"][1]["usable_bytes"] = 1


def _graph_path(name: str) -> Callable[[dict], None]:
    """Point the plan's graph.path at a file beside it (made by the fixture)."""

    def edit(document: dict) -> None:
        document["graph"]["path"] = name

    return edit


CASES = (
    graph_cases()
    + dag_cases()
    + plan_cases()
    + cluster_cases()
    + calibration_cases()
    + flip_cases()
)


# -- the command lines -------------------------------------------------------------------------

PLAN_FLAGS = [
    "--gpus",
    "2",
    "--pp",
    "2",
    "--global-batch",
    "8",
    "--micro-batch",
    "1",
    "--time-limit",
    "5",
]
EVALUATE_FLAGS = ["--pp", "2", "--split", "even", "--global-batch", "8"]
SWEEP_FLAGS = [
    "--gpus",
    "2",
    "--global-batch",
    "8",
    "--workers",
    "1",
    "--quiet",
    "--time-limit",
    "5",
]


def command(cli: str, path: str, extra: tuple[str, ...]) -> tuple[str, list[str]]:
    """(runner, argv) of one CLI reading ``path``."""
    if cli == "evaluate":
        return "evaluate", [path, *EVALUATE_FLAGS, *extra]
    if cli == "plan":
        return "plan", [path, *PLAN_FLAGS, *extra]
    if cli == "sweep":
        return "sweep", [path, *SWEEP_FLAGS, *extra]
    if cli == "evaluate-plan":
        return "evaluate", ["--plan", path, *extra]
    if cli == "validate":
        return "validate", [path, "--model", "gpt-tiny", "--timeout", "30", *extra]
    if cli == "plan-cluster":
        return "plan", [
            GPT_1_3B,
            "--cluster",
            path,
            "--global-batch",
            "8",
            "--pp",
            "2",
            "--micro-batch",
            "1",
            "--time-limit",
            "5",
            *extra,
        ]
    if cli == "evaluate-calibration":
        return "evaluate", [GPT_1_3B, *EVALUATE_FLAGS, "--calibration", path, *extra]
    if cli == "plan-calibration":
        return "plan", [GPT_1_3B, *PLAN_FLAGS, "--calibration", path, *extra]
    if cli == "sweep-calibration":
        return "sweep", [GPT_1_3B, *SWEEP_FLAGS, "--calibration", path, *extra]
    raise AssertionError(cli)


DRIVER = r"""
import contextlib, importlib, io, json, sys, time, traceback

RUNNERS = {
    "plan": ("solver.cli.plan", "plan_main"),
    "evaluate": ("solver.cli.evaluate", "evaluate_main"),
    "sweep": ("solver.cli.sweep", "sweep_main"),
    "validate": ("profiling.validate", "main"),
}
manifest_path, results_path = sys.argv[1:3]
results = {}
for entry in json.load(open(manifest_path)):
    module, name = RUNNERS[entry["runner"]]
    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = getattr(importlib.import_module(module), name)(entry["argv"])
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            code = "traceback"
            err.write(traceback.format_exc())
    results[entry["id"]] = {
        "code": code,
        "out": out.getvalue(),
        "err": err.getvalue(),
        "s": time.perf_counter() - started,
    }
json.dump(results, open(results_path, "w"))
"""
"""Runs every command line of the manifest in this one interpreter: main(argv), exit code,
stdout and stderr (a traceback is recorded, not raised)."""


# -- fixtures ----------------------------------------------------------------------------------


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict[str, Any]:
    """Writes every case's file, runs the driver once over every command line, and returns
    {"results": {run id: record}, "runs": {case id: [run ids]}, "before"/"after": digests}."""
    from solver.cli.plan import plan_main

    work = tmp_path_factory.mktemp("hostile")
    inputs = work / "inputs"
    inputs.mkdir()
    plan_path = work / "plan.json"
    with open(os.devnull, "w") as sink, _redirect(sink):
        code = plan_main([GPT_1_3B, *PLAN_FLAGS, "--json", str(plan_path), "--quiet"])
    assert code == 0
    # files a mutated plan's graph.path may point at
    (inputs / "graph.json.gz").write_bytes(gzip.compress(Path(GPT_1_3B).read_bytes(), mtime=0))
    os.mkfifo(work / "graph.fifo")  # no writer: reading it would wait forever
    document = Calibration(scales={"weights": 1.2}, constant_bytes=100).to_dict()
    bases = {
        "graph": Path(GPT_1_3B).read_bytes(),
        "dag": Path(T5_DAG).read_bytes(),
        "plan": plan_path.read_bytes(),
        "cluster": Path(MIXED_CLUSTER).read_bytes(),
        "calibration": json.dumps(document, indent=1).encode(),
    }
    manifest, runs = [], {}
    for case in CASES:
        path = inputs / f"{case.id}.json"
        path.write_bytes(case.mutate(bases[case.kind]))
        runs[case.id] = []
        for cli in case.clis:
            runner, argv = command(cli, str(path), case.extra)
            run_id = f"{case.id}/{cli}"
            manifest.append({"id": run_id, "runner": runner, "argv": argv})
            runs[case.id].append(run_id)
    before = _digest(inputs)
    results = run_driver(DRIVER, manifest, work, timeout=600)
    return {"results": results, "runs": runs, "before": before, "after": _digest(inputs)}


class _redirect:
    """stdout and stderr to ``sink`` (the fixture's own plan run prints nothing of interest)."""

    def __init__(self, sink):
        self.sink = sink

    def __enter__(self):
        self.saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = self.sink

    def __exit__(self, *exc):
        sys.stdout, sys.stderr = self.saved


# -- the tests ---------------------------------------------------------------------------------


def check_one_line_error(record: dict[str, Any]) -> None:
    err = record["err"]
    assert record["code"] != "traceback", err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), f"{len(lines)} stderr lines: {err[:2000]!r}"
    assert len(lines[0]) < MAX_LINE, f"{len(lines[0])} characters: {lines[0][:600]!r}"


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.strict], ids=lambda c: c.id)
def test_a_hostile_file_is_exit_2_in_one_line(outcome, case):
    for run_id in outcome["runs"][case.id]:
        record = outcome["results"][run_id]
        check_one_line_error(record)
        assert record["code"] == case.code, f"{run_id}: exit {record['code']}: {record['err']!r}"
        if case.code == 2:
            assert "fits" not in record["out"], f"{run_id}: {record['out'][:2000]}"


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if not c.strict], ids=lambda c: c.id)
def test_a_flipped_file_is_read_or_refused_in_one_line(outcome, case):
    for run_id in outcome["runs"][case.id]:
        record = outcome["results"][run_id]
        assert record["code"] in (0, 2, 3, 4, 6), f"{run_id}: {record['code']}: {record['err']!r}"
        if record["code"] == 0:
            assert "Traceback" not in record["err"]
        else:
            check_one_line_error(record)


@pytest.mark.slow
def test_no_input_file_is_changed_and_nothing_is_written_beside_them(outcome):
    assert outcome["after"] == outcome["before"]


@pytest.mark.slow
def test_every_cli_ran_and_the_driver_stays_fast(outcome):
    runners = {run_id.partition("/")[2] for run_id in outcome["results"]}
    assert runners == {
        "evaluate",
        "plan",
        "sweep",
        "evaluate-plan",
        "validate",
        "plan-cluster",
        "evaluate-calibration",
        "plan-calibration",
        "sweep-calibration",
    }
    slowest = max(outcome["results"].items(), key=lambda item: item[1]["s"])
    assert slowest[1]["s"] < 20, slowest[0]


@pytest.mark.slow
def test_error_lines_escape_what_they_quote(outcome):
    """A name with ANSI escapes, newlines or a lone surrogate is quoted escaped, and a
    document's top-level list is described, never reprinted."""
    results = outcome["results"]
    ansi = results["graph-name-ansi/evaluate"]["err"]
    assert "\x1b" not in ansi and "\\x1b[31mred" in ansi
    assert "\\ud800" in results["graph-name-lone-surrogate/evaluate"]["err"]
    assert "array of 20002 item(s)" in results["graph-top-list/evaluate"]["err"]
    assert "looks like a gzip file" in results["graph-gzip/evaluate"]["err"]
    assert "exceeds the limit 2^48" in results["graph-params-2^60/evaluate"]["err"]
    assert "the top level is an array" in results["plan-top-list-validate/validate"]["err"]
    assert "does not match the plan" in results["plan-other-model/validate"]["err"]
    assert "beyond the 2^62" in results["graph-at-limit-huge-batch/evaluate"]["err"]


# -- real interpreters: python -m, ASCII-only streams ------------------------------------------


def _python_m(module: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
        timeout=300,
    )


@pytest.mark.slow
def test_python_m_with_ascii_streams(tmp_path):
    """The CLIs as users run them, stdout and stderr ASCII-only: bad files are one line and
    exit 2; names that ASCII cannot encode are printed escaped, not a UnicodeEncodeError."""
    graph = json.loads(Path(GPT_1_3B).read_text())
    bad = copy.deepcopy(graph)
    bad["layers"][LAYER]["name"] = "x\ud800\x1b[31m"
    bad_path = tmp_path / "bad.json"
    bad_path.write_text(json.dumps(bad))
    wide = copy.deepcopy(graph)
    wide["layers"][0]["name"] = "\u5c42-\u00e9"
    wide_path = tmp_path / "wide.json"
    wide_path.write_text(json.dumps(wide, ensure_ascii=False), encoding="utf-8")
    packed = tmp_path / "graph.json.gz"
    packed.write_bytes(gzip.compress(Path(GPT_1_3B).read_bytes()))
    runs = [
        (_python_m("solver.plan", str(bad_path), *PLAN_FLAGS), 2),
        (_python_m("solver.evaluate", "--plan", str(packed)), 2),
        (_python_m("solver.sweep", str(bad_path), "--gpus", "2", "--global-batch", "8"), 2),
        (_python_m("solver.plan", GPT_1_3B, "--gpus", "8", "--gpu-memory", "1e400"), 2),
        (_python_m("profiling.validate", str(packed), "--model", "gpt-tiny"), 2),
        (_python_m("solver.evaluate", str(wide_path), *EVALUATE_FLAGS), 0),
    ]
    for done, expected in runs:
        err = done.stderr.decode("ascii")
        assert done.returncode == expected, (done.args, err)
        assert "Traceback" not in err, err
        if expected == 2:
            assert err.count("\n") == 1 and len(err) < MAX_LINE, err
            assert b"fits" not in done.stdout
    assert b"\\u5c42-\\xe9" in runs[-1][0].stdout


# -- the API: the same ranges as the flags -----------------------------------------------------


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Cluster(num_gpus=8, gpu_memory_bytes=10**30), "gpu_memory_bytes must be an"),
        (lambda: Cluster(num_gpus=8, gpu_flops=math.inf), "gpu_flops must be a finite number"),
        (lambda: Cluster(num_gpus=8, flops_efficiency=math.nan), "flops_efficiency must be"),
        (lambda: Cluster(num_gpus=8, inter_node_gb_per_s=-1.0), "inter_node_gb_per_s must be"),
        (lambda: Cluster(num_gpus=1.5), "num_gpus must be an integer in 1..2^32, got 1.5"),
        (lambda: Cluster(num_gpus=2**64), "num_gpus must be an integer in 1..2^32"),
        (lambda: TrainingConfig(global_batch=8, min_throughput=math.inf), "min_throughput"),
        (lambda: TrainingConfig(global_batch=8, min_throughput=1e-300), "an iteration of 1 ns"),
        (lambda: TrainingConfig(global_batch=8, max_slowdown=math.inf), "max_slowdown must be"),
        (lambda: TrainingConfig(global_batch=2**30), "global_batch must be an integer in"),
        (lambda: TrainingConfig(global_batch=8, optimizer_bytes_per_param=2**60), "0..256"),
    ],
)
def test_the_api_refuses_what_the_flags_refuse(build, message):
    with pytest.raises(InputError, match=re.escape(message)):
        build()


# -- the smaller ones: FIFOs, empty list items -------------------------------------------------


class _deadline:
    """SIGALRM after ``seconds`` raises TimeoutError in the test (a read that waits fails the
    test instead of hanging it)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        import signal

        def expired(signum, frame):
            raise TimeoutError(f"still waiting after {self.seconds} s")

        self.saved = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc):
        import signal

        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.saved)


def test_a_fifo_without_a_writer_is_refused_at_once(tmp_path, run_cli):
    """A FIFO given as the graph, or recorded as a plan's graph.path, with no writer: one line
    and exit 2 at once (it waited forever before); the recorded one is never opened."""
    from solver.cli.evaluate import evaluate_main
    from solver.cli.plan import plan_main

    fifo = tmp_path / "graph.fifo"
    os.mkfifo(fifo)
    with _deadline(20):
        code, out, err = run_cli(evaluate_main, str(fifo), *EVALUATE_FLAGS)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {fifo}: a FIFO (named pipe) with no writer, nothing to read")
    plan_path = tmp_path / "plan.json"
    assert run_cli(plan_main, GPT_1_3B, *PLAN_FLAGS, "--json", str(plan_path), "--quiet")[0] == 0
    document = json.loads(plan_path.read_text())
    document["graph"]["path"] = str(fifo)
    plan_path.write_text(json.dumps(document))
    with _deadline(20):
        code, out, err = run_cli(evaluate_main, "--plan", str(plan_path))
    assert code == 2 and out == "" and err.count("\n") == 1
    # quoted as every path from a file is (cut past 80 characters: xdist's tmp_path is longer)
    assert f"graph.path {quote(str(fifo))} is not a regular file (a FIFO, device or socket)" in err


def _unread(descriptor: int) -> int:
    """Bytes in a pipe not read yet (FIONREAD)."""
    import fcntl
    import struct
    import termios

    return struct.unpack("i", fcntl.ioctl(descriptor, termios.FIONREAD, b"\0" * 4))[0]


def test_a_fifo_with_a_writer_is_read(tmp_path, run_cli):
    """Process substitution (<(cat graph.json)) and a FIFO being written still work."""
    import threading
    import time

    from solver.cli.evaluate import evaluate_main

    fifo = tmp_path / "graph.fifo"
    os.mkfifo(fifo)
    data = Path(GPT_1_3B).read_bytes()
    descriptor = os.open(fifo, os.O_RDWR)  # a writer from now on (Linux: never waits)

    def write() -> None:
        view = memoryview(data)
        while view:  # waits while the pipe is full, until the reader takes it
            view = view[os.write(descriptor, view) :]
        while _unread(descriptor):  # closing before the reader took it all would drop it
            time.sleep(0.01)
        os.close(descriptor)  # the reader's end of file

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    with _deadline(20):
        code, out, err = run_cli(evaluate_main, str(fifo), *EVALUATE_FLAGS)
    writer.join(5)
    assert code == 0 and err == "" and "peak:" in out


@pytest.mark.parametrize(
    ("cli", "flags"),
    [
        ("plan", ["--virtual-stages", "1,,2"]),
        ("plan", ["--virtual-stages", "2,"]),
        ("plan", ["--micro-batch", ",1"]),
        ("plan", ["--cp", "1,,2"]),
        ("plan", ["--ep", "1,,2"]),
        ("plan", ["--bytes-per-param", "2,,4,12"]),
        ("sweep", ["--gpu-memory", "40GiB,,80GiB"]),
        ("evaluate", ["--split", "1,,2"]),
        ("evaluate", ["--virtual-stages", "1,"]),
    ],
)
def test_an_empty_item_of_a_list_option_is_refused(run_cli, cli, flags):
    """Every comma-list option: an empty item is an error naming the flag, never skipped."""
    from solver.cli.evaluate import evaluate_main
    from solver.cli.plan import plan_main
    from solver.cli.sweep import sweep_main

    main, base = {
        "plan": (plan_main, [GPT_1_3B, *PLAN_FLAGS]),
        "sweep": (sweep_main, [GPT_1_3B, *SWEEP_FLAGS]),
        "evaluate": (evaluate_main, [GPT_1_3B, "--pp", "2", "--global-batch", "8"]),
    }[cli]
    if cli == "evaluate" and flags[0] != "--split":
        base = [*base, "--split", "even"]
    code, out, err = run_cli(main, *base, *flags)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "empty item" in err and flags[0] in err
