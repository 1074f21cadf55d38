"""Stage 2, canonicalize: placements, and shards mapped back to their logical tensor.

Imports `format` only.
"""
