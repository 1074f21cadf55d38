"""torchtitan's own configurations, made runnable on CPU, for tracing torchtitan's Trainer with ttrace.

`--module ttrace_examples.torchtitan --config llama3_debugmodel` (torchtitan's CLI loads
`ttrace_examples.torchtitan.config_registry`): see config_registry.py and docs/torchtitan.md.
"""
