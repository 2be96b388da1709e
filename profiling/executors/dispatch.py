"""Which executor runs a rank, and the rank's child-process entry point (:func:`rank_worker`,
what :func:`profiling.run.run_plan` spawns): megatron-core (:mod:`profiling.executors.megatron`),
a traced model (:mod:`profiling.executors.traced`) or a zoo model on torch pipelining
(:mod:`profiling.executors.torch_zoo`). It imports the executors; none of them imports it."""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from profiling.executors.base import RankReport, RunJob
from profiling.executors.megatron import megatron_rank_main
from profiling.executors.torch_zoo import zoo_rank_main
from profiling.executors.traced import traced_rank_main
from solver.errors import InputError
from solver.workers import exit_with_parent


def rank_main(job: RunJob) -> Callable[[int, RunJob], RankReport]:
    """The executor's rank entry for ``job``: its engine, then traced or zoo for torch."""
    if job.engine == "megatron":
        return megatron_rank_main
    return traced_rank_main if job.traced else zoo_rank_main


def rank_worker(rank: int, job: RunJob, result_dir: str) -> None:
    """Child entry point: write ``rank{r}.pt`` (the report) or ``rank{r}.err`` and exit non-zero.
    Ctrl-C is the parent's to handle (it stops every rank); a rank ends with its parent even
    when the parent is killed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    directory = Path(result_dir)
    try:
        report = rank_main(job)(rank, job)
        torch.save(report, directory / f"rank{rank}.tmp")
        os.replace(directory / f"rank{rank}.tmp", directory / f"rank{rank}.pt")
        import torch.distributed as dist

        dist.barrier()  # nobody tears down gloo while a peer still talks to it
        dist.destroy_process_group()
    except InputError as error:  # the plan or model, found wrong on this rank: one line
        (directory / f"rank{rank}.input").write_text(str(error))
        os._exit(1)
    except BaseException:
        (directory / f"rank{rank}.err").write_text(f"{time.time()}\n{traceback.format_exc()}")
        os._exit(1)  # skip atexit and gloo teardown: peers may be gone or stuck
