import shutil

import pytest

from tests.synthetic_runs import write_pair
from ttrace_core.compare.engine import RunComparison, TensorComparison, compare_runs
from ttrace_core.format.schema import TensorKey
from ttrace_core.format.fingerprint import environment_fingerprint, fingerprint_differences
from ttrace_core.localize.reproduction import check_reproduction, reproducible_keys
from ttrace_core.format.reader import RunReader


@pytest.fixture
def runs(tmp_path):
    reference, candidate = write_pair(tmp_path)
    with RunReader(reference) as ref, RunReader(candidate) as cand:
        original = compare_runs(ref, cand)
    return reference, candidate, original


def _compared(fqn: str, slot: str, *, exact: bool, phase: str = "forward", micro_batch: int = 0) -> TensorComparison:
    key = TensorKey(step=0, micro_batch=micro_batch, phase=phase, fqn=fqn, slot=slot)
    return TensorComparison(key=key, status="pass", abs_error=0.0 if exact else 1e-9, error=0.0, ratio=0.0)


def test_only_tensors_whose_sources_were_exact_are_reproducible():
    original = RunComparison(reference="r", candidate="c", comparisons=[
        _compared("a", "input.0", exact=True), _compared("a", "output.0", exact=False),
        _compared("b", "input.0", exact=False), _compared("b", "output.0", exact=False),
        _compared("a", "grad_output.0", exact=True, phase="backward"),
        _compared("a", "grad_input.0", exact=False, phase="backward"),
        _compared("b", "grad_output.0", exact=True, phase="backward"),
        _compared("b", "grad_input.0", exact=False, phase="backward"),
    ])
    keys = [(k.phase, k.fqn, k.slot) for k in reproducible_keys(original, 0)]
    assert keys == [("forward", "a", "output.0"), ("backward", "a", "grad_input.0")]
    assert reproducible_keys(original, 1) == []


def _copy_with(candidate, tmp_path, change=None):
    replay = tmp_path / "replay"
    shutil.copytree(candidate, replay)
    if change:
        change(replay)
    return replay


def _replayed(original, candidate, tmp_path, moved: TensorKey | None = None):
    """check_reproduction of a copy of the candidate as its replay; `moved`: that tensor's first element on
    rank 1 is 1.0 off in the copy."""
    def move(replay_dir):
        import h5py

        from tests.faults.meta_rows import tensor_values, write_tensor_values
        name = f"forward/mb_{moved.micro_batch:04d}/{moved.fqn}#{moved.slot}"
        with h5py.File(replay_dir / "rank_00001.step_000000.h5", "r+") as handle:
            values = tensor_values(handle, name).copy()
            values[0, 0] += 1.0
            write_tensor_values(handle, name, values)

    shutil.rmtree(tmp_path / "replay", ignore_errors=True)
    with RunReader(candidate) as cand, RunReader(_copy_with(candidate, tmp_path, move if moved else None)) as replay:
        return check_reproduction(original, cand, replay, 0)


def test_a_faithful_replay_reproduces_and_a_changed_one_does_not(runs, tmp_path, monkeypatch):
    reference, candidate, original = runs
    exact_key = next(c.key for c in original.comparisons if c.passed and c.key.phase == "forward")
    monkeypatch.setattr("ttrace_core.localize.reproduction.reproducible_keys", lambda original, step: [exact_key])
    same = _replayed(original, candidate, tmp_path)
    assert same.reproduced is True and same.num_checked == 1 and same.mismatches == []
    changed = _replayed(original, candidate, tmp_path, moved=exact_key)
    assert changed.reproduced is False and str(exact_key) in changed.mismatches[0]


def test_fingerprint_differences_name_what_changed():
    recorded = environment_fingerprint(2)
    now = {**recorded, "packages": {**recorded["packages"], "torch": "9.9"},
           "variables": {**recorded["variables"], "OMP_NUM_THREADS": "8", "TTRACE_REWRITE_FROM": "/ref"}}
    assert fingerprint_differences(recorded, now) == [f"torch: {recorded['packages']['torch']} -> 9.9",
                                                      f"OMP_NUM_THREADS: {recorded['variables']['OMP_NUM_THREADS']} -> 8"]
    assert fingerprint_differences(recorded, recorded) == []
    assert "no environment fingerprint" in fingerprint_differences({}, recorded)[0]


def test_a_replay_whose_replicas_drift_as_the_candidates_did_reproduces_it(runs, tmp_path, monkeypatch):
    """The candidate's replicas of layers.1.norm disagree (rank 1 off by 1e-3: an unreduced gradient is the
    same case); a replay that computes the same disagreement reproduces it. One that moves a copy does not."""
    reference, candidate, original = runs
    drift = next(c.key for c in original.comparisons if c.status == "replica_drift" and c.key.micro_batch == 0)
    monkeypatch.setattr("ttrace_core.localize.reproduction.reproducible_keys", lambda original, step: [drift])
    assert _replayed(original, candidate, tmp_path).reproduced is True
    moved = _replayed(original, candidate, tmp_path, moved=drift)
    assert moved.reproduced is False and "replica_drift" in moved.mismatches[0]
