"""Profiling: PyTorch model -> layer graph (docs/profiling.md).

    python -m profiling.export gpt3-175b --out graph.json        # fake tensors, any size
    from profiling.trace.profile import profile_module                  # any nn.Module

Modules: ``profile`` (one traced forward + backward), ``dataflow`` (storage provenance, live
memory), ``tensor_parallel`` (Megatron split rule), ``timing`` (real-mode per-layer times),
``graph_builder`` (trace -> LayerGraph), ``layers`` (default layer granularity), ``hf``
(transformers models from bundled configs), ``export`` (the CLI), ``_torch_compat`` (every private
torch API used, with its canary in tests/test_torch_compat.py).
"""
