"""Measuring activation memory: bytes saved for backward, alive at once.

``torch.cuda.max_memory_allocated`` answers this on a GPU; on the CPU there is
no allocator statistic, so :class:`SavedTensorTracker` counts the storages
autograd keeps for backward while it is active, and their peak.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

from torch import Tensor
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["SavedTensorTracker"]


class _Held:
    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: Tensor, key: tuple[Any, ...], tracker: SavedTensorTracker) -> None:
        self.tensor = tensor
        self.key = key
        self.tracker = tracker

    def __del__(self) -> None:
        self.tracker._release(self.key)


class SavedTensorTracker:
    """Counts bytes of tensors saved for backward that are still alive.

    Each storage counts once however many times it is saved. Use as a
    context manager around forwards; the count drops as autograd frees saved
    tensors (after backward) or graphs die.

    Attributes:
        current_bytes: bytes alive now.
        peak_bytes: the most alive at once since creation.
    """

    def __init__(self) -> None:
        self.current_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[tuple[Any, ...], list[int]] = {}
        self._lock = threading.Lock()
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: Tensor) -> _Held:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        with self._lock:
            entry = self._refs.get(key)
            if entry is None:
                self._refs[key] = [1, storage.nbytes()]
                self.current_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            else:
                entry[0] += 1
        return _Held(t, key, self)

    @staticmethod
    def _unpack(held: _Held) -> Tensor:
        return held.tensor

    def _release(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            entry = self._refs.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                self.current_bytes -= entry[1]
                del self._refs[key]

    def __enter__(self) -> SavedTensorTracker:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
