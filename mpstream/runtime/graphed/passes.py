"""The ends of the backward passes that gradient stores take part in.

A backward pass of the user's loop ends, for each graphed stage's
:class:`~.grads.GradStore` it reached, in a final callback of autograd's
(:class:`PassEnd`): autograd runs those on the streams that were current
around the user's ``backward()`` call, after ordering them after the
streams it accumulated leaf gradients on, so the callback orders them after
the stage streams the graphs added on as well.

**A pass inside a pass.** A plain ``backward()`` run from a hook or a
custom Function's backward inside a pass through the same stores is a pass
of its own, and eager autograd runs the outer pass's post-accumulate hooks
once it has accumulated a parameter's gradient, mostly before the inner
pass starts. The graphs have added the outer pass's gradients into
``.grad`` by then, so when the inner pass first reaches a store,
:func:`finish_part` ends the outer pass's part so far in every store of
that device: their hooks run, tied side buffers are added into ``.grad``
and their hooks run. What the outer pass adds after the inner one is a part
of its own, ended at its end. A training step run inside a pass (from a
hook) ends the outer pass's part so far the same way before it saves the
gradients (else its save would drop them as a failed pass's). A pass that
failed, whose end autograd dropped unrun, is not ended: the next pass or
step to reach a store forgets what it left there (its hooks, its side
sums), as :meth:`~.grads.GradStore.discard` says. Eager autograd
accumulates a parameter when its own node runs, once the pass's gradient of it is whole, hence two
differences: a parameter the outer pass reaches both before and after the
inner one gets its hooks run twice here (once per part), and one whose node
autograd runs only after the inner pass (the first layer's weight, where
the hook is on the pipe's input gradient) sees the outer gradient before
the inner pass's here, and both in eager autograd.

**Gradients taken back** (``torch.autograd.grad``, ``backward(inputs=)``): a
store puts its buffers back on the stage's stream, and :class:`CallerWaits`,
a final callback of that backward's, orders the caller's streams after that.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from ..stream import AnyStream, CPUStream, current_stream
from .tied import TiedHooks

__all__ = ["CallerWaits", "PassEnd", "Store", "after", "closed", "finish_part", "opened"]


class Store(Protocol):
    """What this module uses of a :class:`~.grads.GradStore`."""

    device: torch.device
    tied: TiedHooks

    def flush(self, autograd: bool = True) -> list[torch.cuda.Stream]: ...


def after(stream: AnyStream, producers: Iterable[torch.cuda.Stream]) -> None:
    """Orders ``stream`` after the work issued so far on ``producers``."""
    if not isinstance(stream, CPUStream):
        for producer in producers:
            if producer != stream:
                stream.wait_stream(producer)


def _queue(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class PassEnd:
    """A store's end of a backward pass of the user's loop: queued as a
    final callback, it flushes the store. Autograd holds it while the pass
    runs and drops it when the pass ends or fails: a weak reference to it
    tells whether the pass is still open (see :func:`opened`)."""

    __slots__ = ("store", "__weakref__")

    def __init__(self, store: Store) -> None:
        self.store = store

    def __call__(self) -> None:
        self.store.flush()


# Each store with a pass of the user's loop open: that pass and the
# store's device. Device threads add to it.
_open: weakref.WeakKeyDictionary[Store, tuple[object, torch.device]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def opened(store: Store, token: object) -> weakref.ref[PassEnd]:
    """Queues ``store``'s end of the running backward pass ``token``;
    returns a weak reference to it (dead once autograd dropped it: the pass
    ended or failed)."""
    end = PassEnd(store)
    _queue(end)
    with _lock:
        _open[store] = (token, store.device)
    return weakref.ref(end)


def closed(store: Store) -> None:
    """``store``'s pass ended (flushed or discarded)."""
    with _lock:
        _open.pop(store, None)


def finish_part(store: Store) -> None:
    """Before another pass adds into ``store``'s gradients while its pass
    is still open (a pass inside it): ends that pass's part so far in each
    store with it open on the same device, as the module says, on the
    current stream, which those stores' streams then wait for (the inner
    pass adds into what the hooks read there). Autograd runs a device's
    work on one thread: no other uses those stores meanwhile."""
    with _lock:
        outer = _open.get(store)
        stores = [s for s, key in _open.items() if key == outer]
    tied = {id(s.tied): s.tied for s in stores}
    streams = [st for s in stores for st in s.flush(autograd=False)]
    for t in tied.values():
        t.run()
    stream = current_stream(store.device)
    if not isinstance(stream, CPUStream):
        for st in streams:
            after(st, [stream])


class CallerWaits:
    """Orders the streams current when the running backward pass ends (the
    caller's) after the streams a store put gradients back on within it:
    one final callback per store and pass."""

    __slots__ = ("task", "streams", "done")

    def __init__(self, task: int) -> None:
        self.task = task
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.done = False

    @classmethod
    def note(cls, waits: CallerWaits | None, task: int, stream: AnyStream) -> CallerWaits | None:
        """Notes a put-back on ``stream`` in pass ``task``; returns the
        callback to keep (``waits`` if it is that pass's and has not run,
        else a new one, queued; nothing on the CPU, which needs no order)."""
        if isinstance(stream, CPUStream):
            return waits
        if waits is None or task == -1 or waits.task != task or waits.done:
            waits = cls(task)
            _queue(waits)
        waits.streams[stream.stream_id] = stream
        return waits

    def __call__(self) -> None:
        self.done = True
        for stream in self.streams.values():
            after(current_stream(stream.device), [stream])
