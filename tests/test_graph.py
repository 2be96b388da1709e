"""Layer-graph format v1: loading, defaults, round trip, and every kind of bad input."""

from __future__ import annotations

import copy
import json

import networkx as nx
import pytest

from solver.errors import InputError
from solver.graph import graph_from_dict, load_graph

BASE = {
    "format": "layer-graph",
    "version": 1,
    "model": "tiny",
    "meta": {"seq_len": 16},
    "layers": [
        {
            "name": "embed",
            "params": 100,
            "tp_params": 80,
            "activation_bytes": 10,
            "output_bytes": 32,
        },
        {
            "name": "block",
            "params": 400,
            "activation_bytes": 64,
            "tp_activation_bytes": 32,
            "output_bytes": 32,
            "fwd_flops": 1e6,
        },
        {
            "name": "head",
            "params": 200,
            "activation_bytes": 40,
            "output_bytes": 4,
            "transient_bytes": 128,
            "fwd_ms": 0.5,
            "bwd_ms": 1.0,
        },
    ],
}


def with_change(change) -> dict:
    document = copy.deepcopy(BASE)
    change(document)
    return document


def test_chain_edges_default_to_output_bytes():
    graph = graph_from_dict(BASE)
    assert graph.is_chain
    assert [(e.src, e.dst, e.bytes) for e in graph.edges] == [
        ("embed", "block", 32),
        ("block", "head", 32),
    ]
    assert graph.layers[0].tp_activation_bytes == 0
    assert graph.layers[1].bwd_flops is None


def test_networkx_and_round_trip(tmp_path):
    graph = graph_from_dict(BASE)
    dag = graph.to_networkx()
    assert isinstance(dag, nx.DiGraph)
    assert list(nx.topological_sort(dag)) == ["embed", "block", "head"]
    assert dag.nodes["head"]["transient_bytes"] == 128
    assert dag.edges["embed", "block"]["bytes"] == 32
    path = tmp_path / "g.json"
    graph.save(path)
    again = load_graph(path)
    assert again.layers == graph.layers and again.edges == graph.edges
    assert again.meta == {"seq_len": 16}


def test_dag_with_explicit_edges():
    document = with_change(
        lambda d: d.update(
            edges=[
                {"src": "embed", "dst": "block", "bytes": 32},
                {"src": "embed", "dst": "head", "bytes": 8},
                {"src": "block", "dst": "head", "bytes": 32},
            ]
        )
    )
    graph = graph_from_dict(document)
    assert not graph.is_chain
    assert graph.to_dict()["edges"][1] == {"src": "embed", "dst": "head", "bytes": 8}


def test_malformed_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"format": "layer-graph",')
    with pytest.raises(InputError, match=r"bad\.json: not valid JSON \(line 1"):
        load_graph(path)


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="file not found"):
        load_graph(tmp_path / "nope.json")


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (
            lambda d: d["layers"][1].pop("params"),
            r"\$\.layers\[1\]: 'params' is a required property; add the missing field",
        ),
        (
            lambda d: d["layers"][0].update(params=-5),
            r"\$\.layers\[0\]\.params: -5 is less than the minimum of 0",
        ),
        (
            lambda d: d["layers"][0].update(output_bytes="12"),
            r"\$\.layers\[0\]\.output_bytes: '12' is not of type 'integer'",
        ),
        (
            lambda d: d["layers"][0].update(paramz=1),
            r"\$\.layers\[0\]: Additional properties are not allowed \('paramz'.*allowed keys: ",
        ),
        (lambda d: d.update(format="graph"), r"\$\.format: 'layer-graph' was expected"),
        (lambda d: d.update(version=2), r"\$\.version: 1 was expected; set it to 1"),
        (lambda d: d.update(layers=[]), r"\$\.layers: \[\] should be non-empty"),
        (
            lambda d: d["layers"][0].update(tp_params=101),
            r"\$\.layers\[0\]\.tp_params: 101 exceeds params \(100\)",
        ),
        (
            lambda d: d["layers"][1].update(tp_activation_bytes=65),
            r"\$\.layers\[1\]\.tp_activation_bytes: 65 exceeds activation_bytes \(64\)",
        ),
        (
            lambda d: d["layers"][2].update(name="embed"),
            r"\$\.layers\[2\]\.name: duplicate layer name 'embed' \(also \$\.layers\[0\]\)",
        ),
        (lambda d: d["layers"][2].pop("bwd_ms"), r"only one of fwd_ms/bwd_ms"),
        (
            lambda d: d.update(edges=[{"src": "embed", "dst": "nope", "bytes": 1}]),
            r"\$\.edges\[0\]\.dst: unknown layer 'nope'",
        ),
        (
            lambda d: d.update(
                edges=[
                    {"src": "embed", "dst": "block", "bytes": 1},
                    {"src": "block", "dst": "embed", "bytes": 1},
                ]
            ),
            r"\$\.edges: the graph has a cycle",
        ),
        (
            lambda d: d.update(edges=[{"src": "head", "dst": "block", "bytes": 1}]),
            r"not in topological order: edge \$\.edges\[0\] goes from 'head' \(layer 2\) back",
        ),
        (
            lambda d: d.update(edges=[{"src": "head", "dst": "head", "bytes": 1}]),
            r"self-loop on 'head'",
        ),
        (
            lambda d: d.update(
                edges=[
                    {"src": "embed", "dst": "head", "bytes": 1},
                    {"src": "embed", "dst": "head", "bytes": 2},
                ]
            ),
            r"duplicate edge 'embed' -> 'head'",
        ),
    ],
)
def test_bad_graph_is_one_clear_line(tmp_path, change, pattern):
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(with_change(change)))
    with pytest.raises(InputError, match=pattern) as caught:
        load_graph(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert "\n" not in message
