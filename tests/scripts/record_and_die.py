"""Record the example GPT on one rank and SIGKILL this process in the middle of step 1.

Used by the test that a killed recording keeps its completed steps readable.
"""

import os
import signal
import sys

from ttrace_examples.torch_gpt.single_rank import record_single_rank


def die_on_second_call():
    """A forward hook that kills the process while layer 2 of the second micro-batch runs."""
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def kill_during_step_1(step, model):
    if step == 1:
        model.layers["2"].register_forward_hook(die_on_second_call())


if __name__ == "__main__":
    record_single_rank(sys.argv[1], 2, before_step=kill_during_step_1)
