"""Tensor parallelism over torch.distributed: the rank group, Megatron sharding, worker processes."""
