"""The `ttrace` command line, on top of `ttrace_core.api` alone: it imports nothing else of the core
(tests/core/test_import_layers.py), so the terminal and the dashboard judge through the same calls.
"""
