"""Which recorded tensors are the same bytes: a module's output is often the next module's input, and
a tensor recorded twice in a step is written once (format 5: a second index row naming the same bytes;
format 4 made it a hard link).

Part of stage 1 (record): writer.py and record/background_writer.py ask `WrittenStorages` before
writing. Two records hold the same values when they view the same storage the same way (data
pointer, storage offset, shape, strides, dtype) and no in-place change came between them (the
version counter, which every in-place op bumps, is equal). The version counter alone is not enough:
a write that goes around autograd leaves it as it was (an alias made with `.data`, a collective into
FSDP2's buffers; measured: an FSDP2 parameter's value before and after the optimizer step had one
version), so the two records' statistics (sum, sum of squares, min, max, counts, taken from the
values as they are recorded) must also be equal. A change that keeps all of them bit-identical would
still be missed. The first record's storage is held by a weak reference only: once it is freed, its
memory may hold another tensor with the same shape at the same address and version, so an expired
record never matches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ttrace_core.format.schema import TensorStats


@dataclass(frozen=True, slots=True)
class StorageIdentity:
    """How a tensor views its storage, and the storage's state, at the moment it is recorded."""

    storage: int
    """The storage's address (its StorageImpl), which a freed storage may pass on."""
    data_ptr: int
    storage_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    version: int


def storage_identity(value: torch.Tensor) -> StorageIdentity | None:
    """None for a tensor whose bytes cannot be told apart this way (an inference tensor keeps no
    version counter, a tensor subclass or meta tensor has no plain storage): it is always written."""
    try:
        if type(value) is not torch.Tensor or value.device.type == "meta" or value.is_sparse:
            return None
        return StorageIdentity(storage=value.untyped_storage()._cdata, data_ptr=value.data_ptr(),
                               storage_offset=value.storage_offset(), shape=tuple(value.shape),
                               strides=tuple(value.stride()), dtype=value.dtype, version=value._version)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class WrittenStorages:
    """The dataset each storage was first written to in the current step, while that storage lives."""

    def __init__(self) -> None:
        self._first: dict[StorageIdentity, tuple[str, TensorStats, StorageWeakRef]] = {}

    def clear(self) -> None:
        """A new step: links never cross step files."""
        self._first.clear()

    def first_dataset(self, value: torch.Tensor, stats: TensorStats | None) -> tuple[StorageIdentity | None, str | None]:
        """(identity of `value`, the dataset it was already written to in this step or None). A record
        without statistics (`stats` None) is never linked: nothing would catch a write around autograd."""
        identity = storage_identity(value) if stats is not None else None
        if identity is None or (found := self._first.get(identity)) is None:
            return identity, None
        dataset, first_stats, storage = found
        if storage.expired():  # freed since: the address and version may now belong to other values
            del self._first[identity]
            return identity, None
        return identity, dataset if first_stats == stats else None

    def remember(self, identity: StorageIdentity | None, value: torch.Tensor, dataset: str,
                 stats: TensorStats | None) -> None:
        if identity is not None and stats is not None:
            self._first[identity] = (dataset, stats, StorageWeakRef(value.untyped_storage()))
