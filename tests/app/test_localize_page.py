"""The Localize page through AppTest: no replay yet, a finished replay shown at once, a running one
polled, a failed one explained, a refused path. Replay jobs are written as a finished job would
leave them (tests/core/service/test_jobs.py runs real ones, tests/test_localize_samples.py real replays)."""

import json
import time
from dataclasses import asdict

import pytest

from tests.app.test_pages import PAIR, root  # noqa: F401  (the root fixture)
from tests.support.pages import errors_of as _errors, open_page as _open
from ttrace_core import api
from ttrace_core.service.jobs import JobSpec
from ttrace_core.localize.verdicts import Evidence, Localization, ModuleVerdict


def _finished_job(root, module, *, state="complete", localization: Localization | None = None):
    directory = api.replay_job_dir((root / "reference").resolve(), (root / "candidate").resolve(), module)
    directory.mkdir(parents=True)
    spec = JobSpec(command=["true"], env={}, cwd=str(root), success_codes=(0, 1, 4))
    (directory / "spec.json").write_text(json.dumps(asdict(spec)))
    (directory / "status.json").write_text(json.dumps({"state": state, "pid": 1, "exit_code": 1 if state == "complete" else 3,
                                                       "message": "exit code 3; see the log" if state != "complete" else "",
                                                       "started": time.time() - 20, "finished": time.time()}))
    (directory / "log.txt").write_text("[progress] 2/3 replaying\nTraceback: boom\n")
    if localization is not None:
        (directory / "result.json").write_text(localization.to_json())
    return directory


CULPRIT = Localization(
    reference="r", candidate="c", replay="x", diverged=True, culprits=["layers.0.act"], bug_class="forward",
    modules=[ModuleVerdict(fqn="layers.0", verdict="inherits error"),
             ModuleVerdict(fqn="layers.0.act", verdict="introduces error", phase="forward",
                           evidence=[Evidence(key="step 0 / mb 0 / forward / layers.0.act / output.0", ratio_before=6e4,
                                              ratio_after=6e4, status="mismatch")]),
             ModuleVerdict(fqn="layers.1.norm", verdict="clean")],
    command="ttrace localize r c", reproduction={"reproduced": True, "num_checked": 3, "mismatches": [], "differences": []})


def test_without_a_replay_the_page_offers_one(root):
    app = _open("localize", **PAIR)
    assert not app.exception
    assert "No replay of this target yet" in app.info[0].value
    assert app.button[0].label == "Replay with reference inputs"


def test_a_finished_replay_shows_its_verdicts_at_once(root):
    _finished_job(root, None, localization=CULPRIT)
    app = _open("localize", **PAIR)
    assert not app.exception
    assert any("Culprit (introduces the error): layers.0.act" in error for error in _errors(app))
    table = app.dataframe[0].value
    assert list(table["verdict"]) == ["🟠 inherits", "🔴 introduces", "🟢 clean"]
    assert table["ratio after"][1] == "6e+04" and table["ratio after"][2] == "-"  # one format, as on every page


def test_the_module_in_the_url_selects_its_own_replay(root):
    _finished_job(root, "layers.0.act", localization=CULPRIT)
    app = _open("localize", **PAIR, module="layers.0.act")
    assert not app.exception and any("Culprit" in error for error in _errors(app))
    assert app.selectbox[0].value == "layers.0.act"
    assert "No replay of this target yet" in _open("localize", **PAIR).info[0].value


def test_a_failed_replay_says_so_and_shows_its_log(root):
    _finished_job(root, None, state="failed")
    app = _open("localize", **PAIR)
    assert not app.exception
    assert any("The replay failed: exit code 3" in error for error in _errors(app))
    assert "Traceback: boom" in app.code[0].value


def test_a_not_reproduced_replay_blames_nothing(root):
    not_reproduced = Localization(reference="r", candidate="c", replay="x", diverged=True, command="ttrace localize r c",
                                  reproduction={"reproduced": False, "num_checked": 4,
                                                "mismatches": ["step 0 / ... : ratio 3e5 (mismatch)"],
                                                "differences": ["torch: 2.13.0 -> 2.14.0"]})
    _finished_job(root, None, localization=not_reproduced)
    app = _open("localize", **PAIR)
    assert not app.exception and "Not reproduced" in app.warning[0].value
    assert not _errors(app)


def test_an_escaping_path_is_refused(root):
    app = _open("localize", ref="../../../etc", cand="../x")
    assert not app.exception and any("outside the dashboard root" in e for e in _errors(app))
