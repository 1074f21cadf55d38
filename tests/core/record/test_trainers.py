"""The bracket of one optimizer step that a trainer's callback opens and closes (record/trainers.py)."""

from contextlib import contextmanager

from ttrace_core.record.trainers import TrainerTracing


class _Session:
    active = True

    def __init__(self) -> None:
        self.events, self.closed = [], False

    @contextmanager
    def step(self, number):
        self.events.append(("begin", number))
        try:
            yield
        except BaseException as error:
            self.events.append(("abandoned", number, str(error)))
            raise
        self.events.append(("end", number))

    def close(self) -> None:
        self.closed = True


def _tracing() -> TrainerTracing:
    tracing = TrainerTracing(trainer=None, options={})
    tracing.session = _Session()
    return tracing


def test_a_step_is_open_from_its_begin_to_its_end_and_a_new_begin_closes_the_last():
    tracing = _tracing()
    tracing.begin_step(0)
    assert tracing.step_number == 0
    tracing.begin_step(1)  # a trainer that never said the last step ended
    tracing.end_step()
    tracing.end_step()  # nothing open: nothing to close
    assert tracing.session.events == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1)]
    assert tracing.step_number is None


def test_training_that_fails_abandons_the_open_step_and_closes_the_session():
    tracing = _tracing()
    tracing.begin_step(3)
    tracing.end(RuntimeError("out of memory"))
    assert tracing.session.events == [("begin", 3), ("abandoned", 3, "out of memory")] and tracing.session.closed


def test_before_training_begins_there_is_no_step_to_open():
    tracing = TrainerTracing(trainer=None, options={})
    tracing.begin_step(0)
    assert tracing.step_number is None


class _FailingAttach(TrainerTracing):
    def attached(self):
        raise RuntimeError("a parameter ttrace cannot draw. More advice")


def test_attaching_that_fails_leaves_the_training_untraced_and_says_so_in_one_line(capsys):
    tracing = _FailingAttach(trainer=object(), options={})
    tracing.begin()
    tracing.begin_step(0)
    tracing.end()
    assert tracing.session is not None and not tracing.session.active and tracing.step_number is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["ttrace: attaching to the object failed (RuntimeError: a parameter ttrace cannot draw.); the "
                     "training goes on untraced and this run records no step"]
