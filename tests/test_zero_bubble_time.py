"""The time simulation of the zero-bubble and V schedules (solver/costs/schedule_time.py with
solver/costs/schedule_orders.py).

Oracles: an independent longest-path replay of the same action lists (each action starts when
its rank's previous action and its data dependencies have ended: F(j, i) after F(j - 1, i);
I or B (j, i) after F(j, i) and after the I or B of (j + 1, i); W(j, i) after I(j, i); as
torch runs them, stage 0's I empty and its W the whole backward, and a DualPipeV overlapped
forward's output sent after the backward it is paired with), on
random small cases for every schedule, 1F1B, GPipe and interleaved 1F1B included (no
regression on the old path); and the zero-bubble property at equal times (Qi et al. 2024).
"""

from __future__ import annotations

import random
from functools import cache

import numpy as np
import pytest

from solver.costs import layer_costs, schedule_actions
from solver.costs.schedule_orders import OverlapStep, pipeline_order, rank_stages, stage_ranks
from solver.costs.schedule_time import simulate_schedule, weight_gradient_ns
from solver.errors import InputError
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig

CASES = [  # (schedule, chunks per rank, whether m must be a multiple of max(1, m // p))
    ("1f1b", 1, False),
    ("gpipe", 1, False),
    ("1f1b", 2, True),
    ("interleaved-zb", 1, True),
    ("interleaved-zb", 2, True),
    ("zbv", 2, False),
    ("dualpipev", 2, False),
]


def _reference_makespan(schedule, m, p, v, forward, backward, weight, group=None) -> int:
    """Each action's end by recursion over its dependencies (``schedule_actions``' lists)."""
    n = p * v
    lists = {
        r: [
            (a.kind, rank_stages(schedule, p, v, r)[a.chunk], a.microbatch)
            for a in schedule_actions(m, p, v, r, group, schedule)
        ]
        for r in range(p)
    }
    rank_of = stage_ranks(schedule, p, v)
    position = {action: (r, k) for r, actions in lists.items() for k, action in enumerate(actions)}
    backward_kind = {(j, i): kind for (kind, j, i) in position if kind in "IB"}
    split = schedule in ("interleaved-zb", "zbv", "dualpipev")
    duration = {
        "F": forward,
        "B": backward,
        "I": [b - w for b, w in zip(backward, weight, strict=True)] if split else backward,
        "W": list(weight),
    }
    if split:  # torch's backward_one_chunk skips stage 0's I; its W runs the whole backward
        duration["I"][0], duration["W"][0] = 0, backward[0]
    # an OVERLAP_F_B's forward output leaves after its backward (torch's _add_send_recv)
    overlapped = set()
    if schedule == "dualpipev":
        for entries in pipeline_order(schedule, m, p, v):
            for entry in entries:
                if isinstance(entry, OverlapStep):
                    overlapped.add(("F", entry.forward.stage, entry.forward.microbatch))

    @cache
    def end(action) -> int:
        kind, j, i = action
        r, k = position[action]
        needs = [lists[r][k - 1]] if k else []
        if kind == "F" and j > 0:
            sender = ("F", j - 1, i)
            if sender in overlapped and rank_of[j - 1] != r:
                sender_rank, sender_position = position[sender]
                sender = lists[sender_rank][sender_position + 1]  # the overlap's backward
            needs.append(sender)
        if kind in "IB":
            needs.append(("F", j, i))
            if j < n - 1:
                needs.append((backward_kind[(j + 1, i)], j + 1, i))
        if kind == "W":
            needs.append(("I", j, i))
        assert rank_of[j] == r
        return max((end(need) for need in needs), default=0) + duration[kind][j]

    return max(end(actions[-1]) for actions in lists.values())


@pytest.mark.parametrize("schedule,v,rounds", CASES)
def test_simulation_is_the_longest_path(schedule, v, rounds):
    """Random per-stage times (W at most the backward), no transfer time: the simulated
    iteration equals the longest path through the actions' dependencies."""
    rng = random.Random(31)
    checked = 0
    for _ in range(40):
        p, m = rng.randint(1, 4), rng.randint(1, 10)
        if schedule == "dualpipev":
            m = max(m, 2 * p)
        if rounds and m % max(1, m // p):
            continue
        n = p * v
        forward = [rng.randint(1, 50) for _ in range(n)]
        backward = [rng.randint(2, 100) for _ in range(n)]
        weight = [rng.randint(0, b) for b in backward]
        group = m // max(1, m // p) if (schedule == "1f1b" and v > 1) else None
        simulated = simulate_schedule(
            schedule=schedule,
            num_microbatches=m,
            num_ranks=p,
            forward_ns=forward,
            backward_ns=backward,
            weight_ns=weight,
            group=group,
        ).makespan_ns
        assert simulated == _reference_makespan(
            schedule, m, p, v, forward, backward, weight, group
        ), (schedule, p, m)
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_zbv_has_almost_no_bubble_at_equal_times(p):
    """T_F = T_I = T_W = t per chunk (a stage of 1F1B is two chunks: 2t forward, 4t backward):
    1F1B takes the bubble formula (m + p - 1) 6t; ZB-V takes the work, 6 m t, plus only the
    first forward's fill (p - 1) t, far below; DualPipeV as torch runs it twice that fill
    (its overlapped forward's output leaves after the paired backward, so the forwards that
    wait on it start a t later: measured in benchmarks/bench_schedule_time.md); torch's
    interleaved ZB in between."""
    t = 500
    for m in (2 * p, 3 * p):
        one_f_one_b = simulate_schedule(
            schedule="1f1b",
            num_microbatches=m,
            num_ranks=p,
            forward_ns=[2 * t] * p,
            backward_ns=[4 * t] * p,
        ).makespan_ns
        assert one_f_one_b == (m + p - 1) * 6 * t
        for schedule in ("zbv", "dualpipev"):
            v_shape = simulate_schedule(
                schedule=schedule,
                num_microbatches=m,
                num_ranks=p,
                forward_ns=[t] * (2 * p),
                backward_ns=[2 * t] * (2 * p),
                weight_ns=[t] * (2 * p),
            ).makespan_ns
            fill = (p - 1) * t if schedule == "zbv" else 2 * (p - 1) * t
            assert v_shape == 6 * m * t + fill < one_f_one_b, (schedule, m)


def test_v_turn_around_costs_no_transfer():
    """The V's stages p - 1 and p are both on rank p - 1: a transfer given between them takes
    no time; between ranks it does."""
    p, m, n = 2, 4, 4
    base = dict(
        schedule="zbv", num_microbatches=m, num_ranks=p, forward_ns=[10] * n, backward_ns=[20] * n
    )
    plain = simulate_schedule(**base).makespan_ns
    turned = simulate_schedule(
        **base, transfer_ns={(1, 2): 1000}, gradient_ns={(2, 1): 1000}
    ).makespan_ns
    assert turned == plain
    crossing = simulate_schedule(**base, transfer_ns={(0, 1): 1000}).makespan_ns
    assert crossing > plain + 1000


def test_weight_gradient_time_rule():
    """W = a layer's forward for layers with weights (the default forward is a third of the
    layer time, so W = F and I = F too: T_F = T_I = T_W), none for a weightless layer; scaled
    with the stage's forward."""
    layers = [
        {
            "name": f"l{k}",
            "params": params,
            "activation_bytes": 50,
            "output_bytes": 8,
            "fwd_ms": 1.0 + k,
            "bwd_ms": 2.0 + 2 * k,
        }
        for k, params in enumerate([10, 0, 10, 10])
    ]
    graph = graph_from_dict({"format": "layer-graph", "version": 1, "model": "m", "layers": layers})
    config = ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=4)
    costs = layer_costs(graph, config, Cluster(num_gpus=2), TrainingConfig(global_batch=4))
    stage_of = np.array([0, 0, 1, 1])
    forward = [int(costs.forward_ns[stage_of == j].sum()) for j in range(2)]
    assert (costs.forward_ns > 0).all()
    assert (costs.time_ns - costs.forward_ns >= 2 * costs.forward_ns).all()
    own_forward = [int(costs.forward_ns[0]), int(costs.forward_ns[2] + costs.forward_ns[3])]
    assert weight_gradient_ns(costs, forward, stage_of) == own_forward
    doubled = weight_gradient_ns(costs, [2 * f for f in forward], stage_of)
    assert doubled == [2 * w for w in own_forward]


def test_refused_schedule_sizes():
    with pytest.raises(InputError, match="dualpipev needs at least as many micro-batches"):
        simulate_schedule(
            schedule="dualpipev",
            num_microbatches=3,
            num_ranks=2,
            forward_ns=[1] * 4,
            backward_ns=[2] * 4,
        )
