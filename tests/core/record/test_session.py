"""attach (record/session.py): what it accepts as the model, inside a ttrace command and outside one."""

import os

import pytest
from torch import nn

import ttrace_core as ttrace
from ttrace_core.record.session import SESSION_ENV, SessionSpec


@pytest.mark.parametrize("model", [[nn.Linear(2, 2), nn.Linear(2, 2)], []], ids=["two torch modules", "empty"])
def test_a_list_that_is_not_megatron_chunks_is_refused_in_one_line_and_ignored_outside_ttrace(tmp_path, monkeypatch, model):
    """A list is read as megatron-core's model chunks (virtual pipeline stages); anything else is a one-line
    ValueError under a ttrace command, and a plain run (no session) never looks at it."""
    monkeypatch.delenv(SESSION_ENV, raising=False)
    assert not ttrace.attach(model).active
    spec = tmp_path / "session.json"
    SessionSpec(out=str(tmp_path / "run"), launcher_pid=os.getpid()).write(spec)
    monkeypatch.setenv(SESSION_ENV, str(spec))
    with pytest.raises(ValueError, match=r"^attach\(\) got a list of \d .*megatron-core model chunks") as raised:
        ttrace.attach(model)
    assert "\n" not in str(raised.value) and not (tmp_path / "run").exists()
