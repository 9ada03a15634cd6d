"""Parallel wrappers: DDP and the distributed sampler."""
