"""Memory at each action of the zero-bubble and V schedules (solver/costs/schedule_memory.py).

Oracle: the rule of torch's runtime, action by action: a forward adds the chunk's kept bytes
per micro-batch; an I (``stage_backward_input``, retain_graph=True) frees nothing and adds the
dY its W will consume (none on virtual stage 0, whose I torch skips; without profiled dY the
estimate transient + output per layer with weights); a W frees the micro-batch's kept bytes
and that dY; a full B frees the kept bytes; inside each action what runs beside (a layer's
transient, the input step's, the weight step's groups) is computed by hand from the profile's
fields. On the megatron runtime with deallocated outputs the buffers do not change with the
counts.
"""

from __future__ import annotations

import pytest

from solver.costs import layer_costs, stage_costs
from solver.costs.schedule_memory import rank_memory
from solver.graph import graph_from_dict
from solver.specs import Cluster, ParallelConfig, TrainingConfig


def _costs(
    schedule: str,
    m: int,
    runtime: str = "megatron",
    lifetime: str | None = None,
    profiled: bool = False,
    dp: int = 1,
    zero: int = 0,
):
    """8 layers of 100 B saved, 8 B output to the next per sample (none after the last); l5 has
    no weights (dY 0). ``lifetime``: the gradient lifetime (None: the runtime's default).
    ``profiled``: with a transient of 30 B and the split-backward fields of the profile
    (``PROFILED``); ``dp`` replicas under ZeRO ``zero``."""
    layers = [
        {
            "name": f"l{k}",
            "params": 0 if k == 5 else 10,
            "activation_bytes": 100,
            "output_bytes": 8,
            "fwd_ms": 1.0,
            "bwd_ms": 2.0,
            **(PROFILED if profiled and k != 5 else {}),
        }
        for k in range(8)
    ]
    if profiled:
        layers[5].update(transient_bytes=30, weight_op_grad_bytes=0, input_step_transient_bytes=12)
    graph = graph_from_dict({"format": "layer-graph", "version": 1, "model": "m", "layers": layers})
    config = ParallelConfig(
        pp=2, tp=1, dp=dp, micro_batch=1, num_microbatches=m, zero=zero, schedule=schedule,
        virtual_stages=2,
    )  # fmt: skip
    training = TrainingConfig(
        global_batch=m * dp, runtime=runtime, grad_lifetime=lifetime, zero_stages=(zero,)
    )
    return layer_costs(graph, config, Cluster(num_gpus=2 * dp), training)


PROFILED = {
    "transient_bytes": 30,
    "weight_op_grad_bytes": 20,
    "weight_op_output_grad_bytes": 8,
    "input_step_transient_bytes": 12,
    "weight_step_moments": [[4, 0, -5], [10, 0, -10]],
    "weight_step_end": [6, 0, -5],
}
"""A layer's profiled split-backward fields (a layer with weights; l5 has the transient, no
weight-op gradients, its input step's 12 B and no weight-step points)."""


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved-zb"])
def test_each_action_adds_or_frees_its_terms(schedule):
    """Every action's bytes, from the profile's fields by hand (megatron, persistent gradients:
    4 B per parameter, 40 B a layer with weights; buffers 8 B per boundary a virtual stage
    receives or sends, constant with deallocated outputs). Per virtual stage (2 layers):
    kept 200 B per micro-batch held; dY 48 (each layer's 20 B of weight-op gradients, the
    first's 8 B output gradient too, its consumer in the chunk; stage 2 (l4, l5) 28; stage 0
    none, torch skips its I); what runs beside: F and B (a layer of it running, the layers
    after it freed or not run: 30 - 100 at its first layer, 30 at its last) T = 30, I = 12, W
    = 49 (a layer's points G(4) - 5 = 11 and G(10) - 10 = 30; its end G(6) - 5 = 19, what the
    next layer's groups run beside: 30 + 19; l5's fallback is its transient, 30 + 19), and on
    stage 0 a W is a full backward (T). An action's bytes are the largest of its moment and
    the state after it: F after + T; I after + I (stage 0: after); W before + W; B before +
    T."""
    costs = _costs(schedule, 4, profiled=True)
    split = [0, 0, 1, 1, 2, 2, 3, 3]
    kept, dy, beside = 200, [0, 48, 28, 48], {"T": 30, "I": 12, "W": 49}
    for memory in rank_memory(costs, split):
        own = costs.stages_of_rank(memory.rank)
        buffers = 8 * sum((j > 0) + (j < 3) for j in own)
        grads = 40 * sum(k != 5 for k in range(8) if split[k] in own)
        held, waiting = [0, 0], [0, 0]

        def state() -> int:
            activations = sum(n * kept + w * dy[j] for n, w, j in zip(held, waiting, own))
            return memory.states_bytes + grads + buffers + activations

        expected = []
        for action in memory.actions:
            c, j = action.chunk, own[action.chunk]
            if action.kind in ("W", "B"):
                full = action.kind == "B" or j == 0
                during = state() + beside["T" if full else "W"]
                held[c] -= 1
                waiting[c] -= 0 if full else 1
            elif action.kind == "F":
                held[c] += 1
                during = state() + beside["T"]
            else:
                waiting[c] += j != 0
                during = state() + (beside["I"] if j else 0)
            expected.append(max(during, state()))
        assert list(memory.action_bytes) == expected, (schedule, memory.rank)
        assert memory.peak_bytes == max(expected)


def test_v_placement_puts_first_and_last_chunk_on_rank_0():
    """Under zbv rank 0 holds virtual stages 0 and 3 (the embedding's and the head's chunks),
    rank 1 stages 1 and 2; in-flight counts follow torch's list: rank 0's first chunk holds all
    m = 4 (its 2p - 1 = 3 warm-up forwards and one more before its first I): 1512 B with
    nothing pending and chunk 0's gradients (40 B) not there yet (they appear at its first W;
    chunk 3's exist after its W steps). Its peak comes later, 1560 B: the head chunk's third
    I, with (3, 1) held
    and that W pending, where the pending dY and the input gradients its I steps sent (kept
    to the step's end, ``LayerCosts.copies_at``) outweigh chunk 0's fourth micro-batch on
    this toy."""
    costs = _costs("zbv", 4, runtime="torch")
    assert [costs.stages_of_rank(r) for r in range(2)] == [[0, 3], [1, 2]]
    assert costs.in_flight == [4, 3, 2, 1]
    first = rank_memory(costs, [0, 0, 1, 1, 2, 2, 3, 3])[0]
    assert max(
        value for value, action in zip(first.action_bytes, first.actions, strict=True)
        if action.kind == "F" and action.chunk == 0 and action.microbatch == 3
    ) == 1512
    assert (first.held_at_peak, first.pending_at_peak, first.peak_bytes) == ((3, 1), (0, 1), 1560)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved-zb"])
@pytest.mark.parametrize("runtime", ["megatron", "torch"])
def test_stage_peak_counts_the_pending_dy_as_the_replay(schedule, runtime):
    """stage_costs (what solver.evaluate reports) equals each rank's largest action, and at a
    peak with W steps pending its activations are sum_c n_c kept_c + w_c dY_c, the counts of
    the replay (zbv and interleaved-zb peak with one pending on this toy; dualpipev, whose
    overlapped F + B runs full backwards, with none)."""
    costs = _costs(schedule, 4, runtime=runtime)
    split = [0, 0, 1, 1, 2, 2, 3, 3]
    stored, transient, _ = costs.coefficients(costs.recompute_mask(None))
    kept = [int(stored[2 * j] + stored[2 * j + 1]) for j in range(4)]
    output = [8] * 7 + [0]
    pending = [
        sum(int(transient[k]) + output[k] for k in (2 * j, 2 * j + 1) if k != 5) for j in range(4)
    ]
    pending[0] = 0  # torch skips stage 0's I step (no input gradient): its W is a full backward
    waiting = 0
    for stage, memory in zip(stage_costs(costs, split), rank_memory(costs, split), strict=True):
        assert stage.peak_bytes == memory.peak_bytes
        own = costs.stages_of_rank(memory.rank)
        expected = sum(
            n * kept[j] + w * pending[j]
            for n, w, j in zip(memory.held_at_peak, memory.pending_at_peak, own, strict=True)
        )
        assert stage.activation_bytes == expected
        assert stage.in_flight == sum(memory.held_at_peak)
        waiting += sum(memory.pending_at_peak)
    assert (waiting > 0) == (schedule != "dualpipev")


@pytest.mark.parametrize("schedule, m", [("zbv", 4), ("zbv", 6), ("dualpipev", 4)])
def test_v_turn_around_keeps_m_boundary_storages_each_way(schedule, m):
    """torch passes the tensors between the V's stages p - 1 and p (one rank) by function call:
    p's receive buffer i becomes p - 1's output i, p - 1's gradient buffer i becomes p's input
    gradient i, each freeing the fresh buffer. So at every action the rank keeps m storages of
    the boundary tensor each way, the ones p holds in flight among its stored inputs; the other
    boundaries keep torch's usual copies (R = m - n + B + w, S = m + n + B)."""
    costs = _costs(schedule, m, runtime="torch")
    p = 2
    memory = rank_memory(costs, [0] * 2 + [1] * 2 + [2] * 2 + [3] * 2)
    for rank, turned in ((p - 1, True), (0, False)):
        held, pending, done = [0, 0], [0, 0], [0, 0]
        stages = costs.stages_of_rank(rank)
        for action in memory[rank].actions:
            c = action.chunk
            held[c] += {"F": 1, "I": 0}.get(action.kind, -1)
            pending[c] += {"I": 1, "W": -1}.get(action.kind, 0)
            done[c] += action.kind in ("W", "B")
            copies = [
                costs.copies_at(j, held[k], done[k], pending[k]) for k, j in enumerate(stages)
            ]
            if turned:  # chunk 0 = stage p - 1 (receives from p - 2: none at p = 2), 1 = stage p
                assert copies[0][1] == m  # gradient buffers or p's input gradients
                assert copies[1][0] + held[1] == m  # receive buffers or p - 1's outputs
                assert copies[1][1] == m + held[1] + done[1]  # p's sends go to rank 0 as usual
            else:
                assert copies[0] == (0, m + held[0] + done[0])
                assert copies[1][0] == m - held[1] + done[1] + pending[1]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved-zb"])
def test_a_chunks_gradients_appear_at_its_own_first_weight_step(schedule):
    """torch's ``zero_grad(set_to_none=True)`` (step lifetime): a parameter's ``.grad`` appears
    at the first W or B of its own chunk (``stage_backward_weight`` assigns it; an I makes
    none), so at each action the rank keeps, against persistent gradients, exactly the
    gradients of the chunks with no W or B yet less. Under the V's rank 0 the first chunk's
    come long after the last chunk's."""
    split = [0, 0, 1, 1, 2, 2, 3, 3]
    costs = _costs(schedule, 4, runtime="torch", lifetime="step")
    step = rank_memory(costs, split)
    persistent = rank_memory(_costs(schedule, 4, runtime="torch", lifetime="persistent"), split)
    grads = [int(costs.grad_bytes[2 * j] + costs.grad_bytes[2 * j + 1]) for j in range(4)]
    apart = 0
    for kept, full in zip(step, persistent, strict=True):
        own = costs.stages_of_rank(kept.rank)
        started = [False, False]
        for action, low, high in zip(kept.actions, kept.action_bytes, full.action_bytes):
            first = action.kind in ("W", "B") and not started[action.chunk]
            started[action.chunk] |= action.kind in ("W", "B")
            missing = sum(grads[j] for j, seen in zip(own, started, strict=True) if not seen)
            if first:  # its gradients made inside it (moments "G" / "V"): at most persistent's
                assert low <= high, (kept.rank, action)
            else:
                assert high - low == missing, (kept.rank, action)
            apart += started[0] != started[1]
    assert apart > 0  # some action with one chunk's gradients and not the other's



def test_a_weight_step_makes_whole_dweights_under_zero_2():
    """``stage_backward_weight``'s autograd.grad makes a param group's whole weight gradients
    before any reduce-scatter, so under ZeRO 2 over d = 4 (megatron's runtime, whose kept
    gradients are sharded: 10 B a layer, 40 / 4) a W moment still counts them unsharded: each
    layer's points are G(4) - 5 = 11 and G(10) - 10 = 30, its end G(6) - 5 = 19, at 4 B a
    parameter, as at d = 1: every action of d = 4 is d = 1's less the states and the kept
    gradients the sharding saves."""
    whole, sharded = (_costs("zbv", 4, profiled=True, dp=dp, zero=2) for dp in (1, 4))
    assert list(whole.grad_bytes) == [40, 40, 40, 40, 40, 0, 40, 40]
    assert list(sharded.grad_bytes) == [10, 10, 10, 10, 10, 0, 10, 10]
    for costs in (whole, sharded):
        assert list(costs.weight_step_bytes) == [30, 30, 30, 30, 30, 0, 30, 30]
        assert list(costs.weight_step_end_bytes) == [19, 19, 19, 19, 19, 0, 19, 19]
    split = [0, 0, 1, 1, 2, 2, 3, 3]
    for high, low in zip(rank_memory(whole, split), rank_memory(sharded, split), strict=True):
        # only the kept states and gradients differ (persistent): the same at every action
        layers = [k for k in range(8) if split[k] in whole.stages_of_rank(high.rank)]
        saved = high.states_bytes - low.states_bytes + 30 * sum(k != 5 for k in layers)
        assert {a - b for a, b in zip(high.action_bytes, low.action_bytes)} == {saved}


def test_a_first_backwards_gradients_are_in_the_grads_column():
    """dualpipev m = 4 on the torch runtime (step lifetime, 20 B of gradients a layer), rank 0
    (stages 0 and 3): its peak is chunk 0's first full backward, after chunk 1's W made that
    chunk's 40 B, at l1 (30 B transient; l0's gradients not made yet, l1's own 20 B made by
    its largest moment): the breakdown puts those 20 B in the grads column (60 B), the
    transient column keeps the layer's 30 B, and the total is the replay's."""
    costs = _costs("dualpipev", 4, runtime="torch", lifetime="step", profiled=True)
    split = [0, 0, 1, 1, 2, 2, 3, 3]
    memory = rank_memory(costs, split)[0]
    peak = max(range(len(memory.action_bytes)), key=memory.action_bytes.__getitem__)
    assert (memory.actions[peak].kind, memory.actions[peak].chunk) == ("B", 0)
    assert [a.kind for a in memory.actions[:peak] if a.chunk == 0].count("B") == 0
    stage = stage_costs(costs, split)[0]
    assert (stage.grad_bytes, stage.transient_bytes) == (60, 30)
    assert stage.peak_bytes == memory.peak_bytes == 1754
    assert stage.peak_bytes == (
        stage.weight_bytes + stage.grad_bytes + stage.optimizer_bytes + stage.activation_bytes
        + stage.buffer_bytes + stage.transient_bytes
    )  # fmt: skip
