"""Batch-independent bytes: what a micro-batch of b holds of a per-sample figure X whose part F
does not grow with the batch (the layer graph's ``unbatched_*`` fields,
``solver.graph_fields.UNBATCHED_FIELDS``; measured by ``profiling.trace.batch_line`` from
profiles at batch 1 and 2).

  X_b = b (X - F) + F = b X - (b - 1) F                 exact at b = 1 and b = 2

F > 0: tensors the batch shares (a causal mask, a position index, rotary cos/sin tables, a
position embedding's gradient summed over the batch), which b X counted b times. F < 0: batch 2
held more than twice batch 1 (a copy batch 1 skips, its tensor already contiguous): the line
is then above b X at every b >= 1, never below the batch-1 figure times b. F is taken at most
X (the figure as the cost model splits it): the batch's part never goes negative, X_b >= X.

Saved bytes (``saved_bytes_times_t``): F belongs to the part tensor parallelism leaves whole on
every rank (the mask, the position index and the rotary tables are built whole on every TP
rank, also under sequence parallelism), so per GPU and micro-batch

  stored_l = ceil((b (t A'_l - u F) + t F) / (t c))      u = t without SP (A'_l counts F
                                                          whole), 1 with SP (A'_l = A_l / t)

with F at most the dense replicated part (A_l - tp_A_l - expert_A_l; A_l - expert_A_l under SP);
a negative F (a copy batch 1 skips) under SP is split like the rest: + (b - 1) |F|.
A graph without the fields has F = 0 everywhere: every term is b X, as before.
docs/cost-model.md, "Batch-independent bytes".
"""

from __future__ import annotations

import numpy as np

from solver.graph_fields import UNBATCHED_FIELDS


def unbatched_column(cols: dict[str, np.ndarray], figure: str) -> np.ndarray:
    """F per layer for the graph figure ``figure`` (0 where the graph has none)."""
    key = next(key for key, name in UNBATCHED_FIELDS.items() if name == figure)
    return cols[key]


def batch_bytes(per_sample: np.ndarray, fixed: np.ndarray, micro_batch: int) -> np.ndarray:
    """b X - (b - 1) min(F, X): a micro-batch's bytes of the per-sample figure X whose part F
    does not grow with the batch (module docstring), before any division by c."""
    fixed = np.minimum(fixed, per_sample)
    return micro_batch * per_sample - (micro_batch - 1) * fixed


def saved_bytes_times_t(
    cols: dict[str, np.ndarray], saved_times_t: np.ndarray, tp: int, sp: bool, micro_batch: int
) -> np.ndarray:
    """t times a micro-batch's saved bytes per GPU (before the division by t c): b t A'_l less
    (b - 1) copies of the batch-independent part, which stays whole on every TP rank (module
    docstring). ``saved_times_t``: t A'_l per sample."""
    fixed = unbatched_column(cols, "activation_bytes")
    dense = cols["activation_bytes"] - cols["expert_activation_bytes"]
    if sp:
        # a shared tensor whole on every rank; a copy batch 1 skips (F < 0) split like the rest
        shared = np.clip(fixed, 0, dense)
        skipped = np.minimum(fixed, 0)
        return micro_batch * (saved_times_t - shared) + tp * shared - (micro_batch - 1) * skipped
    fixed = np.minimum(fixed, dense - cols["tp_activation_bytes"])
    return micro_batch * saved_times_t - (micro_batch - 1) * tp * fixed
