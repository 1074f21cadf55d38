"""Part of stage 1 (record): how an error of ttrace's own code is worded, and kept from the training it observes.

A debugging tool must never take down the run it observes. A recording entry point the training code calls is
`never_raises`: its error becomes the trace's finding (`Tracer.record_error`, worded by `failure_message`), never the
training's exception. `one_sentence` is the one-line form of an error, for findings and for the lines a trainer
integration prints when it cannot attach (record/trainers.py).
"""

from __future__ import annotations

import functools
import traceback
from pathlib import Path

from ttrace_core.format.naming import display_fqn


def one_sentence(error: BaseException) -> str:
    """`RuntimeError: [gloo ...] Read error ...: Connection reset by peer.` without gloo's advice after it."""
    text = " ".join(str(error).split())
    sentence, stop, _ = text.partition(". ")
    return f"{type(error).__name__}: {sentence}{stop.strip()}"


def failure_message(fqn: str, slot: str, error: Exception) -> str:
    """A failure of the tracer's own code in one line: what it left out, and where in ttrace it failed."""
    where = f"{display_fqn(fqn)} {slot}".rstrip() if fqn or slot else "ttrace"
    frames = traceback.extract_tb(error.__traceback__)
    origin = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return (f"{where}: the tracer failed ({one_sentence(error)}{origin}) and left {'it' if slot else 'what it was recording'} "
            "out; the training went on. A ttrace bug: report it with this line")


def never_raises(method):
    """A recording entry point the training code calls: its error is the trace's finding (Tracer.record_error),
    never the training's exception. It returns what the method returns, None after an error."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the run must go on; the error is recorded
            self.record_error(error)
            return None
    return guarded
