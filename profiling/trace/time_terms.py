"""The two step-time terms a real profile measures beside the layer times (``meta.timing``).

    terms = measure_time_terms(run_loss, inputs, params, layer_ms=sum(fwd) + sum(bwd),
                               device=device)
    # {"optimizer_step_ns_per_param": 5.1, "microbatch_overhead_ns": 210000.0}

**optimizer_step_ns_per_param** (ns per parameter element): one ``torch.optim.Adam`` step as the
ranks of ``profiling.run`` build it for the torch runtime (``profiling.executors.parallelize.
build_optimizer``: lr ``profiling.executors.base.LEARNING_RATE``, torch's other defaults,
``foreach=True``,
the torch runtime's ``optimizer_impl``), over copies of the model's parameters (same shapes,
dtype and device; the module is left untouched) with random gradients set: one warm-up step
(which allocates the Adam state), then ``TIMED_STEPS`` timed steps; the median divided by the
parameter count. At most ``MAX_OPTIMIZER_ELEMENTS`` elements are timed (the first parameters in
order), so a large model's profile does not hold four more copies of all its weights: the rate
per element of a long foreach step barely depends on how many tensors it covers.

**microbatch_overhead_ns** (ns per micro-batch per pipeline stage): what one more micro-batch
costs beyond the profiled layer times when torch.distributed.pipelining runs it, as
``profiling.run``'s ranks do. Measured by a faithful proxy in this process rather than through
``profiling.run`` (whose spawned ranks take seconds each to start): the whole model is one
``PipelineStage`` of a world-1 gloo group (an in-memory ``HashStore``) run by ``Schedule1F1B``
(the schedule class the ranks use; at one stage every schedule runs F, B per micro-batch), with
the profile's batch as the micro-batch, at m = 1, 2 and 3 micro-batches, round robin
(``MICROBATCH_ROUNDS`` rounds after one warm-up step); the least-squares slope of the median
step time over m, less the sum of the layers' forward + backward times of the same batch, at
least 0. The optimizer is not in these steps (it runs once per step, not per micro-batch).

What it finds (gpt-tiny, fp32, batch 1, 1 thread, a 2-core CPU shared with other jobs, so a few
percent of noise on every number): the pipeline runtime's own per-micro-batch work (splitting the
batch, ``stage_backward``'s ``autograd.backward`` call, the loss bookkeeping, Python) is small:
the proxy's slope is 0.2 ms above a plain forward + backward loop on the 2-layer x 32 preset
(1.47 vs 1.24 ms) and about 1 ms on 6 layers x 256 hidden, seq 128 (63 vs 62 ms). The slope of
``run_plan`` pp 1 at m = 1, 2, 3 (clean steps) was 58.8 ms per micro-batch on 6 x 256, at or
below the proxy's. Both are *below* the summed profiled layer times (65.5 ms there; 2.5 ms on
the 2-layer preset): ``timing.py``'s timer runs Python inside the timed intervals (a pre-hook on
every autograd node in the backward, the forward hooks' stamps), and the summed layer times of
``time_layers`` were 0.7-1.3 ms (40-100%) above an unhooked forward + backward of the same batch
in the same process on 2 layers, 3-5 ms (5-8%) on 6. So on the CPU the recorded overhead is 0 or
a few ms, inside the noise, and a busy machine moves it (0 to 9 ms on 6 x 256 in four profiles
at load 1-2.5). The 10 ms per micro-batch that issue 18 saw above a 44.3 ms layer sum did not
come back with the profile and the ranks both at 1 thread (the layers sum to 59-66 ms then, above
the measured slope); a layer sum that low fits a profile timed with 2 threads (1 thread is
20-50% slower per sample here, issue 18) under ranks that ran with 1, which
``meta.timing.threads`` now prevents. The term stays for devices where a
micro-batch's fixed launch and Python cost does not shrink with the layers (a GPU).

When the proxy cannot run (a process group already initialised in this process, inputs that are
not all batch-major tensors, a stage that fails under the pipeline runtime) the overhead is left
out (logged), and the cost model adds none.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

TIMED_STEPS = 5
"""Timed optimizer steps after one warm-up; the median is kept."""
MICROBATCH_ROUNDS = 5
"""Timed rounds of the micro-batch proxy (each runs every count of ``MICROBATCH_COUNTS``) after one
warm-up step; each count keeps its median, robust to two disturbed steps (with 3 rounds one
disturbed step at m = 3 made a 14 ms "overhead" per micro-batch out of none, +20-50% on every
predicted pipeline step of ``scripts/bench_time.py``; the least time instead was biased low
against the median step that runs are measured by: -9% at pp 1)."""
MICROBATCH_COUNTS = (1, 2, 3)
"""Micro-batch counts of the overhead proxy (the slope is fitted over them)."""
MAX_OPTIMIZER_ELEMENTS = 2**27
"""Parameter elements the optimizer timing covers at most (134M: 2 GiB of fp32 copies with
their gradients and Adam state)."""
ADAM_LEARNING_RATE = 1e-3
"""``profiling.executors.base.LEARNING_RATE`` (not imported: profiling.executors.base pulls in the
zoo)."""


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer_step_ns_per_param(params: list[torch.Tensor], *, device: torch.device) -> float:
    """Median time of one foreach Adam step over copies of ``params`` (random gradients set),
    in ns per parameter element (module docstring)."""
    copies, count = [], 0
    for tensor in params:
        if count + tensor.numel() > MAX_OPTIMIZER_ELEMENTS and copies:
            break
        copy = tensor.detach().clone().requires_grad_(True)
        copy.grad = torch.randn_like(copy)
        copies.append(copy)
        count += tensor.numel()
    optimizer = torch.optim.Adam(copies, lr=ADAM_LEARNING_RATE, foreach=True)
    times = []
    for step in range(1 + TIMED_STEPS):
        _synchronize(device)
        started = time.perf_counter()
        optimizer.step()
        _synchronize(device)
        if step > 0:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e9 / count


class _WholeModel(nn.Module):
    """The profiled run as one pipeline stage: inputs in, the loss (shape [1]) out."""

    def __init__(self, run_loss: Callable[..., torch.Tensor]):
        super().__init__()
        self.run_loss = run_loss

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.run_loss(*inputs).reshape(1)


def slope(counts: list[int], times: list[float]) -> float:
    """Least-squares slope of ``times`` over ``counts`` (per unit of count)."""
    mean_c, mean_t = statistics.fmean(counts), statistics.fmean(times)
    num = sum((c - mean_c) * (t - mean_t) for c, t in zip(counts, times, strict=True))
    den = sum((c - mean_c) ** 2 for c in counts)
    return num / den


@contextlib.contextmanager
def _world_of_one():
    """A gloo process group of this process alone, destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def microbatch_step_ms(
    run_loss: Callable[..., torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
    params: list[torch.Tensor],
    *,
    device: torch.device,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict[int, float]:
    """Median wall time (ms) of a ``Schedule1F1B`` step of the whole model as one stage, at each
    of ``MICROBATCH_COUNTS`` micro-batches of ``inputs``' batch (round robin; gradients of
    ``params`` cleared after each step). ``run_loss(*micro_batch_inputs)`` runs the forward and
    returns the scalar loss; ``context`` wraps every step (the profile's CUDA-like kernels)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage_module = _WholeModel(run_loss)
    loss_spec = torch.empty(1, device="meta")
    times: dict[int, list[float]] = {m: [] for m in MICROBATCH_COUNTS}
    with _world_of_one():
        schedules = {}
        for m in MICROBATCH_COUNTS:
            stage = PipelineStage(
                stage_module,
                0,
                1,
                device,
                input_args=tuple(x.to("meta") for x in inputs),
                output_args=loss_spec,
            )
            schedules[m] = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, _t: out.sum())
        batches = {m: tuple(torch.cat([x] * m) for x in inputs) for m in MICROBATCH_COUNTS}
        targets = {m: torch.zeros(m, device=device) for m in MICROBATCH_COUNTS}
        rounds = range(MICROBATCH_ROUNDS)
        order = [MICROBATCH_COUNTS[0]] + [m for _ in rounds for m in MICROBATCH_COUNTS]
        for k, m in enumerate(order):
            _synchronize(device)
            started = time.perf_counter()
            with context():
                schedules[m].step(*batches[m], target=targets[m], return_outputs=False)
            _synchronize(device)
            if k > 0:
                times[m].append((time.perf_counter() - started) * 1e3)
            for tensor in params:
                tensor.grad = None
    return {m: statistics.median(values) for m, values in times.items()}


def runtime_terms(
    run_loss: Callable[..., torch.Tensor],
    inputs: tuple,
    params: list[torch.Tensor],
    *,
    layer_ms: float,
    device: torch.device,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict[str, float] | None:
    """The runtime's terms from the proxy's step times at m = 1, 2, 3 (least-squares line
    a + b m, ms; ``layer_ms``: the layers' summed forward + backward of ``inputs``' batch):
      microbatch_overhead_ns  max(0, b - layer_ms): the runtime's own work per micro-batch;
      layer_time_scale        min(1, b / layer_ms): where the hooked layer timer's sum is above
                              the unhooked step's slope (module docstring), the factor that
                              brings the layer times down to it (``profile_module`` applies it);
      step_overhead_ns        max(0, a): what a step costs beside its micro-batches and the
                              optimizer (the schedule's setup, clearing the gradients).
    None when the proxy cannot run here (module docstring), or when its step times do not grow
    with m (a slope <= 0 is noise, not a measurement)."""
    import torch.distributed as dist

    if not dist.is_available():
        logger.info("micro-batch overhead not measured: torch.distributed is not available")
        return None
    if dist.is_initialized():
        logger.info("micro-batch overhead not measured: a process group is already initialised")
        return None
    leaves = list(inputs)
    if not leaves or not all(isinstance(x, torch.Tensor) and x.dim() > 0 for x in leaves):
        logger.info("micro-batch overhead not measured: the inputs are not all batch tensors")
        return None
    if len({x.shape[0] for x in leaves}) != 1:
        logger.info("micro-batch overhead not measured: the inputs' batch sizes differ")
        return None
    try:
        medians = microbatch_step_ms(
            run_loss, tuple(leaves), params, device=device, context=context
        )
    except Exception as error:  # the pipeline runtime refused this model: no term, say why
        logger.info("micro-batch overhead not measured: %s: %s", type(error).__name__, error)
        return None
    counts, times = list(medians), list(medians.values())
    per_microbatch = slope(counts, times)
    if per_microbatch <= 0:  # more micro-batches did not take longer: noise (a loaded machine)
        logger.info(
            "micro-batch overhead not measured: the proxy's step times did not grow with the "
            "micro-batches (%s ms at m = %s); rerun on a quieter machine",
            ", ".join(f"{t:.3g}" for t in times),
            ", ".join(map(str, counts)),
        )
        return None
    intercept = statistics.fmean(times) - per_microbatch * statistics.fmean(counts)
    return {
        "microbatch_overhead_ns": max(0.0, per_microbatch - layer_ms) * 1e6,
        "layer_time_scale": min(1.0, per_microbatch / layer_ms) if layer_ms > 0 else 1.0,
        "step_overhead_ns": max(0.0, intercept) * 1e6,
    }


def measure_time_terms(
    run_loss: Callable[..., torch.Tensor],
    inputs: tuple,
    params: list[torch.Tensor],
    *,
    layer_ms: float,
    device: torch.device,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict[str, float]:
    """``meta.timing``'s ``optimizer_step_ns_per_param`` and (when measured) the runtime's
    terms (:func:`runtime_terms`), with the process's current threads."""
    terms = {"optimizer_step_ns_per_param": optimizer_step_ns_per_param(params, device=device)}
    runtime = runtime_terms(
        run_loss, inputs, params, layer_ms=layer_ms, device=device, context=context
    )
    if runtime is not None:
        terms |= runtime
    return terms
