"""Profile a PyTorch module into a layer graph: one forward + backward, per-layer costs per sample.

    from profiling.trace.profile import profile_module
    graph = profile_module(model, (ids,), model_name="gpt", mode="fake")   # -> LayerGraph

This module selects the layers and runs the traced forward + backward; ``graph_builder.py`` turns
the records into the graph and ``timing.py`` times the layers in real mode.

**Layers.** One layer per module path in ``layers``; by default
``profiling.trace.layers.default_layer_paths`` (the repeated blocks plus the parameterised parts
around them). The graph lists the
layers in the order their forward first runs (a topological order); a selected module that never
runs (a position table read through ``.weight``) keeps its place after the layer listed before it
and is named in ``meta["uncalled_layers"]``.

**Modes.** ``mode="fake"`` runs under ``FakeTensorMode``: parameters, buffers and inputs are
replaced by fake tensors (``torch.func.functional_call``), so the module may live on the meta
device and nothing is allocated; the fake device is the module's device, or the CPU for a meta
module. ``mode="real"`` runs real tensors on the module's device (parameters are used through
detached aliases and buffers through copies, so the module, its ``.grad`` and the global RNG are
left untouched) and also times each layer (below).

**Per layer** (bytes and FLOPs per sample: batch totals divided by the batch size, the leading
dimension of the first tensor in ``example_inputs``; byte counts are rounded up, which is exact for
tensors proportional to the batch and adds under one byte per sample for batch-independent ones
such as a causal mask; profile with batch 1 to count those in full):

- ``params``: parameters of the module subtree. A parameter shared by several layers (tied
  embeddings) is counted once, in the first layer (in graph order) that owns it, and listed in
  ``meta["shared_params"]``. A parameter outside every selected layer (``cls_token`` on the root)
  goes to the layer charged with the first op that reads it (see owners), or to
  ``meta["unused_params"]``.
- ``activation_bytes``: bytes saved for backward (``saved_tensors_hooks``), by storage: a storage
  saved twice or through several views counts once (its full ``nbytes``), in the first layer that
  saves it; a parameter, a buffer, or a view of one is not an activation; the model's own inputs
  (token ids saved by an embedding) are.
- ``output_bytes``: bytes of the tensors the layer's forward returns.
- ``fwd_flops``, ``bwd_flops``: ``torch.utils.flop_counter`` formulas (matmuls, convolutions,
  attention; elementwise ops count zero), charged per op to the owner. ``FlopCounterMode`` itself
  gives per-module totals but mixes forward with backward and leaves glue code to the root, so the
  formulas are applied here with the owners below; totals agree with it (tests).
- ``transient_bytes``: the peak of live memory while the layer runs (forward or backward), above
  the live memory at its start, not counting storages saved for backward or gradients of
  parameters (the cost model holds those elsewhere, batch-independent), less the layer's saved
  storages already released in its backward. Live memory is tracked exactly: every storage made
  by an op, until it is freed. It catches the fp32 logits and their gradient of a loss. A
  parameter's gradient is any storage the backward sends to its ``AccumulateGrad`` (the one that
  becomes ``.grad``, one added to it, a tied parameter's partial gradient held for a later sum:
  ``param_grads.py``); it is the parameter's size at any batch, so it is no per-sample figure.
- ``weight_grad_transient_bytes``: the same extra live memory at the moments the layer's weight
  gradients are made (at least 0), and while a partial gradient it made is held. The cost model
  adds the weight-gradient temporary (and a tie's partial gradients, ``solver.costs.embeddings``)
  to this one only: a loss whose fp32 logits peak in the forward, and have been freed by the
  time the LM head's weight gradient is computed, does not count both at once.
- ``backward_grad_moments``: the moments of the layer's backward as (params, tp_params, bytes)
  points, its own parameters with a gradient then and the extra live bytes then (as
  ``transient_bytes``), those no other dominates (``own_grads.py``): what a first backward's
  moment holds of the layer's gradients under the gradient lifetime "step".
- ``tp_params``, ``tp_activation_bytes``, ``tp_comm_bytes``: the Megatron-style split of
  ``tensor_parallel.py``.
- ``vocab_rows``, ``vocab_params``, ``vocab_activation_bytes`` and the transients' parts
  ``vocab_transient_bytes``/``fixed_transient_bytes`` (and at the weight-gradient moments),
  on the layers holding a vocabulary table or LM head (``tensor_parallel.py``): what each
  runtime splits over TP (``solver.costs.vocab``).
- ``attention_kv_bytes``: bytes of the keys and values the layer's attention calls read in the
  forward (SDPA and the zoo's explicit attention; grouped-query heads counted once), what ring
  attention exchanges under context parallelism (``attention_kv.py``); omitted when 0.
- ``attention_score_bytes``: bytes of the [heads, s, s] scores the zoo's explicit attention
  makes per call (``attention_kv.py``), which size Megatron's own ``DotProductAttention``
  buffers on the megatron runtime; omitted when 0 (fused attention).
- ``expert_params``, ``expert_activation_bytes``, ``ep_comm_bytes`` (mixture-of-experts layers
  only) and ``meta["moe"]``: the routed experts, by the module-name rule of ``experts.py``.
- ``fwd_ms``, ``bwd_ms`` (``mode="real"`` only, ``timing.py``): the median over three timed runs
  after one warm-up, per sample; CUDA events on a GPU, ``perf_counter`` on the CPU. The forward is
  split at the layers' forward hooks; the backward at autograd-node pre-hooks. ``meta["timing"]``
  records how: the device type and ``torch.get_num_threads()`` (``timing.timing_meta``), and
  two step-time terms measured with the same threads (``time_terms.py``):
  ``optimizer_step_ns_per_param`` (one Adam step, ns per parameter element) and
  ``microbatch_overhead_ns`` (what the pipeline runtime adds per micro-batch beyond the layer
  times).

**Owners** (see ``dataflow.py``): glue code outside every selected layer (an embedding sum and its
dropout in the root's forward, a loss computed after the head) is charged to the layer that
finished last, which is the pipeline stage a split at each layer's beginning would run it in; glue
before the first layer goes to the first layer. The bytes saved this way are also reported per
layer in ``meta["glue_activation_bytes"]``.

**Edges** come from the dataflow (``dataflow.py``): every storage carries the layers whose forward
produced it (propagated through glue ops, a layer's outputs re-tagged to it), and each input
tensor of a layer's forward gives edges ``src -> layer`` of its per-sample bytes, summed per pair;
a tensor read by several layers gives several edges, and a residual inside a layer stays inside.
Tensors built only from the model inputs (masks, position ids) give no edge. The ``edges`` key is
omitted when the edges are exactly the chain i -> i+1 with the source's ``output_bytes`` (the
format's implied chain), and written otherwise.

**The loss.** The run is ``out = module(*example_inputs)``; the loss is ``out`` when it is a scalar
(the first scalar among the outputs, e.g. HuggingFace's ``loss``), else ``out.float().sum()``
(the sum over every floating output that needs a gradient).

**CUDA-like kernels** (``cuda_like=True``, the default; ``cuda_attention.py``): ``F.dropout`` is
run as ``torch.native_dropout``, the fused kernel CUDA uses (a one-byte mask), instead of CPU's
composite (a mask of the input's dtype), and ``F.scaled_dot_product_attention`` on the CPU as a
GPU's fused attention kernels run it (no ``s x s`` matrix for dropout or a learned bias), in both
modes, so that CPU and fake-CPU profiles match GPU training. Under fake tensors, transformers'
mask code is given the real run's answer (``_transformers_compat.real_run_masks``). Checked on
an H200 (torch 2.11, bf16 GPT, h 1024, s 1024, dropout 0.1): a fake profile on the CUDA device
equals the real CUDA run in every field; a fake CPU profile differs only by the LayerNorm
statistics, which CPU kernels keep in bf16 and CUDA in fp32 (4s bytes per LayerNorm per sample,
0.007% of a block); and the sum of activations plus the largest transient, times the batch, was
within 0.02% of ``max_memory_allocated`` above the weights for one forward + backward.

Limitations: modules called through ``module.forward(...)`` skip hooks and belong to the enclosing
layer; activation checkpointing inside the model hides its saved tensors; a layer called again
after a later layer that feeds it is an error (no DAG).
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from profiling._torch_compat import FakeTensorMode, tree_map
from profiling.hf._transformers_compat import real_run_masks
from profiling.trace.attention_kv import attention_kv
from profiling.trace.batch_line import doubled_inputs, unbatched_fields, with_unbatched
from profiling.trace.cuda_attention import cuda_like_kernels
from profiling.trace.dataflow import Tracer, tensors_in
from profiling.trace.experts import ExpertTracker
from profiling.trace.graph_builder import build_graph
from profiling.trace.layers import block_paths, default_layer_paths
from profiling.trace.param_grads import ParamGradients
from profiling.trace.weight_step import WeightStepGradients
from profiling.trace.tensor_parallel import TensorParallelTracker, is_linear
from profiling.trace.time_terms import measure_time_terms
from profiling.trace.timing import time_layers, timing_meta
from solver.errors import InputError
from solver.graph import LayerGraph

MODES = ("fake", "real")

_FAKE_ONLY_ERRORS = (
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "UnsupportedOperatorException",
    "UnsupportedFakeTensorException",
    "GuardOnDataDependentSymNode",
    "MetadataMismatchError",
)


def profile_module(
    module: nn.Module,
    example_inputs: tuple,
    layers: list[str] | None = None,
    *,
    model_name: str = "model",
    mode: str = "fake",
    meta: dict | None = None,
    progress: Callable[[str], None] | None = None,
    cuda_like: bool = True,
    batch_line: bool = True,
) -> LayerGraph:
    """Run one forward + backward of ``module(*example_inputs)`` and return its layer graph.

    See the module docstring for the layers, the per-sample fields and the modes. ``meta`` is
    merged into the graph's ``meta`` (its keys win). ``progress`` is called with a short message
    per layer and phase. ``batch_line`` (at batch 1): a second, memory-only trace at batch 2
    gives each layer's batch-independent bytes (``batch_line.py``). Raises :class:`InputError` for an unknown layer path, inputs without a
    batch dimension, or a forward that fails (under fake tensors: suggests ``mode="real"``).
    """
    if mode not in MODES:
        raise InputError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    paths = default_layer_paths(module) if layers is None else list(layers)
    selection = select_layers(module, paths, model_name=model_name)
    batch = batch_size(example_inputs, model_name=model_name)
    device = _device(module, example_inputs, mode=mode, model_name=model_name)
    say = progress or (lambda _message: None)

    say(f"{mode} run of {model_name}: {len(selection)} layers, batch {batch}, {device}")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if mode == "fake" else None
    state, inputs = _prepare(module, example_inputs, device, fake_mode)
    with torch.random.fork_rng(devices=_rng_devices(device)):
        tracer, split, experts = _trace(
            module, state, inputs, selection, fake_mode, say, cuda_like, model_name
        )
        timings, timing = None, {}
        if mode == "real":
            timings, timing = _time_real(module, state, inputs, selection, device, say, cuda_like)
    graph = build_graph(
        selection,
        tracer,
        split,
        state.params,
        batch=batch,
        timings=timings,
        model_name=model_name,
        experts=experts,
        blocks=block_paths(module, paths),
        meta={
            "profiled_by": (
                f"profiling.trace.profile.profile_module ({mode} mode, torch {torch.__version__})"
            ),
            "profile_mode": mode,
            "profile_device": str(device),
            "profile_batch": batch,
            "dropout": "cuda-like native_dropout" if cuda_like else "device default",
        }
        | timing
        | dict(meta or {}),
    )
    if batch_line and batch == 1:
        say(f"{mode} run of {model_name} at batch 2, memory only (batch-independent bytes)")
        for _, _, tensor in state.params:
            tensor.grad = None
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            two = doubled_inputs(inputs, batch)
        with torch.random.fork_rng(devices=_rng_devices(device)):
            tracer, split, experts = _trace(
                module, state, two, selection, fake_mode, say, cuda_like, model_name
            )
        totals = build_graph(
            selection,
            tracer,
            split,
            state.params,
            batch=1,  # the batch's totals
            timings=None,
            model_name=model_name,
            experts=experts,
            blocks=block_paths(module, paths),
            meta={},
        )
        graph = with_unbatched(graph, unbatched_fields(graph, totals))
    say("done")
    return graph


def _time_real(
    module: nn.Module,
    state: _State,
    inputs: tuple,
    selection: list[tuple[str, nn.Module]],
    device: torch.device,
    say: Callable[[str], None],
    cuda_like: bool,
) -> tuple[tuple[list[float], list[float]], dict[str, Any]]:
    """Real mode: the per-layer (forward ms, backward ms) per batch, scaled for the hooked
    timer's own cost, and the graph's ``meta.timing`` (the optimizer step and per-micro-batch
    overhead, :func:`profiling.trace.time_terms.measure_time_terms`)."""
    timing = {"timing": timing_meta(device)}
    params = [tensor for _, _, tensor in state.params]

    def run_loss(*args):
        return _loss(torch.func.functional_call(module, state.tensors, args), "model")

    timings = time_layers(
        selection,
        lambda: run_loss(*inputs),
        params,
        device=device,
        progress=say,
        cuda_like=cuda_like,
    )
    say("timing the optimizer step and the per-micro-batch overhead")
    timing["timing"] |= measure_time_terms(
        run_loss,
        inputs,
        params,
        layer_ms=sum(timings[0]) + sum(timings[1]),
        device=device,
        context=lambda: cuda_like_kernels(cuda_like),
    )
    # the hooked timer's own cost, taken out pro rata (time_terms.runtime_terms)
    scale = timing["timing"].get("layer_time_scale", 1.0)
    timings = tuple([t * scale for t in times] for times in timings)
    return timings, timing


# -- layer selection ----------------------------------------------------------------------------


def select_layers(
    module: nn.Module, paths: list[str], *, model_name: str = "model"
) -> list[tuple[str, nn.Module]]:
    """Check the layer paths and return ``(path, module)`` pairs."""
    if not paths:
        raise InputError(f"{model_name}: no layers selected; pass module paths such as 'blocks.0'")
    known = dict(module.named_modules(remove_duplicate=False))
    selection = []
    for path in paths:
        if path not in known or not path:
            close = difflib.get_close_matches(path, [p for p in known if p], n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            hint = hint or f"top-level modules: {', '.join(n for n, _ in module.named_children())}"
            raise InputError(f"{model_name}: unknown layer path {path!r}; {hint}")
        if isinstance(known[path], (nn.ModuleList, nn.ModuleDict)):
            children = [f"{path}.{n}" for n, _ in known[path].named_children()][:3]
            raise InputError(
                f"{model_name}: layer {path!r} is a {type(known[path]).__name__}, which is never "
                f"called; select its elements ({', '.join(children)}, ...)"
            )
        selection.append((path, known[path]))
    seen: dict[int, str] = {}
    for path, child in selection:
        if id(child) in seen:
            raise InputError(
                f"{model_name}: layers {seen[id(child)]!r} and {path!r} are the same module; "
                "list it once"
            )
        seen[id(child)] = path
    for a, _ in selection:
        for b, _ in selection:
            if b.startswith(a + "."):
                raise InputError(
                    f"{model_name}: layer {b!r} is inside layer {a!r}; select modules that do "
                    "not contain each other"
                )
    return selection


def batch_size(example_inputs: tuple, *, model_name: str = "model") -> int:
    """The leading dimension of the first tensor input."""
    leaves = tensors_in(example_inputs)
    if not leaves or leaves[0].dim() == 0 or leaves[0].shape[0] == 0:
        raise InputError(
            f"{model_name}: the first example input must be a tensor with a batch dimension "
            "first (for example token ids of shape (batch, seq))"
        )
    return int(leaves[0].shape[0])


def _device(module: nn.Module, example_inputs: tuple, *, mode: str, model_name: str):
    tensors = [*module.parameters(), *module.buffers()]
    if mode == "real" and any(t.is_meta for t in tensors):
        raise InputError(
            f"{model_name}: the module has parameters on the meta device; mode='real' needs "
            "real weights (build it on a device, or use mode='fake')"
        )
    for tensor in [*tensors, *tensors_in(example_inputs)]:
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def _rng_devices(device: torch.device) -> list[int]:
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


# -- the traced run -------------------------------------------------------------------------------


class _State:
    """Parameters and buffers to run with, by name, and the originals they stand for."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.params: list[tuple[str, nn.Parameter, torch.Tensor]] = []
        """(first name, original parameter, the tensor the run uses) per distinct parameter."""
        self.buffers: list[tuple[str, torch.Tensor]] = []


def _prepare(module, example_inputs, device, fake_mode):
    """Run tensors: fake (``empty_strided`` under the fake mode) or aliases of the real ones."""
    state = _State()
    context = fake_mode if fake_mode is not None else contextlib.nullcontext()

    def fake_like(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(
            t.shape, t.stride(), dtype=t.dtype, device=device, requires_grad=t.requires_grad
        )

    made: dict[int, torch.Tensor] = {}
    with context:
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) not in made:
                if fake_mode is not None:
                    made[id(param)] = fake_like(param)
                else:
                    made[id(param)] = param.detach().requires_grad_(param.requires_grad)
                state.params.append((name, param, made[id(param)]))
            state.tensors[name] = made[id(param)]
        for name, buffer in module.named_buffers(remove_duplicate=False):
            if id(buffer) not in made:
                made[id(buffer)] = (
                    fake_like(buffer) if fake_mode is not None else buffer.detach().clone()
                )
                state.buffers.append((name, made[id(buffer)]))
            state.tensors[name] = made[id(buffer)]
        if fake_mode is not None:
            inputs = tree_map(
                lambda x: fake_like(x) if isinstance(x, torch.Tensor) else x, example_inputs
            )
        else:
            inputs = example_inputs
    return state, inputs


def _loss(out: Any, model_name: str) -> torch.Tensor:
    """The scalar to differentiate: the first scalar output, else the sum of all outputs."""
    leaves = [
        t for t in tensors_in(out) if t.requires_grad and (t.is_floating_point() or t.is_complex())
    ]
    if not leaves:
        raise InputError(
            f"{model_name}: the forward returned no tensor that needs a gradient; check that the "
            "parameters require grad and that the forward is not under torch.no_grad()"
        )
    scalar = next((t for t in leaves if t.numel() == 1), None)
    if scalar is not None:
        return scalar.sum() if scalar.dim() else scalar
    total = leaves[0].float().sum()
    for t in leaves[1:]:
        total = total + t.float().sum()
    return total


class _ModuleHooks:
    """Forward pre- and post-hooks on every module: they keep the stack of running modules and,
    in the forward, tell the tracer where each selected layer starts and ends and the TP and
    expert trackers about every Linear, Embedding and expert module."""

    def __init__(
        self,
        *,
        stack: list[nn.Module],
        selection: list[tuple[str, nn.Module]],
        tracer: Tracer,
        tp: TensorParallelTracker,
        experts: ExpertTracker,
        model_name: str,
    ) -> None:
        self.stack = stack
        self.names = [path for path, _ in selection]
        self.index_of = {id(m): i for i, (_, m) in enumerate(selection)}
        self.tracer, self.tp, self.experts = tracer, tp, experts
        self.model_name = model_name
        self.weight_steps: WeightStepGradients | None = None
        """Told each layer's outputs (``weight_step``), where set."""

    def install(self, modules) -> list:
        """Register both hooks on every module; returns the handles to remove."""
        handles = []
        for mod in modules:
            handles.append(mod.register_forward_pre_hook(self.pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(self.post, with_kwargs=True))
        return handles

    def pre(self, mod, args, kwargs):
        self.stack.append(mod)
        if self.tracer.phase != "fwd":
            return
        index = self.index_of.get(id(mod))
        if index is not None:
            if self.tracer.active is not None:
                raise InputError(
                    f"{self.model_name}: layer {self.names[index]!r} runs inside layer "
                    f"{self.names[self.tracer.active]!r}; select modules that do not call each "
                    "other"
                )
            self.tracer.layer_enter(index, args, kwargs)
        self.experts.enter(mod)
        if is_linear(mod):
            self.tp.linear_enter(mod, args, kwargs)

    def post(self, mod, args, kwargs, output):
        while self.stack and self.stack.pop() is not mod:  # re-synchronise after an exception
            pass
        if self.tracer.phase != "fwd":
            return
        self.experts.exit(mod, args, kwargs)
        if is_linear(mod):
            self.tp.linear_exit(mod, output)
        elif isinstance(mod, nn.Embedding):
            self.tp.embedding_exit(mod, args, output)
        index = self.index_of.get(id(mod))
        if index is not None and self.tracer.active == index:
            outputs = self.tracer.layer_exit(index, output)
            self.tp.layer_outputs(outputs)
            if self.weight_steps is not None:
                self.weight_steps.note_outputs(index, outputs)


def _trace(module, state, inputs, selection, fake_mode, say, cuda_like, model_name):
    names = [path for path, _ in selection]
    paths = {m: path for path, m in module.named_modules()}
    stack: list[nn.Module] = []
    tracer = Tracer(names, where=lambda: list(stack), progress=say)
    tp = TensorParallelTracker(module, tracer)
    experts = ExpertTracker(module, tracer)
    for name, _, tensor in state.params:
        tracer.register(tensor, "param", name)
    for name, tensor in state.buffers:
        tracer.register(tensor, "buffer", name)
    for tensor in tensors_in(inputs):
        tracer.register(tensor, "input")

    hooks = _ModuleHooks(
        stack=stack,
        selection=selection,
        tracer=tracer,
        tp=tp,
        experts=experts,
        model_name=model_name,
    )
    handles = hooks.install(paths)
    param_grads = ParamGradients(tracer, [tensor for _, _, tensor in state.params])
    hooks.weight_steps = weight_steps = WeightStepGradients(
        tracer, [tensor for _, _, tensor in state.params]
    )
    fake = fake_mode if fake_mode is not None else contextlib.nullcontext()
    masks = real_run_masks() if fake_mode is not None else contextlib.nullcontext()
    step = "forward"
    try:
        with (
            fake,
            masks,
            tracer,
            torch.autograd.graph.saved_tensors_hooks(tracer.pack, _unpack),
            cuda_like_kernels(cuda_like),
            attention_kv(lambda: tracer.phase, tracer.owner) as kv_reads,
        ):
            tracer.start_forward()
            out = torch.func.functional_call(module, state.tensors, inputs)
            loss = _loss(out, model_name)
            del out
            step = "backward"
            stack.clear()
            param_grads.install(loss)
            weight_steps.install(loss)
            tracer.start_backward(loss)
            loss.backward()
            tracer.finish()
            # every gradient of a parameter: its .grad, and the partial ones autograd sums
            # into it (held: a tied head's gradient of the table until the embedding's part)
            final = set()
            grad_params = dict(param_grads.param_of)  # gradient uid -> its parameter
            for _, _, tensor in state.params:
                grad = tensor.grad
                record = tracer.record_of(grad) if grad is not None else None
                if record is not None:
                    final.add(record.uid)
                    grad_params.setdefault(record.uid, id(tensor))
            gradients = param_grads.uids | final
            held = param_grads.uids - final
            excluded = set(tracer.saved_owner) | gradients
            del loss
    except InputError:
        raise
    except Exception as error:
        raise _run_error(
            error, tracer, stack, paths, step, fake_mode is not None, model_name
        ) from error
    finally:
        tracer.finish()
        param_grads.remove()
        weight_steps.remove()
        for handle in handles:
            handle.remove()
    if tracer.num_started == 0:
        raise InputError(
            f"{model_name}: none of the selected layers ran ({', '.join(names[:4])}, ...); "
            "select modules the forward calls"
        )
    tracer.model_input_bytes = tracer.model_input_bytes_by_reader()
    tracer.attention_kv_bytes = dict(kv_reads.bytes_by_owner)
    tracer.attention_score_bytes = dict(kv_reads.score_bytes_by_owner)
    tracer.transient_peaks = tracer.transients(excluded)
    tracer.weight_grad_transient_peaks = tracer.transients(excluded, at=gradients, held=held)
    tracer.backward_transient_peaks = tracer.transients(excluded, only="bwd")
    tracer.gradient_moments = (excluded, grad_params)  # own_grads.backward_grad_moments
    tracer.param_gradients = param_grads  # the gradients one node returns together
    tracer.weight_step_bytes = weight_steps.bytes_by_layer(excluded)
    tracer.weight_step_moments = (weight_steps, excluded)  # graph_builder: the W step's moments
    tracer.input_step_peaks = weight_steps.input_step_transients(excluded)
    split = tp.resolve()
    if split.vocab_layers:  # the transients' fixed and vocabulary-sized parts
        vocab = {uid for uid, tag in tracer.vocab_uids.items() if tag in split.vocab_tags}
        tracer.vocab_transient_peaks = tracer.vocab_transients(excluded, vocab)
        tracer.vocab_weight_grad_peaks = tracer.vocab_transients(
            excluded, vocab, at=gradients, held=held
        )
    return tracer, split, experts


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _run_error(error, tracer, stack, paths, step, fake, model_name) -> InputError:
    """One line naming the module and op that failed, and what to try."""
    op, running = tracer.failure if tracer.failure is not None else (None, list(stack))
    inner = [m for m in running if paths.get(m)]
    if step == "backward":
        place = "the backward pass"
    elif inner:
        place = f"module {paths[inner[-1]]!r} ({type(inner[-1]).__name__})"
    elif running:
        place = f"the forward of {model_name} ({type(running[0]).__name__}, outside its layers)"
    else:
        place = f"the forward of {model_name}"
    detail = " ".join(str(error).split())[:240]
    what = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
    at = f" at {op}" if op else ""
    if not fake:
        return InputError(f"{model_name}: {step} failed in {place}{at}: {what}; check the inputs")
    if type(error).__name__ in _FAKE_ONLY_ERRORS:
        hint = (
            "the model needs real values here (data-dependent code); profile with real "
            "tensors instead (mode='real', --device cpu)"
        )
    else:
        hint = (
            "check the example inputs (shapes, dtypes), or profile with real tensors "
            "(mode='real', --device cpu) if it only fails under fake tensors"
        )
    return InputError(
        f"{model_name}: {step} failed under fake tensors in {place}{at}: {what}; {hint}"
    )
