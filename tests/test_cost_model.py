"""The analytic cost model against numbers worked out by hand from docs/cost-model.md."""

from __future__ import annotations

import dataclasses

import pytest

from solver.calibration import Calibration
from solver.costs import (
    boundary_copies,
    in_flight_microbatches,
    iteration_bound_ns,
    layer_costs,
    stage_costs,
    throughput,
)
from solver.costs.schedule_time import simulated_iteration_ns
from solver.errors import InputError
from solver.graph import graph_from_dict
from solver.specs import GRAD_BYTES_PER_PARAM, Cluster, ParallelConfig, TrainingConfig

# a -> b -> c -> d plus a skip edge a -> d (relayed through the middle stage below)
GRAPH = graph_from_dict(
    {
        "format": "layer-graph",
        "version": 1,
        "model": "hand",
        "layers": [
            {
                "name": "a",
                "params": 1000,
                "tp_params": 600,
                "activation_bytes": 30,
                "output_bytes": 10,
                "fwd_ms": 1.0,
                "bwd_ms": 2.0,
                "tp_comm_bytes": 1000,
            },
            {
                "name": "b",
                "params": 200,
                "activation_bytes": 100,
                "tp_activation_bytes": 40,
                "output_bytes": 20,
                "fwd_flops": 1e9,
            },
            {
                "name": "c",
                "params": 300,
                "tp_params": 300,
                "activation_bytes": 50,
                "output_bytes": 30,
                "transient_bytes": 7,
            },
            {"name": "d", "params": 50, "activation_bytes": 8, "output_bytes": 1},
        ],
        "edges": [
            {"src": "a", "dst": "b", "bytes": 10},
            {"src": "b", "dst": "c", "bytes": 20},
            {"src": "a", "dst": "d", "bytes": 5},
            {"src": "c", "dst": "d", "bytes": 30},
        ],
    }
)
CLUSTER = Cluster(num_gpus=12, gpu_memory_bytes=10**6)
CONFIG = ParallelConfig(pp=3, tp=2, dp=2, micro_batch=2, num_microbatches=4, zero=2)
SPLIT = [0, 1, 1, 2]


def costs_for(config: ParallelConfig, runtime: str = "torch", **options):
    """The toy graph's coefficients; gradients persistent unless ``grad_lifetime`` is given
    (the step lifetime's moments: tests/test_grad_lifetime.py), a fused optimizer step unless
    ``optimizer_impl`` is given (foreach's step moment: tests/test_optimizer_step.py)."""
    options.setdefault("grad_lifetime", "persistent")
    options.setdefault("optimizer_impl", "fused")
    training = TrainingConfig(global_batch=config.global_batch, runtime=runtime, **options)
    return layer_costs(GRAPH, config, CLUSTER, training)


def test_boundary_copies_of_each_runtime():
    # torch, 1F1B, m = 4, p = 3: idle receive buffers m - k_s and the input gradient sent last
    # (its bwd_sends list holds it); gradient buffers m + outputs k_s, and the output of
    # micro-batch k_s - 2 that the warm-up's send_work holds past its backward when m >= 2k - 1
    torch = [boundary_copies("torch", "1f1b", 4, 3, s) for s in range(3)]
    assert torch == [(0, 7), (3, 7), (4, 0)]
    assert boundary_copies("torch", "1f1b", 8, 2, 0) == (0, 8 + 2 + 1)  # k 2, m 8
    # GPipe keeps every micro-batch in flight: every receive buffer is a saved stage input
    assert [boundary_copies("torch", "gpipe", 4, 2, s) for s in range(2)] == [(0, 8), (0, 0)]
    assert boundary_copies("torch", "1f1b", 1, 1, 0) == (0, 0)
    # megatron: the next input's and the next gradient's buffer
    assert [boundary_copies("megatron", "1f1b", 4, 3, s) for s in range(3)] == [
        (0, 1),
        (1, 1),
        (1, 0),
    ]


def test_megatron_runtime_counts_one_buffer_per_side():
    first, middle, last = stage_costs(costs_for(CONFIG, "megatron"), SPLIT)
    assert first.buffer_bytes == 2 * (10 + 5)
    assert middle.buffer_bytes == 2 * 10 + 2 * (2 * 5) + 2 * 30  # the relayed a->d both ways
    assert last.buffer_bytes == 2 * 5 + 2 * 30


def test_megatron_without_deallocation_keeps_the_sent_outputs_in_flight():
    """deallocate_pipeline_outputs False: S_s = 1 + k_s on a non-last stage, so each such stage
    holds k_s b (bytes of its outgoing edges, relays included) more; nothing else changes."""
    assert [
        boundary_copies("megatron", "1f1b", 4, 3, s, deallocate_pipeline_outputs=False)
        for s in range(3)
    ] == [(0, 4), (1, 3), (1, 0)]
    assert [  # torch keeps them anyway: the field does not apply
        boundary_copies("torch", "1f1b", 4, 3, s, deallocate_pipeline_outputs=False)
        for s in range(3)
    ] == [boundary_copies("torch", "1f1b", 4, 3, s) for s in range(3)]
    freed = stage_costs(costs_for(CONFIG, "megatron"), SPLIT)
    kept = stage_costs(costs_for(CONFIG, "megatron", deallocate_pipeline_outputs=False), SPLIT)
    # first: k_0 = 3, sends a->b (10) and a->d (5); b = 2
    assert kept[0].buffer_bytes == (1 + 3) * 2 * (10 + 5) == 120
    # middle: k_1 = 2, receives a->b and the relayed a->d, sends c->d (30) and relays a->d (5)
    assert kept[1].buffer_bytes == 1 * 2 * (10 + 5) + (1 + 2) * 2 * (30 + 5) == 240
    assert kept[2].buffer_bytes == freed[2].buffer_bytes == 2 * (5 + 30)  # last: sends nothing
    extra = [k * 2 * out for k, out in ((3, 10 + 5), (2, 30 + 5), (1, 0))]
    assert [a.peak_bytes - f.peak_bytes for a, f in zip(kept, freed, strict=True)] == extra
    assert [a.breakdown() | {"buffers": 0} for a in kept] == [
        f.breakdown() | {"buffers": 0} for f in freed
    ]
    torch = costs_for(CONFIG, "torch", deallocate_pipeline_outputs=False)
    assert [s.peak_bytes for s in stage_costs(torch, SPLIT)] == [
        s.peak_bytes for s in stage_costs(costs_for(CONFIG, "torch"), SPLIT)
    ]


@pytest.mark.parametrize(
    ("runtime", "zero", "options", "bytes_per_param"),
    [
        ("megatron", 0, {}, 2 + 4 + 12),  # bf16 weights, fp32 main_grad, fp32 Adam
        ("megatron", 1, {}, 2 + 4 + 12 / 4),  # distributed optimizer: 6 + 12/d
        ("torch", 0, {}, 2 + 2 + 12),  # bf16 gradients (ZeRO paper)
        ("megatron", 0, {"grad_bytes_per_param": 2}, 2 + 2 + 12),  # an explicit value wins
        ("torch", 0, {"grad_bytes_per_param": 4}, 2 + 4 + 12),
    ],
)
def test_model_states_per_parameter_by_runtime(runtime, zero, options, bytes_per_param):
    config = ParallelConfig(pp=1, tp=1, dp=4, micro_batch=1, num_microbatches=1, zero=zero)
    # persistent gradients: torch's default (step) adds DDP's buckets (tests/test_grad_lifetime.py)
    training = TrainingConfig(
        global_batch=4, runtime=runtime, grad_lifetime="persistent", **options
    )
    (stage,) = stage_costs(layer_costs(GRAPH, config, CLUSTER, training), [0, 0, 0, 0])
    params = 1000 + 200 + 300 + 50
    states = stage.weight_bytes + stage.grad_bytes + stage.optimizer_bytes
    assert states == bytes_per_param * params


def test_gradient_bytes_default_by_runtime():
    assert TrainingConfig(global_batch=1).grad_bytes_per_param == 4  # runtime megatron
    assert TrainingConfig(global_batch=1, runtime="torch").grad_bytes_per_param == 2
    assert GRAD_BYTES_PER_PARAM == {"megatron": 4, "torch": 2}
    megatron = TrainingConfig(global_batch=1, grad_bytes_per_param=None)
    assert megatron == TrainingConfig(global_batch=1, grad_bytes_per_param=4)
    # resolved once: replace() keeps the value unless it is given as None again
    torch = dataclasses.replace(megatron, runtime="torch", grad_bytes_per_param=None)
    assert torch.grad_bytes_per_param == 2
    assert dataclasses.replace(megatron, runtime="torch").grad_bytes_per_param == 4
    with pytest.raises(InputError, match="deallocate_pipeline_outputs must be True or False"):
        TrainingConfig(global_batch=1, deallocate_pipeline_outputs="no")


def test_in_flight_counts():
    assert [in_flight_microbatches("1f1b", 4, 3, s) for s in range(3)] == [3, 2, 1]
    assert [in_flight_microbatches("1f1b", 2, 4, s) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight_microbatches("gpipe", 4, 3, s) for s in range(3)] == [4, 4, 4]


def test_stage_peaks_by_hand():
    stages = stage_costs(costs_for(CONFIG), SPLIT)
    first, middle, last = stages
    # a: P' = 400 + 600/2 = 700; ZeRO-2 shards the optimizer over dp = 2. On the torch runtime
    # at pp > 1 FSDP2 runs under PipelineStage (solver/costs/states.py, reduces_per_step): the
    # unsharded weights (w P') beside their shards (w P'/d) and the unsharded gradients (g P')
    # stay all step, with the reduced shards (g P'/d) kept by the persistent gradients
    assert first.breakdown() == {
        "weights": 1400 + 700,
        "grads": 1400 + 700,
        "optimizer": 4200,
        "activations": 3 * 2 * 30,
        # S_0 = m + k_0 = 4 + 3 copies of what it sends (a->b, a->d), b = 2
        "buffers": 7 * 2 * (10 + 5),
        # the step's reduce (solver/costs/fsdp.py, w = g = 2): a's reduce-scatter input (1400)
        # and new shard (700) where its unsharded weights (1400) are freed; ZeRO 2 gathers
        # only in the first forward, before a's own gradients (1400) exist: nothing more
        "transient": 1400 + 700 - 1400,
    }
    assert first.peak_bytes == sum(first.breakdown().values())
    # b: P' = 200, A' = 60 + 40/2 = 80; c: P' = 150, A' = 50; the skip edge a->d (5 B/sample)
    # goes straight from a's stage to d's (torch; the megatron runtime relays it, below)
    assert middle.breakdown() == {
        "weights": (400 + 300) * 3 // 2,  # unsharded + shards
        "grads": (400 + 300) * 3 // 2,
        "optimizer": 1200 + 900,
        # the peak is c's moment (costs.layer_moments: the end of a forward, c's transient the
        # larger beside it): both micro-batches whole; b's moment holds the running one's b only
        "activations": 2 * (2 * 80 + 2 * 50),
        # R_1 = m - k_1 + 1 (the input gradient sent last) = 3 copies of a->b; S_1 = m + k_1
        # + 1 (micro-batch 0's output, held by torch's warm-up send) = 7 of c->d
        "buffers": 3 * 2 * 10 + 7 * 2 * 30,
        # c's transient 2 x 7 + its gradient temporary 150 (b's reduce 400 + 200 - 400 = 200
        # is the larger, but b's moment holds 2 x 50 of c's saved bytes less)
        "transient": 2 * 7 + 150,
    }
    assert middle.peak_bytes == sum(middle.breakdown().values())
    assert last.breakdown() == {
        "weights": 100 + 50,
        "grads": 100 + 50,
        "optimizer": 300,
        "activations": 16,
        "buffers": 4 * 2 * (5 + 30),  # R_2 = 4 - 1 + 1
        "transient": 100 + 50 - 100,  # d's reduce
    }
    assert [s.in_flight for s in stages] == [3, 2, 1]


def test_recompute_and_zero3_and_gpipe():
    config = ParallelConfig(
        pp=3,
        tp=2,
        dp=2,
        micro_batch=2,
        num_microbatches=4,
        zero=3,
        recompute="full",
        schedule="gpipe",
    )
    middle = stage_costs(costs_for(config), SPLIT)[1]
    # ZeRO-3 under PipelineStage (states.reduces_per_step): a layer's unsharded weights live
    # from its backward to its next forward (fsdp.backward_weight_bytes). The peak is b's
    # backward in the first of GPipe's: c's unsharded weights (300, its backward done) beside
    # the shards (350), a's and b's resharded by the forwards
    assert middle.weight_bytes == 300 + (400 + 300) // 2
    # recompute keeps each layer's output; GPipe keeps all m = 4 micro-batches (a->d skips the
    # stage: torch); the running one holds b's only
    assert middle.activation_bytes == (4 - 1) * (2 * 20 + 2 * 30) + 2 * 20
    # b's transient as ZeRO 2 has it (400), its own unsharded weights (400) and the flat buffer
    # it prefetches for the layer before it, a (1400, on another stage: over)
    assert middle.transient_bytes == 400 + 400 + 1400
    assert middle.peak_bytes == sum(middle.breakdown().values())
    # on the megatron runtime (no FSDP2) ZeRO-3 gathers the running layer's weights and
    # prefetches the next: 2 w P'_l
    megatron = stage_costs(costs_for(config, "megatron"), SPLIT)[1]
    # (a recomputed layer's backward also holds its output's gradient: b x 20 at b)
    assert megatron.transient_bytes == max(
        2 * 80 + 2 * 20 + 2 * 2 * 200, 2 * (7 + 50) + 2 * 30 + 2 * 2 * 150
    )


def test_weight_gradient_temporary_is_transient():
    """A layer's largest weight gradient is a temporary next to its own transient, in the
    weights' dtype (w bytes per element, whatever the persistent gradient's g; a TP-split tensor
    divided by t)."""
    document = GRAPH.to_dict()
    document["layers"][1].update(largest_param=150)  # b: 200 unsplit parameters
    document["layers"][2].update(largest_tp_param=300)  # c: 300 split ones
    graph = graph_from_dict(document)
    training = TrainingConfig(
        global_batch=CONFIG.global_batch, weight_bytes_per_param=4, grad_bytes_per_param=8
    )
    costs = layer_costs(graph, CONFIG, CLUSTER, training)
    assert costs.transient_bytes.tolist() == [0, 4 * 150, 2 * 7 + 4 * 300 // 2, 0]
    bad = GRAPH.to_dict()
    bad["layers"][2].update(largest_param=1)  # c has no unsplit parameter
    with pytest.raises(InputError, match=r"layers\[2\]\.largest_param: 1 exceeds"):
        graph_from_dict(bad, origin="g.json")


def test_weight_gradient_temporary_joins_the_transient_at_its_own_moment():
    """With weight_grad_transient_bytes the temporary adds to what is live when the weight
    gradients are made, not to the layer's peak: max(b T, b W + gtemp) per layer."""
    document = GRAPH.to_dict()
    # b: a peak of 7 per sample (say, logits in the forward), 1 left when its gradient is made
    document["layers"][1].update(
        transient_bytes=7, largest_param=150, weight_grad_transient_bytes=1
    )
    training = TrainingConfig(global_batch=CONFIG.global_batch, weight_bytes_per_param=4)
    costs = layer_costs(graph_from_dict(document), CONFIG, CLUSTER, training)
    b = CONFIG.micro_batch
    assert costs.transient_bytes[1] == max(b * 7, b * 1 + 4 * 150)
    document["layers"][1].update(largest_param=1)  # a small weight: the peak wins
    costs = layer_costs(graph_from_dict(document), CONFIG, CLUSTER, training)
    assert costs.transient_bytes[1] == b * 7
    # without the field the sum, as before
    document["layers"][1].pop("weight_grad_transient_bytes")
    costs = layer_costs(graph_from_dict(document), CONFIG, CLUSTER, training)
    assert costs.transient_bytes[1] == b * 7 + 4 * 1
    document["layers"][1].update(weight_grad_transient_bytes=8)
    with pytest.raises(InputError, match=r"layers\[1\]\.weight_grad_transient_bytes: 8 exceeds"):
        graph_from_dict(document, origin="g.json")


def test_times_by_hand():
    costs = costs_for(CONFIG)
    # a: measured 1 + 2 ms per sample, b = 2, t = 2 -> 3 ms; TP ring all-reduce of
    # 2 * 1000 B at 450 GB/s moving 2 (t-1)/t of it -> 2000/450 ns
    assert costs.time_ns[0] == 3_000_000 + 5  # ceil(3e6 + 4.44)
    # b: 1 GFLOP fwd + 2 bwd per sample at 989e12 * 0.5 FLOP/s, x b / t
    assert costs.time_ns[1] == pytest.approx(2 * 3e9 / 2 / (989e12 * 0.5) * 1e9, abs=1)
    # data-parallel sync of a: 2 (d-1)/d * P' g = 1400 B at 450 GB/s (t d = 4 <= 8 per node)
    assert costs.dp_sync_ns[0] == 4  # ceil(1400 / 450)
    stages = stage_costs(costs, SPLIT)
    # m = 4: rank r waits for the forwards (and, at the end, the backwards) of the ranks before
    # it, runs 4 micro-batches, then rank 0 (or r itself) syncs and steps
    tails = [s.dp_sync_ns + s.optimizer_step_ns for s in stages]
    before = [sum(s.time_ns for s in stages[:r]) for r in range(3)]
    before_forward = [sum(s.chunk_forward_ns[0] for s in stages[:r]) for r in range(3)]
    expected = max(
        max(before[r] + 4 * s.time_ns + tails[0], before_forward[r] + 4 * s.time_ns + tails[r])
        for r, s in enumerate(stages)
    )
    assert iteration_bound_ns(costs, stages) == expected
    assert expected <= simulated_iteration_ns(costs, SPLIT)
    assert throughput(16, 2_000_000_000) == 8.0


def test_inter_node_bandwidth_for_wide_data_parallel_groups():
    config = ParallelConfig(pp=1, tp=2, dp=8, micro_batch=1, num_microbatches=1)
    costs = layer_costs(GRAPH, config, Cluster(num_gpus=16), TrainingConfig(global_batch=8))
    # t d = 16 > 8 GPUs per node: 2 * 7/8 * 700 * 4 B (megatron's fp32 gradients) at 50 GB/s
    assert costs.dp_sync_ns[0] == 98  # ceil(4900 / 50)


def test_calibration_scales_each_coefficient_and_adds_the_constant():
    scales = {"weights": 1.5, "grads": 1.0, "optimizer": 1.0}
    scales |= {"activations": 0.5, "buffers": 2.0, "transient": 3.0}
    calibration = Calibration(scales=scales, constant_bytes=1000)
    # megatron: the skip edge a->d is relayed by the middle stage (torch sends it straight on)
    training = TrainingConfig(global_batch=CONFIG.global_batch, calibration=calibration)
    analytic = stage_costs(costs_for(CONFIG, "megatron"), SPLIT)
    calibrated = stage_costs(layer_costs(GRAPH, CONFIG, CLUSTER, training), SPLIT)
    for plain, scaled in zip(analytic, calibrated, strict=True):
        before, after = plain.breakdown(), scaled.breakdown()
        assert after.pop("constant") == 1000 and "constant" not in before
        # the layers' terms scale one by one (rounded up; here every product is whole) ...
        expected = {name: int(value * scales[name]) for name, value in before.items()}
        if plain.index == 1:  # ... and the relayed skip edge (k_1 x 2 x 5) takes the edge scale
            expected["activations"] = int(0.5 * (540 - 20) + 2.0 * 20)
        assert after == expected
        assert scaled.peak_bytes == sum(after.values()) + 1000


@pytest.mark.parametrize("backend", ["chain", "cpsat", "milp"])
def test_backends_plan_with_the_calibration(backend):
    """Every backend optimises the calibrated peaks: the same optimum as brute force."""
    from solver.backends import solve
    from solver.backends.brute_force import solve_brute_force
    from solver.backends.problem import StageProblem

    chain = graph_from_dict(
        {
            "format": "layer-graph",
            "version": 1,
            "model": "chain",
            "layers": [
                {"name": f"l{i}", "params": p, "activation_bytes": a, "output_bytes": o}
                for i, (p, a, o) in enumerate([(900, 10, 40), (100, 90, 5), (300, 60, 30)] * 2)
            ],
        }
    )
    config = ParallelConfig(pp=3, tp=1, dp=1, micro_batch=1, num_microbatches=4)
    calibration = Calibration(
        scales={"weights": 0.2, "activations": 4.0, "buffers": 3.0}, constant_bytes=-50
    )
    training = TrainingConfig(global_batch=4, runtime="torch", calibration=calibration)
    problem = StageProblem(costs=layer_costs(chain, config, CLUSTER, training))
    solution = solve(problem, backend, time_limit_s=60)
    best = solve_brute_force(problem)
    assert solution.objective == best.objective
    peaks = [s.peak_bytes for s in stage_costs(problem.costs, solution.stage_of_layer)]
    assert max(peaks) == best.objective


def test_sequence_parallelism_splits_every_activation_and_sent_tensor_by_hand():
    """config.sp: A'_l = activation_bytes / t (the replicated parts too) and an edge carries
    ceil(b bytes / t); states, transients and times are those without it (megatron runtime)."""
    plain = stage_costs(costs_for(CONFIG, "megatron"), SPLIT)
    split = stage_costs(costs_for(dataclasses.replace(CONFIG, sp=True), "megatron"), SPLIT)
    # without sp: a keeps A' = 30 (nothing split), b 60 + 40/2 = 80, c 50, d 8
    assert [s.activation_bytes for s in plain] == [3 * 2 * 30, 2 * (2 * 80 + 2 * 50 + 2 * 5), 16]
    # with sp every A'_l is halved: a 15, b 50, c 25, d 4; the relayed a->d carries 2 * 5 / 2
    assert [s.activation_bytes for s in split] == [3 * 2 * 15, 2 * (2 * 50 + 2 * 25 + 5), 2 * 4]
    # one receive and one send buffer per boundary tensor, each [s/t, b, h]
    assert [s.buffer_bytes for s in plain] == [2 * (10 + 5), 2 * 10 + 2 * 2 * 5 + 2 * 30, 70]
    assert [s.buffer_bytes for s in split] == [10 + 5, 10 + 2 * 5 + 30, 5 + 30]
    for before, after in zip(plain, split, strict=True):
        kept = ("weights", "grads", "optimizer", "transient")
        assert {k: after.breakdown()[k] for k in kept} == {k: before.breakdown()[k] for k in kept}
        assert (after.time_ns, after.dp_sync_ns) == (before.time_ns, before.dp_sync_ns)


def test_sequence_parallelism_rounds_up_per_layer_and_splits_recomputed_outputs():
    # b = 1: each per-micro-batch term is ceil(bytes / t)
    config = ParallelConfig(pp=3, tp=2, dp=2, micro_batch=1, num_microbatches=8, sp=True)
    costs = costs_for(config, "megatron")
    assert costs.stored_bytes.tolist() == [15, 50, 25, 4]
    assert costs.edge_bytes.tolist() == [5, 10, 3, 15]  # a->b, b->c, a->d (5 / 2 up), c->d
    # full recomputation keeps each layer's output, the next one's input: [s/t, b, h] too
    recompute = dataclasses.replace(CONFIG, recompute="full", zero=1)  # no FSDP2 buffers
    kept = costs_for(recompute, "torch")
    split = costs_for(dataclasses.replace(recompute, sp=True), "torch")
    assert kept.stored_bytes.tolist() == [2 * 10, 2 * 20, 2 * 30, 2 * 1]
    assert split.stored_bytes.tolist() == [10, 20, 30, 1]
    # the layer being recomputed re-materialises b A'_l next to its transient, beside its
    # output's gradient (b O_l / t: [10, 20, 30, 1])
    assert split.transient_bytes.tolist() == [2 * 15 + 10, 2 * 50 + 20, 2 * 7 + 2 * 25 + 30, 9]


def test_sequence_parallelism_needs_tensor_parallelism():
    with pytest.raises(InputError, match=r"^--sequence-parallel on with tp\(1\)"):
        ParallelConfig(pp=2, tp=1, dp=1, micro_batch=1, num_microbatches=2, sp=True)
    with pytest.raises(InputError, match="sp must be true or false"):
        ParallelConfig(pp=2, tp=2, dp=1, micro_batch=1, num_microbatches=2, sp="yes")
    with pytest.raises(InputError, match=r"^--sequence-parallel on with pinned tp\(1\)"):
        TrainingConfig(global_batch=1, tp=1, sequence_parallel="on")
    with pytest.raises(InputError, match="sequence_parallel must be one of"):
        TrainingConfig(global_batch=1, sequence_parallel=True)
    assert TrainingConfig(global_batch=1, tp=1, sequence_parallel="auto").tp == 1
    config = ParallelConfig(pp=4, tp=8, dp=2, micro_batch=1, num_microbatches=16, sp=True)
    assert config.label() == "pp4 tp8 dp2 b1 m16 zero0 1f1b sp"
    assert "sp" not in dataclasses.replace(config, sp=False).label()


@pytest.mark.parametrize("pp", [1, 2])
def test_fsdp2_under_pipelining_is_said_in_the_plan(tmp_path, capsys, pp):
    """The plan's text says what FSDP2 holds under PipelineStage (one reduce per step), and only
    there: at pp 1 FSDP2 reduce-scatters after every backward."""
    from solver.cli.evaluate import evaluate_main as main

    path = tmp_path / "toy.json"
    GRAPH.save(path)
    split = "2,2" if pp == 2 else "4"
    args = [str(path), "--pp", str(pp), "--dp", "2", "--zero", "3", "--global-batch", "4"]
    args += ["--micro-batch", "1", "--runtime", "torch", "--split", split]
    assert main(args) == 0
    out = capsys.readouterr().out
    said = "FSDP2 under PipelineStage reduce-scatters once per step" in out
    assert said == (pp == 2)
    assert ("ZeRO 2 and 3 the same memory" in out) == (pp == 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy.json"]
