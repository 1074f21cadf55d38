"""The workload of benchmarks/recording_faults.py: record STEPS steps of the example GPT on one rank
into OUT, printing "step K done" once step K's file is complete.

    python benchmarks/record_steps.py OUT STEPS
"""

import signal
import sys
from pathlib import Path

from ttrace_core.format.reader import step_file_name
from ttrace_examples.torch_gpt.single_rank import record_single_rank


def _report_complete(out: str, step: int) -> None:
    """A full disk stops the recording, not the training: a step the run went through is done only with its file."""
    if (Path(out) / step_file_name(0, step)).exists():
        print(f"step {step} done", flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past a file-size limit a write fails (EFBIG) instead of killing
    record_single_rank(sys.argv[1], int(sys.argv[2]), after_step=lambda step: _report_complete(sys.argv[1], step))
