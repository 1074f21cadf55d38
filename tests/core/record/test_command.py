"""`run_session` (record/command.py) tells a command killed from outside from one that failed: a relaunch
(`ttrace localize`) must stop on a fault, never fall back to another replay as if the module could not run alone."""

import sys

import pytest

from ttrace_core.errors import LaunchError
from ttrace_core.record.command import RANK_KILLED_EXIT, run_session
from ttrace_core.record.session import SessionSpec


@pytest.mark.parametrize(("script", "killed"), [
    ("raise SystemExit(1)", False),                                     # the run's own failure
    (f"raise SystemExit({RANK_KILLED_EXIT})", True),                    # a rank killed (the examples' exit code)
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", True),  # the command itself killed
], ids=["failed", "rank-killed", "command-killed"])
def test_a_command_killed_from_outside_is_a_fault(tmp_path, script, killed):
    spec = SessionSpec(out=str(tmp_path / "run"), launcher_pid=0, command=[sys.executable, "-c", script],
                       cwd=str(tmp_path))
    with pytest.raises(LaunchError) as raised:
        run_session(spec, timeout_s=60)
    assert raised.value.killed_by_signal is killed
