"""What the graph says of each boundary tensor changes the torch runtime's buffers
(``costs.direct_buffer_adjustments``): a tensor that needs no gradient gets no gradient
receive buffers at its sender, a received tensor no layer of the stage counts in its stored
bytes takes all m receive buffers, and a sent tensor a layer of the sender counts is not held
again. By hand on a T5-like graph (the HF T5 4|3|3 misses), every backend against brute force,
the graph fields, and the profiler's flags on a traced T5."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from solver.backends.cpsat import CpSatFormulation
from solver.backends.problem import OBJECTIVE_MEMORY, StageProblem
from solver.costs import stage_costs
from solver.errors import InputError
from solver.graph import graph_from_dict
from solver.specs import ParallelConfig
from tests.conftest import assert_backends_match_brute_force, fp32_adam_costs
from tests.random_graphs import random_config, random_dag, short_pipeline

LAYERS = [
    {"name": name, "params": 10, "activation_bytes": 50, "output_bytes": 8}
    for name in ("enc", "dec0", "dec1")
]
# per sample: the encoder output (8 B, saved by both blocks, counted by dec0), dec0's output
# (7 B, counted by dec1), a position bias (5 B, requires grad, dec1 does not save it) and a
# constant bias (3 B, no grad, counted by its producer dec0, as T5's block 0 does)
EDGES = [
    {"src": "enc", "dst": "dec0", "bytes": 8, "tensor": "enc:0", "saved": True, "charged": True},
    {"src": "enc", "dst": "dec1", "bytes": 8, "tensor": "enc:0", "saved": True},
    {"src": "dec0", "dst": "dec1", "bytes": 7, "tensor": "dec0:0", "saved": True, "charged": True},
    {"src": "dec0", "dst": "dec1", "bytes": 5, "tensor": "dec0:1", "saved": False},
    {
        "src": "dec0",
        "dst": "dec1",
        "bytes": 3,
        "tensor": "dec0:2",
        "saved": True,
        "requires_grad": False,
        "src_charged": True,
    },
]


def graph_of(edges):
    return graph_from_dict(
        {
            "format": "layer-graph",
            "version": 1,
            "model": "t5-like",
            "layers": LAYERS,
            "edges": edges,
        }
    )


def unflagged(edges):
    keep = ("src", "dst", "bytes", "tensor")
    return [{key: edge[key] for key in keep if edge.get(key) is not None} for edge in edges]


GPIPE = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=2, num_microbatches=4, schedule="gpipe")


def test_t5_like_split_by_hand():
    """Split enc dec0 | dec1, GPipe, m = k = 4, b = 2. Without the fields stage 0 keeps
    S = m + k = 8 copies of every sent tensor and stage 1 R = m - k = 0. With them:

      stage 0: enc:0 counted by dec0 (S = m = 4), dec0:0 (S = 8), dec0:1 (S = 8), dec0:2 no
               grad and counted by dec0 (S = 0)
      stage 1: enc:0 saved by dec1 but counted by dec0 (R = m = 4), dec0:0 counted by dec1
               (R = 0), dec0:1 not saved (R = 4), dec0:2 saved by dec1, counted by dec0 (R = 4)
    """
    split = np.array([0, 0, 1])
    old = stage_costs(fp32_adam_costs(graph_of(unflagged(EDGES)), GPIPE), split)
    new = stage_costs(fp32_adam_costs(graph_of(EDGES), GPIPE), split)
    b = 2
    assert old[0].buffer_bytes == 8 * b * (8 + 7 + 5 + 3)
    assert old[1].buffer_bytes == 0
    assert new[0].buffer_bytes == b * (4 * 8 + 8 * 7 + 8 * 5 + 0 * 3)
    assert new[1].buffer_bytes == b * (4 * 8 + 0 * 7 + 4 * 5 + 4 * 3)
    for before, after in zip(old, new, strict=True):
        assert after.peak_bytes - after.buffer_bytes == before.peak_bytes - before.buffer_bytes
    # the megatron runtime is unchanged
    megatron = [
        [
            s.peak_bytes
            for s in stage_costs(fp32_adam_costs(graph_of(e), GPIPE, runtime="megatron"), split)
        ]
        for e in (EDGES, unflagged(EDGES))
    ]
    assert megatron[0] == megatron[1]


def test_optimizer_step_keeps_no_gradient_buffers_of_a_constant():
    """At the optimizer step nothing is held: R0 = S0 = m, less the m gradient buffers of the
    constant (``optimizer_step_moment``)."""
    from solver.costs import boundary_bytes, direct_buffer_adjustments, stage_buffer_bytes

    costs = fp32_adam_costs(graph_of(EDGES), GPIPE)
    split = np.array([0, 0, 1])
    into, out_of, _ = boundary_bytes(costs, split)
    adjust = direct_buffer_adjustments(costs, split)
    assert stage_buffer_bytes(costs, 0, 0, 0, into, out_of, adjust) == 4 * 2 * (8 + 7 + 5)
    assert stage_buffer_bytes(costs, 1, 0, 0, into, out_of, adjust) == 4 * 2 * (8 + 7 + 5 + 3)


def test_plain_chains_stay_chains_and_flagged_ones_do_not():
    chain = [
        {"src": "enc", "dst": "dec0", "bytes": 8, "saved": True, "charged": True},
        {"src": "dec0", "dst": "dec1", "bytes": 8, "saved": True, "charged": True},
    ]
    assert fp32_adam_costs(graph_of(chain), GPIPE).is_chain()
    constant = [chain[0], {**chain[1], "requires_grad": False}]
    assert not fp32_adam_costs(graph_of(constant), GPIPE).is_chain()
    assert fp32_adam_costs(graph_of(constant), GPIPE, runtime="megatron").is_chain()


def test_graph_fields_round_trip_and_bad_ones_are_refused():
    graph = graph_of(EDGES)
    again = graph_from_dict(graph.to_dict())
    assert again.edges == graph.edges
    assert graph.to_dict()["edges"][1] == EDGES[1]
    with pytest.raises(InputError, match=r"edges\[0\]\.charged: true needs saved"):
        graph_of([{**EDGES[0], "saved": False}])
    bad = [EDGES[0], {**EDGES[1], "requires_grad": False}]
    with pytest.raises(InputError, match=r"edges\[1\]\.tensor: 'enc:0' also names"):
        graph_of(bad)


def flagged_dag(rng: random.Random, num_layers: int):
    """A random DAG whose producers send one tensor to all consumers, each tensor with random
    requires_grad and src_charged, each edge saved or not and at most one charged edge."""
    document = random_dag(rng, num_layers).to_dict()
    sizes: dict[str, int] = {}
    roles: dict[str, tuple[bool, bool]] = {}
    charged: set[str] = set()
    for edge in document["edges"]:
        src = edge["src"]
        edge["bytes"] = sizes.setdefault(src, edge["bytes"])
        edge["tensor"] = f"{src}:0"
        grad, by_src = roles.setdefault(src, (rng.random() < 0.6, rng.random() < 0.25))
        edge["requires_grad"], edge["src_charged"] = grad, by_src
        edge["saved"] = rng.random() < 0.7
        if edge["saved"] and not by_src and src not in charged and rng.random() < 0.6:
            edge["charged"] = True
            charged.add(src)
    return graph_from_dict(document)


@pytest.mark.parametrize("lifetime", ["step", "persistent"])
@pytest.mark.parametrize("seed", range(10))
def test_backends_agree_with_flagged_tensors(seed, lifetime):
    """torch runtime, DAGs whose tensors carry the fields, GPipe and 1F1B, both gradient
    lifetimes (step: the first-backward rows; with a step temporary: the optimizer-step row):
    CP-SAT and the MILP reach brute force's optimum of the cost model."""
    rng = random.Random(41000 + seed)
    while True:
        graph = flagged_dag(rng, rng.randint(4, 6))
        config = random_config(rng, graph.num_layers)
        if config.pp >= 2:
            break
    config = short_pipeline(rng, config, selective=seed % 3 == 2)
    costs = fp32_adam_costs(graph, config, lifetime=lifetime)
    assert not costs.plain_boundaries
    assert_backends_match_brute_force(StageProblem(costs=costs, objective=OBJECTIVE_MEMORY))


@pytest.mark.parametrize("seed", range(4))
def test_backends_agree_with_flagged_tensors_interleaved(seed):
    """The same with two chunks per rank (the per-tensor terms in every in-flight vector's
    row)."""
    rng = random.Random(42000 + seed)
    graph = flagged_dag(rng, 4 + rng.randint(0, 1))
    config = ParallelConfig(
        pp=2, tp=1, dp=1, micro_batch=rng.choice([1, 2]), num_microbatches=2, virtual_stages=2
    )
    costs = fp32_adam_costs(graph, config)
    assert_backends_match_brute_force(StageProblem(costs=costs, objective=OBJECTIVE_MEMORY))


def test_the_formulation_hints_the_counted_indicators_exactly():
    """A hint of any split fixes every variable, w included, at that split's peak."""
    from ortools.sat.python import cp_model

    config = dataclasses.replace(GPIPE, pp=3)
    graph = graph_from_dict(
        {
            "format": "layer-graph",
            "version": 1,
            "model": "t5-like",
            "layers": [*LAYERS, {**LAYERS[0], "name": "head"}],
            "edges": [*EDGES, {"src": "dec1", "dst": "head", "bytes": 8}],
        }
    )
    costs = fp32_adam_costs(graph, config, lifetime="step")
    problem = StageProblem(costs=costs, objective=OBJECTIVE_MEMORY)
    for split in ([0, 1, 2, 2], [0, 0, 1, 2], [0, 1, 1, 2], [0, 1, 2, 2]):
        formulation = CpSatFormulation(problem)
        assert formulation._counted
        formulation.set_hint(split)
        solver = cp_model.CpSolver()
        solver.parameters.fix_variables_to_their_hinted_value = True
        solver.parameters.num_workers = 1
        assert solver.solve(formulation.model) == cp_model.OPTIMAL
        peak = max(stage.peak_bytes for stage in stage_costs(costs, split))
        assert solver.objective_value == peak


@pytest.mark.slow
def test_traced_t5_edges_say_which_tensors_need_grad_and_who_counts_them():
    """The profiler's fields on the T5 of ``scripts/bench_accuracy.py`` (fp32, seq 64): the
    zero cross-attention bias needs no grad and its producer counts it; the self-attention
    position bias is not saved as received by decoder.block.1; the encoder output is counted by
    decoder.block.0 and saved again by decoder.block.1. Split 4|3|3 (GPipe, m 8) then moves
    8 x (65,536 + 65,536 + 16,384) B from stage 1 to stage 2."""
    from profiling.export import export_graph
    from tests.run_any_factories import TINY_HF_MODELS

    name, overrides = TINY_HF_MODELS["t5"]
    graph = export_graph(name, dtype="fp32", seq=64, overrides=overrides)
    encoder_out = [
        (e.dst, e.bytes, e.requires_grad, e.saved, e.charged, e.src_charged)
        for e in graph.edges
        if e.src == "encoder.final_layer_norm"
    ]
    assert sorted(encoder_out) == [
        ("decoder.block.0", 16384, True, True, True, False),
        ("decoder.block.1", 16384, True, True, False, False),
        ("decoder.embed_tokens", 512, False, True, True, False),
    ]
    edges = [e for e in graph.edges if (e.src, e.dst) == ("decoder.block.0", "decoder.block.1")]
    assert sorted((e.bytes, e.requires_grad, e.saved, e.src_charged) for e in edges) == [
        (16384, True, True, False),
        (65536, False, True, True),
        (65536, True, False, False),
    ]
    config = ParallelConfig(pp=3, tp=1, dp=1, micro_batch=1, num_microbatches=8, schedule="gpipe")
    split = np.repeat([0, 1, 2], [4, 3, 3])
    plain = graph_from_dict(
        {**graph.to_dict(), "edges": unflagged([dataclasses.asdict(e) for e in graph.edges])}
    )
    old, new = (
        [s.peak_bytes for s in stage_costs(fp32_adam_costs(g, config), split)]
        for g in (plain, graph)
    )
    moved = 8 * (65536 + 65536 + 16384)
    assert [b - a for a, b in zip(old, new, strict=True)] == [0, -moved, moved]
