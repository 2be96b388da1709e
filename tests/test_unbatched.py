"""Batch-independent bytes (the layer graph's ``unbatched_*`` fields, ``solver.costs.unbatched``):
the format's checks, and the cost model's b (X - F) + F against figures worked out by hand."""

from __future__ import annotations

import copy

import pytest

from solver.errors import InputError
from solver.graph import graph_from_dict

BLOCK = {
    "name": "block",
    "params": 400,
    "activation_bytes": 6_000,
    "tp_activation_bytes": 4_000,
    "output_bytes": 1_000,
    "transient_bytes": 8_000,
    "weight_grad_transient_bytes": 3_000,
}


def document(**fields) -> dict:
    return {
        "format": "layer-graph",
        "version": 1,
        "model": "tiny",
        "layers": [{**copy.deepcopy(BLOCK), **fields}],
    }


def test_signed_fields_load_and_absent_ones_are_none():
    graph = graph_from_dict(
        document(unbatched_activation_bytes=1_024, unbatched_transient_bytes=-786)
    )
    (layer,) = graph.layers
    assert layer.unbatched_activation_bytes == 1_024
    assert layer.unbatched_transient_bytes == -786
    assert layer.unbatched_weight_grad_transient_bytes is None
    again = graph_from_dict(graph.to_dict())
    assert again.layers[0] == layer


@pytest.mark.parametrize(
    ("key", "value", "figure"),
    [
        ("unbatched_activation_bytes", 6_001, "activation_bytes (6000)"),
        ("unbatched_transient_bytes", 8_001, "transient_bytes (8000)"),
        ("unbatched_weight_grad_transient_bytes", 3_001, "weight_grad_transient_bytes (3000)"),
        # absent: the figure is the whole transient
        ("unbatched_attention_backward_transient_bytes", 8_001, "(8000)"),
    ],
)
def test_a_part_above_its_figure_is_refused(key, value, figure):
    with pytest.raises(InputError) as error:
        graph_from_dict(document(**{key: value}))
    assert key in str(error.value) and figure in str(error.value)


def test_a_part_beyond_the_limit_is_refused_either_sign():
    for value in (2**49, -(2**49)):
        with pytest.raises(InputError, match="exceeds the limit 2"):
            graph_from_dict(document(unbatched_transient_bytes=value))


def test_a_non_integer_part_is_refused():
    with pytest.raises(InputError, match="unbatched_activation_bytes"):
        graph_from_dict(document(unbatched_activation_bytes=1.5))
