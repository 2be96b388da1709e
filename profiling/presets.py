"""Zoo presets at other sizes, for ``python -m solver.sweep --find max-scale``: a function from
a size (layers or hidden) to the preset's layer graph, profiled under fake tensors.

The sweep CLI finds this module as the ``zoo`` entry point of the ``memplan.graph_sources``
group (pyproject.toml; ``solver.cli.sweep.GRAPH_SOURCES``): the module is the source, its
:func:`preset_scale` and :func:`preset_graph_of` what the CLI calls."""

from __future__ import annotations

from collections.abc import Callable

from solver.errors import InputError
from solver.graph import LayerGraph
from solver.sweep.studies import SCALES


def preset_graph_of(
    preset: str, scale: str, *, batch: int = 1, seq: int | None = None
) -> Callable[[int], LayerGraph]:
    """size -> the layer graph of zoo ``preset`` with its ``scale`` field set to size (profiled
    under fake tensors by ``profiling.export``; needs torch, the ``profiling`` extra)."""
    if scale not in SCALES:
        raise InputError(f"--scale {scale!r}: choose one of {', '.join(SCALES)}")
    try:
        from profiling.export import export_graph
    except ImportError as error:
        raise InputError(
            f"--find max-scale profiles the model and needs torch ({error}); "
            "install it with pip install -e '.[profiling]'"
        ) from None
    cache: dict[int, LayerGraph] = {}

    def graph_of(size: int) -> LayerGraph:
        if size not in cache:
            overrides = {SCALES[scale]: size}
            cache[size] = export_graph(preset, batch=batch, seq=seq, overrides=overrides)
        return cache[size]

    return graph_of


def preset_scale(preset: str, scale: str) -> tuple[int, int]:
    """(the preset's current value of ``scale``, the step between valid sizes): hidden sizes
    stay multiples of the head count."""
    try:
        import models
    except ImportError as error:
        raise InputError(f"--find max-scale needs torch ({error})") from None
    try:
        config = models.get(preset).config
    except ValueError as error:
        raise InputError(f"--model {preset}: {error}") from None
    name = SCALES.get(scale)
    if name is None or not hasattr(config, name):
        raise InputError(
            f"--scale {scale}: {preset} has no {name or scale!r} field; "
            f"choose one of {', '.join(s for s in SCALES if hasattr(config, SCALES[s]))}"
        )
    step = getattr(config, "heads", 1) if scale == "hidden" else 1
    return getattr(config, name), step
