"""tests/thirdparty/hf_tp_train.py with one upstream transformers fix undone (transformers_reverts.py).

    torchrun --nproc-per-node 2 tests/real_bugs/transformers_patched.py REVERT --arch qwen3_moe --tp 2 --ep 2 ...

REVERT names an entry of transformers_reverts.REVERTS; the remaining arguments are hf_tp_train.py's.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "thirdparty")]  # the reverts, and hf_tp_train.py (with hf_bugs.py)

from transformers_reverts import REVERTS  # noqa: E402

if __name__ == "__main__":
    REVERTS[sys.argv.pop(1)]()
    import hf_tp_train  # noqa: E402

    hf_tp_train.main()
