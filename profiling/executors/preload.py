"""What the ranks' fork server imports once (``profiling.run.RANK_PRELOAD``): torch, the rank
code of both engines and, where it is installed, megatron-core, so that a rank starts with them
loaded instead of importing them itself (4-6 s of CPU per rank on 2 cores).

megatron-core is imported with its warnings that TransformerEngine and apex are missing turned
off, as the megatron ranks do (``megatron_cpu.quiet_fallback_warnings``): the fork server's
stderr is the user's terminal, and a torch-engine run must not print megatron's warnings."""

from __future__ import annotations

import contextlib

import profiling.executors.dispatch  # noqa: F401  (the rank entry point and every executor)
from profiling.executors.megatron_cpu import quiet_fallback_warnings

quiet_fallback_warnings()
with contextlib.suppress(ImportError):
    # what ``megatron_cpu.megatron_on_cpu`` and the model builder import first thing
    import megatron.core.fusions.fused_bias_gelu  # noqa: F401
    import megatron.core.fusions.fused_bias_swiglu  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401
