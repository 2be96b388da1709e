"""scripts/cuda_peak_tags.py on a hand-made allocator snapshot: the blocks live when recording
began are rebuilt from the dump, the peak is taken inside the marked step only, and each block is
tagged by the repository line that allocated it."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import cuda_peak_tags  # noqa: E402

MODEL_FRAME = {"filename": "/repo/models/common.py", "line": 305, "name": "forward"}
TORCH_FRAME = {"filename": "/torch/nn/functional.py", "line": 10, "name": "linear"}


def alloc(addr: int, size: int, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr: int, size: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": size, "frames": []}


MARK = {"action": "snapshot", "addr": 0, "size": 0, "frames": []}


def snapshot() -> dict:
    """A weight block (1000 B at 0x1000) live throughout; a 5000 B block before the mark (it makes
    the largest total overall, outside the step); inside the marked step a 300 B logits block
    from models/, and a 200 B block with only torch's frame, freed before the step ends. The dump
    (after the history) still holds the weight and a 50 B block from the step."""
    events = [
        alloc(0x2000, 5000, TORCH_FRAME),
        free(0x2000, 5000),
        MARK,
        alloc(0x3000, 300, TORCH_FRAME, MODEL_FRAME),
        alloc(0x4000, 200, TORCH_FRAME),
        free(0x4000, 200),
        free(0x3000, 300),
        alloc(0x5000, 50, MODEL_FRAME),
        MARK,
    ]
    segments = [
        {
            "address": 0x1000,
            "blocks": [
                {"size": 1000, "state": "active_allocated"},
                {"size": 24, "state": "inactive"},
            ],
        },
        {"address": 0x5000, "blocks": [{"size": 50, "state": "active_allocated"}]},
    ]
    return {"segments": segments, "device_traces": [events]}


def test_peak_is_inside_the_marked_step_and_tagged_by_repository_line():
    peak, at_peak, at_end = cuda_peak_tags.peak_live(snapshot())
    assert peak == 1000 + 300 + 200  # not the 6000 B before the mark
    assert sorted(at_peak.values()) == [
        (200, "functional.py:10 linear"),
        (300, "models/common.py:305 forward"),
        (1000, cuda_peak_tags.BEFORE),
    ]
    assert sorted(at_end.values()) == [
        (50, "models/common.py:305 forward"),
        (1000, cuda_peak_tags.BEFORE),
    ]


def test_without_marks_the_whole_history_counts(tmp_path, capsys):
    data = snapshot()
    data["device_traces"][0] = [e for e in data["device_traces"][0] if e["action"] != "snapshot"]
    peak, _, _ = cuda_peak_tags.peak_live(data)
    assert peak == 1000 + 5000
    path = tmp_path / "case.pickle"
    path.write_bytes(pickle.dumps(data))
    assert cuda_peak_tags.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "case.pickle at its peak: 6,000 B" in out
    assert "case.pickle at the end: 1,050 B" in out
