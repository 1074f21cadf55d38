"""record/failures.py: an error of ttrace's own code in one line, and kept from the training it observes."""

from __future__ import annotations

import pytest

from ttrace_core.record.failures import failure_message, never_raises, one_sentence


def _raised(error: Exception) -> Exception:
    try:
        raise error
    except Exception as caught:  # noqa: BLE001 - the test needs the traceback
        return caught


def test_one_sentence_keeps_the_first_sentence_on_one_line_and_names_the_type():
    error = RuntimeError("[gloo] Read error\n  at rank 1. Connection reset by peer. Try again later.")
    assert one_sentence(error) == "RuntimeError: [gloo] Read error at rank 1."


def test_one_sentence_of_an_error_without_a_full_stop_is_the_whole_message():
    assert one_sentence(ValueError("shape [4] vs [2]")) == "ValueError: shape [4] vs [2]"


def test_a_failure_names_the_tensor_and_where_in_ttrace_it_failed():
    message = failure_message("layers.0.mlp", "output", _raised(KeyError("x")))
    assert message.startswith("layers.0.mlp output: the tracer failed (KeyError: 'x' at test_failures.py:")
    assert "in _raised) and left it out; the training went on" in message
    assert message.endswith("report it with this line")


def test_a_failure_outside_any_tensor_says_what_it_left_out():
    message = failure_message("", "", RuntimeError("never raised"))
    assert message.startswith("ttrace: the tracer failed (RuntimeError: never raised)")
    assert "left what it was recording out" in message


class _Recorder:
    def __init__(self):
        self.errors: list[Exception] = []

    def record_error(self, error: Exception) -> None:
        self.errors.append(error)

    @never_raises
    def record(self, value: int) -> int:
        if value < 0:
            raise ValueError("negative")
        return value * 2


def test_a_guarded_entry_point_returns_its_value_and_records_nothing():
    recorder = _Recorder()
    assert recorder.record(3) == 6
    assert recorder.errors == []


def test_a_guarded_entry_point_turns_its_error_into_a_record_and_returns_none():
    recorder = _Recorder()
    assert recorder.record(-1) is None
    assert [str(error) for error in recorder.errors] == ["negative"]


def test_a_guarded_entry_point_lets_an_interrupt_through():
    class Interrupted(_Recorder):
        @never_raises
        def record(self, value: int) -> int:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Interrupted().record(1)
    assert Interrupted.record.__name__ == "record"
