"""The one place the profiler reaches into ``transformers`` internals (checked on 5.24.0).

Under ``FakeTensorMode`` transformers takes every fake tensor for a traced graph
(``transformers.utils.import_utils.is_tracing``) and skips the data-dependent shortcuts of its
mask code. One of them changes what a training step holds:
``masking_utils.find_packed_sequence_indices`` returns None on a real run when each row of
``position_ids`` is one sequence (the model's own ``arange`` positions), so the causal mask is
skipped and SDPA runs with ``is_causal=True``; on fake tensors it returns the packed-sequence
ids, the mask is materialised (``b x 1 x s x s``), SDPA gets it as ``attn_mask`` and, on a
grouped-query model (Llama), ``repeat_kv`` copies K and V to every head because
``use_gqa_in_sdpa`` refuses a mask. Measured on a tiny Llama (bf16, batch 2, seq 16): 5,120
bytes per block more under fake tensors than in the real run.

:func:`real_run_masks` makes the fake run take the real run's answer; the profiler enters it for
fake runs only. The ``hf:`` example inputs never pass ``position_ids`` (the model makes its own
``arange``), so "no packed sequences" is what the real run finds; a model fed packed
``position_ids`` of its own must be profiled with real tensors (``--device cpu``). A transformers
release that moves the function only loses the fix (the fake profile then keeps the mask, as
before); ``tests/test_profile_hf.py`` compares fake and real profiles of HF models and fails then.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator

CHECKED_ON = "5.24.0"
"""The transformers version the patched function was checked against."""


@contextlib.contextmanager
def real_run_masks() -> Iterator[None]:
    """Within it (a fake run), ``find_packed_sequence_indices`` answers what a real run answers for
    the model's own positions: None, one sequence per row. Nothing happens when transformers was
    not imported or has no such function."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        return None

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original
