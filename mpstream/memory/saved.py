"""Measuring activation memory: bytes saved for backward, alive at once.

``torch.cuda.max_memory_allocated`` answers this on a GPU; on the CPU there is
no allocator statistic, so :class:`SavedTensorTracker` counts the storages
autograd keeps for backward while it is active, and their peak;
:class:`StageSavedBytes` does so per pipeline stage.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

from . import checkpoint

__all__ = ["SavedTensorTracker", "StageSavedBytes"]


class _Held:
    __slots__ = ("tensor", "key", "ledger")

    def __init__(self, tensor: Tensor, key: tuple[Any, ...], ledger: _Ledger) -> None:
        self.tensor = tensor
        self.key = key
        self.ledger = ledger

    def __del__(self) -> None:
        self.ledger.release(self.key)


class _Ledger:
    """Storages saved for backward and still alive, each counted once per
    group (one group in all, or one per stage), with the bytes alive per
    group and their peak."""

    def __init__(self, groups: int) -> None:
        self.current = [0] * groups
        self.peak = [0] * groups
        self._refs: dict[tuple[Any, ...], list[int]] = {}
        self._lock = threading.Lock()

    def hold(self, group: int, t: Tensor) -> _Held:
        """Counts ``t``'s storage for ``group`` until what this returns dies."""
        storage = t.untyped_storage()
        key = (group, storage.data_ptr(), t.device)
        with self._lock:
            entry = self._refs.get(key)
            if entry is None:
                self._refs[key] = [1, storage.nbytes()]
                self.current[group] += storage.nbytes()
                self.peak[group] = max(self.peak[group], self.current[group])
            else:
                entry[0] += 1
        # Detached: holding the tensor itself would keep its autograd node,
        # which holds the tracker, alive in a cycle autograd cannot see (a
        # saved output); autograd restores the tensor's history on unpack.
        return _Held(t.detach(), key, self)

    def release(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            entry = self._refs.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                self.current[key[0]] -= entry[1]
                del self._refs[key]


def _unpack(held: _Held | _Unowned) -> Tensor:
    return held.tensor


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
        self._ledger = _Ledger(1)
        self._hooks = saved_tensors_hooks(lambda t: self._ledger.hold(0, t), _unpack)

    @property
    def current_bytes(self) -> int:
        return self._ledger.current[0]

    @property
    def peak_bytes(self) -> int:
        return self._ledger.peak[0]

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


class StageSavedBytes:
    """Per stage, bytes saved for backward by its forwards that are still alive.

    A forward pre-hook on each stage's module marks which stage is running;
    tensors autograd saves meanwhile count for that stage (each storage once
    per stage), until autograd frees them. Parameters (a weight saved for the
    input's gradient) are not activations and do not count. What
    checkpointed stages save goes to the checkpoint's own hooks, as with
    :class:`SavedTensorTracker`.

    Args:
        stages: the stage modules (``pipe.partitions``).

    Attributes:
        current_bytes: per stage, bytes alive now.
        peak_bytes: per stage, the most alive at once.
    """

    def __init__(self, stages: Iterable[nn.Module]) -> None:
        self.stages = list(stages)
        self._ledger = _Ledger(len(self.stages))
        self.current_bytes = self._ledger.current
        self.peak_bytes = self._ledger.peak
        self._running: int | None = None
        self._hooks = saved_tensors_hooks(self._pack, _unpack)
        self._handles: list[RemovableHandle] = []
        self._params: set[int] = set()

    def _enter(self, stage: int) -> None:
        self._running = stage

    def _pack(self, t: Tensor) -> _Held | _Unowned:
        stage = self._running
        if stage is None or t.untyped_storage().data_ptr() in self._params:
            return _Unowned(t.detach())
        return self._ledger.hold(stage, t)

    def __enter__(self) -> StageSavedBytes:
        self._params = {p.untyped_storage().data_ptr() for m in self.stages for p in m.parameters()}
        for s, module in enumerate(self.stages):
            self._handles.append(module.register_forward_pre_hook(lambda *_, s=s: self._enter(s)))
            # always_call: a checkpoint's recomputation stops the forward
            # part-way (by raising), and the stage is over all the same.
            self._handles.append(
                module.register_forward_hook(lambda *_: self._enter_none(), always_call=True)
            )
        self._thread = threading.get_ident()
        self._outer: list[tuple[bool, int | None]] = []
        self._index = {id(m): s for s, m in enumerate(self.stages)}
        self._hooks.__enter__()
        checkpoint.stage_watchers.append(self._checkpointing)
        return self

    def _enter_none(self) -> None:
        self._running = None

    def _checkpointing(self, stage: nn.Module | None) -> None:
        """A checkpoint keeps its stage's input before the stage's hooks run:
        one of ours (on this thread) is running from then on, and whatever
        ran before runs again after it (None: the checkpoint ended)."""
        if threading.get_ident() != self._thread:
            return
        if stage is None:
            if not self._outer:  # a checkpoint begun before the tracker was
                return
            owned, before = self._outer.pop()
            if owned:
                self._running = before
            return
        index = self._index
        found = index.get(id(stage), index.get(id(getattr(stage, "_orig_mod", None))))
        self._outer.append((found is not None, self._running))
        if found is not None:
            self._running = found

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        checkpoint.stage_watchers.remove(self._checkpointing)
        self._running = None


class _Unowned:
    """A tensor saved outside any stage's forward (the loss): not counted."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
