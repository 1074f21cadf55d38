"""service/replays.py, without spawning a replay: where a replay job lives (a directory keyed by its inputs),
the environment and command it is given, the finished job a second request finds, and how its verdict is read.

tests/core/service/test_jobs.py runs real jobs and tests/test_localize_samples.py real replays; here `submit` is
either replaced by a recorder or handed a job directory written as a finished replay leaves it
(tests/cli_support.write_finished_replay), with process spawning made to fail if it were ever reached."""

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest

from tests.cli_support import localization_for, write_finished_replay
from tests.support.paths import REPO
from tests.synthetic_runs import write_pair
from ttrace_core.compare.settings import CompareSettings
from ttrace_core.errors import TraceFormatError, TtraceError
from ttrace_core.localize.verdicts import Localization
from ttrace_core.record.session import SESSION_ENV
from ttrace_core.service import replays
from ttrace_core.service.comparisons import run_fingerprint, ttrace_version
from ttrace_core.service.jobs import Job, JobSpec


@pytest.fixture
def pair(tmp_path):
    reference, candidate = write_pair(tmp_path / "runs")
    return reference.resolve(), candidate.resolve()


@pytest.fixture
def no_spawning(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was spawned: {args[0] if args else kwargs}")
    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_the_project_root_is_the_repository_jobs_run_from():
    assert replays.project_root() == REPO and (replays.project_root() / "ttrace_core" / "__init__.py").is_file()


def test_a_replay_job_lives_in_the_candidate_under_a_digest_of_its_inputs(pair):
    reference, candidate = pair
    directory = replays.replay_job_dir(reference, candidate, None)
    inputs = {"reference": run_fingerprint(reference), "candidate": run_fingerprint(candidate), "module": None,
              "ttrace": ttrace_version()}  # default settings add nothing: earlier versions' job directories stay valid
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    assert directory == candidate / ".ttrace" / "jobs" / f"localize-{digest}"
    assert replays.replay_job_dir(reference, candidate, None, CompareSettings()) == directory


def test_the_job_directory_changes_with_every_input(pair):
    reference, candidate = pair
    first = replays.replay_job_dir(reference, candidate, None).name
    others = [replays.replay_job_dir(reference, candidate, "layers.0").name,
              replays.replay_job_dir(reference, candidate, "layers.1").name,
              replays.replay_job_dir(reference, candidate, None, CompareSettings(tolerance="theorem")).name,
              replays.replay_job_dir(candidate, reference, None).name]  # the runs swapped
    assert len({first, *others}) == 5
    for run_dir, step_file in ((candidate, "rank_00001.step_000000.h5"), (reference, "rank_00000.step_000000.h5")):
        stat = (run_dir / step_file).stat()
        os.utime(run_dir / step_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the run re-recorded
        again = replays.replay_job_dir(reference, candidate, None).name
        assert again not in (first, *others)
        others.append(again)


def test_the_replays_environment_is_this_processs_without_a_session(monkeypatch):
    monkeypatch.setenv(SESSION_ENV, "/tmp/a-session")
    monkeypatch.setenv("TTRACE_TEST_KEPT", "yes")
    monkeypatch.setenv("PYTHONPATH", "/extra")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = replays.job_environment()
    assert SESSION_ENV not in env and env["TTRACE_TEST_KEPT"] == "yes"
    assert env["OMP_NUM_THREADS"] == "1" and env["PYTHONPATH"] == f"{REPO}{os.pathsep}/extra"
    assert os.environ[SESSION_ENV] == "/tmp/a-session" and "OMP_NUM_THREADS" not in os.environ  # ours is untouched
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.delenv("PYTHONPATH")
    env = replays.job_environment()
    assert env["OMP_NUM_THREADS"] == "4" and env["PYTHONPATH"] == str(REPO)


@pytest.fixture
def submitted(monkeypatch):
    """Every (directory, spec, rerun) submit_replay hands to jobs.submit; nothing runs."""
    calls = []

    def record(directory, spec, *, rerun=False):
        calls.append((directory, spec, rerun))
        return Job(directory)
    monkeypatch.setattr(replays, "submit", record)
    return calls


def test_the_replays_command_and_limits(pair, submitted):
    reference, candidate = pair
    settings = CompareSettings(tolerance="theorem", theorem_k=8.0)
    job = replays.submit_replay(os.path.relpath(reference), candidate, "layers.0", timeout_s=60, settings=settings)
    ((directory, spec, rerun),) = submitted
    assert directory == job.directory == replays.replay_job_dir(reference, candidate, "layers.0", settings)
    assert spec.command == [sys.executable, "-m", "ttrace_core", "localize", str(reference), str(candidate), "--here",
                            "--json", str(directory / "result.json"), "--replay-dir", str(directory / "replay"),
                            "--timeout", "60", "--tolerance", "theorem", "--theorem-k", "8.0", "--module", "layers.0"]
    assert (spec.cwd, spec.timeout_s, spec.success_codes, rerun) == (str(REPO), 180, (0, 1, 4), False)
    assert spec.env == replays.job_environment()


def test_the_whole_models_replay_with_its_own_job_timeout_and_rerun(pair, submitted):
    reference, candidate = pair
    replays.submit_replay(reference, candidate, timeout_s=30.0, job_timeout_s=45.0, rerun=True)
    ((directory, spec, rerun),) = submitted
    assert spec.command[-2:] == ["--timeout", "30.0"] and "--module" not in spec.command
    assert (spec.timeout_s, rerun) == (45.0, True) and directory == replays.replay_job_dir(reference, candidate, None)


def test_a_run_without_a_manifest_is_refused_before_any_job_is_made(pair, tmp_path, submitted):
    reference, _ = pair
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFormatError, match="manifest.json: missing"):
        replays.submit_replay(reference, tmp_path / "empty")
    assert submitted == [] and not (tmp_path / "empty" / ".ttrace").exists()


def test_asking_again_answers_from_the_finished_job_without_running_anything(pair, no_spawning):
    reference, candidate = pair
    assert replays.replay_job(reference, candidate, "layers.0") is None
    written = localization_for(1)
    directory = write_finished_replay(reference, candidate, "layers.0", written)
    job = replays.submit_replay(reference, candidate, "layers.0")
    assert job.cached and job.directory == directory
    assert replays.replay_job(reference, candidate, "layers.0").directory == directory
    assert replays.replay_job(reference, candidate, None) is None  # another target, another job
    found = replays.localization(job)
    assert isinstance(found, Localization) and found.exit_code == 1
    assert found == Localization.from_json(written.to_json())  # its infinite ratio read back as None (strict JSON)


def _job(tmp_path, state: str, result: str | None) -> Job:
    directory = tmp_path / "job"
    directory.mkdir()
    spec = JobSpec(command=["true"], env={}, cwd=str(tmp_path), success_codes=replays.LOCALIZE_EXIT_CODES)
    (directory / "spec.json").write_text(json.dumps(asdict(spec)))
    (directory / "status.json").write_text(json.dumps({"state": state, "exit_code": 1 if state == "complete" else 3}))
    if result is not None:
        (directory / "result.json").write_text(result)
    return Job(directory)


@pytest.mark.parametrize("state", ["running", "failed", "cancelled"])
def test_a_job_that_is_not_complete_has_no_localization(tmp_path, state):
    assert replays.localization(_job(tmp_path, state, localization_for(0).to_json())) is None


def test_a_complete_job_whose_result_cannot_be_read_is_a_one_line_ttrace_error(tmp_path):
    with pytest.raises(TtraceError) as raised:
        replays.localization(_job(tmp_path, "complete", "[1, 2]"))
    assert type(raised.value) is TtraceError and "\n" not in str(raised.value)
    assert str(raised.value).startswith(f"{tmp_path / 'job' / 'result.json'}: a job result must be a JSON object")


def test_a_complete_job_whose_result_is_no_localization_names_its_file(tmp_path):
    with pytest.raises(TraceFormatError, match=r"result\.json: not a valid localization result \(field "):
        replays.localization(_job(tmp_path, "complete", '{"reference": 3}'))


def test_the_exit_codes_that_carry_a_verdict():
    assert replays.LOCALIZE_EXIT_CODES == (0, 1, 4)
    assert [localization_for(code).exit_code for code in replays.LOCALIZE_EXIT_CODES] == [0, 1, 4]
