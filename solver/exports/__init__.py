"""A plan as the settings of the engines people train with: torch pipelining, Megatron-LM,
DeepSpeed, torchtitan."""
