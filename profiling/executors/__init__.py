"""Running a plan for real: one process per rank on torch.distributed (torch pipelining on zoo
models, traced HF and factory models, megatron-core)."""
