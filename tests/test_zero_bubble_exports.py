"""Exports of the split-backward schedules (issue 31 item 4): torch pipelining names torch's class
and the V's stage-to-rank mapping, torchtitan its ``pipeline_parallel_schedule`` name (and the V in
its note), Megatron-LM refuses a V plan and warns on interleaved-zb, DeepSpeed warns or refuses."""

from __future__ import annotations

import pytest

from solver.exports import build_exports
from solver.graph import load_graph
from solver.parallel import chunk_places
from solver.specs import ParallelConfig
from tests.conftest import GPT_1_3B

TORCH_CLASS = {
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
}
TORCHTITAN_NAME = {
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
    "interleaved-zb": "InterleavedZeroBubble",
}


@pytest.fixture(scope="module")
def graph():
    return load_graph(GPT_1_3B)


def _exports(graph, schedule: str, *, pp: int = 2, v: int = 2, m: int = 8) -> dict:
    """Exports of an even split of the graph into pp v virtual stages (pipeline order)."""
    config = ParallelConfig(
        pp=pp, tp=1, dp=1, micro_batch=1, num_microbatches=m, schedule=schedule, virtual_stages=v
    )
    names, count = graph.names, pp * v
    bounds = [round(i * len(names) / count) for i in range(count + 1)]
    stages = [names[bounds[j] : bounds[j + 1]] for j in range(count)]
    return build_exports(graph, config, stages)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_export_torchs_class_and_the_v_mapping(graph, schedule):
    exports = _exports(graph, schedule, pp=4)
    torch_section = exports["torch_pipelining"]
    assert torch_section["schedule"] == TORCH_CLASS[schedule]
    assert torch_section["stage_ranks"] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [rank for rank, _ in chunk_places(schedule, 4, 2)] == torch_section["stage_ranks"]
    assert "for j in (pp_rank, 7 - pp_rank)" in torch_section["note"]
    assert "retain_graph=True" in torch_section["memory_note"]
    titan = exports["torchtitan"]
    assert titan["parallelism"]["pipeline_parallel_schedule"] == TORCHTITAN_NAME[schedule]
    assert f'pipeline_parallel_schedule = "{TORCHTITAN_NAME[schedule]}"' in titan["toml"]
    assert "in a V" in titan["note"] and "virtual stages r and 7 - r" in titan["note"]
    assert exports["megatron"] == {
        "refused": f"schedule {schedule} has no Megatron-LM equivalent: Megatron-LM runs 1F1B "
        "and interleaved 1F1B, which place virtual stage j on rank j mod pp, not in a V; use "
        "the torch_pipelining or torchtitan section"
    }
    assert set(exports["deepspeed"]) == {"refused"}  # one contiguous stage per rank


def test_interleaved_zb_keeps_the_loop_and_warns_megatron_and_deepspeed(graph):
    exports = _exports(graph, "interleaved-zb", pp=2, v=2)
    torch_section = exports["torch_pipelining"]
    assert torch_section["schedule"] == "ScheduleInterleavedZeroBubble"
    assert torch_section["stage_ranks"] == [0, 1, 0, 1]
    assert "range(pp_rank, 4, 2)" in torch_section["note"]
    titan = exports["torchtitan"]
    assert titan["parallelism"]["pipeline_parallel_schedule"] == "InterleavedZeroBubble"
    assert "j mod pp" in titan["note"]
    megatron = exports["megatron"]
    assert not megatron["refused"] and megatron["args"]
    assert megatron["warnings"][-1].startswith(
        "schedule interleaved-zb has no Megatron-LM equivalent: these arguments run the same "
        "layers per rank under 1F1B (interleaved 1F1B with --virtual-stages)"
    )
    assert set(exports["deepspeed"]) == {"refused"}  # v 2


def test_interleaved_zb_one_stage_per_rank(graph):
    exports = _exports(graph, "interleaved-zb", pp=4, v=1)
    assert exports["torch_pipelining"]["stage_ranks"] == [0, 1, 2, 3]
    assert "range(pp_rank, 4, 4)" in exports["torch_pipelining"]["note"]
    deepspeed = exports["deepspeed"]
    assert deepspeed["warnings"][-1].startswith(
        "schedule interleaved-zb has no DeepSpeed equivalent: these arguments run the same "
        "layers per rank under 1F1B (PipelineEngine's TrainSchedule)"
    )
    assert exports["torchtitan"]["warnings"][0] == (
        "InterleavedZeroBubble with 1 stage per rank: torchtitan refuses multi-stage schedules "
        "with fewer than 2 stages per rank; plan with --virtual-stages 2"
    )


def test_one_f_one_b_exports_unchanged(graph):
    exports = _exports(graph, "1f1b", pp=2, v=2)
    assert exports["torch_pipelining"]["schedule"] == "ScheduleInterleaved1F1B"
    assert exports["torchtitan"]["parallelism"]["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert not any("equivalent" in w for w in exports["megatron"]["warnings"])
