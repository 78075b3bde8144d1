"""A step's warm-up and capture on CUDA, undone if either fails.

Capture needs what runs once (allocations, cuDNN autotuning, optimizer
state, graphed stages' own captures) done beforehand, on side streams, not
the default ones. :func:`warm_up_and_capture` runs the warm-up steps there,
then captures the step as one graph (or, over graphed stages, lets the
caller capture what runs around them), and puts the pipe, the optimizer,
the generators and the caller's streams back, whether it succeeds or not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import torch
from torch import Tensor

from ..pipe.pipe import Pipe
from ..runtime.errors import annotate
from ..runtime.graphed.capturing import capturing
from ..runtime.graphed.lifetimes import LIFETIMES
from ..runtime.stream import synchronize
from .optimizer import check_state
from .state import Saved, Trained

__all__ = ["warm_up_and_capture"]


def warm_up_and_capture(
    step: Callable[[], Tensor],
    pipe: Pipe,
    trained: Trained,
    devices: Sequence[torch.device],
    warmup: int,
    pool: Any,
    owner: object,
    around: Callable[[], None] | None = None,
) -> tuple[torch.cuda.CUDAGraph | None, Tensor | None]:
    """Runs ``warmup`` steps, then captures one; what they changed is undone.

    Args:
        step: one whole training step, as Python issues it.
        pipe: the pipe the step trains.
        trained: what the step changes (saved first, restored after).
        devices: the GPUs the step runs on.
        warmup: eager steps before capture.
        pool: the one graph's memory pool (None: a new one).
        owner: who holds the graph (its lifetime, :mod:`~..lifetimes`).
        around: over graphed stages, captures what runs around them (the
            stages keep their own graphs): called instead of capturing
            ``step`` as one graph.

    Returns:
        The step's graph and the loss tensor its replays write, or
        ``(None, None)`` where ``around`` captured.

    Raises:
        Exception: whatever warm-up or capture raised, with a note; the
            pipe, the optimizer, the generators and the caller's streams
            and device are restored first.
    """
    saved = Saved(trained, devices)
    callers = {d: torch.cuda.current_stream(d) for d in devices}
    device = torch.cuda.current_device()
    graph: torch.cuda.CUDAGraph | None = None
    loss: Tensor | None = None
    try:
        sides = {d: torch.cuda.Stream(d) for d in devices}  # type: ignore[no-untyped-call]
        for d in devices:
            sides[d].wait_stream(callers[d])
        with _current(sides):
            for _ in range(warmup):
                step()
        check_state(trained.optimizer)  # as warm-up made it
        for d in devices:
            callers[d].wait_stream(sides[d])
        # On the warm-up's streams: library workspaces exist; not default streams.
        synchronize(devices)  # as torch.cuda.graph does
        # As torch.cuda.graph does too: while a capture is underway the
        # allocator frees no cached block, and the graph's pool cannot use
        # them, so warm-up's cached activations would stay beside the
        # capture's own (about 40 GB more at the transformer's 1b preset).
        torch.cuda.empty_cache()
        if around is not None:
            around()
        else:
            graph = torch.cuda.CUDAGraph()
            # Undone if it fails (unlike torch.cuda.graph); a loader thread may run.
            own = torch.cuda.graph_pool_handle() if pool is None else pool
            # The graph bakes in the library workspaces of every stream its
            # capture forks onto (the stages'): kept with their graphs.
            forked = [_key(st) for _, st in pipe.scheduler.named_streams()]
            with ExitStack() as pins:
                for key in forked:
                    pins.enter_context(LIFETIMES.pinned(key))
                with pipe.scheduler.captured(), _current(sides), capturing(graph, own, owner=owner):
                    loss = step()
                for key in forked:
                    LIFETIMES.adopt(graph, key, owner)
        for c in callers.values():
            c.synchronize()
    except BaseException as exc:
        for c in callers.values():  # the warm-up's streams were current
            torch.cuda.set_stream(c)
        torch.cuda.set_device(device)  # set_stream made each stream's device current
        with suppress(RuntimeError):  # a failed capture may leave a CUDA error behind
            synchronize(devices)
        saved.restore(captured=False)
        annotate(
            exc,
            "mpstream.CapturedStep: capturing the step failed; the pipe, the optimizer "
            "and the random number generators are as they were before. Run the pipe "
            "eagerly, or see docs/tuning.md (When the host is the bottleneck) for what "
            "capture needs.",
        )
        raise
    saved.restore(captured=True)
    synchronize(devices)
    return graph, loss


def _key(stream: Any) -> tuple[int, int]:
    return (stream.device_index, stream.cuda_stream)


@contextmanager
def _current(streams: dict[torch.device, Any]) -> Iterator[None]:
    """Makes each stream current on its device, and the first device current."""
    with ExitStack() as stack:
        for stream in streams.values():
            stack.enter_context(torch.cuda.stream(stream))
        stack.enter_context(torch.cuda.device(next(iter(streams))))
        yield
