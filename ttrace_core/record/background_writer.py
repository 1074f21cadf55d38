"""Part of stage 1 (record): step files written by a thread off the training thread.

`BackgroundWriter` has RunWriter's interface. `write` copies the tensor (the training step may change
it in place once the hook returns) and queues the copy; a writer thread stores it. The queue holds at
most `max_pending_bytes` of copies: a write that would pass the bound waits until the thread has
stored enough, so a slow disk slows training instead of growing memory. `end_step` waits until the
step file is complete and renamed, so a step's file is finished when its `with tracer.step(i)` block
exits, as with the synchronous writer. An error in the thread (a full disk) is raised on the
training thread at its next call, and the copies still queued are dropped.

It pays off only where a core is idle while training runs (benchmarks/recording_overhead.py measures
it): the copy costs the training thread about a third of the write it replaces.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from ttrace_core.format.schema import Finding, TensorMeta
from ttrace_core.format.reader import dataset_path
from ttrace_core.format.same_storage import WrittenStorages
from ttrace_core.format.writer import RunWriter


class BackgroundWriter:
    def __init__(self, writer: RunWriter, max_pending_bytes: int) -> None:
        if max_pending_bytes <= 0:
            raise ValueError(f"max_pending_bytes must be positive, got {max_pending_bytes}")
        self._writer = writer
        self.run_dir, self.rank = writer.run_dir, writer.rank
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.peak_pending_bytes = 0
        """The most bytes of copies ever queued at once."""
        self.seconds_waited = 0.0
        """Time the training thread spent blocked on a full queue or a step's end."""
        self._queue: deque[tuple[Callable[[], None], int]] = deque()
        self._condition = threading.Condition()
        self._error: BaseException | None = None
        self._busy = False
        """The thread is storing a task it has taken off the queue."""
        self._written = WrittenStorages()
        """Tensors of this step queued for writing (on the training thread), for links to the same bytes."""
        self._thread = threading.Thread(target=self._drain, name=f"ttrace-writer-{writer.rank}", daemon=True)
        self._stopping = False
        self._thread.start()

    @property
    def num_bytes_written(self) -> int:
        return self._writer.num_bytes_written

    @property
    def num_link_bytes(self) -> int:
        return self._writer.num_link_bytes

    # ---- the training thread ------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self._written.clear()
        self._put(lambda: self._writer.begin_step(step), 0)

    def write(self, meta: TensorMeta, value: torch.Tensor | None) -> None:
        if value is None:
            self._put(lambda: self._writer.write(meta, None), 0)
            return
        # The same bytes recorded again this step are a link, decided here on the original (the copy
        # the thread gets has storage of its own): no copy is made for them.
        identity, first = self._written.first_dataset(value, meta.stats)
        if first is not None:
            num_bytes = value.numel() * value.element_size()
            self._put(lambda: self._writer.write_link(meta, first, num_bytes), 0)
            return
        self._written.remember(identity, value, dataset_path(meta.key), meta.stats)
        copy = value.detach().clone()  # the step goes on and may change `value` in place
        self._put(lambda: self._writer.write(meta, copy, deduplicate=False), copy.numel() * copy.element_size())

    def add_finding(self, finding: Finding) -> None:
        self._put(lambda: self._writer.add_finding(finding), 0)

    def end_step(self, blind_spots: dict[str, str] | None = None) -> None:
        self._put(lambda: self._writer.end_step(blind_spots), 0)
        self._wait_until_empty()

    def close(self, why: str = "") -> None:
        """Store what is queued, then close the open step (it stays partial, with `why`). An error the
        thread met that no call has reported yet is dropped: the close is what matters now."""
        with self._condition:
            self._error = None
        self._put(lambda: self._writer.close(why), 0)
        self._wait_until_empty()

    def stop(self) -> None:
        """End the thread once it has stored what is queued; idempotent."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        self._thread.join()

    def _put(self, task: Callable[[], None], num_bytes: int) -> None:
        with self._condition:
            self._raise_error()
            started = time.perf_counter()
            while self.pending_bytes and self.pending_bytes + num_bytes > self.max_pending_bytes:
                self._condition.wait()  # back-pressure: the thread frees room as it stores
                self._raise_error()
            self.seconds_waited += time.perf_counter() - started
            self._queue.append((task, num_bytes))
            self.pending_bytes += num_bytes
            self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)
            self._condition.notify_all()

    def _wait_until_empty(self) -> None:
        with self._condition:
            started = time.perf_counter()
            while self._queue or self._busy:
                self._condition.wait()
                self._raise_error()
            self.seconds_waited += time.perf_counter() - started
            self._raise_error()

    def _raise_error(self) -> None:
        """Raise (once) what the thread failed on; it went on, with the copies queued after it dropped."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # ---- the writer thread --------------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._stopping:
                    self._condition.wait()
                if not self._queue:
                    return
                task, num_bytes = self._queue.popleft()
                self._busy = True
            try:
                task()
                failed = None
            except BaseException as error:  # noqa: BLE001 - handed to the training thread
                failed = error
            with self._condition:
                self._busy = False
                self.pending_bytes -= num_bytes
                if failed is not None:
                    self._error = failed
                    self.pending_bytes -= sum(size for _, size in self._queue)
                    self._queue.clear()  # drop the copies: nothing after a failed write is stored
                self._condition.notify_all()
