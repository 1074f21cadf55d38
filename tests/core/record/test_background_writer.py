"""The writer thread (background_writer.py): back-pressure instead of memory, copies taken at the hook,
finished steps complete on disk when a later step raises, and a failed write that stops its own step."""

from __future__ import annotations

import errno
import time

import pytest
import torch

from ttrace_core.record.background_writer import BackgroundWriter
from ttrace_core.format.schema import Layout, TensorKey, TensorMeta
from ttrace_core.format.reader import RunReader
from ttrace_core.format.writer import RunWriter
from ttrace_core.record.tracer import Tracer, TracerConfig

from tests.support.tiny_mlp import mlp as _model, train_step as _train_step

KIB = 1024


def _meta(index: int, shape: tuple[int, ...]) -> TensorMeta:
    key = TensorKey(step=0, micro_batch=0, phase="forward", fqn=f"layers.{index}", slot="output.0")
    return TensorMeta(key=key, rank=0, dtype="float32", local_shape=shape, layout=Layout.replicated(shape), seq=index)


class SlowWriter(RunWriter):
    """A disk that stores 256 KiB in 20 ms."""

    def write(self, meta, value, **options):
        time.sleep(0.02)
        super().write(meta, value, **options)


def test_a_full_queue_slows_the_training_thread_instead_of_growing_memory(tmp_path):
    background = BackgroundWriter(SlowWriter(tmp_path, 0), max_pending_bytes=1024 * KIB)
    tensors = [torch.full((64, KIB), float(i)) for i in range(30)]  # 256 KiB each, 7.5 MiB in all
    background.begin_step(0)
    started = time.perf_counter()
    for index, tensor in enumerate(tensors):
        background.write(_meta(index, tuple(tensor.shape)), tensor)
        tensor.add_(100.0)  # the step goes on and changes it in place: the copy taken at the hook is stored
    queued = time.perf_counter() - started
    background.end_step()
    background.stop()
    assert background.peak_pending_bytes <= 1024 * KIB  # never more than the bound of copies waiting
    # 30 writes of at least 20 ms each behind a queue of 4: the producer cannot have queued the last one before
    # 25 were written (20 asserted: a lower bound the sleeps guarantee, not a speed), and it did wait. How long it waited
    # depends on how fast it copies on a loaded machine, so only that it waited is asserted.
    assert queued > 20 * 0.02 and background.seconds_waited > 0
    from ttrace_core.format.schema import RunManifest
    from ttrace_core.format.writer import write_manifest

    write_manifest(tmp_path, RunManifest(role="reference", world_size=1))
    with RunReader(tmp_path) as reader:
        assert reader.complete_steps == [0]
        for key, (meta,) in reader.index.items():
            assert torch.equal(reader.read(meta), torch.full((64, KIB), float(meta.seq)))


def _record(run_dir, *, fail_at_step: int | None = None, writer_queue_bytes: int = 64 * KIB, steps: int = 3) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(run_dir, model, role="reference", optimizer=optimizer,
                    config=TracerConfig(writer_queue_bytes=writer_queue_bytes))
    try:
        for step in range(steps):
            with tracer.step(step):
                _train_step(model, optimizer)
                if step == fail_at_step:
                    raise RuntimeError("out of memory in the next micro-batch")
    finally:
        tracer.close()


def test_a_step_that_raises_leaves_the_finished_steps_complete_on_disk(tmp_path):
    _record(tmp_path / "sync", writer_queue_bytes=0, steps=2)
    with pytest.raises(RuntimeError, match="out of memory"):
        _record(tmp_path / "thread", fail_at_step=2)
    with RunReader(tmp_path / "sync") as sync, RunReader(tmp_path / "thread") as thread:
        assert thread.complete_steps == [0, 1] and list(thread.partial_steps) == [2]
        assert "RuntimeError: out of memory in the next micro-batch" in thread.partial_steps[2]
        assert set(thread.index) == set(sync.index) and not thread.inventory_gaps
        for key, metas in sync.index.items():  # the same values as written on the training thread
            assert torch.equal(thread.read(thread.index[key][0]), sync.read(metas[0])), key


class FullDisk(RunWriter):
    """A disk that fills up at the 5th tensor of step 1."""

    def write(self, meta, value, **options):
        if meta.key.step == 1 and meta.seq == 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.run_dir))
        super().write(meta, value, **options)


def test_a_write_that_fails_in_the_thread_stops_its_own_step_and_the_recording(tmp_path, monkeypatch, capsys):
    import ttrace_core.record.tracer as tracer_module

    monkeypatch.setattr(tracer_module, "RunWriter", FullDisk)
    _record(tmp_path, steps=3)  # the training goes on
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ttrace: {tmp_path}: cannot write step 1 of rank 0 (No space left on device); recording stopped")
    with RunReader(tmp_path) as reader:
        assert reader.complete_steps == [0] and list(reader.partial_steps) == [1]
        assert "rank 0 stopped on OSError: [Errno 28] No space left on device" in reader.partial_steps[1]
