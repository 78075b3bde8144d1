"""A write the caller makes mid-run into tensors the stage streams write too.

``Pipe.zero_grad(set_to_none=False)`` may run while a pass is under way: in
a ``train_step``'s ``loss_fn`` (inside the last stage's task), or from a
hook in a backward pass. Its kernels go to the current stream of each
parameter's device, while the stages' backward kernels add into the same
``.grad`` on their compute streams, queued earlier or later by the host and
ordered with that stream by nothing. Read as the host issued them (as on
the CPU, and as eager autograd's order says), a zeroing drops every add
queued before it and keeps every add queued after it. :func:`ordered_write`
makes the streams keep that order: the writing stream waits for the work
queued so far on each compute stream of its device, and each of them waits
for the write before its next kernel. Outside a run and a backward pass
nothing is needed (the caller's streams wait for a run at its end, and a
run's streams for the caller's at its start), and nothing is issued.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from . import private
from .stream import AnyStream, current_stream, is_cuda

__all__ = ["ordered_write"]


class Streams(Protocol):
    """What is read of an :class:`~mpstream.runtime.scheduler.EventScheduler`."""

    devices: Sequence[torch.device]
    compute_streams: Sequence[AnyStream | None]
    native: Any  # its running flag


def _capturing(stream: AnyStream) -> bool:
    """Whether a CUDA graph captures ``stream``."""
    with torch.cuda.stream(stream):  # type: ignore[arg-type]
        return torch.cuda.is_current_stream_capturing()


@contextmanager
def ordered_write(sched: Streams | None) -> Iterator[None]:
    """Orders what the body queues on the current streams between the stage
    streams' work queued before and after it (see the module), while a run
    or a backward pass is under way.

    Args:
        sched: the pipe's scheduler; None before its first run (no stream
            has work then).
    """
    mid = sched is not None and (sched.native.running or private.current_graph_task_id() != -1)
    if not mid:
        yield
        return
    assert sched is not None
    pairs: list[tuple[AnyStream, list[AnyStream]]] = []
    for device in dict.fromkeys(sched.devices):
        if device.type != "cuda":
            continue
        writer = current_stream(device)
        # A stream a CUDA graph captures (a CapturedStep's, a graphed stage's
        # capture) may be ordered only with streams of its capture: a wait
        # across the capture's boundary is refused.
        captured = _capturing(writer)
        stages = [
            st
            for d, st in zip(sched.devices, sched.compute_streams)
            if d == device and st is not None and is_cuda(st) and st != writer
        ]
        stages = [st for st in dict.fromkeys(stages) if _capturing(st) == captured]
        pairs.append((writer, stages))
    for writer, stages in pairs:
        for st in stages:
            writer.wait_stream(st)  # type: ignore[union-attr, arg-type]
    try:
        yield
    finally:
        # Also after a write that failed part way: what it queued is ordered.
        for writer, stages in pairs:
            for st in stages:
                st.wait_stream(writer)  # type: ignore[union-attr, arg-type]
