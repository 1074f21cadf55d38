"""A rank SIGKILLed in the middle of a TP 2 recording (tests/faults/rank_faults.py, one fixed
kill point): the launcher stops (no hang) naming it, no finished step is lost, every file a rank
completed is bitwise the uninterrupted run's, and the trace names the dead rank while the survivor
says what stopped it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.faults import rank_faults


pytestmark = pytest.mark.distributed
STEPS = 3
SMALL = ("--num-layers", "2", "--d-model", "64", "--seq-len", "16")


def _when_both_ranks_are_in_step_1(out: Path, pids: list[int]) -> str:
    deadline = time.monotonic() + 120
    while not all((out / f"rank_{rank:05d}.step_000001.h5.partial").exists() for rank in range(2)):
        assert time.monotonic() < deadline, "the ranks never began step 1"
        time.sleep(0.01)
    return "both ranks in step 1"


def test_a_rank_killed_mid_step_is_named_and_the_others_files_stay_consistent(tmp_path):
    pristine = tmp_path / "pristine"
    launcher = rank_faults.launch(pristine, STEPS, *SMALL)
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, stderr

    trial = rank_faults.kill_one_rank(tmp_path / "killed", pristine, STEPS, victim=1,
                                      wait_for_kill=_when_both_ranks_are_in_step_1, flags=SMALL)

    assert not trial.hang  # stopped within rank_faults.STOP_LIMIT_S; how fast is benchmarks/recording_faults.py's
    assert "rank 1 was killed by SIGKILL; the other ranks were stopped" in trial.error_line
    assert not trial.unreadable and trial.done_before == [0] and trial.complete == [0] and not trial.lost
    assert not trial.inconsistent_files
    assert list(trial.partial) == [1] and trial.flagged == {1} and trial.named and not trial.survivors_blamed
    assert "rank 1 left no word: killed, or its machine died" in trial.partial[1]
    assert "rank 0 stopped on " in trial.partial[1]  # gloo's closed connection, or the launcher's SIGTERM
