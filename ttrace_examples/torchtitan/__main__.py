"""`python -m ttrace_examples.torchtitan ARGS`: torchtitan's Trainer, traced under a ttrace command (launcher.py)."""

from ttrace_examples.torchtitan.launcher import main

main()
