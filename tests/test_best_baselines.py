"""Baselines at their best config (solver.search.best_baselines): the engines' own splits and
recomputation flags, the bounds-pruned search against brute force over every config, the time
limit, and the plan report / JSON field through the real CLI."""

from __future__ import annotations

import json

import pytest

from solver import Cluster, TrainingConfig
from solver.cli import plan_main
from solver.costs import layer_costs
from solver.deadline import Deadline
from solver.engine_rules import ModelFacts, degrees_of, engine_refusal
from solver.evaluation import evaluate_assignment, prepare_training
from solver.report.baselines import counts_to_assignment
from solver.search.best_baselines import (
    FAMILIES,
    best_baselines,
    every_second_block,
    first_blocks,
    megatron_accounted_split,
    torchtitan_split,
    transformer_balanced_split,
)
from solver.search.candidates import candidate_configs
from tests.conftest import GPT_1_3B


def counts(split: list[int]) -> list[int]:
    return [split.count(s) for s in range(max(split) + 1)]


def test_megatron_accounted_split_counts_embedding_and_loss_as_one_layer_each(gpt_graph):
    # gpt-1.3b: embedding, 24 blocks, head
    both = megatron_accounted_split(gpt_graph, 2, embedding=True, loss=True)
    assert counts(both) == [1 + 12, 12 + 1]  # (24 + 2) / 2 = 13: 12 blocks beside each end
    first = megatron_accounted_split(gpt_graph, 5, embedding=True, loss=False)
    assert counts(first) == [1 + 4, 5, 5, 5, 5 + 1]  # 25 / 5
    assert megatron_accounted_split(gpt_graph, 4, embedding=True, loss=False) is None  # 25 % 4
    assert megatron_accounted_split(gpt_graph, 4, embedding=True, loss=True) is None  # 26 % 4


def test_torchtitan_split_is_generate_llm_fqn_per_model_part(gpt_graph):
    # 24 blocks + 2 effective layers over 4 stages: 7, 7, 6, 6; the ends hold one block fewer
    assert counts(torchtitan_split(gpt_graph, 4)) == [1 + 6, 7, 6, 5 + 1]
    assert counts(transformer_balanced_split(gpt_graph, 4)) == [7, 6, 6, 7]


def test_recompute_flags_follow_the_engines(gpt_graph):
    split = counts_to_assignment([1 + 12, 12 + 1])
    block = first_blocks(gpt_graph, split, 2, 3)
    assert [i for i, flag in enumerate(block) if flag] == [1, 2, 3, 13, 14, 15]
    # torchtitan: a counter over each rank's blocks, every second one wrapped
    second = every_second_block(gpt_graph, split, 2, 0)
    assert [i for i, flag in enumerate(second) if flag] == [2, 4, 6, 8, 10, 12] + [
        14,
        16,
        18,
        20,
        22,
        24,
    ]


CASE = dict(num_gpus=8, gpu_memory_bytes=int(24 * 2**30))


def brute_force(graph, cluster, training, family):
    """Every config the engine runs, every N: the fastest fitting throughput and smallest peak."""
    search = TrainingConfig(
        global_batch=training.global_batch, zero_stages=(0, 1, 2, 3), recompute="selective"
    )
    facts = ModelFacts.of_graph(graph)
    fastest, smallest = None, None
    for config in candidate_configs(graph.num_layers, cluster, search, facts=facts):
        if not family.zero_ok(config, training.zero_stages):
            continue
        if engine_refusal(degrees_of(config), facts, family.engine) is not None:
            continue
        costs = layer_costs(graph, config, cluster, training)
        split = family.split(graph, costs.num_stages)
        if split is None:
            continue
        for setting in family.settings:
            for n in range(graph.num_layers + 1) if setting.searched else (0,):
                flags = setting.flags(graph, split, costs.num_ranks, n)
                ev = evaluate_assignment(
                    graph, costs, split, cluster=cluster, training=training, recomputed=flags
                )
                smallest = ev.peak_bytes if smallest is None else min(smallest, ev.peak_bytes)
                if ev.fits:
                    fastest = ev.throughput if fastest is None else max(fastest, ev.throughput)
    return fastest, smallest


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["megatron", "torch"])
def test_pruned_search_matches_brute_force_over_every_config(gpt_graph, runtime):
    cluster = Cluster(**CASE)
    training = prepare_training(
        gpt_graph, cluster, TrainingConfig(global_batch=16, runtime=runtime)
    )
    found = best_baselines(gpt_graph, cluster, training, deadline=Deadline.after(None))
    assert found.families and not found.notes
    names = {best.family.name for best in found.families}
    assert names == {f.name for f in FAMILIES if f.engine in ("megatron", "deepspeed", "torchtitan")
                     and (f.engine == "torchtitan") == (runtime == "torch")}  # fmt: skip
    for best in found.families:
        fastest, smallest = brute_force(gpt_graph, cluster, training, best.family)
        assert best.complete
        assert best.smallest is not None and best.smallest.evaluation.peak_bytes == smallest
        assert best.fits == (fastest is not None)
        if fastest is not None:
            assert best.fastest.evaluation.fits
            assert best.fastest.evaluation.throughput == pytest.approx(fastest, rel=1e-12)


def test_an_expired_deadline_searches_nothing_and_says_so(gpt_graph):
    cluster = Cluster(**CASE)
    training = prepare_training(gpt_graph, cluster, TrainingConfig(global_batch=16))
    found = best_baselines(gpt_graph, cluster, training, deadline=Deadline(end=0.0))
    assert found.families == [] and "time limit reached" in found.notes[0]


@pytest.mark.slow
def test_plan_cli_reports_the_best_baselines(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = [GPT_1_3B, "--gpus", "8", "--gpu-memory", "24GiB", "--global-batch", "16"]
    assert plan_main([*argv, "--json", str(out), "--time-limit", "30"]) == 0
    text = capsys.readouterr().out
    assert "baselines at their best config on 8 GPUs" in text
    assert "against the best baseline: " in text
    document = json.loads(out.read_text())
    compared = document["best_baselines"]
    assert [f["name"] for f in compared["families"]][0] == "megatron-even"
    assert compared["plan"]["num_gpus"] == 8 and compared["verdict"]
    fastest = compared["fastest"]
    if fastest is not None:  # the best fitting family's throughput, and the change against it
        best = max(
            (f["fastest"] for f in compared["families"] if f["fastest"]),
            key=lambda c: c["throughput"],
        )
        assert fastest["throughput"] == best["throughput"] and fastest["fits"]
        ours = compared["plan"]["fastest_throughput"]
        assert compared["throughput_change"] == pytest.approx(ours / best["throughput"] - 1)
    assert document["baselines"]["even"]  # the same-config baselines keep their meaning
