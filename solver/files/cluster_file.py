"""Cluster files (``--cluster cluster.json``, docs/cluster.md): node groups -> :class:`Cluster`.

One group is a homogeneous cluster, exactly what the equivalent flags build (same plans); two or
more make a heterogeneous one (``Cluster.groups``). Every problem is a one-line ``InputError``
naming the file, the field and the fix.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jsonschema

from solver.errors import InputError, quote
from solver.files.jsonfile import check_name, read_json, schema_message
from solver.specs import (
    GB_PER_S_RANGE,
    GPU_TFLOPS_RANGE,
    MAX_DEGREE,
    MAX_GPU_MEMORY_BYTES,
    MAX_GPUS_PER_NODE,
    MAX_P2P_LATENCY_US,
    Cluster,
    NodeGroup,
)
from solver.units import parse_bytes

FORMAT_NAME = "cluster"
FORMAT_VERSION = 1

_GB_PER_S = {"type": "number", "minimum": GB_PER_S_RANGE[0], "maximum": GB_PER_S_RANGE[1]}
GROUP_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "num_nodes", "gpus_per_node", "gpu_memory", "gpu_tflops"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "num_nodes": {"type": "integer", "minimum": 1, "maximum": MAX_DEGREE},
        "gpus_per_node": {"type": "integer", "minimum": 1, "maximum": MAX_GPUS_PER_NODE},
        "gpu_memory": {"type": ["string", "integer"]},
        "gpu_tflops": {
            "type": "number",
            "minimum": GPU_TFLOPS_RANGE[0],
            "maximum": GPU_TFLOPS_RANGE[1],
        },
        "flops_efficiency": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "intra_node_gb_per_s": _GB_PER_S,
        "inter_node_gb_per_s": _GB_PER_S,
        "memory_gb_per_s": _GB_PER_S,
        "p2p_latency_us": {"type": "number", "minimum": 0, "maximum": MAX_P2P_LATENCY_US},
    },
}
"""A group's fields and their ranges (``solver.specs``: 1 MFLOP/s to 1 EFLOP/s, 1 MB/s to 1 PB/s,
at most 1024 GPUs per node and 1 PiB per GPU)."""
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["format", "version", "groups"],
    "properties": {
        "format": {"const": FORMAT_NAME},
        "version": {"const": FORMAT_VERSION},
        "description": {"type": "string"},
        "groups": {"type": "array", "minItems": 1, "items": GROUP_SCHEMA},
    },
}


def load_cluster(source: str | Path | dict[str, Any]) -> Cluster:
    """The :class:`Cluster` of a cluster file (a path, or an already-parsed dict)."""
    if isinstance(source, dict):
        return cluster_from_dict(source, origin="<dict>")
    document = read_json(source, kind="cluster", fix="pass the path of a cluster JSON file")
    return cluster_from_dict(document, origin=str(source))


def cluster_from_dict(document: Any, *, origin: str = "<dict>") -> Cluster:
    """Validate a parsed cluster document and build the cluster."""
    _check_schema(document, origin)
    groups = []
    for i, item in enumerate(document["groups"]):
        where = f"{origin}: $.groups[{i}]"
        check_name(item["name"], f"{where}.name", what="group name")
        memory = parse_bytes(
            item["gpu_memory"], what=f"{where}.gpu_memory", maximum=MAX_GPU_MEMORY_BYTES
        )
        try:
            group = NodeGroup(
                name=item["name"],
                num_nodes=item["num_nodes"],
                gpus_per_node=item["gpus_per_node"],
                gpu_memory_bytes=memory,
                gpu_flops=float(item["gpu_tflops"]) * 1e12,
                flops_efficiency=float(item.get("flops_efficiency", 0.5)),
                intra_node_gb_per_s=float(item.get("intra_node_gb_per_s", 450.0)),
                inter_node_gb_per_s=float(item.get("inter_node_gb_per_s", 50.0)),
                memory_gb_per_s=float(item.get("memory_gb_per_s", 3350.0)),
                p2p_latency_us=float(item.get("p2p_latency_us", 0.0)),
            )
        except InputError as error:  # NaN from a dict (a file has none: read_json)
            raise InputError(f"{where}: {error}") from None
        groups.append(group)
    names = [group.name for group in groups]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise InputError(
            f"{origin}: $.groups: name {quote(duplicates[0])} is used twice; give each group "
            "its own name"
        )
    if len(groups) == 1:
        group = groups[0]
        return Cluster(
            num_gpus=group.num_gpus,
            gpu_memory_bytes=group.gpu_memory_bytes,
            gpus_per_node=group.gpus_per_node,
            gpu_flops=group.gpu_flops,
            flops_efficiency=group.flops_efficiency,
            intra_node_gb_per_s=group.intra_node_gb_per_s,
            inter_node_gb_per_s=group.inter_node_gb_per_s,
            memory_gb_per_s=group.memory_gb_per_s,
            p2p_latency_us=group.p2p_latency_us,
        )
    return Cluster(
        num_gpus=sum(group.num_gpus for group in groups),
        gpu_memory_bytes=max(group.gpu_memory_bytes for group in groups),
        gpus_per_node=math.gcd(*(group.gpus_per_node for group in groups)),
        gpu_flops=min(group.gpu_flops for group in groups),
        flops_efficiency=min(group.flops_efficiency for group in groups),
        intra_node_gb_per_s=min(group.intra_node_gb_per_s for group in groups),
        inter_node_gb_per_s=min(group.inter_node_gb_per_s for group in groups),
        memory_gb_per_s=min(group.memory_gb_per_s for group in groups),
        p2p_latency_us=max(group.p2p_latency_us for group in groups),
        groups=tuple(groups),
    )


def _check_schema(document: Any, origin: str) -> None:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    if not errors:
        return
    error = jsonschema.exceptions.best_match(errors)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        hint = f"remove it; allowed keys: {', '.join(allowed)}"
    elif error.validator == "required":
        hint = "add the missing field (see docs/cluster.md)"
    elif error.validator == "const":
        hint = f"set it to {error.validator_value!r}".replace("'", '"')
    else:
        hint = "see docs/cluster.md for the field's type and range"
    raise InputError(f"{origin}: {error.json_path}: {schema_message(error)}; {hint}")
