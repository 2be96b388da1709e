"""The boundary tensors megatron-core's interleaved 1F1B keeps alive at each moment of a rank's
schedule (v > 1; ``LayerCosts.moment_copies``), replayed from megatron-core 0.16's
``forward_backward_pipelining_with_interleaving`` without p2p overlap (its default):

- warm-up, after forward k: ``send_forward_recv_forward`` sends the output (Out of k's chunk)
  and receives the input of forward k + 1 (In of its chunk); the last warm-up step also
  receives the output gradient of backward 0;
- steady step k: ``forward_backward_helper_wrapper`` runs forward W + k, then backward k, while
  the outer locals still hold the previous step's input gradient (InG, an In-sized tensor of
  backward k - 1's chunk) and the received output gradient (OutG, Out-sized, of backward k's
  chunk, which consumes it); the forward's output lives until the p2p after the helper;
  backward k makes its own InG. Then ``send_forward_backward_recv_forward_backward`` receives
  the next input (In of forward W + k + 1's chunk) and the next output gradient (OutG of
  backward k + 1's chunk) while the Out and the InG being sent and the consumed OutG (still the
  outer ``output_tensor_grad``) are alive: 5 boundary tensors after a backward, 4 during it;
- cool-down step k: backward k, then ``send_backward_recv_backward`` (its InG sent, the next
  OutG received into the same local).

Received inputs not yet forwarded count here (In); those of in-flight micro-batches are their
stage inputs, in the activations. Each chunk's model also keeps the input of its last forward
(``forward_step``'s ``set_input_tensor``: ``TransformerBlock.input_tensor``) until its next
forward: once a chunk holds no micro-batch that stale input is one more In of it (the tagged
peak of ``mcore pp4 v2 m8`` rank 2: during a backward of chunk 0, 7 micro-batches held, chunk 1
none, 8 inputs alive, + 1 output, 1 received gradient, 2 input gradients). Without ``deallocate_pipeline_outputs`` the outputs of the
held micro-batches stay alive until their backward (Out = held, on a non-last virtual stage).
Tagged at the peak of ``mcore pp4 v2 m8`` rank 2 (benchmarks/bench_accuracy.md, issue 30).
"""

from __future__ import annotations


def megatron_replay(m: int, p: int, v: int, rank: int, group: int | None = None) -> list[tuple]:
    """(kind F, B or P, held per chunk, running chunk (-1 none), boundary tensors (kind, chunk)
    with kind In, InG, Out or OutG) at every moment of rank ``rank``: F while a forward runs
    (its output not yet made), B while a backward runs, P the p2p after a step."""
    g = group or p
    total = m * v
    order = [c for s in range(0, m, g) for c in range(v) for _ in range(min(g, m - s))]
    warm = min(total, (v - 1) * g + 2 * (p - 1 - rank))
    first = (rank == 0, 0)
    last = (rank == p - 1, v - 1)

    def edge(c: int, end: tuple[bool, int]) -> bool:
        return end[0] and c == end[1]

    backward_order = [v - 1 - c for c in order]

    def recv(k: int, forward: bool) -> int | None:  # recv_tensor_from_previous_stage(k)
        leading = rank == (0 if forward else p - 1)
        chunk = order if forward else backward_order
        if not leading:
            return chunk[k + 1] if k + 1 < total else None
        if k < p - 1 or chunk[k - (p - 1)] == (v - 1 if forward else 0):
            return None
        return chunk[k - (p - 1)] + (1 if forward else -1)

    held, ahead, live = [0] * v, [0] * v, {"og": None, "ig": None}
    forwarded = [0] * v
    moments: list[tuple] = []

    def snap(kind: str, running: int, extra: list) -> None:
        tensors = [("In", c) for c in range(v) for _ in range(ahead[c])]
        tensors += [  # the model's last input (set_input_tensor) once nothing is held
            ("In", c) for c in range(v) if forwarded[c] and not held[c] and not edge(c, first)
        ]
        tensors += [t for t in (*live.values(), *extra) if t]
        moments.append((kind, tuple(held), running, tuple(sorted(tensors))))

    def forward(k: int):
        c = order[k]
        if not edge(c, first):
            ahead[c] -= 1
        held[c] += 1
        forwarded[c] += 1
        snap("F", c, [])
        return None if edge(c, last) else ("Out", c)

    def backward(k: int, extra: list):
        c = v - 1 - order[k]
        grad = None if edge(c, first) else ("InG", c)
        snap("B", c, [*extra, grad])
        held[c] -= 1
        live["ig"] = grad

    ahead[0] += int(not edge(0, first))
    for k in range(warm):
        out = forward(k)
        nxt = recv(k, True) if k != total - 1 else None
        grad = None
        if k == warm - 1 and warm < total and rank != p - 1:
            grad = ("OutG", v - 1 - order[0])
        snap("P", -1, [out, None if nxt is None else ("In", nxt), grad])
        ahead[nxt if nxt is not None else 0] += int(nxt is not None)
        live["og"] = grad or live["og"]
    steady = total - warm
    for k in range(steady):
        out = forward(warm + k)
        backward(k, [out])
        nxt = recv(warm + k, True) if k != steady - 1 else None
        grad = recv(k, False)
        grad = None if grad is None else ("OutG", grad)
        snap("P", -1, [out, None if nxt is None else ("In", nxt), grad])
        ahead[nxt if nxt is not None else 0] += int(nxt is not None)
        live["og"] = grad
    for k in range(steady, total):
        backward(k, [])
        grad = recv(k, False) if k != total - 1 else None
        grad = None if grad is None else ("OutG", grad)
        snap("P", -1, [grad])
        live["og"] = grad
    return moments


def megatron_moment_copies(
    m: int, p: int, v: int, rank: int, group: int | None = None, *, deallocate: bool = True
) -> list[tuple[tuple[int, int], ...]]:
    """Per moment of ``schedule.running_moments`` (same order: a forward's, a backward's and
    the moment after it), the (R_c, S_c) of each chunk c: the In-sized (In, InG) and Out-sized
    (Out, OutG) boundary tensors of ``megatron_replay`` alive then. A forward's moment (its
    last layer) takes the p2p after it in the warm-up, else its own tensors and its output
    (which its last layer's transient may already count: over by one at most)."""
    replay = megatron_replay(m, p, v, rank, group)
    copies = []
    i = 0
    while i < len(replay):
        kind, held, running, tensors = replay[i]
        if kind == "F":
            nxt = replay[i + 1]
            if nxt[0] == "P":  # warm-up: the p2p after it
                tensors = nxt[3]
                i += 1
            elif running != v - 1 or rank != p - 1:
                tensors = (*tensors, ("Out", running))
        copies.append(_counts(tensors, held, v, rank == p - 1, deallocate))
        i += 1
    return copies


def _counts(tensors, held, v: int, last_rank: bool, deallocate: bool):
    receive, send = [0] * v, [0] * v
    for kind, c in tensors:
        if kind in ("In", "InG"):
            receive[c] += 1
        elif kind == "OutG" or deallocate:
            send[c] += 1
    if not deallocate:  # every held micro-batch's output until its backward
        for c in range(v):
            send[c] += 0 if (last_rank and c == v - 1) else held[c]
    return tuple(zip(receive, send, strict=True))


def largest_moment_copies(
    moment_copies: list[list[tuple[tuple[int, int], ...]]], num_ranks: int
) -> tuple[list[int], list[int]]:
    """([R_j], [S_j]): each virtual stage j's (chunk j // p of rank j % p) largest copies over
    its rank's moments (``megatron_moment_copies``), for bounds (``LayerCosts.receive_copies``)."""
    p, v = num_ranks, len(moment_copies[0][0])
    stages = range(p * v)
    receive = [max(at[j // p][0] for at in moment_copies[j % p]) for j in stages]
    send = [max(at[j // p][1] for at in moment_copies[j % p]) for j in stages]
    return receive, send
