"""Adapters that turn framework knowledge (DTensor, Megatron) into ttrace layout metadata."""
