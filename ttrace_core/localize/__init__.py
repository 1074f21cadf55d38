"""Stage 4, localize: verdicts per module from a replay's comparison, and the reproduction check.

Imports `compare` and below.
"""
