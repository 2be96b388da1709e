"""What megatron-core's own (non-TransformerEngine) ``DotProductAttention`` holds beyond the
profile (``--runtime megatron``, layers with ``attention_score_bytes`` S_l > 0: explicit
attention; fused/flash attention has none and nothing changes).

The profile runs the zoo's explicit attention (``models.common.explicit_attention``: q k^T,
out-of-place masked_fill, softmax, @ v). megatron-core 0.16.1 (``transformer/
dot_product_attention.py``, ``fusions/fused_softmax.py``'s torch path, which runs wherever the
fused CUDA kernel does not: fp32, or any dtype without ``--masked-softmax-fusion``) differs in
two places, each measured by tagging the live storages at every rank's peak on the megatron
engine (gpt-tiny h 64, 4 heads, s 256, V 4096, fp32, b 2, pp 2, Megatron's DDP):

- **The score buffer**: ``torch.baddbmm(buffer, q, k^T, beta=0)`` takes its ``input`` from
  ``get_global_memory_buffer().get_tensor([b a/t, s, s], dtype, "mpu")``, allocated at the first
  forward and kept for the run (grown to the largest request): b S_l / t bytes per GPU for the
  rank's largest S_l (2 MiB measured, "other", at every rank's peak). Under sequence
  parallelism the column-parallel linears' all-gather takes the same ("mpu", dtype) tensor: one
  buffer, the larger of the two (``megatron_linear.sp_gather_buffer_bytes``).
- **The attention's backward**: ``attention_mask_func`` masks in place
  (``scores.masked_fill_``) on a view of the baddbmm output, so autograd's ``CopySlices`` runs
  its backward: it clones the incoming gradient and the view's slice before masked_fill's own
  backward makes its output. The probabilities are freed by then, and 4 score-sized tensors
  are live: one score matrix more than the zoo's out-of-place mask holds at its backward's
  peak (measured to the byte on a single attention call, 4 x 2 MiB at the first stage's peak).
  The profile's backward-only transient B_l (``attention_backward_transient_bytes``) already
  deducts what the layer has released by then (the MLP's saved tensors, the attention's
  output: +3.1 to +5.4% over per stage when the whole transient took their place); the zoo's
  whole transient T_l bounds Megatron's forward (its in-place mask makes one copy fewer).

- **The output gradient**: beside them Megatron's backward still holds the layer's output
  gradient [s, b, h] (tagged at rank 0's peak, gpt-tiny s 256 and s 512, b 2, pp 3 and 4: the
  4 score tensors, the [s, b, h] gradient the schedule's ``custom_backward`` passed in and the
  context's [b a, s, d] gradient, one [s, b, h] more than b B_l + the clone). The profile's
  batch-independent part of B_l (``unbatched_attention_backward_transient_bytes``, two
  [s, h] tensors the zoo's backward holds at batch 1 but not twice at batch 2) is not
  Megatron's: its moment takes b B_l, the line's b (B - F) + F 131,072 B (s 256) and
  262,144 B (s 512) under it.

Per GPU, micro-batch b, t tensor-parallel ranks (the score matrix is [b a/t, s, s], whole
sequence also under SP: the attention runs after the all-gather):

    score_buffer = max_l ceil(b S_l / t)              kept for the run, joins trans_l
    trans_l      = max(b T_l, b B_l + ceil(b S_l / t) + ceil(b O_l / t))
                                                    where S_l > 0 (B_l = T_l if absent; O_l
                                                    the output bytes, / t with SP only)

The buffer is allocated at a rank's first attention forward: layers before the model's first
attention layer are charged without it where that is never low (``kept_buffer_bytes``: an
embedding-only first stage measured +140.6% with it, +3.7% without). docs/cost-model.md,
"Megatron's explicit attention".
"""

from __future__ import annotations

import numpy as np

from solver.costs.units import ceil_div
from solver.specs import ParallelConfig


def score_bytes(cols: dict[str, np.ndarray], config: ParallelConfig) -> np.ndarray:
    """Per layer, bytes per GPU of one micro-batch's [b a/t, s, s] attention scores (0 without
    explicit attention), / c with context parallelism."""
    return ceil_div(config.micro_batch * cols["attention_score_bytes"], config.tp * config.cp)


def backward_held_bytes(cols: dict[str, np.ndarray], config: ParallelConfig) -> np.ndarray:
    """Per layer, the bytes per GPU Megatron's attention backward holds beyond the profile's
    b B_l (module docstring): the mask's clone, one micro-batch's scores, and the layer's
    output gradient, [s, b, h] (/ t c with SP and CP); 0 without explicit attention."""
    scores = score_bytes(cols, config)
    output = ceil_div(config.micro_batch * cols["output_bytes"], config.dims.sequence_split)
    return np.where(scores > 0, scores + output, 0)


def score_buffer_bytes(cols: dict[str, np.ndarray], config: ParallelConfig) -> int:
    """Bytes per GPU of the global memory buffer ``DotProductAttention`` passes to baddbmm:
    the largest layer's scores (module docstring); 0 without explicit attention."""
    return int(score_bytes(cols, config).max(initial=0))


def kept_buffer_bytes(
    running: tuple[np.ndarray, ...], scores: np.ndarray, sp_buffer: int, score_buffer: int
) -> np.ndarray:
    """Per layer, the "mpu" buffer bytes per GPU kept beside its moments (the larger of the
    score buffer and SP's all-gather buffer, ``sp_buffer``), given each layer's ``running``
    transient in each recompute state (bytes, without the buffer) and its ``scores`` (> 0:
    explicit attention).

    The score buffer exists on a rank once one of its attention layers has run. A layer before
    the model's first attention layer (the embedding) shares its stage only with later layers
    (a rank without attention keeps no score buffer: an embedding-only first stage), so where
    its running transient is at most every attention layer's, in both states, a stage holding
    both peaks at the attention layer's moment, which counts the buffer: the layer is charged
    ``sp_buffer`` alone, exact alone on its rank and never under beside attention."""
    kept = np.full(len(scores), max(sp_buffer, score_buffer), dtype=np.int64)
    attention = scores > 0
    if score_buffer <= sp_buffer or not attention.any():
        return kept
    least = min(int(state[attention].min()) for state in running)
    leading = np.arange(len(scores)) < int(np.argmax(attention))
    for state in running:
        leading &= state <= least
    kept[leading] = sp_buffer
    return kept
