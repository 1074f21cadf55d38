"""Example workloads that `ttrace example` records: real PyTorch distributed training on CPU."""
