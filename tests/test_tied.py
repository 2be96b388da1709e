"""Tied parameters under pipeline parallelism (solver/costs/embeddings.py): the profile marks the
layer that shares a parameter counted elsewhere (``tied_params``), a stage holding it without
the owner keeps its own copy with gradient and optimizer state, and the copies' gradient
all-reduce joins both ranks' tails; every backend plans with it."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.problem import StageProblem
from solver.costs import layer_costs, stage_costs
from solver.errors import InputError
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.random_graphs import random_layer
from tests.test_agreement import solve_all

VOCAB, HIDDEN = 1024, 64
TABLE = VOCAB * HIDDEN


def lm_graph(*, tied: bool = True, blocks: int = 4) -> dict:
    """Embedding, blocks, an LM head whose weight is the embedding's (counted there)."""
    rng = random.Random(7)
    head = {"name": "head", "params": 0, "activation_bytes": 5000, "output_bytes": 4}
    if tied:
        head["tied_params"] = {"embed": TABLE}
    layers = [
        {"name": "embed", "params": TABLE, "activation_bytes": 100, "output_bytes": 400},
        *(random_layer(rng, f"b{i}") for i in range(blocks)),
        head,
    ]
    return {"format": "layer-graph", "version": 1, "model": "tied-lm", "layers": layers}


def peaks(document: dict, config: ParallelConfig, split: list[int], **training):
    graph = graph_from_dict(document)
    costs = layer_costs(
        graph,
        config,
        Cluster(num_gpus=config.num_gpus),
        TrainingConfig(global_batch=config.global_batch, **training),
    )
    return costs, stage_costs(costs, split)


@pytest.mark.parametrize(
    ("runtime", "zero", "dp", "per_param"),
    [
        ("megatron", 0, 1, 2 + 4 + 12),  # bf16 weights, fp32 main_grad, Adam
        ("torch", 0, 1, 2 + 2 + 12),
        ("megatron", 1, 2, 2 + 4 + 12 // 2),  # the distributed optimizer shards the Adam state
    ],
)
def test_last_stage_holds_its_own_copy_of_the_tied_embedding(runtime, zero, dp, per_param):
    config = ParallelConfig(pp=2, tp=1, dp=dp, zero=zero, micro_batch=1, num_microbatches=4)
    split = [0, 0, 0, 1, 1, 1]
    options = {"runtime": runtime, "optimizer_impl": "fused"}  # no step temporary: exact
    _, tied = peaks(lm_graph(), config, split, **options)
    _, untied = peaks(lm_graph(tied=False), config, split, **options)
    assert tied[0].peak_bytes == untied[0].peak_bytes  # the owner's stage: unchanged
    grown = tied[1].peak_bytes - untied[1].peak_bytes
    states = lambda s: s.weight_bytes + s.grad_bytes + s.optimizer_bytes  # noqa: E731
    assert states(tied[1]) - states(untied[1]) == TABLE * per_param
    # the copy's weight gradient is the last stage's largest temporary (2 B, bf16 weights)
    assert grown == TABLE * per_param + max(0, 2 * TABLE - untied[1].transient_bytes)


@pytest.mark.parametrize("micro_batch", [1, 4])
def test_one_stage_holds_one_copy_and_the_partial_gradients_autograd_sums(micro_batch):
    """p = 1: no copy (the states are the untied graph's); the table's partial gradients are
    batch-independent terms (embeddings.tied_gradient_bytes): B = w n from the head's
    backward through every block's to the embedding's, whose weight-gradient moment holds its
    own partial and the held one beside the sum (gtemp)."""
    config = ParallelConfig(pp=1, tp=1, dp=1, micro_batch=micro_batch, num_microbatches=4)
    costs_tied, tied = peaks(lm_graph(), config, [0] * 6)
    costs_untied, untied = peaks(lm_graph(tied=False), config, [0] * 6)
    states = lambda s: s.weight_bytes + s.grad_bytes + s.optimizer_bytes  # noqa: E731
    assert states(tied[0]) == states(untied[0])
    table = 2 * TABLE  # bf16 weights: gradients made in bf16
    grown = costs_tied.transient_bytes - costs_untied.transient_bytes
    assert grown[0] == 2 * table  # its own partial and the held one (gtemp: the sum)
    assert list(grown[1:-1]) == [table] * 4  # each block's backward holds the head's partial
    assert costs_tied.transient_bytes[-1] == table  # the head: its partial (no transient here)
    assert tied[0].peak_bytes > untied[0].peak_bytes


def test_the_copies_gradient_all_reduce_joins_both_ranks_tails():
    """g n bytes over the link between the first and the last pipeline ranks (intra-node: one
    node of 8 here), on the owner's and on the copy's rank."""
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4)
    cluster = Cluster(num_gpus=2)
    costs_tied, tied = peaks(lm_graph(), config, [0, 0, 0, 1, 1, 1])
    costs_untied, untied = peaks(lm_graph(tied=False), config, [0, 0, 0, 1, 1, 1])
    sync = -(-4 * TABLE // int(cluster.intra_node_gb_per_s))  # fp32 main_grad, bytes / (B/ns)
    step = lambda costs: costs.optimizer_step_ns  # noqa: E731
    assert step(costs_tied)[0] - step(costs_untied)[0] == pytest.approx(sync, abs=1)
    # the head's own step now covers the copy too: its step time grows by the copy's step
    assert step(costs_tied)[-1] > step(costs_untied)[-1] + sync - 2
    assert tied[0].optimizer_step_ns > untied[0].optimizer_step_ns


@pytest.mark.parametrize("seed", range(8))
def test_backends_agree_on_a_tied_chain(seed):
    """CP-SAT, the MILP, the chain DP and brute force find one optimum, and each split's peak
    recomputes from the cost model (the copy is a coefficient of the head's layer)."""
    rng = random.Random(500 + seed)
    document = lm_graph(blocks=rng.randint(2, 5))
    config = ParallelConfig(
        pp=rng.choice([2, 3]),
        tp=1,
        dp=rng.choice([1, 2]),
        zero=rng.choice([0, 1, 3]),
        micro_batch=1,
        num_microbatches=rng.choice([2, 4, 8]),
        schedule=rng.choice(["1f1b", "gpipe"]),
    )
    graph = graph_from_dict(document)
    costs = layer_costs(
        graph,
        config,
        Cluster(num_gpus=config.num_gpus),
        TrainingConfig(global_batch=config.global_batch),
    )
    problem = StageProblem(costs=costs)
    oracle = solve_brute_force(problem)
    assert set(solve_all(problem).values()) == {oracle.objective}
    untied = layer_costs(
        graph_from_dict(lm_graph(tied=False, blocks=graph.num_layers - 2)),
        config,
        Cluster(num_gpus=config.num_gpus),
        TrainingConfig(global_batch=config.global_batch),
    )
    assert oracle.objective >= solve_brute_force(StageProblem(costs=untied)).objective


@pytest.mark.parametrize(
    ("tied", "message"),
    [
        ({"nowhere": 5}, "'nowhere' is no layer of the graph"),
        ({"head": 5}, "'head' is the layer itself"),
        ({"embed": TABLE + 1}, f"exceeds the params ({TABLE}) of 'embed'"),
    ],
)
def test_a_bad_tied_entry_is_one_line(tied, message):
    document = lm_graph()
    document["layers"][-1]["tied_params"] = tied
    with pytest.raises(InputError) as error:
        graph_from_dict(document, origin="g.json")
    text = str(error.value)
    assert "\n" not in text and text.startswith("g.json: $.layers[5].tied_params")
    assert message in text


def test_plan_cli_refuses_a_bad_tied_entry(tmp_path, capsys):
    from solver.cli.plan import plan_main as main

    document = lm_graph()
    document["layers"][-1]["tied_params"] = {"embed": 0}
    path = tmp_path / "g.json"
    path.write_text(json.dumps(document))
    assert main([str(path), "--gpus", "2", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "tied_params" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.json"]


def test_saving_keeps_the_field():
    graph = graph_from_dict(lm_graph())
    again = graph_from_dict(json.loads(json.dumps(graph.to_dict())))
    assert again.layers[-1].tied_params == {"embed": TABLE}
    assert dataclasses.asdict(again.layers[-1]) == dataclasses.asdict(graph.layers[-1])


@pytest.mark.slow
def test_the_profile_marks_the_tied_head():
    """A zoo GPT with tied embeddings: the head's layer names the embedding's table."""
    import models
    from profiling.trace.profile import profile_module

    spec = models.get("gpt-tiny", tied_embeddings=True, layers=2, seq_len=32)
    module = spec.build()
    graph = profile_module(module, spec.example_inputs(1, 32), spec.layers, mode="fake")
    vocab, hidden = spec.config.vocab_size, spec.config.hidden
    assert graph.layers[-1].tied_params == {graph.layers[0].name: vocab * hidden}
    assert all(layer.tied_params is None for layer in graph.layers[:-1])


def _profiled_tie(*, dtype: str | None = "fp32") -> dict:
    """A profile of the tie after ``profiling.trace.param_grads``: no gradient of a parameter
    in the per-sample transients."""
    document = lm_graph()
    if dtype is not None:
        document["meta"] = {"dtype": dtype}
    embed = document["layers"][0]
    embed["largest_param"] = TABLE
    embed |= {"transient_bytes": 512, "weight_grad_transient_bytes": 256}
    return document


def _embed_transient(document: dict, pp: int, runtime: str = "megatron", b: int = 1) -> int:
    config = ParallelConfig(pp=pp, tp=1, dp=1, micro_batch=b, num_microbatches=4)
    costs, _ = peaks(document, config, [0] * 3 + [pp - 1] * 3, runtime=runtime, precision="fp32")
    return int(costs.transient_bytes[0])


@pytest.mark.parametrize("runtime", ["megatron", "torch"])
@pytest.mark.parametrize("b", [1, 4])
def test_the_owners_weight_gradient_moment(runtime, b):
    """pp 2 (each stage keeps its copy): the owner's moment is its gradient temporary alone;
    pp 1 (one table, autograd sums the head's partial and the owner's into the gradient): two
    tables more, whatever the micro-batch."""
    gtemp = 4 * TABLE
    assert _embed_transient(_profiled_tie(), 2, runtime, b) == 256 * b + gtemp
    assert _embed_transient(_profiled_tie(), 1, runtime, b) == 256 * b + 3 * gtemp
