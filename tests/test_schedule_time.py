"""The schedule simulation for time (solver/costs/schedule_time.py).

Oracles: hand-worked timelines (in the docstrings), the bubble formula (m + p - 1) max_s T_s
where it is exact (equal stages), path lower bounds, torch's own action lists
(``Schedule1F1B`` / ``ScheduleGPipe`` / ``ScheduleInterleaved1F1B``), and the cost model's own
boundary bytes and times.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest

from solver.costs import (
    boundary_bytes,
    forwards_before_first_backward,
    interleaved_schedule_groups,
    iteration_bound_ns,
    layer_costs,
    pipeline_link_gb_per_s,
    schedule_actions,
    stage_costs,
)
from solver.costs.schedule_time import (
    schedule_timeline,
    simulate_schedule,
    simulated_iteration_ns,
    stage_transfer_bytes,
)
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import t5_like_graph


def _timeline(result) -> list[str]:
    return [
        " ".join(f"{a.kind}{a.microbatch}[{s},{e}]" for a, s, e in actions)
        for actions in result.actions
    ]


def test_hand_worked_1f1b_two_stages_three_microbatches():
    """p 2, m 3, stage 0 F 1 B 2, stage 1 F 2 B 4 (T = 3, 6). Rank 0 runs F0, then F1 B0, F2 B1,
    then B2 (p - 1 - r = 1 warm-up forward); rank 1 F0 B0 F1 B1 F2 B2:

        rank 0  F0[0,1] F1[1,2]           B0[7,9] F2[9,10]         B1[13,15]        B2[19,21]
        rank 1          F0[1,3] B0[3,7]   F1[7,9] B1[9,13] F2[13,15] B2[15,19]

    B0 on rank 0 waits for rank 1's B0 (ends 7), rank 1's F2 for its own B1 (13). 21 ns against
    the formula's (3 + 2 - 1) 6 = 24 and the lower bound 3 + 3 x 6 = 21: rank 1 never idles
    after its first input."""
    result = simulate_schedule(
        schedule="1f1b", num_microbatches=3, num_ranks=2, forward_ns=[1, 2], backward_ns=[2, 4]
    )
    assert _timeline(result) == [
        "F0[0,1] F1[1,2] B0[7,9] F2[9,10] B1[13,15] B2[19,21]",
        "F0[1,3] B0[3,7] F1[7,9] B1[9,13] F2[13,15] B2[15,19]",
    ]
    assert result.makespan_ns == 21
    assert result.busy_ns == [9, 18] and result.idle_ns == [12, 3] and result.tail_ns == [0, 0]


def test_hand_worked_gpipe_two_stages_three_microbatches():
    """Same stages under GPipe: every forward, then every backward, in micro-batch order.

        rank 0  F0[0,1] F1[1,2] F2[2,3]                           B0[11,13] B1[15,17] B2[19,21]
        rank 1          F0[1,3] F1[3,5] F2[5,7] B0[7,11] B1[11,15] B2[15,19]

    The same 21 ns as 1F1B: both bubbles are the fill and drain of the other stage."""
    result = simulate_schedule(
        schedule="gpipe", num_microbatches=3, num_ranks=2, forward_ns=[1, 2], backward_ns=[2, 4]
    )
    assert _timeline(result) == [
        "F0[0,1] F1[1,2] F2[2,3] B0[11,13] B1[15,17] B2[19,21]",
        "F0[1,3] F1[3,5] F2[5,7] B0[7,11] B1[11,15] B2[15,19]",
    ]
    assert result.makespan_ns == 21


def test_hand_worked_1f1b_three_stages_four_microbatches():
    """p 3, m 4, F (1, 2, 1), B (2, 4, 2): T = (3, 6, 3). Warm-ups 2, 1, 0 forwards.

        rank 0  F0[0,1] F1[1,2] F2[2,3] B0[10,12] F3[12,13] B1[16,18] B2[22,24] B3[26,28]
        rank 1  F0[1,3] F1[3,5] B0[6,10] F2[10,12] B1[12,16] F3[16,18] B2[18,22] B3[22,26]
        rank 2  F0[3,4] B0[4,6] F1[6,7] B1[7,9] F2[12,13] B2[13,15] F3[18,19] B3[19,21]

    Rank 1 (the slow stage) waits only for its first input (1 ns) and for rank 2's B0 (6): 28
    ns, against the formula's (4 + 3 - 1) 6 = 36 and the lower bound T_0 + m T_1 = 27."""
    result = simulate_schedule(
        schedule="1f1b",
        num_microbatches=4,
        num_ranks=3,
        forward_ns=[1, 2, 1],
        backward_ns=[2, 4, 2],
    )
    assert _timeline(result) == [
        "F0[0,1] F1[1,2] F2[2,3] B0[10,12] F3[12,13] B1[16,18] B2[22,24] B3[26,28]",
        "F0[1,3] F1[3,5] B0[6,10] F2[10,12] B1[12,16] F3[16,18] B2[18,22] B3[22,26]",
        "F0[3,4] B0[4,6] F1[6,7] B1[7,9] F2[12,13] B2[13,15] F3[18,19] B3[19,21]",
    ]
    assert result.makespan_ns == 28


def test_hand_worked_interleaved_two_ranks_two_chunks():
    """p 2, v 2, m 4, g 2, every chunk F 1 B 2. Virtual stages 0 1 2 3 on ranks 0 1 0 1. Rank 0
    warms up with (v - 1) g + 2 (p - 1 - r) = 4 forwards, rank 1 with 2 (chunk c, micro-batch i
    written c.i):

        rank 0  F0.0[0,1] F0.1[1,2] F1.0[2,3] F1.1[3,4] F0.2[4,5] B1.0[6,8] F0.3[8,9] B1.1[9,11]
                F1.2[11,12] B0.0[12,14] F1.3[14,15] B0.1[15,17] B1.2[18,20] B1.3[21,23]
                B0.2[23,25] B0.3[25,27]
        rank 1  F0.0[1,2] F0.1[2,3] F1.0[3,4] B1.0[4,6] F1.1[6,7] B1.1[7,9] F0.2[9,10]
                B0.0[10,12] F0.3[12,13] B0.1[13,15] F1.2[15,16] B1.2[16,18] F1.3[18,19]
                B1.3[19,21] B0.2[21,23] B0.3[23,25]

    27 ns = m T_r + (p - 1) T_chunk = 4 x 6 + 3, the interleaved formula (exact here)."""
    result = simulate_schedule(
        schedule="1f1b", num_microbatches=4, num_ranks=2, forward_ns=[1] * 4, backward_ns=[2] * 4
    )
    lines = [
        " ".join(f"{a.kind}{a.chunk}.{a.microbatch}[{s},{e}]" for a, s, e in actions)
        for actions in result.actions
    ]
    assert lines == [
        "F0.0[0,1] F0.1[1,2] F1.0[2,3] F1.1[3,4] F0.2[4,5] B1.0[6,8] F0.3[8,9] B1.1[9,11] "
        "F1.2[11,12] B0.0[12,14] F1.3[14,15] B0.1[15,17] B1.2[18,20] B1.3[21,23] B0.2[23,25] "
        "B0.3[25,27]",
        "F0.0[1,2] F0.1[2,3] F1.0[3,4] B1.0[4,6] F1.1[6,7] B1.1[7,9] F0.2[9,10] B0.0[10,12] "
        "F0.3[12,13] B0.1[13,15] F1.2[15,16] B1.2[16,18] F1.3[18,19] B1.3[19,21] B0.2[21,23] "
        "B0.3[23,25]",
    ]
    assert result.makespan_ns == 27


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_equal_stages_equal_the_bubble_formula(schedule):
    """Equal stages, no transfers: exactly (m + p - 1)(F + B), whatever F : B."""
    rng = random.Random(7)
    for _ in range(60):
        p, m = rng.randint(1, 6), rng.randint(1, 12)
        forward, backward = rng.randint(1, 50), rng.randint(1, 50)
        result = simulate_schedule(
            schedule=schedule,
            num_microbatches=m,
            num_ranks=p,
            forward_ns=[forward] * p,
            backward_ns=[backward] * p,
        )
        assert result.makespan_ns == (m + p - 1) * (forward + backward), (p, m)
        assert result.busy_ns == [m * (forward + backward)] * p


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_uneven_stages_between_the_path_bounds_and_the_formula(schedule):
    """Uneven stages with B_s = 2 F_s (the cost model's default backward): never above
    (m + p - 1) max_s T_s, strictly below it on (almost) every uneven split, and never below
    m T_s + the fill and drain of the stages before s (micro-batch 0's forwards and micro-batch
    m - 1's backwards through them), for every s. With any F : B per stage the path bounds hold
    too."""
    rng = random.Random(11)
    below = uneven = 0
    for trial in range(400):
        p, m = rng.randint(2, 5), rng.randint(1, 10)
        forward = [rng.randint(1, 30) for _ in range(p)]
        proportional = trial % 2 == 0
        backward = [2 * f if proportional else rng.randint(1, 60) for f in forward]
        result = simulate_schedule(
            schedule=schedule,
            num_microbatches=m,
            num_ranks=p,
            forward_ns=forward,
            backward_ns=backward,
        )
        total = [f + b for f, b in zip(forward, backward, strict=True)]
        for s in range(p):
            assert result.makespan_ns >= m * total[s] + sum(total[:s])
        formula = (m + p - 1) * max(total)
        if proportional or schedule == "1f1b":
            assert result.makespan_ns <= formula
        if proportional and len(set(total)) > 1:
            uneven += 1
            below += result.makespan_ns < formula
    assert below >= 0.95 * uneven


def test_gpipe_can_exceed_the_formula_when_forward_and_backward_bottlenecks_differ():
    """p 2, m 2, F (1, 2), B (2, 1): equal stage totals (3, 3), formula 3 x 3 = 9, but the
    forwards queue behind stage 1 and the backwards behind stage 0:

        rank 0  F0[0,1] F1[1,2]                 B0[6,8] B1[8,10]
        rank 1          F0[1,3] F1[3,5] B0[5,6] B1[6,7]

    10 ns. (GPipe's forward phase alone is a flow shop: sum_s F_s + (m - 1) max_s F_s.)"""
    result = simulate_schedule(
        schedule="gpipe", num_microbatches=2, num_ranks=2, forward_ns=[1, 2], backward_ns=[2, 1]
    )
    assert _timeline(result) == [
        "F0[0,1] F1[1,2] B0[6,8] B1[8,10]",
        "F0[1,3] F1[3,5] B0[5,6] B1[6,7]",
    ]
    assert result.makespan_ns == 10


def test_interleaved_equal_chunks_equal_the_formula_and_uneven_ones_can_exceed_it():
    """Equal chunks, m a multiple of p: exactly m v (F + B) + (p - 1)(F + B), the interleaved
    formula m T_r + (p - 1) T_j. Uneven chunks can exceed it: p 2, v 2, m 2,
    F 1 everywhere, B (2, 1, 1, 2) for virtual stages 0..3 (T_r = 5 on both ranks, formula
    2 x 5 + 3 = 13):

        rank 0  F0.0[0,1] F0.1[1,2] F1.0[2,3] F1.1[3,4] B1.0[6,7] B1.1[9,10] B0.0[10,12]
                B0.1[12,14]
        rank 1  F0.0[1,2] F0.1[2,3] F1.0[3,4] B1.0[4,6] F1.1[6,7] B1.1[7,9] B0.0[9,10]
                B0.1[10,11]

    14 ns; every random case stays above m max_r T_r."""
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in range(p, 4 * p + 1, p):
                for forward, backward in ((1, 2), (3, 1)):
                    result = simulate_schedule(
                        schedule="1f1b",
                        num_microbatches=m,
                        num_ranks=p,
                        forward_ns=[forward] * (p * v),
                        backward_ns=[backward] * (p * v),
                    )
                    assert result.makespan_ns == (m * v + p - 1) * (forward + backward)
    result = simulate_schedule(
        schedule="1f1b",
        num_microbatches=2,
        num_ranks=2,
        forward_ns=[1] * 4,
        backward_ns=[2, 1, 1, 2],
    )
    assert result.makespan_ns == 14
    rng = random.Random(5)
    for _ in range(100):
        p, v = rng.randint(2, 4), rng.randint(2, 3)
        m = p * rng.randint(1, 3)
        forward = [rng.randint(1, 20) for _ in range(p * v)]
        backward = [rng.randint(1, 40) for _ in range(p * v)]
        result = simulate_schedule(
            schedule="1f1b",
            num_microbatches=m,
            num_ranks=p,
            forward_ns=forward,
            backward_ns=backward,
        )
        chunk = [f + b for f, b in zip(forward, backward, strict=True)]
        assert result.makespan_ns >= m * max(sum(chunk[r::p]) for r in range(p))


def _torch_actions(order: dict, rank: int, renumber: bool = False) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) of a torch action list, idle steps and gradient reductions
    left out; ``renumber``: micro-batches numbered by their order per (kind, stage), as the
    schedule runs them."""
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    actions = [
        (kinds[a.computation_type.name], a.stage_index, a.microbatch_index)
        for a in order[rank]
        if a is not None and a.computation_type.name in kinds
    ]
    if renumber:
        counts: dict[tuple[str, int], int] = {}
        numbered = []
        for kind, stage, _ in actions:
            numbered.append((kind, stage, counts.get((kind, stage), 0)))
            counts[(kind, stage)] = numbered[-1][2] + 1
        actions = numbered
    return actions


def _ours(m: int, p: int, v: int, rank: int, group=None, schedule="1f1b"):
    return [
        (a.kind, a.chunk * p + rank, a.microbatch)
        for a in schedule_actions(m, p, v, rank, group, schedule)
    ]


@pytest.mark.parametrize("name,schedule", [("Schedule1F1B", "1f1b"), ("ScheduleGPipe", "gpipe")])
def test_action_order_is_torchs(name, schedule):
    """torch's ``_get_pipeline_order`` (the schedule IR its single-stage schedules publish, read
    without a process group) gives the same forwards and backwards, in order, per rank. The IR
    numbers micro-batches loosely (Schedule1F1B's last rank lists F1..Fm: its counter starts at
    0 and is incremented before the first steady forward; below m = p it lists warm-up forwards
    of micro-batches that do not exist), so the micro-batches are compared as the schedule's
    ``_step_microbatches`` runs them: in order per stage (m >= p)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, name)
    for p in range(1, 6):
        for m in range(p, p + 6):
            order = cls._get_pipeline_order(SimpleNamespace(_num_stages=p, _n_microbatches=m))
            for rank in range(p):
                assert _ours(m, p, 1, rank, schedule=schedule) == _torch_actions(
                    order, rank, renumber=True
                )


def test_interleaved_action_order_is_torchs():
    """``ScheduleInterleaved1F1B._calculate_single_rank_operations`` (torch 2.13, through
    ``profiling._torch_compat.interleaved_1f1b_actions``) against ``schedule_actions`` with
    torch's rounds (``interleaved_schedule_groups``); each (kind, stage)'s micro-batches are
    numbered in the order the schedule runs them."""
    compat = pytest.importorskip("profiling._torch_compat")
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in range(p, 3 * p + 1):
                if m % max(1, m // p):
                    continue  # torch refuses these
                group = interleaved_schedule_groups("torch", m, p)
                for rank in range(p):
                    counts: dict[tuple[str, int], int] = {}
                    theirs = []
                    for stage, name in compat.interleaved_1f1b_actions(m, p, v, rank):
                        if name not in kinds:
                            continue
                        key = (kinds[name], stage)
                        theirs.append((*key, counts.get(key, 0)))
                        counts[key] = theirs[-1][2] + 1
                    assert _ours(m, p, v, rank, group) == theirs, (p, v, m, rank)


@pytest.mark.slow
def test_interleaved_order_is_megatrons():
    """megatron-core 0.16.1's ``get_schedule_table``: forward k runs (micro-batch, chunk) =
    table[k], backward k table[k] with the chunk reversed (``get_model_chunk_id(k,
    forward=False)``), after 2 (p - 1 - r) + (v - 1) g warm-up forwards
    (``get_pp_rank_microbatches``) with g = p (slow: importing megatron-core takes seconds)."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    for p, v, m in [(2, 2, 4), (2, 3, 6), (4, 2, 8), (4, 3, 12), (3, 2, 9)]:
        table = schedules.get_schedule_table(m, v, p)
        for rank in range(p):
            warmup = min(m * v, 2 * (p - 1 - rank) + (v - 1) * p)
            forwards = [("F", chunk * p + rank, i) for i, chunk in table]
            backwards = [("B", (v - 1 - chunk) * p + rank, i) for i, chunk in table]
            order = forwards[:warmup]
            for k in range(m * v - warmup):
                order += [forwards[warmup + k], backwards[k]]
            order += backwards[m * v - warmup :]
            assert _ours(m, p, v, rank) == order


# -- from the cost model ---------------------------------------------------------------------


def _chain(times_ms: list[float], *, output_bytes: int = 64):
    """A chain with measured per-sample times: forward t ms, backward 2 t ms."""
    layers = [
        {
            "name": f"l{i}",
            "params": 10,
            "activation_bytes": 100,
            "output_bytes": output_bytes,
            "fwd_ms": t,
            "bwd_ms": 2 * t,
        }
        for i, t in enumerate(times_ms)
    ]
    return graph_from_dict({"format": "layer-graph", "version": 1, "model": "m", "layers": layers})


def _costs(graph, *, recompute="none", **config):
    """The cost model's coefficients without optimizer step or transfer time (the hand-worked
    schedules below count compute and sync only; tests that want them set them)."""
    config = ParallelConfig(
        **({"tp": 1, "dp": 1, "micro_batch": 1, "recompute": recompute} | config)
    )
    training = TrainingConfig(global_batch=config.num_microbatches * config.dp)
    costs = layer_costs(graph, config, Cluster(num_gpus=config.pp * config.dp), training)
    no_step = np.zeros(costs.num_layers, dtype=np.int64)
    return dataclasses.replace(costs, optimizer_step_ns=no_step, link_gb_per_s=None)


def test_forward_and_backward_sum_to_the_layer_time(gpt_graph):
    """forward_ns + backward_ns == time_ns exactly, per layer, in both recompute states; the
    forward is b fwd_flops / (gpu_flops efficiency) rounded up (plus half the TP all-reduces)."""
    cluster = Cluster(num_gpus=8)
    for tp, b in ((1, 1), (2, 4)):
        config = ParallelConfig(pp=2, tp=tp, dp=1, micro_batch=b, num_microbatches=4)
        costs = layer_costs(gpt_graph, config, cluster, TrainingConfig(global_batch=4 * b))
        assert np.array_equal(costs.forward_ns + costs.backward_ns, costs.time_ns)
        assert np.array_equal(
            costs.forward_ns + costs.recompute_backward_ns, costs.recompute_time_ns
        )
        assert (costs.backward_ns >= costs.forward_ns).all()
        flops = np.array([layer.fwd_flops for layer in gpt_graph.layers], dtype=float)
        rate = cluster.gpu_flops * cluster.flops_efficiency
        comm = np.array([layer.tp_comm_bytes for layer in gpt_graph.layers], dtype=float)
        expected = np.ceil(
            b * flops / rate / tp * 1e9 + b * comm * (tp - 1) / tp / cluster.intra_node_gb_per_s
        )
        assert np.array_equal(costs.forward_ns, expected)
    mask = np.zeros(costs.num_layers, dtype=bool)
    mask[3] = True
    full = _costs(_chain([1.0, 2.0]), recompute="full", pp=1, num_microbatches=1)
    forward, backward = full.forward_backward_ns(None)
    assert forward.tolist() == [1_000_000, 2_000_000]
    assert backward.tolist() == [3_000_000, 6_000_000]  # the forward again, then the backward


def test_chain_even_split_equals_formula_and_uneven_is_below():
    """8 equal layers, pp 4, m 8: the even split (2 each) gives exactly the planner's
    (m + p - 1) max_s T_s, and so does the iteration bound; the split 1-3-2-2 is slower by the
    formula (max 3 layers) and the simulation charges less than it, more than the bound."""
    graph = _chain([1.0] * 8)
    costs = _costs(graph, pp=4, num_microbatches=8)

    def formula(split):
        return 11 * max(stage.time_ns for stage in stage_costs(costs, split))

    even = [0, 0, 1, 1, 2, 2, 3, 3]
    assert simulated_iteration_ns(costs, even) == formula(even) == 11 * 6_000_000
    assert iteration_bound_ns(costs, stage_costs(costs, even)) == formula(even)
    uneven = [0, 1, 1, 1, 2, 2, 3, 3]
    assert formula(uneven) == 11 * 9_000_000
    simulated = simulated_iteration_ns(costs, uneven)
    bound = iteration_bound_ns(costs, stage_costs(costs, uneven))
    # rank 1: stage 0 first (3 ms), then 8 x its own 9 ms, and its first backward waits for
    # micro-batch 0 through ranks 2 and 3 (3 + 6 + 6 ms) where its 3 warm-up forwards take 9
    assert bound == 3_000_000 + 8 * 9_000_000 + 6_000_000
    assert bound <= simulated < formula(uneven)


def test_transfers_follow_the_boundary_bytes():
    """Neighbour p2p (megatron): the bytes stage j sends forward are ``boundary_bytes``' out_of
    (relays included); a gradient comes back for each. p 2, m 1: F0 + x + F1 + B1 + x + B0
    with x = ceil(64 B / 10 GB/s) = 7 ns."""
    costs = _costs(_chain([1.0, 1.0]), pp=2, num_microbatches=1)
    stage_of = np.array([0, 1])
    forward, backward = stage_transfer_bytes(costs, stage_of)
    _, out_of, _ = boundary_bytes(costs, stage_of)
    assert forward == {(0, 1): int(out_of[0])} == {(0, 1): 64}
    assert backward == {(1, 0): 64}
    simulated = simulated_iteration_ns(costs, stage_of, link_gb_per_s=10.0)
    assert simulated == 2 * 3_000_000 + 2 * 7


def test_direct_sends_and_relays_on_a_dag():
    """t5-like DAG (enc feeds dec0 and dec1): on megatron the encoder output is relayed through
    the stage in between, on torch it goes straight to each consuming stage."""
    graph = t5_like_graph()
    stage_of = np.array([0, 0, 1, 2])
    config = ParallelConfig(pp=3, tp=1, dp=1, micro_batch=1, num_microbatches=3)
    for runtime, expected in (
        ("megatron", {(0, 1): 8 + 6, (1, 2): 8 + 7}),
        ("torch", {(0, 1): 8 + 6, (0, 2): 8, (1, 2): 7}),
    ):
        training = TrainingConfig(global_batch=3, runtime=runtime)
        costs = layer_costs(graph, config, Cluster(num_gpus=3), training)
        forward, backward = stage_transfer_bytes(costs, stage_of)
        assert forward == expected
        assert backward == {(c, a): size for (a, c), size in expected.items()}
        _, out_of, _ = boundary_bytes(costs, stage_of)
        if runtime == "megatron":  # one neighbour each: what the memory model's buffers send
            for j in range(2):
                assert out_of[j] == forward[(j, j + 1)]


def test_links_serialise_transfers():
    """A transfer of 5 ns per micro-batch after 1 ns forwards: the second waits for the first on
    the link (FIFO), so F1 on stage 1 starts at 1 + 5 + 5 = 11, not 2 + 5."""
    result = simulate_schedule(
        schedule="gpipe",
        num_microbatches=2,
        num_ranks=2,
        forward_ns=[1, 1],
        backward_ns=[1, 1],
        transfer_ns={(0, 1): 5},
    )
    assert _timeline(result)[1].startswith("F0[6,7] F1[11,12]")


def test_sync_overlap_and_optimizer_step():
    """AR_r after the rank's last backward (default), or overlapped with it
    (``last_backward``), + the optimizer step; the iteration is the latest rank."""
    base = dict(
        schedule="1f1b", num_microbatches=3, num_ranks=2, forward_ns=[1, 2], backward_ns=[2, 4]
    )
    # last backwards: rank 0 B2[19,21], rank 1 B2[15,19]
    after = simulate_schedule(**base, dp_sync_ns=[3, 10], optimizer_step_ns=[1, 2])
    assert after.makespan_ns == max(21 + 3 + 1, 19 + 10 + 2) == 31
    assert after.tail_ns == [4, 12]
    overlap = simulate_schedule(
        **base, dp_sync_ns=[3, 10], dp_overlap="last_backward", optimizer_step_ns=1
    )
    assert overlap.makespan_ns == max(max(21, 19 + 3), max(19, 15 + 10)) + 1 == 26
    overhead = simulate_schedule(**base, microbatch_overhead_ns=1)
    assert overhead.busy_ns == [9 + 3, 18 + 3]


def test_timeline_sync_is_the_rank_sum_of_dp_sync():
    """``schedule_timeline`` takes AR_r from the layers' ``dp_sync_ns`` (dp 2): the simulated
    iteration is the compute makespan + the slowest rank's sync when the ranks finish together
    (equal stages): the formula's (m + p - 1) max T + max AR."""
    costs = _costs(_chain([1.0] * 4), pp=2, dp=2, num_microbatches=4)
    stage_of = [0, 0, 1, 1]
    assert costs.dp_sync_ns.sum() > 0
    timeline = schedule_timeline(costs, stage_of)
    stages = stage_costs(costs, stage_of)
    formula = 5 * max(s.time_ns for s in stages) + max(s.dp_sync_ns for s in stages)
    assert timeline.makespan_ns == formula == iteration_bound_ns(costs, stages)


def test_pipeline_links_follow_megatrons_rank_order():
    """tp 2, dp 1, 8 GPUs a node: ranks 0-3 on node 0, 4-7 on node 1, so only links that cross
    between them are inter-node; with t d = 8 every link is."""
    cluster = Cluster(num_gpus=16, intra_node_gb_per_s=400.0, inter_node_gb_per_s=25.0)
    links = pipeline_link_gb_per_s(
        ParallelConfig(pp=8, tp=2, dp=1, micro_batch=1, num_microbatches=8), cluster
    )
    assert links[(0, 1)] == links[(2, 3)] == links[(5, 4)] == 400.0
    assert links[(3, 4)] == links[(7, 0)] == 25.0
    wide = pipeline_link_gb_per_s(
        ParallelConfig(pp=2, tp=8, dp=1, micro_batch=1, num_microbatches=2), cluster
    )
    assert wide == {(0, 1): 25.0, (1, 0): 25.0}


@pytest.mark.parametrize("runtime", ["megatron", "torch"])
def test_interleaved_layout_from_the_cost_model(runtime):
    """8 equal layers on p 2, v 2 (virtual stage j holds layers 2j, 2j + 1; chunk j // p of rank
    j % p), m 4: equal chunks, so the simulation equals the cost model's interleaved formula
    m T_r + (p - 1) T_j; with recompute every backward also runs the forward again."""
    graph = _chain([1.0] * 8)
    stage_of = [0, 0, 1, 1, 2, 2, 3, 3]
    for recompute, chunk_ns in (("none", 6_000_000), ("full", 8_000_000)):
        config = ParallelConfig(
            pp=2,
            tp=1,
            dp=1,
            micro_batch=1,
            num_microbatches=4,
            virtual_stages=2,
            recompute=recompute,
        )
        training = TrainingConfig(global_batch=4, virtual_stages=(2,), runtime=runtime)
        costs = layer_costs(graph, config, Cluster(num_gpus=2), training)
        costs = dataclasses.replace(
            costs, optimizer_step_ns=np.zeros(8, dtype=np.int64), link_gb_per_s=None
        )
        formula = 4 * 2 * chunk_ns + chunk_ns
        assert iteration_bound_ns(costs, stage_costs(costs, stage_of)) == formula
        assert simulated_iteration_ns(costs, stage_of) == formula


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_forwards_before_the_first_backward_follow_the_action_lists(schedule):
    """The bound's c_r (``forwards_before_first_backward``) is what each rank's own list of
    actions runs before its first backward, for every rank and short and long pipelines."""
    for p, m in ((1, 1), (2, 1), (3, 2), (4, 4), (4, 9), (6, 3)):
        for r in range(p):
            actions = schedule_actions(m, p, 1, r, None, schedule)
            first = next(k for k, action in enumerate(actions) if action.kind == "B")
            assert forwards_before_first_backward(m, p, r, schedule) == first


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_never_exceeds_the_simulation(seed):
    """``iteration_bound_ns`` (what the solvers search with) is a lower bound on the simulated
    iteration for every split: random chains and times, 1F1B, GPipe and interleaved, dp 1 and
    2 (sync after or during the last backward), per-micro-batch and per-step overheads,
    transfers on or off; and it meets the simulation on some splits (it is not loose)."""
    rng = random.Random(seed)
    met = 0
    for _ in range(30):
        layers = rng.randint(4, 9)
        graph = _chain([rng.uniform(0.1, 2.0) for _ in range(layers)])
        v = rng.choice([1, 1, 2])
        pp = rng.randint(2, min(4, layers // v))
        schedule = "gpipe" if v == 1 and rng.random() < 0.4 else "1f1b"
        dp = rng.choice([1, 2])
        m = rng.randint(1, 10) if v == 1 else rng.choice([pp, 2 * pp])
        config = ParallelConfig(
            pp=pp,
            tp=1,
            dp=dp,
            micro_batch=1,
            num_microbatches=m,
            virtual_stages=v,
            schedule=schedule,
        )
        training = TrainingConfig(
            global_batch=m * dp, virtual_stages=(v,), runtime=rng.choice(["torch", "megatron"])
        )
        costs = layer_costs(graph, config, Cluster(num_gpus=pp * dp), training)
        costs = dataclasses.replace(
            costs,
            microbatch_overhead_ns=rng.choice([0, 50_000]),
            step_overhead_ns=rng.choice([0, 300_000]),
            link_gb_per_s=rng.choice([None, 1e-4]),
        )
        cuts = sorted(rng.sample(range(1, layers), pp * v - 1))
        bounds = [0, *cuts, layers]
        split = [j for j in range(pp * v) for _ in range(bounds[j], bounds[j + 1])]
        stages = stage_costs(costs, split)
        bound = iteration_bound_ns(costs, stages)
        simulated = simulated_iteration_ns(costs, split)
        assert bound <= simulated, (config, split)
        met += bound == simulated
    assert met > 0
