"""A zbv plan run by the torch engine (issue 31 item 3): torch's ScheduleZBVZeroBubble with the V
placement trains to the single-process gradients, runs the action list
``solver.costs.schedule_orders`` gives, and each rank's measured peak is within the bound the new
schedules measured (benchmarks/bench_accuracy_schedules.md)."""

from __future__ import annotations

import pytest

from profiling.export import export_graph
from profiling.run import run_plan
from solver.costs.schedule_orders import zero_bubble_actions
from tests.conftest import assert_peaks_within
from tests.test_run import OVERRIDES, assert_matches_reference, evaluated

ZBV_BOUNDS = {"under_pct": 0.01, "over_pct": 1.0}
"""Within the per-action moments' measured figures (benchmarks/bench_accuracy_schedules.md: 28
ranks within 0.0% .. +0.42%, none under, issue 31's target met), never under: rank 0 reads the
model's inputs and labels, whose batch torch's ``step()`` holds (``model_input_bytes``), and
every rank keeps Adam's step scalars (``param_tensors``). The 0.01% is the device mesh's rank
map (8-16 B, on the CPU in a GPU run: not charged, docs/cost-model.md "Known gaps")."""


@pytest.fixture(scope="module")
def graph():
    return export_graph("gpt-tiny", dtype="fp32", overrides=OVERRIDES)


@pytest.mark.slow
@pytest.mark.distributed
def test_zbv_pp2_runs_the_v_and_its_peaks_hold(graph):
    # 6 layers (embed, 4 blocks, head) in 4 virtual stages; rank 0 holds stages 0 and 3
    plan_dict = evaluated(
        graph,
        [2, 1, 1, 2],
        pp=2,
        tp=1,
        dp=1,
        micro_batch=1,
        num_microbatches=4,
        virtual_stages=2,
        schedule="zbv",
    )
    chunks = [stage["chunks"] for stage in plan_dict["stages"]]
    assert chunks == [[["embed", "layers.0"], ["layers.3", "head"]], [["layers.1"], ["layers.2"]]]
    reports = run_plan("gpt-tiny", plan_dict, iterations=2, overrides=OVERRIDES, capture_grads=True)
    assert [(r.rank, r.stage) for r in reports] == [(0, 0), (1, 1)]
    assert_matches_reference(reports, global_batch=4, iterations=2)
    for report in reports:  # one recorded memory per F, I and W of torch's list
        assert len(report.action_bytes) == len(zero_bubble_actions("zbv", 4, 2, 2, report.rank))
    print([round(r.error_pct, 2) for r in reports])
    assert_peaks_within(reports, **ZBV_BOUNDS)
