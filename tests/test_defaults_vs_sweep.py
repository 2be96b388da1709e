"""Default flags never lose to a hand-scripted sweep (issue 29, item 1), by brute force.

The sweep a user would script: every (pp, tp, dp) of the cluster, micro-batch 1-4 dividing the
batch, ZeRO 0 or the distributed optimizer (ZeRO 1), no or full recomputation, SP with tp > 1,
each with Megatron's even split (``baselines.even_split``), evaluated by the cost model
(``solver.evaluation.evaluate``) and kept when an engine of the megatron runtime runs it. The
planner under default flags must reach at least the best fitting config's throughput, and
``solver.sweep --find min-gpus`` must never need more GPUs than the smallest count at which some
even config fits. Small graphs and tight memories, so the answers differ between configs (the
old defaults, --zero 0 --recompute none --micro-batch 1,2,4, lose on the first case).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass

import pytest

from solver.cli.plan import plan_main
from solver.cli.sweep import sweep_main
from solver.engine_rules import ModelFacts, degrees_of, runtime_refusal
from solver.evaluation import evaluate
from solver.graph import LayerGraph, load_graph
from solver.report.baselines import even_split
from solver.reserve import default_reserve
from solver.search.best_baselines import first_blocks
from solver.search.candidates import divisors
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from solver.units import parse_bytes
from tests.conftest import GPT_1_3B, T5_DAG

pytestmark = pytest.mark.slow  # each case plans and evaluates a few hundred configs: ~1-3 s

GPUS_PER_NODE = 8
BATCH = 32
CASES = [
    (GPT_1_3B, 8, "16GiB"),
    (GPT_1_3B, 8, "10GiB"),
    (GPT_1_3B, 8, "8GiB"),
    (T5_DAG, 8, "2GiB"),
]
"""(graph, GPUs, memory per GPU): the 26-layer GPT 1.3B chain and the 16-layer T5 DAG."""


@dataclass(frozen=True)
class Best:
    """The best fitting even-split config of the sweep."""

    throughput: float
    """Samples/s of its simulated iteration."""
    label: str


def user_configs(graph: LayerGraph, gpus: int) -> list[ParallelConfig]:
    """Every config of the hand-scripted sweep on ``gpus`` GPUs that the megatron runtime runs."""
    facts = ModelFacts.of_graph(graph)
    configs = []
    for pp in (p for p in divisors(gpus) if p <= graph.num_layers):
        for tp in divisors(math.gcd(gpus // pp, GPUS_PER_NODE)):
            dp = gpus // (pp * tp)
            for micro_batch in (b for b in (1, 2, 3, 4) if BATCH % (dp * b) == 0):
                for zero in (0, 1):
                    for recompute in ("none", "full"):
                        config = ParallelConfig(
                            pp=pp,
                            tp=tp,
                            dp=dp,
                            micro_batch=micro_batch,
                            num_microbatches=BATCH // (dp * micro_batch),
                            zero=zero,
                            recompute=recompute,
                            sp=tp > 1,
                        )
                        if runtime_refusal(degrees_of(config), facts, "megatron") is None:
                            configs.append(config)
    return configs


def best_even_config(graph: LayerGraph, gpus: int, memory: str) -> Best | None:
    """The fastest even-split config of the sweep whose peak fits memory - the CLI's default
    reserve (1 GiB + 5%); None when none fits."""
    training = TrainingConfig(
        global_batch=BATCH,
        micro_batch_sizes=(1, 2, 3, 4),
        zero_stages=(0, 1),
        recompute="auto",
        reserve=default_reserve(None),
    )
    cluster = Cluster(
        num_gpus=gpus, gpu_memory_bytes=parse_bytes(memory), gpus_per_node=GPUS_PER_NODE
    )
    usable = training.usable_bytes(cluster.gpu_memory_bytes)
    best = None
    for config in user_configs(graph, gpus):
        result = evaluate(
            graph, config, even_split(graph, config.pp), cluster=cluster, training=training
        )
        throughput = BATCH * 1e9 / result.iteration_ns
        if result.peak_bytes <= usable and (best is None or throughput > best.throughput):
            best = Best(throughput, config.label())
    return best


def best_block_config(graph: LayerGraph, gpus: int, memory: str) -> Best | None:
    """The fastest fitting config of the sweep run as Megatron's ``--recompute-method block
    --recompute-num-layers N`` (the even split, the first N blocks of every stage recomputed, N
    the smallest that fits), ZeRO 0-3 (the default ``--zero auto``); None when none fits."""
    training = TrainingConfig(
        global_batch=BATCH,
        micro_batch_sizes=(1, 2, 3, 4),
        zero_stages=(0, 1, 2, 3),
        recompute="selective",
        reserve=default_reserve(None),
    )
    cluster = Cluster(
        num_gpus=gpus, gpu_memory_bytes=parse_bytes(memory), gpus_per_node=GPUS_PER_NODE
    )
    usable = training.usable_bytes(cluster.gpu_memory_bytes)
    best = None
    for plain in user_configs(graph, gpus):
        if plain.recompute != "none":
            continue
        for zero in (0, 1, 2, 3) if plain.dp > 1 else (0,):
            config = dataclasses.replace(plain, recompute="selective", zero=zero)
            split = even_split(graph, config.pp)
            for n in range(graph.num_layers + 1):  # more blocks: never more memory or less time
                flags = first_blocks(graph, split, config.pp, n)
                result = evaluate(
                    graph, config, split, cluster=cluster, training=training, recomputed=flags
                )
                if result.peak_bytes <= usable:
                    throughput = BATCH * 1e9 / result.iteration_ns
                    if best is None or throughput > best.throughput:
                        best = Best(throughput, f"{config.label()} block N={n}")
                    break
    return best


def plan_json(run_cli, tmp_path, graph: str, gpus: int, memory: str, *flags: str) -> dict:
    """``solver.plan`` with default flags (and ``flags``): its JSON; exit 0 and no stderr."""
    out = tmp_path / "plan.json"
    args = [graph, "--gpus", str(gpus), "--gpu-memory", memory, "--global-batch", str(BATCH)]
    code, _, err = run_cli(plan_main, *args, *flags, "--json", str(out), "--quiet")
    assert (code, err) == (0, "")
    document = json.loads(out.read_text())
    out.unlink()
    return document


@pytest.mark.parametrize(("graph", "gpus", "memory"), CASES)
def test_default_plan_never_slower_than_the_best_even_config(
    run_cli, tmp_path, graph, gpus, memory
):
    best = best_even_config(load_graph(graph), gpus, memory)
    assert best is not None, "a case where some even config fits"
    document = plan_json(run_cli, tmp_path, graph, gpus, memory)
    fastest = document["fastest_throughput"]
    assert fastest >= best.throughput * (1 - 1e-9), best
    # fastest_throughput is that of the default search's fastest plan: --objective throughput
    fastest_plan = plan_json(run_cli, tmp_path, graph, gpus, memory, "--objective", "throughput")
    assert fastest_plan["throughput"] == pytest.approx(fastest, rel=1e-9)
    assert fastest_plan["fits"] and document["fits"]
    # and the smallest-peak plan is within the default --max-slowdown (1.25) of it
    assert document["throughput"] * 1.25 >= fastest * (1 - 1e-9)
    assert document["peak_bytes"] > 0


def test_default_plan_never_slower_than_megatron_block_recomputation(run_cli, tmp_path):
    """Issue 29's acceptance where Megatron's block recomputation of some blocks beats both no
    and full recomputation of every config (GPT 1.3B on 8 x 7 GiB): the best baseline layout
    seeds the fastest plan (``solver.search.seeds``), so the default plan's fastest is at least
    the best baseline's and the brute-force block sweep's, and --objective throughput returns
    it, recomputing the first N blocks of every stage as reported."""
    graph, gpus, memory = GPT_1_3B, 8, "7GiB"
    loaded = load_graph(graph)
    block = best_block_config(loaded, gpus, memory)
    assert block.throughput > best_even_config(loaded, gpus, memory).throughput * 1.05, block
    document = plan_json(run_cli, tmp_path, graph, gpus, memory)
    fitting = [f["fastest"] for f in document["best_baselines"]["families"] if f["fits"]]
    baseline = max(fitting, key=lambda found: found["throughput"])
    assert baseline["recompute"].startswith("recompute block N="), baseline
    fastest = document["fastest_throughput"]
    assert fastest >= max(block.throughput, baseline["throughput"]) * (1 - 1e-9)
    notes = document["solver"]["notes"]
    assert any(
        n.startswith("the fastest plan is a baseline layout, megatron-recompute-block")
        for n in notes
    )
    assert document["fits"] and document["throughput"] * 1.25 >= fastest * (1 - 1e-9)

    fastest_plan = plan_json(run_cli, tmp_path, graph, gpus, memory, "--objective", "throughput")
    assert fastest_plan["throughput"] == pytest.approx(fastest, rel=1e-9)
    assert fastest_plan["fits"] and 0 < fastest_plan["peak_bytes"]
    assert fastest_plan["config"]["recompute"] == "selective"
    n = int(baseline["recompute"].removeprefix("recompute block N="))
    assert n > 0
    for stage in fastest_plan["stages"]:
        blocks = [name for name in stage["layers"] if name.startswith("layers.")]
        assert stage["recomputed"] == blocks[:n]
    # a pinned --recompute narrows the seeds too: no baseline layout recomputes some blocks
    pinned = plan_json(run_cli, tmp_path, graph, gpus, memory, "--recompute", "none")
    assert pinned["fastest_throughput"] < baseline["throughput"]
    assert not any("baseline layout" in note for note in pinned["solver"]["notes"])


def test_old_defaults_lose_to_the_sweep(run_cli, tmp_path):
    """Why the defaults changed: --zero 0 --recompute none --micro-batch 1,2,4 (the defaults
    before issue 29) leave the distributed optimizer out, and lose to the sweep's best config
    (pp1 tp2 dp4 b1 zero1 at 16 GiB)."""
    graph, gpus, memory = CASES[0]
    best = best_even_config(load_graph(graph), gpus, memory)
    old = ("--zero", "0", "--recompute", "none", "--micro-batch", "1,2,4")
    document = plan_json(run_cli, tmp_path, graph, gpus, memory, *old)
    assert document["fastest_throughput"] < best.throughput * 0.99


COUNTS = (1, 2, 4, 8, 16)


@pytest.mark.parametrize(("graph", "memory"), [(GPT_1_3B, "10GiB"), (T5_DAG, "2GiB")])
def test_min_gpus_never_more_than_the_even_sweep(run_cli, tmp_path, graph, memory):
    loaded = load_graph(graph)
    smallest = next(n for n in COUNTS if best_even_config(loaded, n, memory) is not None)
    args = [graph, "--find", "min-gpus", "--gpus", ",".join(map(str, COUNTS))]
    args += ["--gpu-memory", memory, "--global-batch", str(BATCH)]
    code, out, err = run_cli(sweep_main, *args, "--workers", "1")
    assert (code, err) == (0, "")
    found = int(re.search(r"smallest GPU count that fits [^:]*: (\d+)", out).group(1))
    assert found <= smallest
    assert not list(tmp_path.iterdir())  # nothing written: no --json, no --out
