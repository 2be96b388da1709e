"""Profiling: PyTorch model -> layer graph (issue 3)."""
