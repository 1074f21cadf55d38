"""A script that starts its own workers with `torch.multiprocessing.spawn` (tests/user_script/spawn_train.py, the
shape of PyTorch's DDP tutorial), recorded as `ttrace record -- python spawn_train.py 2`: two spawned workers pass
against one, every micro-batch compared; a module wrong on worker 1 fails first there, and `ttrace localize`, which
relaunches the command and so spawns the workers again, names it."""

import json
import sys
from pathlib import Path

import pytest

from tests.cli_support import ttrace_command

SCRIPT = Path(__file__).parent / "user_script" / "spawn_train.py"


def _record(root: Path, name: str, *args: str) -> None:
    done = ttrace_command("record", "--out", name, "--timeout", "240", "--", sys.executable, str(SCRIPT), *args,
                          cwd=root, timeout=300)
    assert done.returncode == 0, f"record {name}: " + done.stdout[-1500:] + done.stderr[-3000:]


@pytest.mark.distributed
def test_spawned_workers_pass_and_a_module_wrong_on_worker_1_is_localized(tmp_path):
    _record(tmp_path, "reference", "1")
    _record(tmp_path, "spawn2", "2")
    _record(tmp_path, "spawn2-bug", "2", "--bug")

    done = ttrace_command("compare", "reference", "spawn2", "--json", "clean.json", cwd=tmp_path, timeout=300)
    rows = json.loads((tmp_path / "clean.json").read_text())["comparisons"]
    assert done.returncode == 0 and {row["status"] for row in rows} == {"pass"}, done.stdout[-3000:]
    assert {(row["key"]["step"], row["key"]["micro_batch"]) for row in rows if row["key"]["phase"] == "forward"} == \
        {(step, micro_batch) for step in (0, 1) for micro_batch in range(4)}
    assert {"grad", "param"} <= {row["key"]["phase"] for row in rows}

    done = ttrace_command("localize", "reference", "spawn2-bug", cwd=tmp_path, timeout=400)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert "culprit: 0  (introduces error in forward)" in done.stdout, done.stdout[-3000:]
    assert "modules: 1 introduce error" in done.stdout, done.stdout[-3000:]
