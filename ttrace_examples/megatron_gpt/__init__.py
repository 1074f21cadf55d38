"""The megatron-core GPT example workload and its zoo of injectable silent bugs (bugs.py)."""
