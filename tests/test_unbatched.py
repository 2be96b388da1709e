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


# -- the cost model ------------------------------------------------------------------------------


def coefficients(layer_fields: dict, *, b: int, tp: int = 1, sp: bool = False):
    """(stored, transient) bytes per GPU and micro-batch of the one-layer graph's layer."""
    from solver.costs import layer_costs
    from solver.specs import Cluster, ParallelConfig, TrainingConfig

    graph = graph_from_dict(document(**layer_fields))
    config = ParallelConfig(pp=1, tp=tp, dp=1, micro_batch=b, num_microbatches=2, sp=sp)
    training = TrainingConfig(global_batch=config.global_batch, runtime="megatron")
    costs = layer_costs(graph, config, Cluster(num_gpus=tp), training)
    return int(costs.stored_bytes[0]), int(costs.transient_bytes[0])


def test_a_micro_batch_holds_the_shared_part_once():
    """A 6,000 B (4,000 TP-split), T 8,000, at the weight gradients 3,000; F_A 1,000 (a mask),
    F_T 2,000, F_W 1,500, b 3: saved b (A' - F) + F, whole on every TP rank, also under SP."""
    shared = {
        "unbatched_activation_bytes": 1_000,
        "unbatched_transient_bytes": 2_000,
        "unbatched_weight_grad_transient_bytes": 1_500,
    }
    # stored 3 (6000 - 1000) + 1000; transient max(3 8000 - 2 2000, 3 3000 - 2 1500)
    assert coefficients(shared, b=3) == (16_000, 20_000)
    assert coefficients({}, b=3) == (18_000, 24_000)
    # tp 2: A' = 2000 + 4000 / 2, 3 (4000 - 1000) + 1000
    assert coefficients(shared, b=3, tp=2)[0] == 10_000
    # tp 2 with SP: A' = 6000 / 2, 3 (3000 - 1000 / 2) + 1000
    assert coefficients(shared, b=3, tp=2, sp=True)[0] == 8_500
    assert coefficients({}, b=3, tp=2, sp=True)[0] == 9_000
    # at b 1 the figures are X(1): unchanged without SP (under SP the mask is whole: + F / 2)
    assert coefficients(shared, b=1) == coefficients({}, b=1)
    assert coefficients(shared, b=1, tp=2) == coefficients({}, b=1, tp=2)
    assert coefficients(shared, b=1, tp=2, sp=True)[0] == 3_000 + 500


def test_the_shared_part_is_capped_and_a_negative_one_adds():
    """F_A above the replicated part (6000 - 4000) counts as that part; F_T < 0 (a copy batch 1
    skips) adds (b - 1) |F|: never below b X."""
    capped = {"unbatched_activation_bytes": 5_000}
    assert coefficients(capped, b=3, tp=2)[0] == 3 * 4_000 - 2 * 2_000
    assert coefficients(capped, b=3)[0] == 3 * 6_000 - 2 * 2_000
    skipped = {"unbatched_transient_bytes": -500, "unbatched_activation_bytes": -100}
    assert coefficients(skipped, b=3) == (18_000 + 200, 24_000 + 1_000)
    assert coefficients(skipped, b=1) == coefficients({}, b=1)


@pytest.mark.parametrize("seed", range(12))
def test_backends_and_brute_force_agree_with_shared_parts(seed):
    """Random chains with batch-independent parts on every layer: the chain algorithm, CP-SAT
    and the MILP agree with brute force (all read the same coefficients)."""
    import random

    from solver.backends.brute_force import solve_brute_force
    from tests.random_graphs import random_chain, random_problem
    from tests.test_agreement import solve_all

    rng = random.Random(7000 + seed)
    graph = random_chain(rng, rng.randint(3, 7)).to_dict()
    for layer in graph["layers"]:
        activation, transient = layer["activation_bytes"], layer.get("transient_bytes", 0)
        layer["unbatched_activation_bytes"] = rng.randint(-activation, activation)
        layer["unbatched_transient_bytes"] = rng.randint(-transient, transient)
    problem = random_problem(rng, graph_from_dict(graph))
    values = solve_all(problem)
    assert set(values.values()) == {solve_brute_force(problem).objective}
