"""Stage 1, record: the tracer, the session a training script attaches, the weight generator, the writer thread and the rank launcher.

Imports `format`, `canonicalize` and `integrations`.
"""
