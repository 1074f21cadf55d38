"""The workload of benchmarks/recording_faults.py: record STEPS steps of the example GPT on one rank
into OUT, printing "step K done" once step K's file is complete.

    python benchmarks/record_steps.py OUT STEPS
"""

import signal
import sys

from ttrace_examples.torch_gpt.single_rank import record_single_rank

if __name__ == "__main__":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past a file-size limit a write fails (EFBIG) instead of killing
    record_single_rank(sys.argv[1], int(sys.argv[2]), after_step=lambda step: print(f"step {step} done", flush=True))
