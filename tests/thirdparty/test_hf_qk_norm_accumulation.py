"""transformers 5.24's q_norm / k_norm gradients under TP2 and gradient accumulation (docs/findings.md):
the minimal reproduction, which needs no ttrace, still shows the bug with the pinned transformers, and
the candidate fix (reduce each backward's own gradient) removes it. When an upgrade fixes it, the first
test fails: update docs/findings.md and docs/transformers.md, which lean on it."""

import os
import subprocess
from pathlib import Path

import pytest

import transformers  # noqa: F401 - imported, never skipped: requirements.txt pins it

pytestmark = pytest.mark.slow  # transformers on 2 torchrun ranks
SCRIPT = Path(__file__).parent / "hf_qk_norm_accumulation.py"


def _run(tmp_path: Path, *flags: str) -> str:
    done = subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "2", str(SCRIPT), "--models",
                           str(tmp_path / "models"), *flags], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "self_attn.q_norm.weight: accumulated vs one pass" in done.stdout, done.stdout
    return done.stdout


@pytest.mark.parametrize("flags, verdict", [((), "BUG REPRODUCED"), (("--patched",), "NOT REPRODUCED")],
                         ids=["as-shipped", "candidate-fix"])
def test_accumulated_qk_norm_gradients(tmp_path, flags, verdict):
    assert verdict in _run(tmp_path, *flags).splitlines()
