"""The smallest GPU count that fits (solver/search/gpu_counts.py) and exit 3's GPU count advice.

Oracle for the search: a scan of every count with the same ``fits``. Oracle for the advice:
``solver.sweep.min_gpus`` (``--find min-gpus --gpus auto``), which runs the same search with
sweep rows, on the README's examples; the count the message names really fits.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from solver.errors import InfeasibleError
from solver.graph import load_graph
from solver.search import planner
from solver.search.config_search import Deadline
from solver.search.gpu_counts import (
    CountSearch,
    GpuCountAdvice,
    smallest_fitting_count,
    valid_gpu_counts,
)
from solver.search.planner import plan
from solver.specs import Cluster, TrainingConfig
from solver.sweep import min_gpus
from tests.conftest import EXAMPLES, cluster_group, cluster_of, slow_params

GIB = 2**30


@pytest.fixture(scope="module")
def gpt3():
    return load_graph(str(EXAMPLES / "gpt3-175b.json"))


# -- the search, on made-up answers ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_search_equals_a_scan_whatever_the_answers(seed):
    rng = random.Random(seed)
    counts = sorted(rng.sample(range(1, 200), rng.randint(1, 30)))
    fitting = {n for n in counts if rng.random() < rng.choice([0.1, 0.5, 0.9])}
    bounded = {n for n in counts if n not in fitting and rng.random() < 0.5}  # bound rules out
    asked = []

    def fits(n):
        asked.append(n)
        return n in fitting

    found = smallest_fitting_count(
        counts, fits, may_fit=lambda n: n not in bounded, chunk=rng.choice([1, 3])
    )
    assert found.complete and found.open_from is None
    assert found.gpus == min(fitting, default=None)
    assert len(asked) == len(set(asked)) == len(found.solved)  # each count asked once
    below = [n for n in counts if found.gpus is None or n < found.gpus]
    assert found.skipped == len([n for n in below if n in bounded and n not in asked])


def test_prepare_sees_each_chunk_and_known_answers_are_not_asked_again():
    counts = list(range(1, 11))
    prepared, asked = [], []
    found = smallest_fitting_count(
        counts,
        lambda n: asked.append(n) or n >= 7,
        prepare=prepared.append,
        chunk=4,
        known={10: True, 1: False},
    )
    assert found.gpus == 7
    assert 10 not in asked and 1 not in asked
    # bisection asks 5, 8, 7, 6; the scan below 7 goes by chunks of 4 counts (1-4, 5-6) and
    # prepares those not answered yet
    assert prepared == [[2, 3, 4]]


def test_no_answer_stops_the_search_and_says_what_is_known():
    counts = list(range(1, 21))
    answers = iter([True, False, True, False, None])  # 20, 10, 15, 13, then no answer

    found = smallest_fitting_count(counts, lambda n: next(answers))
    assert not found.complete
    assert found.gpus == 15  # the smallest count shown to fit
    assert found.solved == [20, 10, 15, 13]
    assert found.open_from == 1  # bisection rules out no range

    ruled = smallest_fitting_count(
        counts, lambda n: None if n == 5 else n >= 15, may_fit=lambda n: n >= 3
    )
    assert not ruled.complete and ruled.gpus == 15
    assert ruled.open_from == 5  # 1, 2 by bounds, 3 and 4 solved


def test_an_expired_deadline_stops_before_any_answer():
    found = smallest_fitting_count([1, 2, 3], lambda n: True, deadline=Deadline.after(0))
    assert not found.complete and found.gpus is None and found.solved == []
    assert found.open_from == 1


def test_valid_counts_keep_the_pins():
    cluster = Cluster(num_gpus=8, gpus_per_node=8)
    free = valid_gpu_counts(26, cluster, TrainingConfig(global_batch=64))
    pinned = valid_gpu_counts(26, cluster, TrainingConfig(global_batch=64, tp=8, dp=2))
    assert pinned == sorted({pp * 16 for pp in range(1, 27)})
    assert set(pinned) <= set(free)


def _worded(search: CountSearch, counts=(8, 16, 24, 32)) -> str:
    return GpuCountAdvice(search=search, counts=list(counts), label="pp2", wall_s=1.0).text("fits")


def test_the_message_says_what_the_search_found():
    done = CountSearch(gpus=24, complete=True, solved=[32, 16, 24], skipped=1)
    assert _worded(done).startswith("smallest GPU count that fits: 24 (pp2; every count")
    assert "3 counts solved, 1 ruled out by memory bounds" in _worded(done)
    none = CountSearch(gpus=None, complete=True, solved=[32], skipped=3)
    assert _worded(none).startswith("no GPU count fits either (every count some config can use")
    assert "8..32: 1 count solved" in _worded(none)
    early = CountSearch(gpus=32, complete=False, open_from=16, solved=[32])
    assert _worded(early).startswith("stopped looking after 1 count at the time limit (1.0 s)")
    assert "32 fits (pp2), every count below 16 was ruled out; raise --time-limit" in (
        _worded(early)
    )
    nothing = CountSearch(gpus=None, complete=False, open_from=8, solved=[])
    assert "no count found that fits, no smaller count was ruled out" in _worded(nothing)


# -- exit 3's advice equals --find min-gpus ----------------------------------------------------


def _advice(graph, gpus, memory, training, **options) -> InfeasibleError:
    cluster = Cluster(num_gpus=gpus, gpu_memory_bytes=memory)
    with pytest.raises(InfeasibleError) as caught:
        plan(graph, cluster, training, **options)
    return caught.value


def _min_gpus(graph, memory, training) -> int | None:
    return min_gpus(graph, memory, training, Cluster(num_gpus=1), workers=1).gpus


@pytest.mark.slow
@pytest.mark.parametrize(
    ("gpus", "memory", "expected"),
    slow_params([(4, 9 * GIB, 6), (3, 7 * GIB, 8)], (4, 9 * GIB, 6)),  # doublings gave 8 and 12
)
def test_gpt_1_3b_advice_is_the_min_gpus_answer(gpt_graph, gpus, memory, expected):
    training = TrainingConfig(global_batch=64)
    error = _advice(gpt_graph, gpus, memory, training)
    assert error.suggested_gpus == expected == _min_gpus(gpt_graph, memory, training)
    assert f"smallest GPU count that fits: {expected} (" in str(error)
    assert "checked as by --find min-gpus" in str(error)


@pytest.mark.slow
def test_advice_keeps_the_throughput_constraint(gpt_graph):
    """An absolute constraint that 6 GPUs meet in memory but not in speed: the advice, like
    min_gpus, is a count that meets both."""
    memory = 9 * GIB
    loose = TrainingConfig(global_batch=64)
    six = plan(gpt_graph, Cluster(num_gpus=6, gpu_memory_bytes=memory), loose)
    training = dataclasses.replace(loose, min_throughput=six.throughput * 1.2)
    error = _advice(gpt_graph, 4, memory, training)
    expected = _min_gpus(gpt_graph, memory, training)
    assert expected is not None and expected > 6
    assert error.suggested_gpus == expected
    fitted = plan(gpt_graph, Cluster(num_gpus=expected, gpu_memory_bytes=memory), training)
    assert fitted.throughput >= training.min_throughput


@pytest.mark.slow
def test_throughput_unmet_advice_is_the_min_gpus_answer(gpt_graph):
    """8 GPUs fit in memory but are far too slow: the count that meets the constraint."""
    memory, training = 8 * GIB, TrainingConfig(global_batch=64, min_throughput=1000)
    error = _advice(gpt_graph, 8, memory, training)
    assert "throughput constraint cannot be met" in str(error)
    assert error.suggested_gpus == 72  # = min_gpus: the slow test below
    assert "add GPUs; smallest GPU count that meets it: 72 (" in str(error)


@pytest.mark.slow
def test_min_gpus_agrees_on_the_throughput_case(gpt_graph):
    training = TrainingConfig(global_batch=64, min_throughput=1000)
    assert _min_gpus(gpt_graph, 8 * GIB, training) == 72


@pytest.mark.slow
def test_gpt3_80gib_advice_is_56_like_min_gpus(gpt3):
    """With sequence parallelism (the megatron default; 64 without it) and no reserve."""
    training = TrainingConfig(global_batch=256)
    error = _advice(gpt3, 32, 80 * GIB, training)
    assert error.suggested_gpus == 56 == _min_gpus(gpt3, 80 * GIB, training)  # doublings: 64
    assert "smallest GPU count that fits: 56 (pp7 tp8" in str(error)


@pytest.mark.slow
def test_gpt3_40gib_advice_is_136_like_min_gpus(gpt3):
    """docs/sweeps.md's --reserve 0 figure: with sequence parallelism (208 without it)."""
    training = TrainingConfig(global_batch=1536)
    error = _advice(gpt3, 64, 40 * GIB, training)
    assert error.suggested_gpus == 136 == _min_gpus(gpt3, 40 * GIB, training)  # doublings: 256


@pytest.mark.slow
def test_gpt3_on_8gib_gpus_gets_a_count_where_doublings_found_none(gpt3):
    """4 x 8 GiB with --zero auto --recompute full: doublings up to 256 found nothing; the advice
    says 512, ZeRO-3 at pp 1 (Megatron-FSDP). It said 480 (pp5 tp8 dp12 zero3) before the
    engine rules (solver/engine_rules.py) refused ZeRO 2/3 with pp > 1 on the megatron runtime:
    neither Megatron-LM nor DeepSpeed's pipeline engine runs that."""
    training = TrainingConfig(global_batch=1536, recompute="full", zero_stages=(0, 1, 2, 3))
    error = _advice(gpt3, 4, 8 * GIB, training)
    assert error.suggested_gpus == 512
    assert "pp1 tp8 dp64" in str(error) and "zero3" in str(error)


@pytest.mark.slow
def test_a_short_time_limit_says_where_it_stopped(gpt3, monkeypatch):
    monkeypatch.setattr(planner, "ADVICE_MIN_S", 0.3)
    training = TrainingConfig(global_batch=1536, recompute="full", zero_stages=(0, 1, 2, 3))
    error = _advice(gpt3, 4, 8 * GIB, training, time_limit_s=0.6)
    message = str(error)
    assert "stopped looking after" in message and "at the time limit" in message
    assert "raise --time-limit" in message
    if error.suggested_gpus is not None:  # a count it found does fit, whatever the rest
        assert f"{error.suggested_gpus} fits (" in message
        assert error.suggested_gpus >= 768


def test_sweep_points_and_suggest_gpus_false_do_not_search_counts(gpt_graph):
    error = _advice(gpt_graph, 4, 8 * GIB, TrainingConfig(global_batch=64), suggest_gpus=False)
    assert error.suggested_gpus is None
    assert "--find min-gpus" in str(error) and "smallest GPU count" not in str(error)


def test_heterogeneous_cluster_gets_no_count(gpt_graph):
    """A cluster file fixes the GPUs per group: no count to suggest, the message says more
    nodes (behaviour kept)."""
    cluster = cluster_of(cluster_group("small", 2**20, gpus=2), cluster_group("tiny", 2**20))
    with pytest.raises(InfeasibleError) as caught:
        plan(gpt_graph, cluster, TrainingConfig(global_batch=8))
    assert caught.value.suggested_gpus is None
    assert "more nodes" in str(caught.value)


@pytest.mark.slow
def test_options_already_searched_are_not_suggested(gpt_graph):
    training = TrainingConfig(global_batch=64, zero_stages=(0, 1, 2, 3), recompute="full")
    message = str(_advice(gpt_graph, 1, 2 * GIB, training))
    assert "--zero auto" not in message and "--recompute" not in message
    plain = str(_advice(gpt_graph, 1, 2 * GIB, TrainingConfig(global_batch=64)))
    assert "--zero auto" in plain and "--recompute auto" in plain
