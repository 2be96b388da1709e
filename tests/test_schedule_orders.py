"""The zero-bubble and V schedules' action lists (solver/costs/schedule_orders.py).

Oracle: torch 2.13's own schedule objects (``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, public classes), built over stand-in stages
(the attributes their constructors read; no process group), whose public ``pipeline_order``
must equal the port entry by entry, idle steps (None) and overlapped steps included, and whose
refusals the port must make too, as an InputError naming the rule.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from solver.costs import schedule_actions
from solver.costs.schedule_orders import (
    OverlapStep,
    pipeline_order,
    rank_stages,
    stage_ranks,
    zero_bubble_actions,
)
from solver.errors import InputError

CLASSES = {
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
}


def _text(entry) -> str | None:
    """An entry as torch's ``_Action.__repr__`` writes it ("0F1", "(0F3;3B1)OVERLAP_F_B")."""
    if entry is None:
        return None
    if isinstance(entry, OverlapStep):
        return f"({_text(entry.forward)};{_text(entry.backward)})OVERLAP_F_B"
    return f"{entry.stage}{entry.kind}{entry.microbatch}"


def _torch_order(pipelining, schedule: str, m: int, p: int, v: int):
    """torch's ``pipeline_order`` as text per rank, or the exception its constructor raises."""
    cls = getattr(pipelining, CLASSES[schedule])
    stages = [
        SimpleNamespace(group_size=p, group_rank=0, num_stages=p * v, submod=None) for _ in range(v)
    ]
    try:
        order = cls(stages, m).pipeline_order
    except ValueError as error:
        return error
    return [[None if a is None else str(a) for a in order[r]] for r in range(p)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(CLASSES))
def test_action_lists_are_torchs(schedule):
    """Every (p, v, m) with p <= 6, v <= 3, m <= 3p + 3: the same lists, or both refuse
    (padding: ZBV below m = 2p - 1; bubbles: interleaved-zb below m = p)."""
    pipelining = pytest.importorskip("torch.distributed.pipelining")
    compared = refused = 0
    for p in range(1, 7):
        for v in (1, 2, 3):
            for m in range(1, 3 * p + 4):
                theirs = _torch_order(pipelining, schedule, m, p, v)
                if isinstance(theirs, ValueError):
                    with pytest.raises(InputError):
                        pipeline_order(schedule, m, p, v)
                    refused += 1
                    continue
                ours = [[_text(e) for e in rank] for rank in pipeline_order(schedule, m, p, v)]
                assert ours == theirs, (schedule, p, v, m)
                compared += 1
    assert compared >= 40 and refused >= 50


@pytest.mark.parametrize(
    "schedule,m,p,v,rule",
    [
        ("zbv", 8, 4, 1, "exactly 2 chunks per rank"),
        ("dualpipev", 8, 4, 3, "exactly 2 chunks per rank"),
        ("dualpipev", 7, 4, 2, "m = 7 < 2 pp = 8"),
        ("interleaved-zb", 9, 4, 2, "multiple of its rounds max(1, m // pp) = 2"),
    ],
)
def test_refusals_name_the_rule(schedule, m, p, v, rule):
    with pytest.raises(InputError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        pipeline_order(schedule, m, p, v)


def test_v_placement():
    """Rank r holds virtual stages r and 2p - 1 - r (torch's style "v"): rank 0 the first and
    the last; interleaved-zb keeps the loop placement."""
    assert stage_ranks("zbv", 4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert rank_stages("dualpipev", 4, 2, 0) == [0, 7]
    assert rank_stages("interleaved-zb", 4, 2, 1) == [1, 5]


def test_actions_flatten_idle_and_overlapped_steps():
    """``schedule_actions`` gives each rank's compute steps: no idle step, an overlapped
    F + B as F then B, every (chunk, micro-batch) once per kind it runs, W after its I."""
    for schedule, m, p in [("zbv", 3, 4), ("dualpipev", 8, 4), ("interleaved-zb", 6, 3)]:
        v = 2
        for rank in range(p):
            actions = schedule_actions(m, p, v, rank, None, schedule)
            assert actions == zero_bubble_actions(schedule, m, p, v, rank)
            for chunk in range(v):
                forwards = [a.microbatch for a in actions if a.kind == "F" and a.chunk == chunk]
                assert sorted(forwards) == list(range(m))
                backward = [a for a in actions if a.kind in "IB" and a.chunk == chunk]
                assert sorted(a.microbatch for a in backward) == list(range(m))
                for a in actions:
                    if a.kind == "W" and a.chunk == chunk:
                        assert _position(actions, "I", chunk, a.microbatch) < actions.index(a)
    dual = schedule_actions(8, 2, 2, 0, None, "dualpipev")
    overlapped = [e for e in pipeline_order("dualpipev", 8, 2, 2)[0] if isinstance(e, OverlapStep)]
    assert overlapped and all(e.backward.kind == "B" for e in overlapped)
    entries = [e for e in pipeline_order("dualpipev", 8, 2, 2)[0] if e is not None]
    assert len(dual) == sum(2 if isinstance(e, OverlapStep) else 1 for e in entries)


def _position(actions, kind: str, chunk: int, microbatch: int) -> int:
    """Position of the (kind, chunk, micro-batch) action in a rank's list."""
    return next(
        k
        for k, a in enumerate(actions)
        if (a.kind, a.chunk, a.microbatch) == (kind, chunk, microbatch)
    )
