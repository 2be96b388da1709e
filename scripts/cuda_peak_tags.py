"""What is live at a CUDA step's peak: the allocator's blocks, tagged by the code that made them.

    python scripts/cuda_peak_tags.py SNAPSHOT.pickle [--top 25]

Reads a ``torch.cuda.memory._dump_snapshot`` file (``scripts/cuda_profile_check.py --snapshots``
writes one per case), replays its allocator events (``alloc`` / ``free_completed``) from the
blocks live when recording began, finds the moment of the largest allocated total (what
``torch.cuda.max_memory_allocated`` reports) between the first two "snapshot" events (the marks
around the measured step; the whole history without them) and prints the blocks live then,
grouped by the line of this repository's code (or torch's) that allocated them, largest first;
then the same for the blocks still live at the end of the history. Blocks allocated before
recording began are one group. Needs no torch: the snapshot is a pickle of plain lists and dicts.
"""

from __future__ import annotations

import argparse
import pickle
from collections import Counter
from pathlib import Path

BEFORE = "(allocated before recording began)"


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


def peak_live(snapshot: dict) -> tuple[int, dict[int, tuple[int, str]], dict[int, tuple[int, str]]]:
    """(peak allocated bytes inside the marked window, the blocks live then, the blocks live at
    the end of the history)."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    marks = [i for i, e in enumerate(events) if e["action"] == "snapshot"]
    first, last = (marks[0], marks[1]) if len(marks) >= 2 else (-1, len(events))
    live = live_at_start(snapshot, events)
    total = sum(size for size, _ in live.values())
    best, at_best = -1, {}
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], tag(event.get("frames", [])))
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
        if first <= index <= last and total > best:
            best, at_best = total, dict(live)
    return best, at_best, live


def print_groups(title: str, blocks: dict[int, tuple[int, str]], top: int) -> None:
    """``blocks`` summed by where they were allocated, largest first."""
    groups: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for size, where in blocks.values():
        groups[where] += size
        counts[where] += 1
    total = sum(groups.values())
    print(f"{title}: {total:,} B ({total / 2**30:.3f} GiB), {len(blocks)} blocks")
    for where, size in groups.most_common(top):
        print(f"{size / 2**20:12.2f} MiB {counts[where]:6d} blocks  {where}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", type=Path)
    parser.add_argument("--top", type=int, default=25, help="groups to print (default 25)")
    args = parser.parse_args(argv)
    with args.snapshot.open("rb") as handle:
        snapshot = pickle.load(handle)
    _, at_peak, at_end = peak_live(snapshot)
    print_groups(f"{args.snapshot.name} at its peak", at_peak, args.top)
    print_groups(f"{args.snapshot.name} at the end", at_end, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
