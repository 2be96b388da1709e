"""Print the boundary tensors megatron-core's interleaved 1F1B keeps alive at every moment of
each rank (``solver.costs.megatron_buffers.megatron_replay``, the cost model's rule for
``--runtime megatron`` with ``--virtual-stages`` > 1; issue 30), beside the held micro-batches
per chunk and the running chunk.

Usage: PYTHONPATH=. python scripts/megatron_interleaved_buffers.py M P V
"""

from __future__ import annotations

import sys

import harness

from solver.costs.megatron_buffers import megatron_replay


def main(argv: list[str]) -> int:
    parser = harness.parser(__doc__, out=None)
    for name, meaning in (("m", "micro-batches"), ("p", "pipeline ranks"), ("v", "chunks")):
        parser.add_argument(name, type=int, help=meaning)
    args = parser.parse_args(argv)
    m, p, v = args.m, args.p, args.v
    for r in range(p):
        print(f"rank {r}")
        for kind, held, running, tensors in megatron_replay(m, p, v, r):
            print(f"  {kind} held {held} running {running:2d}: {len(tensors)} {tensors}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
