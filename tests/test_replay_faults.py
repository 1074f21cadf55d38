"""CI slice of benchmarks/replay_faults.py: a real replay (the Localize page's job) hit by a fault.
A rank of the replay killed mid-run must fail the job: never a verdict from a broken replay, never a
silent fallback to another replay, the lock released, no process left, and asking again gives the
uninterrupted verdict. (tests/core/service/test_jobs.py covers a killed command or supervisor, timeouts,
cancels and hostile job files with small commands.)"""

from __future__ import annotations

import pytest

from tests.faults import replay_faults


EXPECTED = ["decoder.layers.0.self_attention.linear_proj", "decoder.layers.0.mlp.linear_fc2"]


@pytest.mark.distributed
def test_a_replay_whose_rank_is_killed_fails_and_the_next_one_completes(tmp_path):
    pair = replay_faults.copied_pair(tmp_path)
    trial = replay_faults.run_trial("rank crashed", 0.0, pair, EXPECTED)  # ranks forked without imports end in a second
    assert not trial.finished_before_fault and trial.state == "failed", trial
    assert "exit code" in trial.message and not replay_faults.failures(trial), trial
    assert trial.rerun_state == "complete" and trial.rerun_same_verdict
