"""Profiling an nn.Module into a layer graph under fake tensors (or for real): one forward +
backward seen op by op, per-layer costs per sample."""
