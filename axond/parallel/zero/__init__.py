"""ZeRO-1: optimizer state sharded over the ranks (`ZeroRedundancyOptimizer`)."""

from axond.parallel.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
