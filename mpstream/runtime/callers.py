"""A call of a pipe made from another stream than the previous call's.

A run orders itself after its caller's current stream only (the source
event the scheduler records there, ``csrc/scheduler.cpp`` ``begin_run``).
What the previous call left for its own caller is read on that caller's
stream, after the call returned or at its very end: a graphed pipe's
outputs are the replays' buffers until ``gather`` concatenates them (or
``finish`` copies a single micro-batch's) on the caller's stream, and the
parameter gradients (a graphed stage's ``.grad`` views the buffers its
graphs add into) are read by the caller's optimizer step. A next call made
from another stream would let its replays and gradient adds overtake those
reads. :class:`CallerStreams` makes such a call's current stream wait on
the previous call's first, before the call issues anything: the run's
source events then imply it.

One read of the previous call's is on none of its caller's streams: the
gradient of a pipeline input on another GPU than the stage reading it is
copied back by the input's :class:`~.copy.Copy` node on the io stream of
the stage's device, and where that stage is graphed the gradient is the
stage's static input-gradient buffer (``runtime/replay_autograd.py``
hands it on uncopied), which the next backward replay of the same graph
rewrites on the stage's stream. A next call whose input comes the same way
copies it in on that io stream first, and the stage waits for that copy;
one whose input already sits on the stage's device (or a training step,
with no input copy there at all) has no such task. So the copy notes its
stream (:meth:`CallerStreams.note_read`) and the next call's current stream
waits on it too. (A host input's gradient needs none: the host waits for
its copy, :class:`~.transfer.HostWait`; an input on the stage's device gets
a copy made on the stage's own stream.)

A call that fails after :meth:`CallerStreams.follow` owes the next one
nothing more: its waits went onto its own caller's stream before anything
else of it, and a wait on that stream (an event recorded there) covers
what it waited on, CUDA's ordering being transitive. Only a ``follow``
that raises part-way (a Ctrl-C) leaves waits unissued: it then keeps the
previous call's streams as the latest and puts the reads back, so the next
call waits on them.

Host cost: one current-stream lookup per CUDA device per call; the wait
only when the stream changed, or a backward noted a read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .stream import AnyStream, capturing, current_stream

__all__ = ["CallerStreams"]


class CallerStreams:
    """The streams the latest call of one pipe was made from, per CUDA device.

    Args:
        devices: the pipe's caller devices (one per device its stages use);
            only CUDA ones have streams to follow.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = [d for d in devices if d.type == "cuda"]
        #: Per CUDA device, the current stream of the latest call (None
        #: before the first).
        self.latest: list[AnyStream] | None = None
        #: Per CUDA device (its index in :attr:`devices`), the stream a
        #: backward read a graph's buffer on since the latest call, for the
        #: next call to wait on (see :meth:`note_read`).
        self.reads: dict[int, AnyStream] = {}

    def note_read(self, device: torch.device, stream: AnyStream) -> None:
        """Called as autograd copies the gradient of a pipeline input back
        from ``device`` on ``stream`` (that device's io stream): the next
        call's current stream there waits on ``stream`` before the call
        issues anything (see the module's docstring).

        Args:
            device: the receiving stage's device, as the pipe names it
                (one of :attr:`devices`; a host device notes nothing).
            stream: the stream the gradient was read on there.
        """
        if device in self.devices:
            self.reads[self.devices.index(device)] = stream

    def follow(self) -> None:
        """Called as a call starts: where the calling thread's current
        stream differs from the latest call's, it waits on that one; where
        a backward noted a read since (:meth:`note_read`), on that read's
        stream too.

        Nothing is waited on or remembered while a CUDA graph captures the
        call: an event recorded outside a capture cannot be waited on inside
        it, and the graph's replays run wherever the user replays them (the
        reads noted stay for the next call outside a capture). Raising
        part-way, it leaves the next call owing every wait it owed.
        """
        if not self.devices:
            return
        now = [current_stream(d) for d in self.devices]
        latest = self.latest
        if now == latest and not self.reads:
            return
        if capturing(self.devices):
            return
        if latest is not None:
            for new, old in zip(now, latest):
                if new != old:
                    new.wait_stream(old)  # type: ignore[union-attr, arg-type]
        reads, self.reads = self.reads, {}
        try:
            for i, stream in reads.items():
                if now[i] != stream:
                    now[i].wait_stream(stream)  # type: ignore[union-attr, arg-type]
        except BaseException:
            # A wait interrupted (Ctrl-C) or refused: the next call owes the
            # reads (a read noted since is newer and stays).
            self.reads = {**reads, **self.reads}
            raise
        self.latest = now
