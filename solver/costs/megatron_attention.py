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
  backward makes its output. With the probabilities already freed, 4 score-sized tensors are
  live at that moment, where the zoo's out-of-place masked_fill holds 2 beside the saved
  probabilities: b S_l / t bytes per micro-batch more than the profiled transient (measured
  to the byte on a single attention call, and 4 x 2 MiB at the first stage's peak).

Per GPU, micro-batch b, t tensor-parallel ranks (the score matrix is [b a/t, s, s], whole
sequence also under SP: the attention runs after the all-gather):

    score_buffer     = max_l ceil(b S_l / t)           kept for the run, joins every trans_l
    trans_l         += ceil(b S_l / t)                 the CopySlices clone at the mask's backward

The second term is added to the layer's whole transient: where the layer's profiled peak is
not its attention's backward (a short sequence) the sum is high, never low. docs/cost-model.md,
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


def score_buffer_bytes(cols: dict[str, np.ndarray], config: ParallelConfig) -> int:
    """Bytes per GPU of the global memory buffer ``DotProductAttention`` passes to baddbmm:
    the largest layer's scores (module docstring); 0 without explicit attention."""
    return int(score_bytes(cols, config).max(initial=0))
