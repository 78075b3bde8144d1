"""Graphs captured on one stream go together.

From torch 2.11 (``aten/src/ATen/cuda/CUDAGraph.cpp``, ``CUDAGraph::reset``,
since pytorch/pytorch#175276; reported as pytorch/pytorch#193402) destroying
a ``torch.cuda.CUDAGraph`` drops the cuBLAS and cuBLASLt workspaces torch
keeps for the stream the graph was captured on. Every other live graph
captured on that stream baked the same workspace's address into its matrix
multiplies: the memory returns to the caching allocator, and their replays
then write their scratch over whatever tensor is allocated there next
(silently), or fault once the memory is unmapped. mpstream's graphs come and
go while others live (a stage's least recently used calls are dropped, a
stage is recaptured after its parameters were replaced, a pipe or a captured
step is garbage), and torch hands out its pooled streams round-robin, so two
owners' graphs can share a stream.

So every graph mpstream captures is adopted here, with its owner (the object
whose death means it is no longer wanted) and its capture stream; it is
released only once every graph captured on that stream has been let go by
its owner, all of them at once. A graph let go early waits for the stream's
others, holding its memory pool until then: that is the cost, paid only when
owners sharing a stream die apart.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

__all__ = ["Lifetimes", "LIFETIMES"]

#: A capture stream: its device's index and its handle.
Key = tuple[int, int]


@dataclass
class _Group:
    """The graphs captured on one stream."""

    # Per live owner (by id): its graphs, and the weak reference that tells.
    owners: dict[int, tuple[list[Any], weakref.ref[Any]]] = field(default_factory=dict)
    retired: list[Any] = field(default_factory=list)
    # Captures underway on the stream: what they bake in must not go meanwhile.
    pins: int = 0


class Lifetimes:
    """Keeps captured graphs until their stream's graphs can all go (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[Key, _Group] = {}
        # Owners that died, for the next holder of the lock to retire: a
        # weak reference's callback may run inside adopt() on this thread
        # (a garbage collection), where the lock is already held.
        self._dead: deque[tuple[Key, int, weakref.ref[Any]]] = deque()

    def adopt(self, graph: Any, stream: Key, owner: object | None) -> None:
        """Keeps ``graph``, captured on ``stream``, while ``owner`` lives (None:
        nothing owns it any more: it waits only for the stream's others)."""
        with self._lock:
            group = self._groups.setdefault(stream, _Group())
            if owner is None:
                group.retired.append(graph)
            else:
                oid = id(owner)
                known = group.owners.get(oid)
                if known is not None and known[1]() is not owner:
                    # A dead owner's id, reused before its death was reaped.
                    group.retired.extend(group.owners.pop(oid)[0])
                if oid not in group.owners:
                    ref = weakref.ref(owner, partial(self._gone, stream, oid))
                    group.owners[oid] = ([], ref)
                group.owners[oid][0].append(graph)
            released = self._reap(stream)
        released.clear()  # destroyed outside the lock: a destructor may take a while
        self._retry()

    @contextmanager
    def pinned(self, stream: Key) -> Iterator[None]:
        """While the block runs (a capture on ``stream``), none of the
        stream's graphs goes, even if its owners all die meanwhile."""
        with self._lock:
            self._groups.setdefault(stream, _Group()).pins += 1
        try:
            yield
        finally:
            with self._lock:
                group = self._groups.get(stream)  # gone only if clear() ran meanwhile
                if group is not None:
                    group.pins -= 1
                released = self._reap(stream)
            released.clear()
            self._retry()

    def _retry(self) -> None:
        """Reaps deaths queued while another thread held the lock (their
        callback could not take it), so their graphs need no later call."""
        while self._dead and self._lock.acquire(blocking=False):
            try:
                released = self._reap()
            finally:
                self._lock.release()
            released.clear()

    def _gone(self, stream: Key, oid: int, ref: weakref.ref[Any]) -> None:
        """An owner died: its graphs retire (now, or when the lock is next
        taken); a stream's go once none of them is owned."""
        self._dead.append((stream, oid, ref))
        if not self._lock.acquire(blocking=False):
            return
        try:
            released = self._reap()
        finally:
            self._lock.release()
        released.clear()

    def _reap(self, *also: Key) -> list[Any]:
        """Retires the dead owners' graphs and takes out every stream's (and
        ``also``'s) graphs that no live owner holds (under the lock)."""
        streams = set(also)
        while self._dead:
            stream, oid, ref = self._dead.popleft()
            group = self._groups.get(stream)
            entry = None if group is None else group.owners.get(oid)
            if group is not None and entry is not None and entry[1] is ref:
                group.retired.extend(group.owners.pop(oid)[0])
            streams.add(stream)
        released: list[Any] = []
        for stream in streams:
            group = self._groups.get(stream)
            if group is not None and not group.owners and not group.pins:
                del self._groups[stream]
                released.extend(group.retired)
        return released

    def held(self, stream: Key | None = None) -> int:
        """Graphs kept (on ``stream``, or on every stream)."""
        with self._lock:
            released = self._reap(*self._groups)
            groups = self._groups.values() if stream is None else [self._groups.get(stream)]
            count = sum(
                len(g.retired) + sum(len(gs) for gs, _ in g.owners.values())
                for g in groups
                if g is not None
            )
        released.clear()
        return count

    def clear(self) -> None:
        """Lets every graph go (at the interpreter's exit, before CUDA's teardown)."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
            self._dead.clear()
        for g in groups:
            g.retired.clear()
            g.owners.clear()


#: The process's graphs (those :func:`~.capturing.capturing` captured).
LIFETIMES = Lifetimes()
atexit.register(LIFETIMES.clear)
