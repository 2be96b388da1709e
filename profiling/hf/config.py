"""Where an ``hf:NAME`` config comes from: a local path, a bundled config, or the HF cache / Hub.

Lookup order (the first that applies wins):

1. **A local path that exists**: a directory (what ``save_pretrained`` writes; its
   ``config.json`` is read) or a file (``hf:path/to/config.json``). A name that looks like a path
   (``./x``, ``/x``, ``~/x``, ``x.json``, more than one ``/``) but does not exist is an error; it
   never reaches the Hub.
2. **A bundled config**: ``profiling/hf/configs/NAME.json`` (``hf:gpt2``, ``hf:llama-2-7b``, ...,
   ``bundled_configs()``), always offline.
3. **The HF cache, then the Hub**: ``hf:ORG/NAME`` (or a bare legacy id such as ``gpt2-medium``)
   through transformers' ``PreTrainedConfig.get_config_dict``: first from the local cache
   (``HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``) without any network request, then,
   unless ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``), downloaded from the Hub (only
   ``config.json``, never weights). A cached copy wins over the Hub: the profile of a name does
   not change under the user's feet (``hf download ORG/NAME config.json`` refreshes it).

Everything here returns the config as a plain dict plus a short description of where it came
from; ``profiling.hf.models`` turns it into a transformers config and a model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solver.errors import InputError
from solver.files.jsonfile import check_document, read_json

CONFIG_DIR = Path(__file__).with_name("configs")
"""The bundled configs: copies of the Hub's config.json, one file per short name."""


@dataclass(frozen=True, kw_only=True)
class FoundConfig:
    raw: dict[str, Any]
    """The config.json contents."""
    source: str
    """Where it was read: a file path, or ``HF cache``/``Hub`` plus the repo id (for messages)."""


def bundled_configs() -> list[str]:
    """The short names of the bundled configs, sorted."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.json"))


def find_config(name: str) -> FoundConfig:
    """The config of ``hf:NAME`` by the lookup order of the module docstring.

    Raises InputError (one line naming the path, cache or field) for a missing path, a directory
    without config.json, invalid JSON, or a hub name that is neither cached nor downloadable.
    """
    path = Path(name).expanduser()
    if path.exists():
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise InputError(
                f"hf:{name}: directory {path} has no config.json; give a directory written by "
                "save_pretrained() or hf:path/to/config.json"
            )
        return FoundConfig(raw=read_config_file(file), source=str(file))
    if _looks_like_path(name):
        raise InputError(f"hf:{name}: no such file or directory")
    bundled = CONFIG_DIR / f"{name}.json"
    if bundled.is_file():
        return FoundConfig(raw=read_config_file(bundled), source=f"bundled {bundled.name}")
    return _from_hub(name)


def read_config_file(path: Path) -> dict[str, Any]:
    """A config.json as a dict, read by the project's one reading path
    (``solver.files.jsonfile.read_json``: size, encoding, syntax, nesting at most 64 levels,
    finite numbers); InputError naming the file otherwise."""
    return read_json(
        path,
        kind="config.json",
        fix="give a directory written by save_pretrained() or hf:path/to/config.json",
    )


def _looks_like_path(name: str) -> bool:
    """True for names that are meant as paths (a hub repo id is NAME or ORG/NAME)."""
    return (
        name.startswith((".", "/", "~"))
        or name.endswith(".json")
        or name.count("/") > 1
        or "\\" in name
    )


def _from_hub(name: str) -> FoundConfig:
    """``name``'s config.json from the HF cache, else (online) from the Hub."""
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError
    from transformers import PreTrainedConfig

    try:
        huggingface_hub.utils.validate_repo_id(name)
    except HFValidationError:
        raise InputError(
            f"hf:{name}: no such file, bundled config ({', '.join(bundled_configs())}) or "
            "hub model id (ORG/NAME)"
        ) from None
    cache = huggingface_hub.constants.HF_HUB_CACHE
    try:
        raw, _ = PreTrainedConfig.get_config_dict(name, local_files_only=True)
        check_document(raw, f"hf:{name}: the cached config.json in {cache}")
        return FoundConfig(raw=raw, source=f"HF cache {name}")
    except OSError:
        pass  # not cached: the Hub, when online
    except json.JSONDecodeError as error:
        raise InputError(
            f"hf:{name}: the cached config.json in {cache} is not valid JSON "
            f"({error.msg}, line {error.lineno})"
        ) from None
    except RecursionError:
        raise InputError(
            f"hf:{name}: the cached config.json in {cache} is nested deeper than the JSON reader "
            "can follow; a config.json nests a few levels"
        ) from None
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        flag = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
        raise InputError(
            f"hf:{name}: no such bundled config or local path, and not in the HF cache {cache} "
            f"({flag}=1: no download); unset {flag} to fetch config.json, "
            f"run `hf download {name} config.json` online, or give hf:path/to/dir"
        )
    try:
        raw, _ = PreTrainedConfig.get_config_dict(name)
    except RecursionError:
        raise InputError(
            f"hf:{name}: the Hub's config.json is nested deeper than the JSON reader can follow"
        ) from None
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(
            f"hf:{name}: no such bundled config or local path, not in the HF cache {cache}, "
            f"and the Hub answered: {first}"
        ) from None
    check_document(raw, f"hf:{name}: the Hub's config.json")
    return FoundConfig(raw=raw, source=f"Hub {name}")
