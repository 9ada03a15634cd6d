"""DistributedDataParallel: gradient buckets reduced during backward."""
