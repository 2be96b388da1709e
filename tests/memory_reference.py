"""An independent reference of the core memory rules: a stage's peak bytes per GPU, from the
formulas of docs/cost-model.md and the papers it cites, written apart from ``solver.costs``.

It never imports ``solver.costs``: plain loops over plain ints (``Fraction`` where a rule divides
and rounds up once), one function per rule, so that a wrong term in the cost model, which every
backend and brute force share, shows up as a difference here (``tests/test_memory_reference.py``).

What it covers, for a chain of layers cut into p contiguous stages (no MoE, no context
parallelism, no interleaving, persistent gradients, no calibration):

- model states, (w, g, o) bytes per parameter, tp-split parameters, ZeRO 0-3 over d
  (Rajbhandari et al. 2020), FSDP2's ZeRO-2 keeping the sharded weights beside the gathered
  ones on the torch runtime; under pipelining FSDP2 keeps the unsharded weights and gradients
  to the step's end, except ZeRO 3's weights, live from a layer's backward to its next forward;
- activations: k_s micro-batches in flight, min(m, p - s) under 1F1B (Narayanan et al. 2021),
  m under GPipe; tp-split activations, sequence parallelism (Korthikanti et al. 2022, 4.2.2),
  full recomputation keeping only each recomputable layer's output (its input to the next);
- boundary buffers: received and sent copies per runtime (megatron: 1 and 1, or 1 + k_s
  without output deallocation; torch pipelining: m - k_s and m + k_s, under 1F1B one more of
  each where Schedule1F1B's send lists hold them; under GPipe, in its backward phase, the
  outputs and input gradients sent by the micro-batches already back-propagated);
- the moments of the schedule: layer i of one micro-batch running (forward or backward) beside
  k_s - 1 others held whole, that one holding the layers up to i; on the torch runtime the last
  stage keeps the model's output for the loss per micro-batch in flight, the running one's
  through every layer of that stage; under torch's GPipe every moment of the backward phase
  (h = 1 .. m - 1 held whole, the largest transient);
- the transient of the running layer (its own, its weight-gradient temporary, ZeRO-3's gathered
  weights, a recomputed layer's re-materialised activations; on the megatron runtime Megatron's
  own explicit attention: the score buffer it keeps and its in-place mask's backward clone);
- the optimizer step moment (no micro-batch held, foreach Adam's one state element per
  parameter);
- Adam's and AdamW's step counts, a 4-byte scalar per parameter tensor (param_tensors, none
  where a layer does not count them), in the optimizer state, whatever the ZeRO stage;
- on the torch runtime the model inputs step() is given: the replica's whole batch, m b
  model_input_bytes of each layer that reads them, on its stage at every moment (buffers).
- apart (``split_rank_bytes``), the split-backward schedules zbv, dualpipev and interleaved-zb
  over p v virtual stages, both gradient lifetimes: each action's moments, F, I, W, B and a
  chunk's first W and first B, from the profiled weight-step, input-step and weight-op
  gradient fields (docs/cost-model.md, "Zero-bubble and V schedules"); torch's action lists
  are the input.

A layer is a dict with the layer-graph fields (docs/layer-graph.md): params, tp_params,
activation_bytes, tp_activation_bytes, output_bytes, transient_bytes, largest_param,
largest_tp_param, grad_partner_params, attention_score_bytes, param_tensors,
model_input_bytes and kind. All sizes are bytes per GPU; per-sample
fields are multiplied by the micro-batch size b.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import ceil


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One layout and its training options, the reference's whole input besides the layers."""

    pp: int
    tp: int
    dp: int
    micro_batch: int
    """b, samples per micro-batch."""
    num_microbatches: int
    """m, micro-batches per step per data-parallel replica."""
    zero: int
    schedule: str
    """1f1b | gpipe (``stage_peaks``) | zbv | dualpipev | interleaved-zb (``split_rank_bytes``)."""
    recompute: str
    """none | full."""
    sp: bool
    runtime: str
    """megatron | torch."""
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    """(w, g, o): bytes per parameter."""
    deallocate_outputs: bool = True
    """megatron: a sent output is freed at once (False: kept until its backward)."""
    step_bytes: int = 0
    """u: bytes per parameter the optimizer step allocates (4 for a foreach Adam with fp32
    states, 0 fused)."""
    optimizer: str = "adam"
    """The optimizer's name: adam and adamw keep a step count per parameter tensor."""
    unsaved_output_bytes: int = 0
    """torch: bytes per sample of the model's output that no op saves (the graph's
    ``meta.unsaved_output_bytes``): the pipeline's loss_fn keeps it per micro-batch in flight,
    and the micro-batch in backward keeps it through every layer of the last layer's stage."""
    virtual_stages: int = 1
    """v: chunks per rank (the split-backward schedules: zbv and dualpipev 2 in a V)."""
    grad_lifetime: str = "persistent"
    """persistent | step (torch's zero_grad(set_to_none=True): a chunk's gradients from its
    first W or B; split-backward schedules only here)."""


@dataclass(frozen=True)
class StagePeak:
    """The reference's bytes per GPU of one stage at its peak moment."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    transient: int

    @property
    def peak(self) -> int:
        return (
            self.weights + self.grads + self.optimizer + self.activations + self.buffers
        ) + self.transient


# -- model states --------------------------------------------------------------------------------


def params_per_gpu(layer: dict, tp: int) -> Fraction:
    """P' = (params - tp_params) + tp_params / t: only the tp-split part is divided."""
    return (layer["params"] - layer["tp_params"]) + Fraction(layer["tp_params"], tp)


def state_shards(setup: Setup) -> tuple[int, int, int]:
    """The divisors of (weights, gradients, optimizer state) under ZeRO z over d ranks:
    z >= 1 shards the optimizer state, z >= 2 the gradients too, z = 3 the weights too."""
    d, z = setup.dp, setup.zero
    return (d if z >= 3 else 1, d if z >= 2 else 1, d if z >= 1 else 1)


def uses_fsdp2(setup: Setup) -> bool:
    """The torch runtime's ZeRO 2/3 over d > 1: FSDP2, one unit per layer."""
    return setup.runtime == "torch" and setup.zero >= 2 and setup.dp > 1


def reduces_per_step(setup: Setup) -> bool:
    """FSDP2 under pipelining (p > 1): torch's PipelineStage turns gradient sync and resharding
    off for every micro-batch and reduce-scatters once per step (docs/cost-model.md, "Model
    states"): ZeRO 2 and 3 keep every layer's unsharded weights and gradients."""
    return uses_fsdp2(setup) and setup.pp > 1


def resharded(setup: Setup) -> bool:
    """FSDP2 ZeRO 3 under pipelining (1F1B or GPipe, no interleaving): its unsharded weights
    are resharded after every forward and gathered again by the backward, which keeps them; so
    while layer i of a micro-batch runs the stage holds the unsharded weights of its layers
    after i only (their backward ran last), layer i's own and the flat buffer its backward
    prefetches for layer i - 1 (the transient), and every one of them after a backward that
    no forward follows (docs/cost-model.md, FSDP2 under pipelining)."""
    return reduces_per_step(setup) and setup.zero >= 3


def unsharded_weights(layer: dict, setup: Setup) -> int:
    """w P': a layer's whole weights in the weights' dtype, one rank's tp share."""
    return ceil(setup.weight_bytes * params_per_gpu(layer, setup.tp))


def layer_states(layer: dict, setup: Setup) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes of one layer per GPU, each rounded up on its own.
    FSDP2's ZeRO-2 (torch runtime) keeps the sharded weights beside the gathered ones:
    w P' (1 + 1/d), the gathered copy and the shard each rounded up; with d = 1 there is
    nothing to shard and no FSDP (docs/cost-model.md does not say so: the code's reading)."""
    p = params_per_gpu(layer, setup.tp)
    w_shard, g_shard, o_shard = state_shards(setup)
    if reduces_per_step(setup):  # unsharded weights and gradients to the step's end
        w, g = setup.weight_bytes, setup.grad_bytes
        return (
            ceil(w * p) + ceil(w * p / setup.dp),
            ceil(g * p) + ceil(g * p / setup.dp),  # + the shards kept (persistent gradients)
            ceil(setup.optimizer_bytes * p / o_shard),
        )
    weights = ceil(setup.weight_bytes * p / w_shard)
    if uses_fsdp2(setup) and setup.zero == 2:
        weights = ceil(setup.weight_bytes * p) + ceil(setup.weight_bytes * p / setup.dp)
    return (
        weights,
        ceil(setup.grad_bytes * p / g_shard),
        ceil(setup.optimizer_bytes * p / o_shard),
    )


def step_counts(layer: dict, setup: Setup) -> int:
    """Adam's ``state['step']`` scalars of one layer: 4 bytes per parameter tensor (a layer
    without the count: none, the count is not known), none for other optimizers; every rank
    keeps its own (not sharded); none where the optimizer keeps no state (o = 0)."""
    if setup.optimizer not in ("adam", "adamw") or setup.optimizer_bytes == 0:
        return 0
    return 4 * (layer.get("param_tensors") or 0)


def step_inputs(layer: dict, setup: Setup) -> int:
    """torch runtime: the model inputs the layer reads, for all m micro-batches of b samples
    (the batch step() is given and holds); megatron loads one micro-batch at a time: 0."""
    if setup.runtime != "torch":
        return 0
    return setup.num_microbatches * setup.micro_batch * (layer.get("model_input_bytes") or 0)


# -- activations ---------------------------------------------------------------------------------


def in_flight(stage: int, setup: Setup) -> int:
    """k_s: micro-batches whose forward has run and backward not, at stage s's peak.
    1F1B runs p - s warm-up forwards, then one forward per backward; GPipe runs all m first."""
    m, p = setup.num_microbatches, setup.pp
    return min(m, p - stage) if setup.schedule == "1f1b" else m


def recomputable(layer: dict, runtime: str) -> bool:
    """Megatron-LM checkpoints its transformer blocks only; torch can wrap any layer."""
    return runtime == "torch" or layer["kind"] == "block"


def saved_per_sample(layer: dict, setup: Setup) -> Fraction:
    """A' per sample per GPU: the tp-split part over t; with sequence parallelism all of it."""
    t = setup.tp
    if setup.sp:
        return Fraction(layer["activation_bytes"], t)
    split = layer["tp_activation_bytes"]
    return (layer["activation_bytes"] - split) + Fraction(split, t)


def boundary_tensor_bytes(output_bytes: int, setup: Setup) -> int:
    """One micro-batch of a tensor leaving a layer: b bytes per sample, [s/t, b, h] with SP."""
    size = setup.micro_batch * output_bytes
    return ceil(Fraction(size, setup.tp)) if setup.sp else size


def stored_bytes(layer: dict, setup: Setup) -> int:
    """What one micro-batch of the layer keeps for its backward: ceil(b A'), or under full
    recomputation (of a recomputable layer) only its output, the next layer's input."""
    if recomputed(layer, setup):
        return boundary_tensor_bytes(layer["output_bytes"], setup)
    return ceil(saved_per_micro_batch(layer, setup))


def saved_per_micro_batch(layer: dict, setup: Setup) -> Fraction:
    """b A' with the batch-independent part F (``unbatched_activation_bytes``) held once, not
    b times: b (A' - F') + F, where F' is F as A' counts it per GPU (whole without SP, / t with
    SP) and F itself is whole on every TP rank (a mask built on each rank). F is capped by the
    replicated part A' keeps whole (A - tp_A, or A under SP); a negative F (batch 2 saved more
    than twice batch 1) adds (b - 1) |F'|, split as A' splits it."""
    b, t = setup.micro_batch, setup.tp
    fixed = layer.get("unbatched_activation_bytes", 0)
    if setup.sp:
        if fixed >= 0:
            fixed = min(fixed, layer["activation_bytes"])
            return b * (saved_per_sample(layer, setup) - Fraction(fixed, t)) + fixed
        return b * saved_per_sample(layer, setup) - (b - 1) * Fraction(fixed, t)
    fixed = min(fixed, layer["activation_bytes"] - layer["tp_activation_bytes"])
    return b * saved_per_sample(layer, setup) - (b - 1) * fixed


def per_micro_batch(layer: dict, figure: str, setup: Setup) -> int:
    """A working-memory figure X (``transient_bytes`` and its moments) for one micro-batch:
    the line through batch 1 and 2, X(1) + (b - 1) (X(1) - F), F = ``unbatched_<figure>``
    at most X(1); a figure the layer lacks is its whole transient, with that one's F."""
    if layer.get(figure) is None:
        figure = "transient_bytes"
    whole = layer[figure]
    fixed = min(layer.get(f"unbatched_{figure}", 0), whole)
    return whole + (setup.micro_batch - 1) * (whole - fixed)


def recomputed(layer: dict, setup: Setup) -> bool:
    return setup.recompute == "full" and recomputable(layer, setup.runtime)


# -- boundary buffers ----------------------------------------------------------------------------


def boundary_copies(stage: int, held: int, setup: Setup) -> tuple[int, int]:
    """(R, S): copies of the received and of the sent boundary tensor stage s keeps while
    ``held`` micro-batches are in flight. The k held inputs are the stage's saved activations.
    megatron: one receive buffer per direction, plus the held outputs without deallocation.
    torch pipelining: a receive buffer per micro-batch for the run (m - k idle ones), and the
    output of each held micro-batch beside the m gradient receive buffers; under 1F1B
    (Schedule1F1B's send lists) also the input gradient last sent (m > 1; counted at the
    optimizer step too, where the schedule has waited on it: one copy over) and, with k >= 2
    and m >= 2k - 1, the warm-up output of micro-batch k - 2. Under GPipe (ScheduleGPipe keeps
    every send's work, which holds its tensor, until step() returns) a stage holding fewer than
    m, between 1 and m - 1, is in its backward phase: each of the m - held micro-batches
    back-propagated still has its sent output and its sent input gradient."""
    m, p = setup.num_microbatches, setup.pp
    if setup.runtime == "torch":
        one_f_one_b = setup.schedule == "1f1b"
        backward_phase = setup.schedule == "gpipe" and 1 <= held <= m - 1
        finished = m - held if backward_phase else 0
        receive = m - held + finished + int(one_f_one_b and m > 1)
        send = m + held + finished + int(one_f_one_b and 2 <= held and 2 * held - 1 <= m)
    else:
        receive, send = 1, 1 if setup.deallocate_outputs else 1 + held
    return (receive if stage > 0 else 0, send if stage < p - 1 else 0)


def buffer_bytes(stage: int, held: int, into: int, out: int, setup: Setup) -> int:
    """R copies of the tensor entering the stage and S of the one leaving it (bytes per
    micro-batch ``into`` and ``out``)."""
    receive, send = boundary_copies(stage, held, setup)
    return receive * into + send * out


# -- transients ----------------------------------------------------------------------------------


def fsdp2_buffers(layers: list[dict], i: int, setup: Setup, temporary: int) -> tuple[int, int]:
    """(gathered, weight-gradient) bytes of layer i under FSDP2 (torch runtime, ZeRO 2/3, d > 1;
    docs/cost-model.md, FSDP2): ZeRO 3 gathers its own weights and keeps the neighbour's flat
    all-gather buffer, w max(P'_i, P'_{i-1}), and layer i+1's reduce-scatter input g P'_{i+1}
    (ZeRO 2: the larger of the flat buffer and that input); its weight gradients are whole and
    unsharded, w P'_i, charged whole (the profile's weight-gradient transient credits what the
    backward freed before it), and at its reduce-scatter its own input g P'_i where its weights
    (ZeRO 3) and i+1's input are freed."""
    w, g = setup.weight_bytes, setup.grad_bytes

    def weights(j: int, per_param: int) -> int:
        return ceil(per_param * params_per_gpu(layers[j], setup.tp)) if 0 <= j < len(layers) else 0

    held, flat = weights(i + 1, g), max(weights(i, w), weights(i - 1, w))
    gathered = weights(i, w) + flat + held if setup.zero == 3 else max(flat, held)
    shard = ceil(g * params_per_gpu(layers[i], setup.tp) / setup.dp)
    freed_first = (weights(i, w) if setup.zero == 3 else 0) + held
    at_reduce = max(
        weights(i, g) - freed_first, weights(i, g) + shard - freed_first - weights(i, w)
    )
    return gathered, max(temporary, weights(i, w) + max(at_reduce, 0))


def layer_transient(layers: list[dict], i: int, setup: Setup) -> int:
    """The extra bytes while layer i runs, on top of what is stored (``running_transient`` in
    the setup's recompute state), plus the score buffer Megatron's explicit attention keeps
    (``kept_score_buffer``)."""
    running = running_transient(layers, i, setup, recomputed(layers[i], setup))
    if reduces_per_step(setup):
        return running
    return running + kept_score_buffer(layers, i, setup)


def running_transient(layers: list[dict], i: int, setup: Setup, recompute: bool) -> int:
    """The larger of layer i's own transient and its weight-gradient moment (the gradient
    temporary of its largest parameter, in the weights' dtype), plus ZeRO-3's gathered weights
    (this layer's and the prefetched next, 2 w P'); FSDP2's buffers instead where it runs
    (``fsdp2_buffers``). With ``recompute`` the layer re-materialises its saved bytes during its
    backward, beside its output's gradient. Megatron's explicit attention (S > 0): its own
    transient is the larger of the whole one and the backward's b B (``attention_backward_
    transient_bytes``, else the whole one) with one more score matrix (the mask's clone) and
    the layer's output gradient."""
    layer = layers[i]
    b, w = setup.micro_batch, setup.weight_bytes
    extra = 0
    if recompute:  # its saved tensors again, and its output's gradient
        output = boundary_tensor_bytes(layer["output_bytes"], setup)
        extra = ceil(saved_per_micro_batch(layer, setup)) + output
    whole = per_micro_batch(layer, "transient_bytes", setup) + extra
    clone = attention_backward_clone(layer, setup)
    # Megatron's backward is not the zoo's: b B (none of the zoo's batch-independent part)
    # with its output's gradient, [s, b, h] (/ t under SP), beside the clone
    backward = b * layer.get("attention_backward_transient_bytes", layer["transient_bytes"])
    backward += boundary_tensor_bytes(layer["output_bytes"], setup)
    own = max(whole, backward + extra + clone) if clone else whole
    # the largest weight gradient and its op's other parameter gradients (a bias), unsplit
    grad_temporary = w * (
        max(layer["largest_param"], ceil(Fraction(layer["largest_tp_param"], setup.tp)))
        + layer.get("grad_partner_params", 0)
    )
    gather = 2 * ceil(w * params_per_gpu(layer, setup.tp)) if setup.zero == 3 else 0
    if resharded(setup):  # its own weights and the flat buffer prefetched for i - 1
        before = unsharded_weights(layers[i - 1], setup) if i > 0 else 0
        running = max(own, whole + step_reduce_temporary(layer, setup, grad_temporary))
        own_weights = unsharded_weights(layer, setup)
        # a forward after a forward gathers with nothing else unsharded: its own and the buffer
        return max(running + own_weights + before, 2 * own_weights)
    if reduces_per_step(setup):
        return max(
            own,
            whole + step_reduce_temporary(layer, setup, grad_temporary),
            forward_gather(layer, setup),
        )
    if uses_fsdp2(setup):
        gather, grad_temporary = fsdp2_buffers(layers, i, setup, grad_temporary)
    return max(own, whole + grad_temporary) + gather


def kept_score_buffer(layers: list[dict], i: int, setup: Setup) -> int:
    """Megatron's score buffer beside layer i: it appears at a rank's first attention forward,
    so a layer before the model's first attention layer whose running transient (either
    recompute state) is at most every attention layer's is charged without it; every other
    layer with it."""
    full = score_buffer(layers, setup)
    attention = [j for j, layer in enumerate(layers) if attention_backward_clone(layer, setup)]
    if not full or i >= attention[0]:
        return full
    states = (False, True)
    least = min(running_transient(layers, j, setup, r) for j in attention for r in states)
    leading = all(running_transient(layers, i, setup, r) <= least for r in states)
    return 0 if leading else full


def attention_backward_clone(layer: dict, setup: Setup) -> int:
    """Megatron's own explicit attention (megatron runtime, attention_score_bytes S > 0): its
    in-place mask's backward (autograd's CopySlices) holds one more [b a/t, s, s] score tensor
    than the profile's out-of-place mask, b S / t bytes (docs/cost-model.md, "Megatron's
    explicit attention")."""
    if setup.runtime != "megatron":
        return 0
    return ceil(Fraction(setup.micro_batch * layer.get("attention_score_bytes", 0), setup.tp))


def score_buffer(layers: list[dict], setup: Setup) -> int:
    """The global memory buffer Megatron's explicit attention passes to baddbmm, kept for the
    run: the largest layer's b S / t (megatron runtime; the reference's layers carry no
    sp_gathered_bytes, so no SP all-gather shares it)."""
    return max(attention_backward_clone(layer, setup) for layer in layers)


def step_reduce_temporary(layer: dict, setup: Setup, temporary: int) -> int:
    """FSDP2 reducing once per step: a micro-batch's weight gradients add plain autograd's
    temporary, or the layer's whole gradients w P' where the weights' dtype is not the reduce
    dtype; the step's reduce-scatter makes its input g P' and shard g P' / d where the layer's
    unsharded weights w P' are freed."""
    p = params_per_gpu(layer, setup.tp)
    w, g = setup.weight_bytes, setup.grad_bytes
    at_reduce = ceil(g * p) + ceil(g * p / setup.dp) - ceil(w * p)
    made_whole = ceil(w * p) if w != g else 0
    return max(temporary, at_reduce, made_whole, 0)


def forward_gather(layer: dict, setup: Setup) -> int:
    """FSDP2 reducing once per step: the flat all-gather buffer at a layer's forward start,
    alone: w P' with ZeRO 3 (every forward gathers again), w P' - g P' with ZeRO 2 (only the
    step's first forward, before the layer's own gradients exist)."""
    p = params_per_gpu(layer, setup.tp)
    full = ceil(setup.weight_bytes * p)
    return full if setup.zero >= 3 else max(full - ceil(setup.grad_bytes * p), 0)


def step_temporary(layer: dict, setup: Setup) -> int:
    """The optimizer step's temporary of one layer: u bytes per parameter, sharded like the
    optimizer state (over d from ZeRO-1)."""
    return ceil(setup.step_bytes * params_per_gpu(layer, setup.tp) / state_shards(setup)[2])


# -- the stage's peak ----------------------------------------------------------------------------


def stage_peaks(layers: list[dict], stage_of_layer: list[int], setup: Setup) -> list[StagePeak]:
    """Each stage's bytes per GPU at its largest moment: a layer i running with k_s - 1 other
    micro-batches held whole and the running one's stored bytes up to i (docs/cost-model.md,
    "Transient peak"), or the optimizer step with none held (every gradient, the step's
    temporary). A fused step (u = 0) adds no moment: "the stage's peak is its schedule's"
    (docs/cost-model.md, Optimizer step), though on the torch runtime the end of the schedule
    holds m buffers of each direction, more than the forward moment's where a stage's input
    outweighs what it stores (full recomputation of a layer whose input is larger than its
    outputs)."""
    peaks = []
    for stage in range(setup.pp):
        members = [i for i, s in enumerate(stage_of_layer) if s == stage]
        first, last = members[0], members[-1]
        weights = grads = optimizer = stored = step = inputs = 0
        # torch: the model's output the pipeline keeps for its loss, with the last layer
        output = setup.micro_batch * setup.unsaved_output_bytes if setup.runtime == "torch" else 0
        held_output = output if len(layers) - 1 in members else 0
        for i in members:
            w, g, o = layer_states(layers[i], setup)
            weights, grads, optimizer = weights + w, grads + g, optimizer + o
            optimizer += step_counts(layers[i], setup)
            inputs += step_inputs(layers[i], setup)
            stored += stored_bytes(layers[i], setup)
            step += step_temporary(layers[i], setup)
        stored += held_output
        into = boundary_tensor_bytes(layers[first - 1]["output_bytes"], setup) if stage else 0
        out = boundary_tensor_bytes(layers[last]["output_bytes"], setup)
        held = in_flight(stage, setup)
        buffers = buffer_bytes(stage, held, into, out, setup) + inputs
        # while layer i of one micro-batch runs (forward or backward), the k - 1 others are
        # kept whole and that one keeps the layers up to i (the later ones not run yet, or
        # freed by their backward); the first layer wins a tie
        during, kept_so_far, gone = [], 0, 0
        for i in members:
            kept_so_far += stored_bytes(layers[i], setup)
            activations = (held - 1) * stored + kept_so_far
            transient = layer_transient(layers, i, setup)
            if i == len(layers) - 1:  # the output kept for the loss: part of its stored bytes
                activations += held_output
            else:  # before the last layer: still held, beside its transient
                transient += held_output
            if resharded(setup):  # unsharded: the layers after i only (i's own: its transient)
                gone += unsharded_weights(layers[i], setup)
            moment = StagePeak(weights - gone, grads, optimizer, activations, buffers, transient)
            during.append(moment)
        # after a backward, h micro-batches held: the next backward's moments, its micro-batch
        # kept whole beside the largest transient (over). Under FSDP2's resharding (no forward
        # follows) every layer is unsharded then: k - 1 held, the transients less the gathered
        # weights. Under torch's GPipe every moment of the backward phase, 1 <= h <= m - 1: its
        # send works keep the sent outputs and input gradients (boundary_copies)
        after = {held - 1} if resharded(setup) else set()
        if setup.runtime == "torch" and setup.schedule == "gpipe":
            after |= set(range(1, held))
        for h in sorted(after):
            rest = 0
            for i in members:
                transient = layer_transient(layers, i, setup)
                if resharded(setup):
                    transient -= unsharded_weights(layers[i], setup)
                    transient -= unsharded_weights(layers[i - 1], setup) if i > 0 else 0
                rest = max(rest, transient)
            after_buffers = buffer_bytes(stage, h, into, out, setup) + inputs
            during.append(StagePeak(weights, grads, optimizer, h * stored, after_buffers, rest))
        forward = max(during, key=lambda moment: moment.peak)
        if not setup.step_bytes:  # a fused step allocates nothing: the schedule's peak
            peaks.append(forward)
            continue
        optimizer_step = StagePeak(
            weights, grads, optimizer, 0, buffer_bytes(stage, 0, into, out, setup) + inputs, step
        )
        peaks.append(max(forward, optimizer_step, key=lambda moment: moment.peak))
    return peaks


# -- split-backward schedules (zbv, dualpipev, interleaved-zb) -----------------------------------
#
# docs/cost-model.md, "Zero-bubble and V schedules": per rank, the memory inside and after each
# action of torch's list (F, I, W, B per chunk), from the layer-graph fields alone. Covered:
# a chain cut into p v contiguous virtual stages, no recomputation, no FSDP2, no sequence
# parallelism, no model output kept for the loss, a fused optimizer step (no step moment).


def rank_chunks(rank: int, setup: Setup, virtual: int) -> list[int]:
    """The virtual stages of ``rank`` in chunk order: the V (zbv, dualpipev) places r and
    2p - 1 - r, interleaved-zb the loop r + c p."""
    p = setup.pp
    if setup.schedule in ("zbv", "dualpipev"):
        return [rank, 2 * p - 1 - rank]
    return [rank + c * p for c in range(virtual)]


def gradients_of(params: int, tp_params: int, setup: Setup) -> int:
    """G(P, T): the gradient bytes per GPU of P parameters, T of them split by tp, unsharded:
    a weight step's autograd.grad makes a group's whole dweights, whatever ZeRO shards later."""
    return ceil(setup.grad_bytes * ((params - tp_params) + Fraction(tp_params, setup.tp)))


def weight_step_figures(layer: dict, setup: Setup, transient: int) -> tuple[int, ...]:
    """(W, End, W1, End1) of one layer: its weight step's largest point G(P, T) + b e (the
    points but the end) and its end point; in a chunk's first weight step each point counts
    the layer's groups so far (a point's P is the previous group's and the running one's, so a
    group is P less the previous group), the end all of them. Without the profiled points:
    (transient, 0, transient + its gradients, its gradients)."""
    own = gradients_of(layer["params"], layer["tp_params"], setup)
    if layer.get("weight_step_moments") is None:
        return transient, 0, transient + own, own
    b = setup.micro_batch
    points = list(layer["weight_step_moments"])
    end = layer.get("weight_step_end") or [0, 0, 0]
    largest = largest_first = None
    previous, so_far = (0, 0), (0, 0)
    for params, tp_params, extra in points:
        value = gradients_of(params, tp_params, setup) + b * extra
        largest = value if largest is None else max(largest, value)
        previous = (params - previous[0], tp_params - previous[1])
        so_far = (so_far[0] + previous[0], so_far[1] + previous[1])
        first = gradients_of(*so_far, setup) + b * extra
        largest_first = first if largest_first is None else max(largest_first, first)
    end_value = gradients_of(end[0], end[1], setup) + b * end[2]
    end_first = gradients_of(*so_far, setup) + b * end[2]
    return largest or 0, end_value, largest_first or 0, end_first


def chunk_figures(layers: list[dict], members: list[int], setup: Setup, first: bool) -> dict:
    """Per virtual stage: kept (stored bytes per micro-batch), dY (what a micro-batch keeps
    between its I and W: each layer's weight-op gradients, and its output's where the next
    layer is in the chunk; none on virtual stage 0, ``first``), gradients, and what runs beside
    the counts: T (a forward or full backward at layer l: transient_l less the chunk's stored
    bytes after l), G (a first full backward: + the gradients of the layers after l and l's
    own), I (the input step: max(0, max X_l)), W and V (the weight step and the first one: the
    largest of W_l plus the End of the chunk's earlier layers)."""
    b = setup.micro_batch
    stored = [stored_bytes(layers[i], setup) for i in members]
    grads = [layer_states(layers[i], setup)[1] for i in members]
    trans = [layer_transient(layers, i, setup) for i in members]
    pending = 0
    for k, i in enumerate(members):
        layer = layers[i]
        if layer.get("weight_op_grad_bytes") is not None:
            pending += b * layer["weight_op_grad_bytes"]
            if k + 1 < len(members):
                pending += b * layer.get("weight_op_output_grad_bytes", 0)
        elif layer["params"]:  # the estimate: its transient and its output (none: the last)
            output = layer["output_bytes"] if i < len(layers) - 1 else 0
            pending += trans[k] + boundary_tensor_bytes(output, setup)
    figures = {"kept": sum(stored), "dY": 0 if first else pending, "grads": sum(grads)}
    after = [sum(stored[k + 1 :]) for k in range(len(members))]
    later_grads = [sum(grads[k + 1 :]) for k in range(len(members))]
    figures["T"] = max(trans[k] - after[k] for k in range(len(members)))
    figures["G"] = max(
        trans[k] - after[k] + later_grads[k] + grads[k] for k in range(len(members))
    )
    inputs = [
        trans[k]
        if layers[i].get("input_step_transient_bytes") is None
        else b * layers[i]["input_step_transient_bytes"]
        for k, i in enumerate(members)
    ]
    figures["I"] = max(0, *inputs)
    steps = [weight_step_figures(layers[i], setup, trans[k]) for k, i in enumerate(members)]
    for name, at in (("W", 0), ("V", 2)):
        best, credit = 0, 0
        for step in steps:
            best = max(best, step[at] + credit)
            credit += step[at + 1]
        figures[name] = best
    return figures


def split_copies(stage: int, counts: tuple[int, int, int], setup: Setup, last: int) -> tuple:
    """(R, S) of virtual stage j holding n micro-batches with B backwards done and w pending
    W steps: megatron (1, 1) (S = 1 + n without deallocation); torch (m - n + B + w, m + n + B),
    its input gradients and outputs sent kept to the step's end, except the V's turn-around
    (both on rank p - 1, tensors passed by function call): stage p (m - n, m + n + B), stage
    p - 1 (m - n + B + w, m). None on stage 0's input and the last stage's output."""
    n, done, pending = counts
    m, p = setup.num_microbatches, setup.pp
    if setup.runtime == "megatron":
        receive, send = 1, 1 if setup.deallocate_outputs else 1 + n
    elif setup.schedule in ("zbv", "dualpipev") and stage == p:
        receive, send = m - n, m + n + done
    elif setup.schedule in ("zbv", "dualpipev") and stage == p - 1:
        receive, send = m - n + done + pending, m
    else:
        receive, send = m - n + done + pending, m + n + done
    return (receive if stage > 0 else 0, send if stage < last else 0)


def persistent_gradients(setup: Setup) -> bool:
    """Every gradient exists all step (not torch's zero_grad(set_to_none=True))."""
    return setup.grad_lifetime != "step"


def split_rank_bytes(
    layers: list[dict], stage_of_layer: list[int], setup: Setup, rank: int, actions
) -> list[int]:
    """Rank r's bytes per GPU at each of its ``actions`` ((kind, chunk) in torch's order): the
    largest of its moments. With per chunk n held (F run, W or B not), w pending (I run, W
    not), B done and g (its gradients exist: always, or under step lifetime
    (``Setup.grad_lifetime``) from its first W or B), a state is weights + optimizer (+ DDP's
    buckets) + sum_c (g_c grads_c + n_c kept_c + w_c dY_c + buffers_c). F: the state after
    it + T; I: after it + I (virtual stage 0 runs no I: after it alone); W: the state before
    it + W, or, its chunk's first under step lifetime, with none of that chunk's gradients +
    V; B (and W on virtual stage 0, a full backward): before it + T, or G without the chunk's
    gradients at its first; each also after it."""
    last = setup.pp * setup.virtual_stages - 1
    chunks = rank_chunks(rank, setup, setup.virtual_stages)
    members = [[i for i, s in enumerate(stage_of_layer) if s == j] for j in chunks]
    figures = [chunk_figures(layers, own, setup, j == 0) for own, j in zip(members, chunks)]
    edges = []
    for own in members:
        into = boundary_tensor_bytes(layers[own[0] - 1]["output_bytes"], setup) if own[0] else 0
        edges.append((into, boundary_tensor_bytes(layers[own[-1]]["output_bytes"], setup)))
    # DDP (torch, d > 1, ZeRO 0/1) under step lifetime: its buckets, g P' per layer, all step
    buckets = setup.runtime == "torch" and setup.dp > 1 and not persistent_gradients(setup)
    base = sum(
        layer_states(layers[i], setup)[0]
        + layer_states(layers[i], setup)[2]
        + (gradients_of(layers[i]["params"], layers[i]["tp_params"], setup) if buckets else 0)
        + step_counts(layers[i], setup)  # Adam's step scalars, in the optimizer state
        + step_inputs(layers[i], setup)  # the batch a torch step() holds
        for own in members
        for i in own
    )
    count = len(chunks)
    persistent = persistent_gradients(setup)
    n, w, done, g = [0] * count, [0] * count, [0] * count, [persistent] * count

    def state(exclude: int = -1) -> int:
        total = base
        for c, j in enumerate(chunks):
            total += figures[c]["grads"] if g[c] and c != exclude else 0
            total += n[c] * figures[c]["kept"] + w[c] * figures[c]["dY"]
            receive, send = split_copies(j, (n[c], done[c], w[c]), setup, last)
            total += receive * edges[c][0] + send * edges[c][1]
        return total

    values = []
    for kind, c in actions:
        full = kind == "B" or (kind == "W" and chunks[c] == 0)
        during = []
        if kind in ("W", "B"):
            if g[c]:
                during.append(state() + figures[c]["T" if full else "W"])
            else:
                during.append(state(exclude=c) + figures[c]["G" if full else "V"])
            n[c] -= 1
            w[c] -= 0 if full else 1
            done[c] += 1
            g[c] = True
        elif kind == "F":
            n[c] += 1
            during.append(state() + figures[c]["T"])
        else:
            w[c] += 0 if chunks[c] == 0 else 1
            during.append(state() + (0 if chunks[c] == 0 else figures[c]["I"]))
        values.append(max(*during, state()))
    return values
