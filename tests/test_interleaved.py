"""Interleaved 1F1B (v model chunks per pipeline rank): in-flight counts, costs and exact solves.

Oracles: torch's own ScheduleInterleaved1F1B action lists (replayed to count the micro-batches each
chunk holds), the closed forms of Megatron / Korthikanti et al., per-rank costs recomputed here
from the layer fields with plain loops, and brute force over every split into p v virtual stages.
"""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from solver.backends.brute_force import solve_brute_force
from solver.backends.cpsat import solve_cpsat
from solver.backends.milp import solve_milp
from solver.backends.problem import OBJECTIVE_MEMORY, OBJECTIVE_TIME, OPTIMAL, StageProblem
from solver.cli import evaluate_main, plan_main
from solver.costs import (
    in_flight_microbatches,
    in_flight_vectors,
    interleaved_schedule_groups,
    iteration_bound_ns,
    layer_costs,
    stage_costs,
)
from solver.costs.schedule_time import simulated_iteration_ns
from solver.errors import InputError
from solver.evaluation import evaluate
from solver.search.candidates import memory_lower_bound, time_lower_bound
from solver.search.planner import plan
from solver.specs import Cluster, ParallelConfig, TrainingConfig
from tests.conftest import MIXED_CLUSTER, gpt_chain, slow_params
from tests.random_graphs import random_chain, random_dag

BACKENDS = {"cpsat": solve_cpsat, "milp": solve_milp}


def _maximal(vectors: list[tuple[int, ...]]) -> set[tuple[int, ...]]:
    return {
        a
        for a in vectors
        if not any(b != a and all(x >= y for x, y in zip(b, a, strict=True)) for b in vectors)
    }


def _torch_moments(m: int, p: int, v: int, rank: int) -> list[tuple[tuple, tuple]]:
    """Replay torch's ScheduleInterleaved1F1B actions for one rank: (micro-batches held, backwards
    done) per chunk after every forward and every full backward."""
    pytest.importorskip("torch.distributed.pipelining.schedules")
    from profiling._torch_compat import interleaved_1f1b_actions

    held, done, seen = [0] * v, [0] * v, []
    for stage_index, kind in interleaved_1f1b_actions(m, p, v, rank):
        assert stage_index % p == rank
        chunk = stage_index // p
        if kind == "FORWARD":
            held[chunk] += 1
        else:
            assert kind == "FULL_BACKWARD"
            held[chunk] -= 1
            done[chunk] += 1
        seen.append((tuple(held), tuple(done)))
    assert held == [0] * v
    return seen


def _torch_in_flight(m: int, p: int, v: int, rank: int) -> set[tuple[int, ...]]:
    return _maximal([n for n, _ in _torch_moments(m, p, v, rank)])


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 2, 16), (3, 3, 6), (4, 2, 10)])
def test_in_flight_vectors_match_torch_interleaved_schedule(p, v, m):
    group = interleaved_schedule_groups("torch", m, p)
    for rank in range(p):
        assert set(in_flight_vectors(m, p, v, rank, group)) == _torch_in_flight(m, p, v, rank)


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_largest_in_flight_total_is_megatrons_warmup_plus_one(p, v, groups):
    """Megatron-core get_pp_rank_microbatches: W_r = (p - r - 1) 2 + (v - 1) p warm-up forwards,
    capped at m v; the peak holds W_r + 1 chunk-micro-batches (all m v when all are warm-up)."""
    m = groups * p
    for rank in range(p):
        warmup = 2 * (p - rank - 1) + (v - 1) * p
        total = max(sum(vector) for vector in in_flight_vectors(m, p, v, rank))
        assert total == min(m * v, warmup + 1)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_one_chunk_is_the_plain_schedule(schedule):
    for p, m in [(4, 8), (4, 2), (1, 3), (3, 3)]:
        for rank in range(p):
            k = in_flight_microbatches(schedule, m, p, rank)
            if schedule == "1f1b":
                assert in_flight_vectors(m, p, 1, rank) == [(k,)]


def _uniform_chain(num_layers: int, activation: int = 1000) -> dict:
    return {
        "format": "layer-graph",
        "version": 1,
        "model": "uniform",
        "layers": [
            {
                "name": f"l{i}",
                "params": 0,
                "activation_bytes": activation,
                "output_bytes": 10,
                "fwd_flops": 1e9,
            }
            for i in range(num_layers)
        ],
    }


@pytest.mark.parametrize(("p", "v"), [(2, 2), (4, 2), (4, 4), (3, 2)])
def test_first_rank_activations_grow_by_korthikanti_factor(p, v):
    """Equal chunks: rank 0 holds p (1 + (p - 1) / (p v)) stage-micro-batches instead of p
    (Korthikanti et al. 2022, section 4.2.3; Megatron's interleaved schedule)."""
    from solver.graph import graph_from_dict

    num_layers, m = 2 * p * v, 4 * p
    graph = graph_from_dict(_uniform_chain(num_layers))
    plain = ParallelConfig(pp=p, tp=1, dp=1, micro_batch=1, num_microbatches=m)
    interleaved = dataclasses.replace(plain, virtual_stages=v)
    training = TrainingConfig(global_batch=m, virtual_stages=(v,))
    cluster = Cluster(num_gpus=p)
    even = [layer * p * v // num_layers for layer in range(num_layers)]
    plain_costs = layer_costs(graph, plain, cluster, training)
    ours = stage_costs(layer_costs(graph, interleaved, cluster, training), even)
    base = stage_costs(plain_costs, [layer * p // num_layers for layer in range(num_layers)])
    ratio = ours[0].activation_bytes / base[0].activation_bytes
    assert ratio == pytest.approx(1 + (p - 1) / (p * v))
    # fill and drain take p - 1 chunk slots: (m + (p - 1) / v) stage times (Narayanan et al.)
    # the simulated schedule and the iteration bound (no transfer time) agree on it
    costs = layer_costs(graph, interleaved, cluster, training)
    narayanan = m * ours[0].time_ns + (p - 1) * ours[0].time_ns // v
    assert iteration_bound_ns(costs, ours) == narayanan
    assert simulated_iteration_ns(costs, even, link_gb_per_s=None) == narayanan


def _random_interleaved(seed: int, selective: bool = False, **training_options):
    """A random interleaved config's costs; ``training_options`` override TrainingConfig fields
    (the same draws: the runtime is drawn either way)."""
    rng = random.Random(seed)
    p, v = rng.choice([(2, 2), (2, 3), (3, 2)])
    num_layers = p * v + rng.randint(0, 1 if selective else 2)
    graph = (random_chain if seed % 2 else random_dag)(rng, num_layers)
    m = p * rng.choice([1, 2, 3])
    config = ParallelConfig(
        pp=p,
        tp=rng.choice([1, 2]),
        dp=rng.choice([1, 2]),
        micro_batch=rng.choice([1, 2]),
        num_microbatches=m,
        zero=rng.choice([0, 1, 3]),
        recompute="selective" if selective else rng.choice(["none", "full"]),
        virtual_stages=v,
    )
    options = {
        "global_batch": config.global_batch,
        "virtual_stages": (v,),
        "runtime": rng.choice(["megatron", "torch"]),
    }
    training = TrainingConfig(**(options | training_options))
    return graph, config, layer_costs(graph, config, Cluster(num_gpus=config.num_gpus), training)


def _megatron_actions(m: int, p: int, v: int, rank: int) -> list[tuple[str, int]]:
    """megatron-core's interleaved order for one rank, written from its description
    (``get_schedule_table``: forwards in groups of p micro-batches, chunk 0 for the group, then
    chunk 1, ...; backwards in the same order with the chunks reversed;
    ``get_pp_rank_microbatches``: 2 (p - 1 - r) + (v - 1) p warm-up forwards), as (kind, chunk)."""
    table = [
        chunk for group in range(0, m, p) for chunk in range(v) for _ in range(min(p, m - group))
    ]
    forwards = [("F", chunk) for chunk in table]
    backwards = [("B", v - 1 - chunk) for chunk in table]
    warmup = min(m * v, 2 * (p - 1 - rank) + (v - 1) * p)
    order = forwards[:warmup]
    for k in range(m * v - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[m * v - warmup :]


def _megatron_live_buffers(m: int, p: int, v: int, rank: int) -> list[list[tuple[str, int]]]:
    """The boundary tensors megatron-core's interleaved loop keeps alive (besides the held
    micro-batches' inputs), as ("in" | "out" | "sent": a step's output, chunk), at each moment
    the replay below looks at:
    a forward (at its last layer: in the warm-up the p2p after it, else its output with the
    loop's locals), a backward, the p2p after a backward. Written from the loop's variables:
    received inputs wait in ``input_tensors`` until their forward; ``output_tensor_grad`` and
    ``input_tensor_grad`` hold the last received output gradient and the last input gradient
    made until rebound; a step's output lives until its p2p, which receives the next input and
    output gradient before letting go of anything; each chunk's model keeps its last forward's
    input (``set_input_tensor``), beyond its held ones once it holds none."""
    table = [c for g in range(0, m, p) for c in range(v) for _ in range(min(p, m - g))]
    total = m * v
    fwd, bwd = table, [v - 1 - c for c in table]
    warm = min(total, 2 * (p - 1 - rank) + (v - 1) * p)

    def arriving(k: int, forward: bool) -> int | None:
        order, lead = (fwd, 0) if forward else (bwd, p - 1)
        if rank != lead:
            return order[k + 1] if k + 1 < total else None
        j = k - (p - 1)  # the other end's step that sent it
        if j < 0 or order[j] == (v - 1 if forward else 0):
            return None
        return order[j] + (1 if forward else -1)

    waiting = [0] * v
    locals_ = {"output_tensor_grad": None, "input_tensor_grad": None}
    moments: list[list[tuple[str, int]]] = []
    model_input = [False] * v  # the chunk's model keeps an input beyond its held ones
    holding = [0] * v

    def live(*extra):
        tensors = [("in", c) for c in range(v) for _ in range(waiting[c])]
        tensors += [("in", c) for c in range(v) if model_input[c] and not holding[c]]
        return tensors + [t for t in (*locals_.values(), *extra) if t is not None]

    def run_forward(k: int):
        c = fwd[k]
        waiting[c] -= int(not (rank == 0 and c == 0))
        model_input[c] = not (rank == 0 and c == 0)
        holding[c] += 1
        return None if (rank == p - 1 and c == v - 1) else ("sent", c)

    def input_grad(c: int):
        return None if (rank == 0 and c == 0) else ("in", c)

    waiting[0] += int(rank != 0)
    for k in range(warm):
        output = run_forward(k)
        nxt = arriving(k, True) if k < total - 1 else None
        grad = None
        if k == warm - 1 and warm < total and rank != p - 1:
            grad = ("out", bwd[0])
        moments.append(live(output, nxt is not None and ("in", nxt) or None, grad))
        if nxt is not None:
            waiting[nxt] += 1
        if grad is not None:
            locals_["output_tensor_grad"] = grad
    for k in range(total - warm):
        output = run_forward(warm + k)
        moments.append(live(output))
        c = bwd[k]
        moments.append(live(output, input_grad(c)))
        holding[c] -= 1
        locals_["input_tensor_grad"] = input_grad(c)
        nxt = arriving(warm + k, True) if warm + k < total - 1 else None
        grad = arriving(k, False)
        grad = None if grad is None else ("out", grad)
        moments.append(live(output, nxt is not None and ("in", nxt) or None, grad))
        if nxt is not None:
            waiting[nxt] += 1
        locals_["output_tensor_grad"] = grad
    for k in range(total - warm, total):
        c = bwd[k]
        moments.append(live(input_grad(c)))
        holding[c] -= 1
        locals_["input_tensor_grad"] = input_grad(c)
        grad = arriving(k, False) if k < total - 1 else None
        grad = None if grad is None else ("out", grad)
        moments.append(live(grad))
        locals_["output_tensor_grad"] = grad
    return moments


def _rank_peaks_by_hand(graph, costs, split) -> list[int]:
    """Per-rank peak straight from the definition, with loops (chains and DAGs), replaying the
    rank's actions (torch's own ScheduleInterleaved1F1B list; megatron's order from its
    description) layer by layer: every state, every gradient, each other held micro-batch whole
    (+ its relayed edges), the running one (the forward's after it counts, the backward's
    before it frees) its relayed edges and the stored bytes of its chunk's layers up to the
    running one, whose transient (+ on the torch runtime the model's output the pipeline keeps,
    on the chunk of the last layer before it) runs beside them; after each backward the same
    with nothing running. Boundary buffers: megatron one per direction per virtual stage (and
    the n held outputs without deallocate_pipeline_outputs); torch m receive buffers less the
    held inputs plus the input gradients sent back (kept until the step ends), m gradient
    buffers plus the held outputs plus the outputs already sent back from. With a foreach
    optimizer step, at least the step: every state, the step temporaries, the buffers with
    nothing held."""
    p, num_stages = costs.num_ranks, costs.num_stages
    stored, transient, _ = costs.coefficients(None)
    relayed = [0] * num_stages
    received = [0] * num_stages
    sent = [0] * num_stages
    for u, v, nbytes in zip(costs.edge_src, costs.edge_dst, costs.edge_bytes, strict=True):
        a, b = split[u], split[v]
        if a == b:
            continue
        sent[a] += int(nbytes)
        received[b] += int(nbytes)
        if costs.runtime == "megatron":  # torch sends straight to the consumer: no relay
            for j in range(a + 1, b):
                relayed[j] += int(nbytes)
    m, last = costs.config.num_microbatches, num_stages - 1
    last_layer = len(split) - 1

    def copies(j: int, n: int, done: int) -> tuple[int, int]:
        if costs.runtime == "torch":
            return (0 if j == 0 else m - n + done), (0 if j == last else m + n + done)
        kept_outputs = 0 if costs.deallocate_pipeline_outputs else n
        return int(j > 0), (1 + kept_outputs) * (j < last)

    def running_transient(layer: int) -> int:
        held_output = costs.runtime == "torch" and split[last_layer] == split[layer]
        return int(transient[layer]) + (
            costs.held_output_bytes if held_output and layer != last_layer else 0
        )

    peaks = []
    for rank in range(p):
        own = list(range(rank, num_stages, p))
        v = len(own)
        layers = [layer for layer in range(len(split)) if split[layer] in own]
        states = sum(int(costs.state_bytes[layer]) for layer in layers)
        chunk_layers = [[layer for layer in layers if split[layer] == j] for j in own]
        whole = [
            sum(int(stored[layer]) for layer in chunk) + relayed[j]
            for chunk, j in zip(chunk_layers, own, strict=True)
        ]
        if costs.runtime == "torch":
            pytest.importorskip("torch.distributed.pipelining.schedules")
            from profiling._torch_compat import interleaved_1f1b_actions

            actions = [
                ("F" if kind == "FORWARD" else "B", stage // p)
                for stage, kind in interleaved_1f1b_actions(m, p, v, rank)
            ]
        else:
            actions = _megatron_actions(m, p, v, rank)
            live = iter(_megatron_live_buffers(m, p, v, rank))
        held, done, values = [0] * v, [0] * v, []

        def moment_copies() -> list[tuple[int, int]]:
            if costs.runtime == "torch":
                return [copies(j, n, b) for n, b, j in zip(held, done, own, strict=True)]
            tensors = next(live)  # megatron: the loop's live boundary tensors
            return [
                (
                    tensors.count(("in", c)),
                    tensors.count(("out", c))
                    + (  # without deallocation the sent output is a held micro-batch's
                        tensors.count(("sent", c))
                        if costs.deallocate_pipeline_outputs
                        else (0 if j == last else n)
                    ),
                )
                for c, (n, j) in enumerate(zip(held, own, strict=True))
            ]

        def memory(running: int | None) -> list[int]:
            at = moment_copies()
            base = states + sum(
                n * h + r * (received[j] + relayed[j]) + s * (sent[j] + relayed[j])
                for n, h, j, (r, s) in zip(held, whole, own, at, strict=True)
            )
            if running is None:
                return [base]
            moments, kept = [], relayed[own[running]]
            for layer in chunk_layers[running]:
                kept += int(stored[layer])
                moments.append(
                    base - whole[running] + kept + running_transient(layer)
                )  # fmt: skip
            return moments

        for kind, chunk in actions:
            if kind == "F":
                held[chunk] += 1
                values += memory(chunk)
            else:
                values += memory(chunk)
                held[chunk] -= 1
                done[chunk] += 1
                values += memory(None)
        peak = max(values)
        if costs.step_bytes is not None:  # the optimizer step: nothing held, the temporary
            step = sum(int(costs.step_bytes[layer]) for layer in layers)
            idle = sum(
                copies(j, 0, 0)[0] * (received[j] + relayed[j])
                + copies(j, 0, 0)[1] * (sent[j] + relayed[j])
                for j in own
            )
            peak = max(peak, states + step + idle)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("deallocate", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_rank_costs_recompute_by_hand(seed, deallocate):
    graph, config, costs = _random_interleaved(seed, deallocate_pipeline_outputs=deallocate)
    rng = np.random.default_rng(seed)
    for _ in range(5):
        cuts = np.sort(rng.choice(np.arange(1, graph.num_layers), costs.num_stages - 1, False))
        split = np.searchsorted(cuts, np.arange(graph.num_layers), side="right").tolist()
        stages = stage_costs(costs, split)
        assert [s.peak_bytes for s in stages] == _rank_peaks_by_hand(graph, costs, split)
        assert [len(s.chunks) for s in stages] == [config.virtual_stages] * config.pp
        assert sum(len(s.layers) for s in stages) == graph.num_layers


def test_a_running_chunk_holds_less_than_the_persistent_moment():
    """The moments with the running chunk (``LayerCosts.running_chunks``) are never above the
    persistent ones (every held micro-batch whole, the rank's largest transient at every
    moment), and below them where a chunk's largest transient sits before its later layers'
    stored bytes; a rank's largest action of the schedule picture is its peak."""
    from solver.costs.schedule_memory import rank_memory

    lower = 0
    for seed in range(12):
        graph, config, costs = _random_interleaved(seed)
        persistent = dataclasses.replace(costs, running_chunks=[])
        assert costs.layer_moment_ranks and not persistent.layer_moment_ranks
        rng = np.random.default_rng(seed)
        for _ in range(5):
            cuts = np.sort(rng.choice(np.arange(1, graph.num_layers), costs.num_stages - 1, False))
            split = np.searchsorted(cuts, np.arange(graph.num_layers), side="right").tolist()
            ours = [s.peak_bytes for s in stage_costs(costs, split)]
            upper = [s.peak_bytes for s in stage_costs(persistent, split)]
            assert all(a <= b for a, b in zip(ours, upper, strict=True))
            lower += sum(a < b for a, b in zip(ours, upper, strict=True))
            assert [rank.peak_bytes for rank in rank_memory(costs, split)] == ours
    assert lower  # some rank's running chunk frees part of it at its peak


@pytest.mark.parametrize("seed", slow_params(range(16), 0, 5, 9, 11, 12, 13))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_solvers_equal_brute_force(seed, backend):
    graph, config, costs = _random_interleaved(seed)
    oracle = solve_brute_force(StageProblem(costs=costs, objective=OBJECTIVE_MEMORY))
    problem = StageProblem(costs=costs, objective=OBJECTIVE_MEMORY)
    solution = BACKENDS[backend](problem, time_limit_s=30)
    assert solution.status == OPTIMAL
    assert solution.objective == oracle.objective
    assert problem.objective_value(solution.stage_of_layer) == oracle.objective
    # the config's static bounds never exceed the optimum (they prune configs in the search)
    assert memory_lower_bound(costs) <= oracle.objective
    fastest = solve_brute_force(StageProblem(costs=costs, objective=OBJECTIVE_TIME))
    assert time_lower_bound(costs) <= fastest.objective
    # under a throughput budget between the fastest and the memory optimum's iteration
    _, slow = problem.measure(oracle.stage_of_layer)
    budget = (fastest.objective + slow) // 2
    limited = StageProblem(costs=costs, objective=OBJECTIVE_MEMORY, iteration_budget_ns=budget)
    expected = solve_brute_force(limited)
    got = BACKENDS[backend](limited, time_limit_s=30)
    assert got.status == expected.status
    assert got.objective == expected.objective
    timed = BACKENDS[backend](StageProblem(costs=costs, objective=OBJECTIVE_TIME), time_limit_s=30)
    assert timed.objective == fastest.objective


@pytest.mark.parametrize("seed", range(8))
def test_solvers_equal_brute_force_when_megatron_keeps_sent_outputs(seed):
    """Without deallocate_pipeline_outputs a virtual stage's sent copies follow its in-flight
    count at each moment (1 + n_c, ``LayerCosts.copies_at``): one memory row per vector."""
    graph, config, costs = _random_interleaved(
        seed, runtime="megatron", deallocate_pipeline_outputs=False
    )
    problem = StageProblem(costs=costs, objective=OBJECTIVE_MEMORY)
    oracle = solve_brute_force(problem)
    assert [s.peak_bytes for s in stage_costs(costs, oracle.stage_of_layer)] == (
        _rank_peaks_by_hand(graph, costs, oracle.stage_of_layer)
    )
    for solve in BACKENDS.values():
        solution = solve(problem, time_limit_s=30)
        assert solution.status == OPTIMAL
        assert solution.objective == oracle.objective
        assert problem.objective_value(solution.stage_of_layer) == oracle.objective
    assert memory_lower_bound(costs) <= oracle.objective


@pytest.mark.parametrize("seed", slow_params(range(6), 0, 5))
def test_selective_recompute_with_interleaving_equals_brute_force(seed):
    graph, config, costs = _random_interleaved(seed, selective=True)
    problem = StageProblem(costs=costs, objective=OBJECTIVE_MEMORY)
    oracle = solve_brute_force(problem)
    for solve in BACKENDS.values():
        solution = solve(problem, time_limit_s=30)
        assert solution.objective == oracle.objective
        recomputed = solution.recomputed
        assert problem.objective_value(solution.stage_of_layer, recomputed) == oracle.objective


def _gpt_graph_file(tmp_path, blocks: int = 12) -> str:
    path = tmp_path / "gpt.json"
    graph = gpt_chain(blocks)
    document = {
        "format": "layer-graph",
        "version": 1,
        "model": graph.model,
        "layers": [
            {key: value for key, value in dataclasses.asdict(layer).items() if value is not None}
            | {"fwd_flops": 1e12, "activation_bytes": 2**30}
            for layer in graph.layers
        ],
    }
    path.write_text(json.dumps(document))
    return str(path)


def test_plan_and_evaluate_round_trip(tmp_path, capsys):
    graph_file = _gpt_graph_file(tmp_path)
    out = tmp_path / "plan.json"
    flags = ["--gpus", "4", "--gpu-memory", "80GiB", "--global-batch", "16", "--pp", "4"]
    code = plan_main(
        [graph_file, *flags, "--virtual-stages", "2", "--micro-batch", "1", "--json", str(out)]
    )
    assert code == 0
    document = json.loads(out.read_text())
    assert document["config"]["virtual_stages"] == 2
    assert "interleaved-1f1b v2" in capsys.readouterr().out
    counts = document["baselines"]["even"]["layer_counts"]
    assert len(counts) == 8
    layout = document["exports"]["megatron"]["layout"]
    assert len(layout.split("|")) == 8
    assert document["exports"]["torch_pipelining"]["schedule"] == "ScheduleInterleaved1F1B"
    assert document["exports"]["torch_pipelining"]["stage_ranks"] == [0, 1, 2, 3] * 2
    planned = [0] * 8
    for stage in document["stage_of_layer"]:
        planned[stage] += 1
    evaluated = tmp_path / "eval.json"
    code = evaluate_main(
        [
            graph_file,
            "--gpus",
            "4",
            "--global-batch",
            "16",
            "--pp",
            "4",
            "--virtual-stages",
            "2",
            "--split",
            ",".join(map(str, planned)),
            "--json",
            str(evaluated),
        ]
    )
    assert code == 0
    assert json.loads(evaluated.read_text())["peak_bytes"] == document["peak_bytes"]


def test_search_over_chunk_counts_keeps_the_best(tmp_path):
    """Searching v in {1, 2} gives the smaller optimum of the two pinned searches."""
    graph = gpt_chain(12)
    cluster = Cluster(num_gpus=4, gpu_memory_bytes=80 * 2**30)
    base = TrainingConfig(global_batch=16, pp=4, micro_batch_sizes=(1,), max_slowdown=None)
    peaks = {
        v: plan(graph, cluster, dataclasses.replace(base, virtual_stages=(v,))).peak_bytes
        for v in (1, 2)
    }
    both = plan(graph, cluster, dataclasses.replace(base, virtual_stages=(1, 2)))
    assert both.peak_bytes == min(peaks.values())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cluster", MIXED_CLUSTER], "heterogeneous cluster"),
        (["--backend", "chain"], "--backend chain does not plan interleaved"),
        (["--memory-model", "empirical"], "analytic"),
    ],
)
def test_plan_errors(tmp_path, capsys, extra, message):
    graph_file = _gpt_graph_file(tmp_path)
    gpus = [] if "--cluster" in extra else ["--gpus", "4"]
    args = [graph_file, *gpus, "--global-batch", "16", "--virtual-stages", "2", *extra]
    assert plan_main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_evaluate_needs_micro_batches_a_multiple_of_pp():
    graph = gpt_chain(12)
    config = ParallelConfig(pp=4, tp=1, dp=1, micro_batch=1, num_microbatches=6, virtual_stages=2)
    with pytest.raises(InputError, match="pp | micro-batches"):
        evaluate(graph, config, "even")


def test_gpipe_cannot_interleave():
    with pytest.raises(InputError, match="1f1b"):
        TrainingConfig(global_batch=8, schedule="gpipe", virtual_stages=(2,))


@pytest.mark.parametrize("seed", range(4))
def test_optimum_is_never_worse_than_the_baseline_partitioners(seed):
    from solver.evaluation import evaluate_partitioners

    graph, config, costs = _random_interleaved(2 * seed + 1)  # chains
    cluster = Cluster(num_gpus=config.num_gpus)
    training = TrainingConfig(
        global_batch=config.global_batch, virtual_stages=(config.virtual_stages,)
    )
    names = ("even", "uniform", "parameters", "size", "throughput")
    baselines = evaluate_partitioners(graph, costs, cluster=cluster, training=training, names=names)
    optimum = solve_cpsat(StageProblem(costs=costs, objective=OBJECTIVE_MEMORY), time_limit_s=30)
    for name, evaluation in baselines.items():
        assert sorted(set(evaluation.stage_of_layer)) == list(range(costs.num_stages)), name
        assert optimum.objective <= evaluation.peak_bytes, name
    with pytest.raises(InputError, match="CAPSlog"):
        evaluate_partitioners(graph, costs, cluster=cluster, training=training, names=("capslog",))
