"""A small GPT in plain PyTorch, runnable as the single-device reference or under TP, TP+SP, DDP,
FSDP2 and pipelining on CPU ranks (gloo)."""
