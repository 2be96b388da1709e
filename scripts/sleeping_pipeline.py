"""torch's own pipeline schedules over gloo with stages that sleep known times.

Each virtual stage j is a module whose forward sleeps F_j and whose backward splits as torch's
split-backward schedules split it: ``out = Sleep(x * w1; F_j, I_j) + Sleep(w2; 0, W_j)``. The
input-gradient path (through ``x``) sleeps I_j and the weight-gradient path of ``w2`` sleeps
W_j, so torch's ``stage_backward_input`` (an I step) runs only the first and
``stage_backward_weight`` (a W step) only the second (its param group's intermediate is the
add), and a full backward (B, or any backward of 1F1B and GPipe) sleeps both. Sleeping takes no
CPU, so a shared machine barely moves the step; what remains against a simulation is the
runtime's own per-action cost (Python, gloo send/receive of a 16-byte tensor, sleep overshoot).

Used by ``scripts/bench_schedule_time.py --torch``.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from solver.costs.schedule_time import simulate_schedule
from solver.parallel import rank_stages

SCHEDULE_CLASSES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""Our schedule name -> torch 2.13's class in ``torch.distributed.pipelining``."""
SINGLE_STAGE = ("1f1b", "gpipe")
"""The classes that take one stage (the others a list of the rank's stages)."""


@dataclass(frozen=True)
class SleepCase:
    """One timed layout: per virtual stage j (pipeline order, p v of them) its forward, input-
    gradient and weight-gradient sleeps, ms. Under 1F1B and GPipe the backward is I + W."""

    schedule: str
    num_ranks: int
    num_microbatches: int
    forward_ms: tuple[float, ...]
    input_ms: tuple[float, ...]
    weight_ms: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.forward_ms)

    @property
    def backward_ms(self) -> tuple[float, ...]:
        return tuple(i + w for i, w in zip(self.input_ms, self.weight_ms, strict=True))


def simulated_ms(case: SleepCase) -> float:
    """``simulate_schedule``'s iteration for the case, ms (the inputs are ms)."""
    return simulate_schedule(
        schedule=case.schedule,
        num_microbatches=case.num_microbatches,
        num_ranks=case.num_ranks,
        forward_ns=list(case.forward_ms),
        backward_ns=list(case.backward_ms),
        weight_ns=list(case.weight_ms),
    ).makespan_ns


def _worker(rank: int, case: SleepCase, port: int, repeats: int, out: str) -> None:
    """One pipeline rank: its virtual stages (torch's placement), ``repeats`` + 1 steps between
    barriers; the rank holding stage 0 writes the step times after the warm-up to ``out``."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, forward_ms, backward_ms):
            time.sleep(forward_ms / 1e3)
            ctx.backward_ms = backward_ms
            return x * 1.0

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.backward_ms / 1e3)
            return grad * 1.0, None, None

    class Stage(torch.nn.Module):
        def __init__(self, j: int):
            super().__init__()
            self.j = j
            self.w1 = torch.nn.Parameter(torch.ones(4))
            self.w2 = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            j = self.j
            through = Sleep.apply(x * self.w1, case.forward_ms[j], case.input_ms[j])
            return through + Sleep.apply(self.w2, 0.0, case.weight_ms[j])

    p, n = case.num_ranks, case.num_stages
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    shape = (torch.ones(1, 4),)
    received = (torch.ones(1, 4, requires_grad=True),)  # its gradient goes back: an I step
    own = sorted(rank_stages(case.schedule, p, n // p, rank))
    stages = [
        pipelining.PipelineStage(
            Stage(j),
            j,
            n,
            torch.device("cpu"),
            input_args=shape if j == 0 else received,
            output_args=shape,
            output_grads=None if j == n - 1 else shape,
            input_grads=None if j == 0 else shape,
        )
        for j in own
    ]
    schedule_class = getattr(pipelining, SCHEDULE_CLASSES[case.schedule])
    runner = schedule_class(
        stages[0] if case.schedule in SINGLE_STAGE else stages,
        case.num_microbatches,
        loss_fn=lambda output, target: output.sum(),
    )
    m = case.num_microbatches
    args = (torch.ones(m, 4),) if 0 in own else ()
    kwargs = {"target": torch.ones(m, 4), "return_outputs": False} if n - 1 in own else {}
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        runner.step(*args, **kwargs)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if 0 in own:
        Path(out).write_text(json.dumps(times[1:]))
    dist.destroy_process_group()


def measured_step_ms(case: SleepCase, repeats: int) -> list[float]:
    """The case's step run by torch ``repeats`` times after a warm-up (one process per rank,
    gloo, one thread each): the step times, ms."""
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "times.json")
        mp.spawn(_worker, args=(case, port, repeats, out), nprocs=case.num_ranks)
        return [1e3 * t for t in json.loads(Path(out).read_text())]


def row(case: SleepCase, repeats: int) -> dict:
    """The measured median step against the simulation, one table row."""
    times = measured_step_ms(case, repeats)
    measured = statistics.median(times)
    simulated = simulated_ms(case)

    def joined(values: tuple[float, ...]) -> str:
        return "/".join(f"{x:g}" for x in values)

    return {
        "schedule": case.schedule,
        "pp": case.num_ranks,
        "v": case.num_stages // case.num_ranks,
        "m": case.num_microbatches,
        "forward ms": joined(case.forward_ms),
        "input-grad ms": joined(case.input_ms),
        "weight-grad ms": joined(case.weight_ms),
        "measured ms": round(measured, 1),
        "spread ms": round(max(times) - min(times), 1),
        "simulated ms": round(simulated, 1),
        "simulated error %": round(100 * (simulated - measured) / measured, 1),
        "excess per action ms": round((measured - simulated) / actions_per_rank(case), 2),
    }


def actions_per_rank(case: SleepCase) -> int:
    """Compute actions each rank runs in a step: F and B per micro-batch and chunk, or F, I
    and W under a split-backward schedule (DualPipeV's full backwards counted as I + W)."""
    per = 2 if case.schedule in SINGLE_STAGE else 3
    return per * case.num_microbatches * case.num_stages // case.num_ranks
