"""The `ttrace` command line, on top of `ttrace_core.api` and the workflows.
"""
