"""Replay megatron-core 0.16's ``forward_backward_pipelining_with_interleaving`` (no p2p
overlap, the default; ``deallocate_pipeline_outputs``) on one rank and list the boundary tensors
alive at each moment besides the stored inputs of the in-flight micro-batches (issue 30,
diagnosis; not yet the cost model's rule).

Read from megatron/core/pipeline_parallel/schedules.py (the installed 0.16.1):

- warm-up, after forward k: ``send_forward_recv_forward`` sends the output (Out of k's chunk)
  and receives the input of forward k + 1 (In of its chunk); the last warm-up step also
  receives the output gradient of backward 0 (``send_forward_backward_recv_forward_backward``);
- steady step k: ``forward_backward_helper_wrapper`` runs forward W + k, then backward k, while
  the outer locals still hold the previous step's ``input_tensor_grad`` (InG of backward k - 1's
  chunk) and ``output_tensor_grad`` (OutG of backward k's chunk, consumed by it); the forward's
  output (Out) lives until the p2p after the helper; backward k makes its InG at its end. Then
  ``send_forward_backward_recv_forward_backward`` allocates the next input (In of forward
  W + k + 1's chunk) and the next output gradient (OutG of backward k + 1's chunk) while the
  Out being sent, the InG being sent and the consumed OutG (still the outer local) are alive:
  5 boundary tensors at the moment after a backward, 4 during it, 2 during a forward (+ the
  output it makes), whatever v;
- cool-down step k: backward k, then ``send_backward_recv_backward`` (InG sent, the next OutG
  received; ``output_tensor_grad`` rebinds it).

The cost model (``LayerCosts.copies_at``, megatron branch) charges per chunk one In (non-first
virtual stage) and one Out (non-last) at every moment: 2 v - [first rank] - [last rank].

Usage: PYTHONPATH=. python scripts/megatron_interleaved_buffers.py M P V
"""

from __future__ import annotations

import sys

from solver.costs.schedule import running_moments


def replay(m: int, p: int, v: int, r: int, g: int | None = None) -> list[tuple]:
    """(label, held per chunk, running chunk (-1 none), boundary tensors) at every moment:
    F (a forward runs), B (a backward runs), P (the p2p after a step; running -1)."""
    g = g or p
    total = m * v
    order = [c for s in range(0, m, g) for c in range(v) for _ in range(min(g, m - s))]

    def fchunk(k):
        return order[k]

    def bchunk(k):
        return v - 1 - order[k]

    def first(c):
        return r == 0 and c == 0

    def last(c):
        return r == p - 1 and c == v - 1

    warm = min(total, (v - 1) * g + 2 * (p - 1 - r))

    def recv(k, forward):  # recv_tensor_from_previous_stage(k, forward): for step k + 1
        leading = r == 0 if forward else r == p - 1
        chunk = fchunk if forward else bchunk
        if not leading:
            return (k + 1 < total), (chunk(k + 1) if k + 1 < total else None)
        if k < p - 1:
            return False, None
        c = chunk(k - (p - 1))
        if c == (v - 1 if forward else 0):
            return False, None
        return True, c + 1 if forward else c - 1

    held, ahead, locals_ = [0] * v, [0] * v, {}
    moments = []

    def snap(label, running, extra=()):
        tensors = [("In", c) for c in range(v) for _ in range(ahead[c])]
        tensors += [t for t in locals_.values() if t] + [t for t in extra if t]
        moments.append((label, tuple(held), running, tuple(sorted(tensors))))

    def forward(k):
        c = fchunk(k)
        if not first(c):
            ahead[c] -= 1
        held[c] += 1
        snap(f"F{k}", c)
        return None if last(c) else ("Out", c)

    if not first(0):
        ahead[0] += 1
    for k in range(warm):
        out = forward(k)
        rp, cp = recv(k, True)
        rp = rp and k != total - 1
        extra = [out, ("In", cp) if rp else None]
        if k == warm - 1 and warm < total and r != p - 1:
            extra.append(("OutG", bchunk(0)))
            locals_["og"] = None
            snap(f"P{k}", -1, extra)
            locals_["og"] = ("OutG", bchunk(0))
        else:
            snap(f"P{k}", -1, extra)
        if rp:
            ahead[cp] += 1
    for k in range(total - warm):
        out = forward(warm + k)
        cb = bchunk(k)
        grad = None if first(cb) else ("InG", cb)
        snap(f"B{k}", cb, [out, grad])
        held[cb] -= 1
        locals_["ig"] = grad
        rp, cp = recv(warm + k, True)
        rn, cn = recv(k, False)
        rp = rp and k != total - warm - 1
        snap(f"P{k}", -1, [out, ("In", cp) if rp else None, ("OutG", cn) if rn else None])
        if rp:
            ahead[cp] += 1
        locals_["og"] = ("OutG", cn) if rn else None
    for k in range(total - warm, total):
        cb = bchunk(k)
        grad = None if first(cb) else ("InG", cb)
        snap(f"B{k}", cb, [grad])
        held[cb] -= 1
        locals_["ig"] = grad
        rn, cn = recv(k, False)
        rn = rn and k != total - 1
        snap(f"P{k}", -1, [("OutG", cn) if rn else None])
        locals_["og"] = ("OutG", cn) if rn else None
    return moments


def check_against_solver(m: int, p: int, v: int, r: int) -> None:
    """The replay's F and B moments hold what ``schedule.running_moments`` says."""
    ours = [(h, c) for label, h, c, _ in replay(m, p, v, r) if label[0] in "FB"]
    theirs = [(h, c) for h, _, c in running_moments(m, p, v, r, p) if c >= 0]
    assert ours == theirs, (m, p, v, r)


def main(argv: list[str]) -> None:
    m, p, v = map(int, argv[:3])
    for r in range(p):
        check_against_solver(m, p, v, r)
        charged = sum(int(not (r == 0 and c == 0)) + int(not (r == p - 1 and c == v - 1))
                      for c in range(v))
        print(f"rank {r}: the model charges {charged} boundary tensors at every moment")
        for label, held, running, tensors in replay(m, p, v, r):
            print(f"  {label:5s} held {held} running {running:2d} {len(tensors)} {tensors}")


if __name__ == "__main__":
    main(sys.argv[1:])
