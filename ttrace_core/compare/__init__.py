"""Stage 3, compare: result types and their codec, tolerances, the estimate file, metrics, evidence, the engine, the table.

Imports `format` and `canonicalize`.
"""
