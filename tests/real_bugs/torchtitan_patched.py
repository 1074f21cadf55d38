"""torchtitan's Trainer with one upstream fix undone (torchtitan_reverts.py), traced by the ttrace launcher.

    torchrun --nproc-per-node 2 tests/real_bugs/torchtitan_patched.py REVERT --module ttrace_examples.torchtitan ...

REVERT names an entry of torchtitan_reverts.REVERTS; the remaining arguments are torchtitan's own CLI.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # torchtitan_reverts, beside this script

from ttrace_examples.torchtitan import launcher  # noqa: E402

from torchtitan_reverts import REVERTS  # noqa: E402

if __name__ == "__main__":
    revert = sys.argv.pop(1)
    launcher.use_cpu_without_accelerator()
    REVERTS[revert]()
    launcher.main()
