"""Helpers the tests share, and that benchmarks import to build the same inputs."""
