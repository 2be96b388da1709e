"""What megatron-core's tensor-parallel linears hold beyond the profile (``--runtime megatron``).

The profile runs torch's autograd, whose linear backward makes the weight gradient first and the
input gradient after it. megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication``
(``tensor_parallel/layers.py``) makes the input gradient first, then (with sequence parallelism)
the reduce-scatter output [s/t, b, h], and only then the weight gradient. Two terms follow:

- **The LM head's weight-gradient moment** holds the head's input gradient, b s h d (the
  gradient of the gathered input: full sequence), and with SP the reduce-scatter output
  b s h d / t. The head's V/t x h weight-gradient temporary is the model's largest, so this is
  the moment that counts. In torch's order that input gradient is made right after the weight
  gradient, with everything else still live: the moment the head's transient T counts. So,
  per sample, for a layer with a vocabulary whose input needs a gradient (the head, not the
  embedding):

      G_l -> max(G_l, min(F_l + ceil(k max(V_wg_l, 0) / t), G_l + in_l) + [SP] ceil(in_l / t))

  F_l: the fixed part of the transient at any moment (``fixed_transient_bytes``), V_wg_l the
  vocabulary part at the weight-gradient moments, split as ``vocab`` splits it (k = V_pad / V),
  in_l the bytes per sample of the tensors entering the layer that need a gradient. A graph
  without the parts takes T_l for F_l + V. The second bound of the same moment: torch's own
  weight-gradient moment of the head, at most G_l (the profile's weight-gradient moments, as
  split), with the input gradient Megatron makes before the weight gradient. F_l can be a later
  moment's, after the logits are freed: moe-tiny's RMSNorm head (h 64, s 256, V 2048) has
  F_l = 3 s h d + 4 (its norm's backward), G_l = s h d + 4 and in_l = s h d, so 2 s h d + 4
  instead of 3 (tagged at a last stage's peak, megatron-core 0.16.1, pp 2, b 2: the V x h
  temporary and the input gradient [512, 64] beside the saved softmax; 128 KiB less, the last
  stages +1.0..1.2% -> +0.4..0.5%). Measured (megatron-core 0.16.1, gpt-tiny h 64, s 512,
  V 16384, fp32, pp 2, head-only last stage): the live tensors at the peak are the head's
  weight-gradient temporary, the input gradient [1024, 64] and, with SP, the [256, 2, 64]
  reduce-scatter output; the last stage was predicted 0.32% (tp 1) and 1.51% (pp 2 x tp 2, SP)
  low without them. A block's weight-gradient moments in the profile already hold more than a
  linear's input gradient (its activations' gradients): blocks measure exact, unchanged.

- **The sequence-parallel all-gather buffer**: with SP a column-parallel linear all-gathers its
  input into ``get_global_memory_buffer()``'s "mpu" tensor, kept for the run and grown to the
  largest request: one [s, b, h] per rank (b times the largest gathered input of one linear,
  min(sp_gathered_bytes_l, the largest tensor entering l), over the graph). It joins every
  layer's transient: the stage's largest transient is then at least that moment's (on a stage
  without a column-parallel linear, an embedding alone, the charge is high, never low).

docs/cost-model.md, "Sequence parallelism" and "Transient peak".
"""

from __future__ import annotations

import numpy as np

from solver.costs.units import ceil_div
from solver.costs.vocab import vocab_rows_per_rank
from solver.specs import ParallelConfig


def input_grad_bytes(cols: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sum, largest) bytes per sample of the tensors entering each layer that need a
    gradient (the edges into it with ``requires_grad``)."""
    count = len(cols["params"])
    total = np.zeros(count, dtype=np.int64)
    largest = np.zeros(count, dtype=np.int64)
    needs = cols["edge_requires_grad"]
    np.add.at(total, cols["edge_dst"][needs], cols["edge_bytes"][needs])
    np.maximum.at(largest, cols["edge_dst"][needs], cols["edge_bytes"][needs])
    return total, largest


def head_weight_grad_moment(cols: dict[str, np.ndarray], config: ParallelConfig) -> np.ndarray:
    """Per layer, bytes per sample live beside the weight-gradient temporary on the megatron
    runtime (module docstring): the graph's ``weight_grad_transient_bytes`` (as split), raised
    for an LM head to its input gradient's moment. ``cols``: after ``vocab.with_vocab_split``."""
    beside = cols["weight_grad_transient_bytes"]
    rows = cols["vocab_rows"]
    into, _ = input_grad_bytes(cols)
    heads = (rows > 0) & (into > 0)
    if not heads.any():
        return beside
    t = config.tp
    held_rows = vocab_rows_per_rank(rows, config, "megatron")
    vocab_part = cols["vocab_weight_grad_transient_bytes"]
    split_vocab = ceil_div(np.maximum(vocab_part, 0) * held_rows, np.maximum(rows, 1) * t)
    measured = (cols["fixed_transient_bytes"] >= 0) & (vocab_part >= 0)
    after_weight_grad = np.where(
        measured, cols["fixed_transient_bytes"] + split_vocab, cols["transient_bytes"]
    )
    # the other bound of the same moment: torch's own weight-gradient moment (at most the
    # split weight_grad_transient_bytes) and the input gradient Megatron makes before it
    moment = np.minimum(after_weight_grad, beside + into)
    if config.sp:
        moment = moment + ceil_div(into, t)  # the reduce-scatter output, [s/t, b, h]
    return np.where(heads, np.maximum(beside, moment), beside)


def sp_gather_buffer_bytes(cols: dict[str, np.ndarray], config: ParallelConfig) -> int:
    """Bytes per GPU of megatron-core's all-gather buffer under sequence parallelism: b times
    the largest input one column-parallel linear gathers (module docstring), / c with context
    parallelism; 0 without SP."""
    if not config.sp:
        return 0
    _, largest = input_grad_bytes(cols)
    gathered = np.minimum(cols["sp_gathered_bytes"], largest)
    widest = int(gathered.max(initial=0))
    return int(ceil_div(config.micro_batch * widest, config.cp))
