"""The devices a step is captured on, and the graphs a step adds on each.

One CUDA graph cannot span devices: PyTorch's graph memory pools are per
device and multi-device replays fault (pytorch/pytorch#153025, open in
2026). So a step is captured as one graph only when every stage is on one
GPU; on several, the stages replay their own graphs (``Pipe(graphs=True)``,
each on its device) and what the step issues around them, the gradients'
zeroing and the optimizer's update, is captured by :class:`DeviceGraphs`
as one graph per device, replayed on each device's current stream.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..runtime.graphed.capturing import CaptureApi, capturing

__all__ = ["Cuda", "DeviceGraphs", "capture_devices"]


def capture_devices(devices: Sequence[torch.device], graphed: bool) -> list[torch.device]:
    """The GPUs a step on stages on ``devices`` is captured on.

    Args:
        devices: each stage's device.
        graphed: whether the stages replay graphs of their own.

    Returns:
        The distinct CUDA devices, in stage order (empty: every stage on
        CPUs, where the step runs eagerly).

    Raises:
        ValueError: stages on both CPUs and GPUs, or on several GPUs with
            stages that are not graphed (the step would be one graph).
    """
    distinct = list(dict.fromkeys(devices))
    cuda = [d for d in distinct if d.type == "cuda"]
    if cuda and len(cuda) < len(distinct):
        raise ValueError(
            f"CapturedStep needs every stage on CUDA devices or every stage on CPUs: "
            f"stages are on {', '.join(map(str, distinct))}; move the CPU stages to a GPU "
            f"or run the pipe eagerly."
        )
    if len(cuda) > 1 and not graphed:
        raise ValueError(
            f"CapturedStep: stages are on {', '.join(map(str, cuda))}, and PyTorch cannot "
            f"replay one CUDA graph across devices (pytorch/pytorch#153025); build the pipe "
            f"with graphs=True: each stage then replays graphs of its own on its device, and "
            f"the step captures the zeroing and the optimizer's update per device."
        )
    return cuda


@dataclass(frozen=True)
class Cuda:
    """The CUDA objects :class:`DeviceGraphs` makes and how it makes a stream
    current: PyTorch's by default; a test passes fakes that log."""

    stream: Callable[[torch.device], Any] = field(default=torch.cuda.Stream)
    graph: Callable[[], Any] = field(default=torch.cuda.CUDAGraph)
    current: Callable[[torch.device], Any] = field(default=torch.cuda.current_stream)
    use: Callable[[Any], AbstractContextManager[Any]] = field(default=torch.cuda.stream)
    pool: Callable[[], Any] = field(default=torch.cuda.graph_pool_handle)
    undo: CaptureApi | None = None  # None: torch's own calls


class DeviceGraphs:
    """What one call issues on each of some devices, captured as a graph per device.

    Construction runs nothing: each device's share of the call's work is
    recorded on a side stream of that device, which starts after the
    device's current stream and which that stream then waits on (what a
    capture does eagerly, before torch 2.13 its prologue's writes of the
    generator's graph scalars, stays in order); :meth:`replay` launches
    each graph on its device's current stream, which orders the captured
    work. A device on which the call issued nothing gets no graph.

    Args:
        fn: the work (zeroing gradients, an optimizer's step).
        devices: the GPUs it issues work on.
        cuda: what makes streams and graphs (tests pass fakes).

    Raises:
        Exception: whatever the capture raised; every capture opened is
            undone first (:func:`~mpstream.runtime.graphed.capturing.capturing`).
    """

    def __init__(
        self, fn: Callable[[], object], devices: Sequence[torch.device], cuda: Cuda | None = None
    ) -> None:
        self.cuda = c = cuda or Cuda()
        self.graphs: dict[torch.device, Any] = {}
        if not devices:
            return
        # Captures of several devices are open side by side: a second one's
        # start and the first one's end are calls a thread-local capture
        # forbids its own thread.
        mode = "relaxed" if len(devices) > 1 else "thread_local"
        sides = {d: c.stream(d) for d in devices}
        graphs = {d: c.graph() for d in devices}
        empty: set[torch.device] = set()
        opened: list[tuple[torch.device, ExitStack]] = []
        try:
            for d in devices:
                sides[d].wait_stream(c.current(d))
                stack = ExitStack()
                # Begun, ended and undone with its stream current on its
                # device, which is what torch checks the capture against.
                with c.use(sides[d]):
                    stack.enter_context(capturing(graphs[d], c.pool(), c.undo, mode, self))
                opened.append((d, stack))
            with ExitStack() as current:
                for d in devices:
                    current.enter_context(c.use(sides[d]))
                fn()
            while opened:
                d, stack = opened[0]
                with c.use(sides[d]), _sorted_warnings(d, empty):
                    opened.pop(0)
                    stack.close()
        except BaseException as exc:
            while opened:
                d, stack = opened.pop()
                with c.use(sides[d]), _sorted_warnings(d, set()):
                    stack.__exit__(type(exc), exc, exc.__traceback__)
            raise
        for d in devices:
            c.current(d).wait_stream(sides[d])
        self.graphs = {d: g for d, g in graphs.items() if d not in empty}

    @property
    def launches(self) -> int:
        """Graph launches per :meth:`replay`."""
        return len(self.graphs)

    def replay(self) -> None:
        """Launches each device's graph on its current stream: after what was
        issued there, before what is issued next."""
        for device, graph in self.graphs.items():
            with self.cuda.use(self.cuda.current(device)):
                graph.replay()


@contextmanager
def _sorted_warnings(device: torch.device, empty: set[torch.device]) -> Iterator[None]:
    """Takes torch's warning that a capture on ``device`` is empty (adding
    ``device`` to ``empty``: nothing of the call's there, so no launch); any
    other warning is passed on, also when the block raises."""
    catcher = warnings.catch_warnings(record=True)
    said = catcher.__enter__()
    warnings.simplefilter("always")
    try:
        yield
    finally:
        catcher.__exit__(None, None, None)
        for w in said or ():
            if "CUDA Graph is empty" in str(w.message):
                empty.add(device)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
