"""The vocabulary split over TP per runtime (solver/costs/vocab.py): Megatron splits every
vocabulary, padded to a multiple of 128 tp; the torch runtime from 16384 rows
(profiling.executors.parallelize); the LM head's logits transient over tp with its fixed part
whole; the tied copy split like its vocabulary; every backend plans with it."""

from __future__ import annotations

import json
import random

import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.problem import StageProblem
from solver.costs import layer_costs
from solver.engine_rules import padded_vocab_size
from solver.errors import InputError
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.random_graphs import random_layer
from tests.test_agreement import solve_all

HIDDEN = 64
NORM = 2 * HIDDEN
"""The head's final norm (weight and bias): replicated everywhere."""
LOGITS, FIXED = 128_000, 8_196
"""The head's transient per sample: its vocabulary part (fp32 logits) and the part that does
not scale with the vocabulary (the gradient of its input), as a profile of vocabulary 1000."""


def lm_graph(vocab: int = 1000, *, tied: bool = False, fields: bool = True, blocks: int = 2):
    """Embedding, blocks, an LM head of ``vocab`` rows (with the vocabulary fields when
    ``fields``, as ``profiling.export`` writes them; a graph written before them without)."""
    table = vocab * HIDDEN
    split = vocab >= 16384  # the profile's tp split (the torch runtime's rule)
    scale = vocab / 1000
    logits, saved = int(LOGITS * scale), int(256_000 * scale)
    embed = {"name": "embed", "params": table, "activation_bytes": 1024, "output_bytes": 8192}
    head = {
        "name": "head",
        "params": NORM + (0 if tied else table),
        "activation_bytes": saved + 17_152,
        "output_bytes": 4,
        "transient_bytes": logits + 1_024,
        "weight_grad_transient_bytes": 0,
        "largest_param": HIDDEN if (tied or split) else table,
    }
    if split:
        embed |= {"tp_params": table, "largest_tp_param": table}
        head |= {"tp_activation_bytes": saved}
        if not tied:
            head |= {"tp_params": table, "largest_tp_param": table}
    if tied:
        head["tied_params"] = {"embed": table}
    if fields:
        embed |= {"vocab_rows": vocab, "vocab_params": table}
        head |= {
            "vocab_rows": vocab,
            "vocab_params": 0 if tied else table,
            "vocab_activation_bytes": saved,
            "vocab_transient_bytes": logits,
            "fixed_transient_bytes": FIXED,
            "vocab_weight_grad_transient_bytes": 0,
            "fixed_weight_grad_transient_bytes": FIXED,
        }
    rng = random.Random(3)
    layers = [embed, *(random_layer(rng, f"b{i}") for i in range(blocks)), head]
    return {"format": "layer-graph", "version": 1, "model": "lm", "layers": layers}


def costs_of(document: dict, *, tp: int, pp: int = 1, runtime: str = "megatron", sp=False):
    config = ParallelConfig(pp=pp, tp=tp, dp=1, micro_batch=1, num_microbatches=4, sp=sp)
    return layer_costs(
        graph_from_dict(document),
        config,
        Cluster(num_gpus=config.num_gpus),
        TrainingConfig(global_batch=4, runtime=runtime, optimizer_impl="fused"),
    )


def test_megatron_pads_the_vocabulary_to_a_multiple_of_128_tp():
    assert padded_vocab_size(1000, 2, "megatron") == 1024
    assert padded_vocab_size(1024, 2, "megatron") == 1024
    assert padded_vocab_size(50257, 8, "megatron") == 51200  # GPT-2 at tp 8
    assert padded_vocab_size(151936, 8, "megatron") == 152576  # Qwen2 at tp 8
    assert padded_vocab_size(128256, 1, "megatron") == 128256


def test_megatron_splits_a_small_vocabulary_over_tp_padded():
    """Vocabulary 1000 at tp 2: each rank holds 512 padded rows of the embedding and the head
    (bf16 weights: 2 B per element), the head's norm whole."""
    costs = costs_of(lm_graph(1000), tp=2)
    assert costs.weight_bytes[0] == 2 * 512 * HIDDEN
    assert costs.weight_bytes[-1] == 2 * (512 * HIDDEN + NORM)
    assert costs.grad_bytes[-1] == 4 * (512 * HIDDEN + NORM)  # fp32 main_grad
    # at tp 1 the padded vocabulary: 1024 rows
    assert costs_of(lm_graph(1000), tp=1).weight_bytes[0] == 2 * 1024 * HIDDEN


def test_torch_keeps_a_small_vocabulary_whole():
    """The torch runtime splits only vocabularies of 16384+ rows (parallelize.py): below,
    weights and the transient are the profile's, at any tp."""
    one, two = costs_of(lm_graph(1000), tp=1, runtime="torch"), None
    two = costs_of(lm_graph(1000), tp=2, runtime="torch")
    assert two.weight_bytes[0] == 2 * 1000 * HIDDEN == one.weight_bytes[0]
    assert two.weight_bytes[-1] == 2 * (1000 * HIDDEN + NORM)
    assert two.transient_bytes[-1] == one.transient_bytes[-1] == LOGITS + 1_024


def test_the_logits_transient_halves_and_its_fixed_part_stays():
    """tp 2: the vocabulary part / 2 (megatron: of the padded 1024 rows), the fixed part whole;
    the saved softmax / 2 too."""
    megatron = costs_of(lm_graph(1000), tp=2)
    assert megatron.transient_bytes[-1] == FIXED + LOGITS * 1024 // (1000 * 2)
    assert megatron.transient_bytes[-1] < LOGITS + 1_024  # the profile's whole transient
    torch = costs_of(lm_graph(16384), tp=2, runtime="torch")
    logits = int(LOGITS * 16.384)
    assert torch.transient_bytes[-1] == FIXED + logits // 2
    # a graph without the fields: the whole transient (the behaviour before)
    older = costs_of(lm_graph(16384, fields=False), tp=2, runtime="torch")
    assert older.transient_bytes[-1] == logits + 1_024


def test_megatron_saves_the_padded_softmax_shard():
    base = costs_of(lm_graph(1000, fields=False), tp=2)
    split = costs_of(lm_graph(1000), tp=2)
    saved = 256_000
    assert base.stored_bytes[-1] - split.stored_bytes[-1] == saved - saved * 1024 // (1000 * 2)
    # with sequence parallelism every saved tensor / 2, the vocabulary part padded
    sp = costs_of(lm_graph(1000), tp=2, sp=True)
    assert sp.stored_bytes[-1] == -(-(17_152 + saved * 1024 // 1000) // 2)


def test_the_tied_copy_at_tp_2_on_megatron_is_half():
    """pp 2: the last stage's copy of the tied table, 512 of the padded 1024 rows per rank."""
    tied = costs_of(lm_graph(1000, tied=True), tp=2, pp=2)
    assert tied.weight_bytes[-1] == 2 * (512 * HIDDEN + NORM)
    replicated = costs_of(lm_graph(1000, tied=True, fields=False), tp=2, pp=2)
    assert replicated.weight_bytes[-1] == 2 * (1000 * HIDDEN + NORM)


@pytest.mark.parametrize("seed", range(6))
def test_backends_agree_with_split_vocabularies(seed):
    """CP-SAT, the MILP, the chain DP and brute force find one optimum on both runtimes."""
    rng = random.Random(900 + seed)
    document = lm_graph(
        rng.choice([1000, 16384, 50257]), tied=rng.random() < 0.5, blocks=rng.randint(2, 4)
    )
    config = ParallelConfig(
        pp=rng.choice([2, 3]),
        tp=rng.choice([2, 4]),
        dp=1,
        micro_batch=1,
        num_microbatches=rng.choice([2, 4]),
    )
    runtime = rng.choice(["megatron", "torch"])
    if runtime == "torch" and document["layers"][-1].get("tied_params"):
        runtime = "megatron"  # torch refuses a tied vocabulary-parallel table
    costs = layer_costs(
        graph_from_dict(document),
        config,
        Cluster(num_gpus=config.num_gpus),
        TrainingConfig(global_batch=config.global_batch, runtime=runtime),
    )
    problem = StageProblem(costs=costs)
    oracle = solve_brute_force(problem)
    assert set(solve_all(problem).values()) == {oracle.objective}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_params": 64_001}, "is not a multiple of vocab_rows (1000)"),
        ({"vocab_rows": 0}, "vocab_rows: 0 for layer 'head'"),
        ({"fixed_transient_bytes": None}, "only one of vocab_transient_bytes"),
        ({"vocab_activation_bytes": 10**7}, "exceeds activation_bytes"),
    ],
)
def test_bad_vocabulary_fields_are_one_line(change, message):
    document = lm_graph(1000)
    head = document["layers"][-1]
    head.update(change)
    document["layers"][-1] = {k: v for k, v in head.items() if v is not None}
    with pytest.raises(InputError) as error:
        graph_from_dict(document, origin="g.json")
    text = str(error.value)
    assert "\n" not in text and text.startswith("g.json: $.layers[3]")
    assert message in text


def test_plan_cli_refuses_bad_vocabulary_fields(tmp_path, capsys):
    from solver.cli.plan import plan_main as main

    document = lm_graph(1000)
    document["layers"][-1]["vocab_params"] = 5
    path = tmp_path / "g.json"
    path.write_text(json.dumps(document))
    assert main([str(path), "--gpus", "2", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "vocab_params" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.json"]


def test_saving_keeps_the_fields():
    graph = graph_from_dict(lm_graph(1000))
    again = graph_from_dict(json.loads(json.dumps(graph.to_dict())))
    assert again.layers[-1] == graph.layers[-1]
    assert again.layers[-1].vocab_transient_bytes == LOGITS


@pytest.mark.slow
def test_the_profile_separates_the_vocabulary_parts():
    """A zoo GPT with vocabulary 1000: the embedding and the head name it whatever its size;
    the head's saved softmax and logits transient are vocabulary-sized, the gradient of its
    input (b s h) is not; a position table of as many rows as
    the vocabulary is not a vocabulary table."""
    from profiling.export import export_graph

    overrides = {"layers": 2, "hidden": HIDDEN, "heads": 4, "seq_len": 1000, "dropout": 0.0}
    graph = export_graph("gpt-tiny", dtype="bf16", overrides={**overrides, "vocab_size": 1000})
    embed, head = graph.layers[0], graph.layers[-1]
    assert (embed.vocab_rows, embed.vocab_params) == (1000, 1000 * HIDDEN)  # not wpe's rows
    assert embed.params == 2 * 1000 * HIDDEN  # token and position tables of 1000 rows each
    assert (head.vocab_rows, head.vocab_params) == (1000, 1000 * HIDDEN)
    seq = 1000
    assert head.vocab_activation_bytes == 4 * seq * 1000  # the fp32 softmax it saves
    assert head.vocab_transient_bytes >= 2 * seq * 1000  # the bf16 logits, their gradient
    # the input's gradient (bf16 b s h) whole, and nothing vocabulary-sized in it
    assert 2 * seq * HIDDEN <= head.fixed_transient_bytes < 2 * seq * 1000
    assert head.tp_params == 0  # the profile's (torch) split: replicated below 16384 rows
