"""Random small layer graphs and per-config problems for property tests (seeded, reproducible)."""

from __future__ import annotations

import dataclasses
import random

from solver.backends.problem import OBJECTIVE_MEMORY, StageProblem
from solver.costs import layer_costs
from solver.graph import LayerGraph, graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig


def random_layer(rng: random.Random, name: str) -> dict:
    params = rng.randint(1, 60) * 1000
    activation = rng.randint(1, 40) * 100
    layer = {
        "name": name,
        "params": params,
        "tp_params": rng.choice([0, params // 2, params]),
        "activation_bytes": activation,
        "tp_activation_bytes": rng.choice([0, activation // 2]),
        "output_bytes": rng.randint(1, 30) * 10,
        "fwd_flops": rng.randint(1, 50) * 1e9,
        "tp_comm_bytes": rng.choice([0, 1000]),
        "transient_bytes": rng.choice([0, 0, 0, rng.randint(1, 50) * 100]),
    }
    return layer


def random_chain(rng: random.Random, num_layers: int) -> LayerGraph:
    layers = [random_layer(rng, f"l{i}") for i in range(num_layers)]
    return graph_from_dict(
        {"format": "layer-graph", "version": 1, "model": "random-chain", "layers": layers}
    )


def random_dag(rng: random.Random, num_layers: int) -> LayerGraph:
    """A chain backbone plus random forward skip edges and one parallel branch (not a chain)."""
    layers = [random_layer(rng, f"l{i}") for i in range(num_layers)]
    edges = {(i, i + 1) for i in range(num_layers - 1)}
    if num_layers >= 4:
        # a branch: layer 1 also feeds layer 3 directly, and layer 2 is skipped over by 1 -> 3
        edges.add((1, 3))
    for _ in range(rng.randint(1, 3)):
        u = rng.randrange(num_layers - 1)
        v = rng.randrange(u + 1, num_layers)
        edges.add((u, v))
    if num_layers >= 5 and rng.random() < 0.5:
        edges.discard((2, 3))  # layer 2 becomes a side branch 1 -> 2 -> 4
        edges.add((2, 4))
    return graph_from_dict(
        {
            "format": "layer-graph",
            "version": 1,
            "model": "random-dag",
            "layers": layers,
            "edges": [
                {"src": f"l{u}", "dst": f"l{v}", "bytes": rng.randint(1, 30) * 10}
                for u, v in sorted(edges)
            ],
        }
    )


def one_tensor_per_producer(graph: LayerGraph) -> LayerGraph:
    """``graph`` with every edge of a producer carrying its one output tensor (``Edge.tensor``
    "<src>:0", the bytes of the producer's first edge), so a tensor can be read on several
    later stages."""
    document = graph.to_dict()
    sizes: dict[str, int] = {}
    for edge in document["edges"]:
        edge["bytes"] = sizes.setdefault(edge["src"], edge["bytes"])
        edge["tensor"] = f"{edge['src']}:0"
    return graph_from_dict(document)


def with_unsaved_output(graph: LayerGraph, nbytes: int) -> LayerGraph:
    """``graph`` with ``meta.unsaved_output_bytes`` = ``nbytes`` per sample: the model's output
    the torch pipeline keeps for its loss (``LayerCosts.held_output_bytes``)."""
    document = graph.to_dict()
    document["meta"] = {**document.get("meta", {}), "unsaved_output_bytes": nbytes}
    return graph_from_dict(document)


def random_config(rng: random.Random, num_layers: int) -> ParallelConfig:
    pp = rng.randint(1, min(4, num_layers))
    return ParallelConfig(
        pp=pp,
        tp=rng.choice([1, 2]),
        dp=rng.choice([1, 2, 4]),
        micro_batch=rng.choice([1, 2]),
        num_microbatches=rng.choice([1, 2, 3, 8]),
        zero=rng.choice([0, 1, 2, 3]),
        recompute=rng.choice(["none", "none", "full"]),
        schedule=rng.choice(["1f1b", "1f1b", "gpipe"]),
    )


def short_pipeline(
    rng: random.Random, config: ParallelConfig, *, selective: bool
) -> ParallelConfig:
    """``config`` with a random schedule, m around p (1..3 under GPipe, 1..p + 1 under 1F1B) and
    selective recomputation, or none or full at random."""
    schedule = rng.choice(["gpipe", "1f1b"])
    return dataclasses.replace(
        config,
        schedule=schedule,
        num_microbatches=rng.randint(1, 3 if schedule == "gpipe" else config.pp + 1),
        recompute="selective" if selective else rng.choice(["none", "full"]),
    )


def random_problem(
    rng: random.Random,
    graph: LayerGraph,
    *,
    objective: str = OBJECTIVE_MEMORY,
    capacity_bytes: int | None = None,
    iteration_budget_ns: int | None = None,
    **training_options,
) -> StageProblem:
    """A random config's problem; ``training_options``: TrainingConfig fields (e.g. runtime)."""
    config = random_config(rng, graph.num_layers)
    cluster = Cluster(num_gpus=config.num_gpus)
    training = TrainingConfig(global_batch=config.global_batch, **training_options)
    return StageProblem(
        costs=layer_costs(graph, config, cluster, training),
        objective=objective,
        capacity_bytes=capacity_bytes,
        iteration_budget_ns=iteration_budget_ns,
    )
