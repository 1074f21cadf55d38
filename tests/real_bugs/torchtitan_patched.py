"""torchtitan's Trainer with one upstream fix undone (torchtitan_reverts.py), traced by the ttrace launcher.

    torchrun --nproc-per-node 2 tests/real_bugs/torchtitan_patched.py [--setup NAME] REVERT --module ttrace_examples.torchtitan ...

REVERT names an entry of torchtitan_reverts.REVERTS ("none" for a reference that needs a setup); a setup
(torchtitan_reverts.SETUPS) is applied first, in both runs of a case; the remaining arguments are
torchtitan's own CLI.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # torchtitan_reverts, beside this script

from ttrace_examples.torchtitan import launcher  # noqa: E402

from torchtitan_reverts import REVERTS, SETUPS  # noqa: E402

if __name__ == "__main__":
    setup = None
    if sys.argv[1] == "--setup":
        setup = sys.argv.pop(2)
        del sys.argv[1]
    revert = sys.argv.pop(1)
    launcher.use_cpu_without_accelerator()
    if setup:
        SETUPS[setup]()
    REVERTS[revert]()
    launcher.main()
