"""Memory-centric planner: partition and parallelise a layer graph to minimise per-GPU peak memory."""
