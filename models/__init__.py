"""Model zoo: PyTorch definitions and presets (issue 3)."""
