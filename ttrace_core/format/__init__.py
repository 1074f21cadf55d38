"""Stage 0, the trace format: schema, typed records, the reader and writer of step files, containment.

Imports nothing of ttrace but `ttrace_core.errors`.
"""
