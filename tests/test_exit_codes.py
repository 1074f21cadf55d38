"""The exit-code contract of every `ttrace` command: 0 success / equivalent, 1 divergence, 2 bad input
(one line `ttrace: error: ...` naming what is wrong), 3 internal error (with a request to report it),
4 (localize) diverged but not explained.

The table runs `ttrace_core.cli.main.main` in this process on small hand-written traces
(tests/synthetic_runs.py: a reference and a diverging 2-rank candidate); localize verdicts come from
replay jobs written as a finished job leaves them. Two cases go through a real subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_support import REPLAYED, localization_for, run_main, write_finished_replay
from tests.conftest import ROOT, run_ttrace
from tests.synthetic_runs import write_pair
from ttrace_core import api
from ttrace_core.service.jobs import Job


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """Every path the table's arguments name, by placeholder."""
    root = tmp_path_factory.mktemp("exit-codes")
    reference, candidate = write_pair(root)
    for module, code in REPLAYED.items():
        write_finished_replay(reference, candidate, module, localization_for(code))
    not_a_trace = root / "not-a-trace"
    not_a_trace.mkdir()
    a_file = root / "a-file.txt"
    a_file.write_text("not a run\n")
    manifests = {"bad-json": "{not json", "a-list": "[1, 2]", "no-role": '{"world_size": 1}'}
    for name, text in manifests.items():
        (root / name).mkdir()
        (root / name / "manifest.json").write_text(text)
    no_rank_files = root / "no-rank-files"
    no_rank_files.mkdir()
    shutil.copy(reference / "manifest.json", no_rank_files)
    corrupt = root / "corrupt"
    shutil.copytree(reference, corrupt)
    reference_copy = root / "reference-copy"  # an equivalent run that is not the reference itself
    shutil.copytree(reference, reference_copy, ignore=shutil.ignore_patterns(".ttrace", ".localize"))
    for step_file in corrupt.glob("*.h5"):
        step_file.write_bytes(b"not hdf5" * 64)
    return {"ref": str(reference), "cand": str(candidate), "missing": str(root / "missing"), "empty": str(not_a_trace),
            "file": str(a_file), "bad_json": str(root / "bad-json"), "a_list": str(root / "a-list"),
            "no_role": str(root / "no-role"), "no_ranks": str(no_rank_files), "corrupt": str(corrupt),
            "new": str(root / "new-run"), "ref_copy": str(reference_copy), "no_folder": str(root / "no-such-folder" / "out")}


# (id, argv with {placeholders}, expected exit code, text expected: in stdout for 0/1/4, in stderr's one line for 2)
CASES = [
    ("compare-equivalent", "compare {ref} {ref_copy}", 0, "PASSED (equivalent) |"),
    ("compare-with-itself", "compare {ref} {ref}", 2, "is compared with itself, which always passes; pass a reference and a different candidate"),
    ("compare-swapped", "compare {cand} {ref}", 2, "the runs are swapped: "),
    ("localize-swapped", "localize {cand} {ref}", 2, "the runs are swapped: "),
    ("report-with-itself", "report {ref} {ref} --markdown", 2, "is compared with itself"),
    ("compare-divergence", "compare {ref} {cand}", 1, "FAILED (not equivalent) | 3/11 tensors pass"),
    ("compare-missing-run-dir", "compare {ref} {missing}", 2, "missing: no such run directory"),
    ("compare-run-dir-is-a-file", "compare {file} {cand}", 2, "a-file.txt: no such run directory"),
    ("compare-not-a-trace", "compare {ref} {empty}", 2, "not-a-trace/manifest.json: missing; this directory is not a ttrace run"),
    ("compare-manifest-not-json", "compare {ref} {bad_json}", 2, "bad-json/manifest.json: not a valid manifest"),
    ("compare-manifest-not-an-object", "compare {ref} {a_list}", 2, "a-list/manifest.json: not a valid manifest (Expected `object`, got `array`)"),
    ("compare-manifest-incomplete", "compare {ref} {no_role}", 2, "no-role/manifest.json: not a valid manifest"),
    ("compare-rank-files-missing", "compare {ref} {no_ranks}", 2, "there is no file of rank 0"),
    ("compare-corrupt-hdf5", "compare {ref} {corrupt}", 2, "it is truncated or corrupted, re-record rank 0"),
    ("compare-json-folder-missing", "compare {ref} {cand} --json {no_folder}", 2, "no-such-folder does not exist; create it"),
    ("compare-json-is-a-directory", "compare {ref} {cand} --json {empty}", 2, "not-a-trace: is a directory; pass a file name"),
    ("compare-bad-tolerance-usage", "compare {ref} {cand} --tolerance loose", 2, "invalid choice: 'loose'"),
    ("estimate-missing-run-dir", "estimate {missing}", 2, "missing: no such run directory"),
    ("estimate-not-a-trace", "estimate {empty}", 2, "manifest.json: missing"),
    ("estimate-no-entrypoint", "estimate {ref}", 2, "no entrypoint recorded"),
    ("localize-missing-run-dir", "localize {ref} {missing}", 2, "missing: no such run directory"),
    ("localize-not-a-trace", "localize {empty} {cand}", 2, "not-a-trace/manifest.json: missing"),
    ("localize-json-folder-missing", "localize {ref} {cand} --json {no_folder}", 2, "no-such-folder does not exist"),
    ("localize-nothing-diverges", "localize {ref} {cand} --module layers.0.lin", 0, "(cached replay:"),
    ("localize-culprit-named", "localize {ref} {cand} --module layers.0.act", 1, "(cached replay:"),
    ("localize-unexplained", "localize {ref} {cand} --module layers.1", 4, "(cached replay:"),
    ("inspect-run", "inspect {cand}", 0, "role: candidate  world_size: 2"),
    ("inspect-missing-run-dir", "inspect {missing}", 2, "missing: no such run directory"),
    ("inspect-not-a-trace", "inspect {empty}", 2, "manifest.json: missing"),
    ("inspect-corrupt-hdf5", "inspect {corrupt}", 2, "not a readable HDF5 file"),
    ("bugs", "bugs", 0, "rowwise-skip-allreduce"),
    ("report-markdown-divergence", "report {ref} {cand} --markdown", 1, "**ttrace: FAILED**"),
    ("report-markdown-equivalent", "report {ref} {ref_copy} --markdown", 0, "**ttrace: PASSED** (equivalent)"),
    ("report-nothing-to-write", "report {ref} {cand}", 2, "nothing to write; pass -o report.html"),
    ("report-missing-run-dir", "report {ref} {missing} --markdown", 2, "missing: no such run directory"),
    ("report-html-folder-missing", "report {ref} {cand} -o {no_folder}", 2, "no-such-folder does not exist; create it"),
    ("dashboard-missing-root", "dashboard {missing}", 2, "missing: not a directory"),
    ("dashboard-root-is-a-file", "dashboard {file}", 2, "a-file.txt: not a directory"),
    ("example-into-an-existing-trace", "example torch-gpt --out {ref}", 2, "already holds a trace; record into a new directory"),
    ("example-out-is-a-file", "example torch-gpt --out {file}", 2, "a-file.txt: is a file, not a directory"),
    ("example-unknown-bug", "example torch-gpt --bug nope --out {new}", 2, "unknown bug 'nope'; `ttrace bugs` lists them"),
    ("example-zero-steps", "example torch-gpt --steps 0 --out {new}", 2, "--steps 0 --num-layers 4: both must be at least 1"),
    ("example-sp-without-tp", "example megatron-gpt --sp --out {new}", 2, "--sp needs --tp 2 or more"),
    ("example-out-missing-usage", "example torch-gpt", 2, "the following arguments are required: --out"),
    ("record-no-command", "record --out {new}", 2, "no command; write it after --"),
    ("record-into-an-existing-trace", "record --out {ref} -- true", 2, "already holds a trace"),
    ("record-command-not-found", "record --out {new} -- no-such-program-here", 2, "cannot start"),
    ("record-command-fails", "record --out {new} -- false", 2, "exited with code 1"),
    ("record-command-records-nothing", "record --out {new} -- true", 2, "recorded nothing into"),
    ("no-command-usage", "", 2, "the following arguments are required: command"),
]


@pytest.mark.parametrize("argv, expected_code, expected_text", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_exit_code_and_message(paths, capsys, argv, expected_code, expected_text):
    code, out, err = run_main(argv.format(**paths).split(), capsys)
    assert code == expected_code, f"exit {code}\nstdout: {out}\nstderr: {err}"
    assert "Traceback" not in err
    if err.startswith("usage:"):  # argparse's own refusal: the usage, then its error line
        assert expected_code == 2 and expected_text in err.splitlines()[-1], err
    elif expected_code == 2:
        (line,) = err.strip().splitlines()  # one line, naming what is wrong
        assert line.startswith("ttrace: error: ") and expected_text in line, line
    else:
        assert expected_text in out, out
    if "{new}" in argv:
        assert not Path(paths["new"]).exists(), "a refused recording must not leave a directory behind"


def test_a_bug_of_ttrace_exits_3_with_its_traceback_and_where_to_report_it(paths, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr("ttrace_core.cli.report.render_run", broken)
    code, _, err = run_main(["inspect", paths["cand"]], capsys)
    assert code == 3
    assert "Traceback (most recent call last)" in err and 'raise RuntimeError("a bug")' in err
    assert err.strip().splitlines()[-1] == ("ttrace: internal error: RuntimeError: a bug; this is a bug in ttrace: "
                                            "please report it on the ttrace issue tracker with the traceback above")


def test_a_file_the_system_refuses_is_bad_input_not_a_bug(paths, capsys, monkeypatch):
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/runs/cand/rank_00000.step_000000.h5")

    monkeypatch.setattr("ttrace_core.cli.report.render_run", refused)
    code, _, err = run_main(["inspect", paths["cand"]], capsys)
    assert code == 2
    assert err.strip() == ("ttrace: error: /runs/cand/rank_00000.step_000000.h5: Permission denied; check the path, "
                           "its folder and their permissions")


def test_a_failed_replay_job_is_an_internal_error_with_its_log(capsys, tmp_path, monkeypatch):
    reference, candidate = write_pair(tmp_path)
    directory = write_finished_replay(reference, candidate, None, localization_for(1))
    (directory / "status.json").write_text(json.dumps({"state": "failed", "pid": 1, "exit_code": 3,
                                                       "message": "exit code 3; see the log",
                                                       "started": time.time() - 1, "finished": time.time()}))
    (directory / "log.txt").write_text("Traceback (most recent call last):\nRuntimeError: replay crashed\n")
    monkeypatch.setattr(api, "submit_replay", lambda *args, **kwargs: Job(directory))
    code, _, err = run_main(["localize", str(reference), str(candidate)], capsys)
    assert code == 3
    assert "the localize job failed" in err and "RuntimeError: replay crashed" in err
    assert err.strip().endswith("please report it on the ttrace issue tracker with the output above")


def test_a_missing_run_directory_from_the_shell_is_one_line(paths):
    result = run_ttrace("compare", paths["ref"], paths["missing"], timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"ttrace: error: {paths['missing']}: no such run directory; pass the --out directory " \
                            "of `ttrace record`, `ttrace example` or a Tracer\n"


def test_a_closed_stdout_stops_quietly(paths):
    """`ttrace ... | head -1`: the reader goes away; no traceback, the shell's SIGPIPE code."""
    ttrace = subprocess.Popen([sys.executable, "-m", "ttrace_core", "inspect", paths["cand"], "--tensors"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    ttrace.stdout.close()  # before ttrace writes anything
    assert ttrace.wait(timeout=120) == 141
    assert ttrace.stderr.read() == b""
