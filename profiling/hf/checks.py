"""The fields of an ``hf:`` config checked before transformers sees them.

A config.json (or a ``--set``) may hold anything: ``"n_layer": "12"``, ``null``, ``12.5``, a
negative position count, 7 heads for 768 hidden dimensions, a hidden size of 1e9. Left to
transformers and torch these end deep in a model build with a traceback (a strict-dataclass
error, ``random_ expects 'from' to be less than 'to'``, ``Storage size calculation overflowed``).
:func:`check_config` refuses them first, each with one line naming the field, the value and
the fix. Nothing here is a per-model list:

- **Types**: every field the config class declares (its dataclass fields, or for an older
  transformers its ``__init__`` defaults) whose annotation is made of ``int``, ``float``,
  ``bool``, ``str`` and ``None`` is checked against it; an integer field takes an integer (not
  ``12.0``, ``"12"``, ``true`` or ``null`` unless it is optional). Every integer fits in torch's
  int64.
- **Ranges**: the standard sizes transformers gives every model (``hidden_size``,
  ``num_hidden_layers``, ``vocab_size``, ... through the class's ``attribute_map``: GPT-2's
  ``n_embd`` is its ``hidden_size``) and every tensor dimension (``*_size``, ``*_dim``, ``d_*``,
  ``*_channels``, ...) are >= 1 (>= 0 where the class's default is 0); every other count
  (``num_*``, ``n_*``, ``*_layers``, ``*_heads``, ``*_experts``) is >= 0 (0 may mean none: no
  shared experts, no MTP layers). Token ids and fields with a negative default (-1 as "unset")
  are left alone: the Hub has configs with ``pad_token_id: -1``.
- **Divisibility**: ``hidden_size`` is a multiple of ``num_attention_heads`` unless the config
  sets ``head_dim`` (T5's ``d_kv``), and ``num_attention_heads`` a multiple of
  ``num_key_value_heads``, for every class whose own defaults keep these rules (all but 3 of
  transformers' 820 config classes; ``test_hostile_models`` checks every default config passes).
- **Tensor size**: the largest weight, about ``hidden_size x max(4 hidden_size, vocab_size,
  positions, 2 experts x intermediate_size)`` elements of 4 bytes (transformers builds in fp32),
  stays under torch's limit of 2^63 bytes per tensor (a hidden size of 1e9 makes a 1e9 x 3e9
  attention weight: ``Storage size calculation overflowed``, even under fake tensors).

:func:`field_hint` names the fields an exception of transformers or torch is about (by the numbers
its message quotes), for the errors no check foresaw.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from typing import Any

from solver.errors import InputError, quote

INT64_MAX = 2**63 - 1
"""Largest integer a torch tensor size or int64 field holds."""
TENSOR_BYTES_LIMIT = 2**63
"""torch's limit on one tensor's storage, bytes (its size is an int64)."""
BUILD_BYTES_PER_ELEMENT = 4
"""Bytes per weight element as transformers builds a model (fp32), for the tensor-size check."""

STANDARD_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    "num_experts",
    "num_labels",
)
"""transformers' standard names of sizes and counts (each class maps its own spelling to them
with ``attribute_map``): each is >= 1 where the config gives it."""

_COUNT = re.compile(r"(^|_)(num|n)_|_layers$|_heads$|_experts$|_positions$")
"""Field names that hold a count (never an id, an index or a sentinel): 0 may mean none."""
_SIZE = re.compile(r"_size$|_dim$|^d_|_channels$|^(vocab|hidden|intermediate)|_inner$")
"""Field names that hold a tensor dimension: 0 makes zero-element weights (torch warns)."""
_TOKEN_ID = re.compile(r"_token_ids?$")

_KIND_NAMES = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "none": "null",
}


def check_config(config_class, raw: dict[str, Any], overrides: dict[str, Any], *, source: str):
    """InputError (one line: the file or ``--set``, the field, the value, the fix) for the first
    field of ``raw`` (config.json) or ``overrides`` (``--set``) that breaks the rules of the module
    docstring; ``config_class`` is the transformers class of the config's ``model_type``."""
    declared = _declared(config_class)
    aliases = dict(getattr(config_class, "attribute_map", {}) or {})
    values: dict[str, Any] = {name: default for name, (_, default) in declared.items()}
    given: dict[str, str] = {}  # field -> where it was given (for messages)
    for origin, fields in ((source, raw), (f"{source}: --set", overrides)):
        for key, value in fields.items():
            name = aliases.get(key, key)
            where = f"{origin} {key}" if origin.endswith("--set") else f"{origin}: {key}"
            _check_type(value, declared.get(name), name, where)
            values[name], given[name] = value, where
    standard = {alias: aliases.get(alias, alias) for alias in STANDARD_SIZES}
    for name, value in values.items():
        if name in given and not isinstance(value, bool) and isinstance(value, int):
            _check_range(name, value, declared.get(name), standard, given[name])
    defaults = {name: default for name, (_, default) in declared.items()}
    _check_divisibility(values, defaults, standard, given, source)
    _check_tensor_size(values, standard, given, source)


def _declared(config_class) -> dict[str, tuple[frozenset[str] | None, Any]]:
    """field -> (the kinds of value its annotation allows, None when not checked; its default)."""
    result: dict[str, tuple[frozenset[str] | None, Any]] = {}
    if dataclasses.is_dataclass(config_class):
        for field in dataclasses.fields(config_class):
            default = None if field.default is dataclasses.MISSING else field.default
            result[field.name] = (_kinds(field.type), default)
    else:  # transformers < 5: keyword arguments of __init__; an int default takes an int or null
        for parameter in inspect.signature(config_class.__init__).parameters.values():
            default = parameter.default
            if isinstance(default, int) and not isinstance(default, bool):
                result[parameter.name] = (frozenset({"int", "none"}), default)
    for name, member in vars(_base_config(config_class)).items():
        if isinstance(member, property) and member.fset and name not in result:
            annotation = inspect.get_annotations(member.fget).get("return")
            result[name] = (_kinds(annotation) if annotation else None, None)
    return result


def _base_config(config_class):
    """transformers' PreTrainedConfig (PretrainedConfig before 5), the class of ``num_labels``."""
    for klass in config_class.__mro__:
        if klass.__name__ in ("PreTrainedConfig", "PretrainedConfig"):
            return klass
    return config_class


def _kinds(annotation) -> frozenset[str] | None:
    """The value kinds an annotation allows (``int | None`` -> {int, none}); None when it allows
    anything beyond int, float, bool, str and None (a list, a dict, a Literal: not checked)."""
    if isinstance(annotation, str):
        parts = [part.strip() for part in annotation.split("|")]
    elif isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        parts = list(typing.get_args(annotation))
    else:
        parts = [annotation]
    kinds = set()
    for part in parts:
        name = part if isinstance(part, str) else getattr(part, "__name__", None)
        name = "none" if name in ("None", "NoneType") or part is None else name
        if name not in _KIND_NAMES:
            return None
        kinds.add(name)
    return frozenset(kinds)


def _kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if value is None:
        return "none"
    for kind in (int, float, str):
        if isinstance(value, kind):
            return kind.__name__
    return "array" if isinstance(value, (list, tuple)) else "object"


def _check_type(value: Any, declared, name: str, where: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        raise InputError(
            f"{where}: {quote(value, 40)} does not fit in 64 bits (|value| <= 2^63 - 1); no "
            "field takes such a number"
        )
    kinds = declared[0] if declared else None
    if declared is None and _TOKEN_ID.search(name):  # a generation field (decoder_start_...)
        kinds = frozenset({"int", "none"})
    kind = _kind_of(value)
    if kinds is None or kind in kinds or (kind == "int" and "float" in kinds):
        return
    wanted = " or ".join(_KIND_NAMES[k] for k in sorted(kinds, key=list(_KIND_NAMES).index))
    fix = f"give {wanted}"
    if "int" in kinds and isinstance(value, float) and value.is_integer():
        fix = f"write {int(value)}, without a decimal point"
    elif "int" in kinds and isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        fix = f"write {value.strip()}, without quotes"
    described = {"array": "an array", "object": "an object"}.get(kind, _KIND_NAMES.get(kind))
    shown = "" if kind in ("none", "array", "object") else f" ({quote(value, 40)})"
    raise InputError(f"{where}: {described}{shown}, not {wanted}; {fix}")


def _check_range(name: str, value: int, declared, standard: dict[str, str], where: str) -> None:
    """Counts and sizes (by name) of integer fields: a field that also takes a float (a dropout
    written as 0) or a field the class does not declare (but a standard size) is not checked."""
    kinds, default = declared if declared else (None, None)
    if _TOKEN_ID.search(name) or (isinstance(default, int) and default < 0):
        return
    if (kinds and "float" in kinds) or (declared is None and name not in standard.values()):
        return
    if name in standard.values() or _SIZE.search(name):
        low = 0 if default == 0 else 1
    elif _COUNT.search(name):
        low = 0  # 0 may mean "none" (no shared experts, no MTP layers, all layers MoE)
    else:
        return
    if value < low:
        what = "a count" if low == 0 else "a size or count, at least 1"
        raise InputError(f"{where}: {value} is out of range ({what}); give an integer >= {low}")


def _check_divisibility(values, defaults, standard, given, source: str) -> None:
    """The rules hold only for a class whose own defaults keep them (one that reads a missing
    ``head_dim`` as ``hidden_size // num_attention_heads`` may have defaults that do not)."""
    hidden_name, heads_name, kv_name = (
        standard[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads")
    )
    hidden, heads, kv_heads = (values.get(name) for name in (hidden_name, heads_name, kv_name))

    def positive(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    def kept_by_defaults(total: str, part: str) -> bool:
        total, part = defaults.get(total), defaults.get(part)
        return not (positive(total) and positive(part)) or total % part == 0

    if positive(hidden) and positive(heads) and values.get(standard["head_dim"]) is None:
        if hidden % heads and kept_by_defaults(hidden_name, heads_name):
            where = given.get(heads_name) or given.get(hidden_name) or source
            raise InputError(
                f"{where}: {heads_name} {heads} does not divide {hidden_name} {hidden} (each head "
                f"takes {hidden_name} / {heads_name} dimensions); choose a head count that "
                f"divides {hidden}"
            )
    if (
        positive(heads)
        and positive(kv_heads)
        and heads % kv_heads
        and kept_by_defaults(heads_name, kv_name)
    ):
        where = given.get(kv_name) or given.get(heads_name) or source
        raise InputError(
            f"{where}: {kv_name} {kv_heads} does not divide {heads_name} {heads} (each K/V head "
            f"serves an equal group of query heads); choose a K/V head count that divides {heads}"
        )


def _check_tensor_size(values, standard, given, source: str) -> None:
    def size(key: str) -> int:
        value = values.get(standard[key])
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    hidden, name = size("hidden_size"), standard["hidden_size"]
    if hidden <= 0:
        return
    experts = max(size("num_experts"), 1)
    candidates = {
        f"4 x {name}": 4 * hidden,
        standard["vocab_size"]: size("vocab_size"),
        standard["max_position_embeddings"]: size("max_position_embeddings"),
        f"2 x {experts} x {standard['intermediate_size']}": 2 * experts * size("intermediate_size"),
    }
    other, columns = max(candidates.items(), key=lambda item: item[1])
    total = hidden * columns * BUILD_BYTES_PER_ELEMENT
    if total < TENSOR_BYTES_LIMIT:
        return
    where = given.get(name) or f"{source}: {name}"
    raise InputError(
        f"{where}: {hidden} makes a weight of {hidden} x {columns} ({other}) elements, {total:.3g} "
        f"bytes in fp32, past torch's limit of 2^63 bytes a tensor; give a smaller {name}"
    )


def field_hint(config, message: str, given: dict[str, Any]) -> str:
    """``" (check n_head 7, n_embd 768)"``: the fields of ``config`` whose value a torch or
    transformers error message quotes (an integer other than 0 and 1, or a quoted string), those
    in ``given`` (``--set``) first; "" when none matches."""
    numbers = {int(text) for text in re.findall(r"(?<![\w.])-?\d+(?![\w.])", message)} - {0, 1}
    words = set(re.findall(r"'([^']{1,80})'", message))
    try:
        fields = config.to_dict()
    except Exception:  # noqa: BLE001 - a hint only
        fields = dict(vars(config))
    aliases = dict(getattr(type(config), "attribute_map", {}) or {})
    user = {aliases.get(key, key) for key in given}

    def quoted(value) -> bool:
        if isinstance(value, bool):
            return False
        return (
            value in numbers
            if isinstance(value, int)
            else isinstance(value, str) and (value in words)
        )

    found = sorted(
        (name for name, value in fields.items() if quoted(value)),
        key=lambda name: (name not in user, name),
    )
    if not found:
        return ""
    return " (check " + ", ".join(f"{name} {fields[name]!r}" for name in found[:3]) + ")"
