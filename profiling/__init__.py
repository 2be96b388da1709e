"""Profiling: a PyTorch model -> its layer graph, and a plan -> a real run that measures it
(docs/profiling.md, docs/running.md).

    python -m profiling.export gpt3-175b --out graph.json     # fake tensors, any size
    python -m profiling.validate plan.json --model gpt-tiny   # run a plan: measured vs predicted
    python -m profiling.calibrate --model gpt-tiny            # fit the memory model to runs

    from profiling import profile_module, export_graph, run_plan, format_reports

The public API is re-exported here lazily, so ``import profiling`` stays cheap (no torch until
a name is used).

Subpackages by role:

- ``trace/``: fake-tensor (or real) profiling of one forward + backward: ``profile``
  (``profile_module``), ``dataflow`` (storage provenance, live memory), ``tensor_parallel``
  (Megatron split rule), ``experts``, ``attention_kv``, ``timing`` and ``time_terms`` (real-mode
  times), ``memory`` (the live-tensor tracker of real runs), ``graph_builder`` (trace ->
  LayerGraph), ``layers`` (default layer granularity).
- ``hf/``: HuggingFace transformers models from bundled configs (``hf:NAME``), their loss and
  the private transformers APIs used (``_transformers_compat``).
- ``executors/``: one rank of a real run: ``base`` (what every executor shares), ``torch_zoo``
  (zoo models on torch pipelining), ``traced`` (any model, cut by tracing), ``megatron*``
  (megatron-core), ``parallelize`` (TP/DP wrappers), and ``dispatch`` (picks the executor; none
  of them imports it); ``preload`` (what the ranks' fork server imports).
- ``run`` (``run_plan``: check a plan, launch the ranks, collect the reports), ``presets``
  (zoo presets at other sizes for ``solver.sweep --find max-scale``, found through the
  ``memplan.graph_sources`` entry point), and the CLIs ``export``, ``validate``, ``calibrate``.
- ``_torch_compat``: every private torch API used, with its canary in
  tests/test_torch_compat.py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from profiling.export import export_graph
    from profiling.run import format_reports, run_plan
    from profiling.trace.profile import profile_module

_EXPORTS = {
    "profile_module": "profiling.trace.profile",
    "export_graph": "profiling.export",
    "run_plan": "profiling.run",
    "format_reports": "profiling.run",
}
"""Public name -> the module that defines it (imported on first use)."""

__all__ = ["export_graph", "format_reports", "profile_module", "run_plan"]


def __getattr__(name: str) -> Any:
    """The public API, imported on first use (``import profiling`` imports no torch)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'profiling' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
