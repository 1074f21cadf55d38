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


def _in_session(tmp_path, monkeypatch) -> None:
    spec = tmp_path / "session.json"
    SessionSpec(out=str(tmp_path / "run"), launcher_pid=os.getpid()).write(spec)
    monkeypatch.setenv(SESSION_ENV, str(spec))


def test_a_full_config_keeps_what_the_call_says(tmp_path, monkeypatch):
    """config= replaces what attach infers, never the call's own arguments: loss_scale, include and exclude other
    than attach's defaults apply on top of it (the HF bf16 reference passes grad_attr this way)."""
    _in_session(tmp_path, monkeypatch)
    session = ttrace.attach(nn.Sequential(nn.Linear(2, 2)), loss_scale=0.25, exclude=("0",),
                            config=ttrace.TracerConfig(grad_attr="main_grad"))
    try:
        config = session.tracer.config
        assert (config.loss_scale, config.exclude, config.include, config.grad_attr) == (0.25, ("0",), ("*",), "main_grad")
    finally:
        session.close()


def test_a_call_and_a_config_that_disagree_are_refused_in_one_line(tmp_path, monkeypatch):
    _in_session(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=r"^attach\(loss_scale=0.25\) and config.loss_scale=0.5 disagree; give it once$"):
        ttrace.attach(nn.Linear(2, 2), loss_scale=0.25, config=ttrace.TracerConfig(loss_scale=0.5))
