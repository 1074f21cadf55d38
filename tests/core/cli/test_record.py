"""`ttrace record` (cli/record.py): the user's command runs as written, and what goes wrong is one line
naming the command or the directory and what to do. (A script that does attach is recorded in
tests/test_user_script.py and tests/test_megatron_user_script.py.)"""

from __future__ import annotations

import sys

import pytest

from tests.cli_support import run_main
from tests.synthetic_runs import write_pair


@pytest.mark.parametrize("command, expected", [
    ([sys.executable, "-c", "print('the script ran')"],
     "finished but recorded nothing into {out}: its script must call ttrace_core.attach(model, optimizer)"),
    ([sys.executable, "-c", "import sys; sys.exit(3)"], "exited with code 3 (its output is above)"),
], ids=["never-attached", "failed"])
def test_a_command_that_records_nothing_is_named_with_what_to_do(tmp_path, capfd, command, expected):
    out = tmp_path / "run"
    code, _, err = run_main(["record", "--out", str(out), "--", *command], capfd)
    assert code == 2
    assert expected.format(out=out) in err
    assert not (out / "manifest.json").exists()


def test_no_command_after_the_separator_says_how_to_write_one(tmp_path, capsys):
    code, _, err = run_main(["record", "--out", str(tmp_path / "run"), "--"], capsys)
    assert code == 2
    assert "ttrace record: no command; write it after --, e.g. ttrace record --out" in err


def test_adaptive_refuses_a_reference_that_is_not_a_run_before_running_anything(tmp_path, capsys):
    marker = tmp_path / "ran"
    code, _, err = run_main(["record", "--out", str(tmp_path / "run"), "--adaptive", str(tmp_path / "missing"), "--",
                             sys.executable, "-c", f"open({str(marker)!r}, 'w')"], capsys)
    assert code == 2
    assert f"{tmp_path / 'missing'}: no such run directory" in err
    assert not marker.exists()


def test_adaptive_reads_a_real_reference_and_then_runs_the_command(tmp_path, capfd):
    reference, _ = write_pair(tmp_path)
    marker = tmp_path / "ran"
    code, _, err = run_main(["record", "--out", str(tmp_path / "run"), "--adaptive", str(reference), "--",
                             sys.executable, "-c", f"open({str(marker)!r}, 'w')"], capfd)
    assert marker.exists(), err
    assert code == 2 and "recorded nothing" in err
