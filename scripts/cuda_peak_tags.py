"""What is live at a CUDA step's peak: the allocator's blocks, tagged by the code that made them.

    python scripts/cuda_peak_tags.py SNAPSHOT.pickle [--top 25]

Reads a ``torch.cuda.memory._dump_snapshot`` file (``scripts/cuda_profile_check.py --snapshots``
writes one per case for its measured step), replays its allocator events (``alloc`` /
``free_completed``) from the blocks live before the step, finds the moment of the largest
allocated total (what ``torch.cuda.max_memory_allocated`` reports) and prints the blocks live then,
grouped by the line of this repository's code (or torch's) that allocated them, largest first.
Blocks allocated before recording began (weights, gradients, optimizer moments) are one group.
Needs no torch: the snapshot is a pickle of plain lists and dicts.
"""

from __future__ import annotations

import argparse
import pickle
from collections import Counter
from pathlib import Path

BEFORE = "(allocated before the step: weights, gradients, optimizer state)"


def tag(frames: list[dict]) -> str:
    """The innermost frame in this repository's code, else the innermost frame at all."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in ("/models/", "/profiling/", "/scripts/")):
            return f"{name.split('/')[-2]}/{name.split('/')[-1]}:{frame['line']} {frame['name']}"
    if frames:
        first = frames[0]
        where = first.get("filename", "?").split("/")[-1]
        return f"{where}:{first.get('line')} {first.get('name')}"
    return "(no stack)"


def live_at_start(snapshot: dict, events: list[dict]) -> dict[int, tuple[int, str]]:
    """Blocks (address -> (bytes, tag)) allocated when recording began: the blocks live at the
    dump, with the step's allocations taken back and its frees put back, replayed backwards."""
    live = {}
    for segment in snapshot["segments"]:
        address = segment["address"]
        for block in segment["blocks"]:  # a segment's blocks lie end to end from its address
            if block["state"] == "active_allocated":
                live[address] = (block["size"], BEFORE)
            address += block["size"]
    for event in reversed(events):
        if event["action"] == "alloc":
            live.pop(event["addr"], None)
        elif event["action"] == "free_completed":
            live[event["addr"]] = (event["size"], BEFORE)
    return live


def peak_live(snapshot: dict) -> tuple[int, dict[int, tuple[int, str]]]:
    """(peak allocated bytes, the blocks live at that moment) over the recorded events."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live = live_at_start(snapshot, events)
    total = sum(size for size, _ in live.values())
    best, at_best = total, dict(live)
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], tag(event.get("frames", [])))
            total += event["size"]
            if total > best:
                best, at_best = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return best, at_best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", type=Path)
    parser.add_argument("--top", type=int, default=25, help="groups to print (default 25)")
    args = parser.parse_args(argv)
    with args.snapshot.open("rb") as handle:
        snapshot = pickle.load(handle)
    peak, blocks = peak_live(snapshot)
    groups: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for size, where in blocks.values():
        groups[where] += size
        counts[where] += 1
    print(f"{args.snapshot.name}: peak {peak:,} B ({peak / 2**30:.3f} GiB), {len(blocks)} blocks")
    for where, size in groups.most_common(args.top):
        print(f"{size / 2**20:12.2f} MiB {counts[where]:6d} blocks  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
