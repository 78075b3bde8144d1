"""Fake CUDA streams and graphs of several devices that log into one world,
so DeviceGraphs can be checked on the CPU."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from mpstream.capture.devices import Cuda

D0, D1 = torch.device("cuda:0"), torch.device("cuda:1")  # names only: nothing runs there


class World:
    """Each device's current stream, the device current now, and one log."""

    def __init__(self, devices: tuple[torch.device, ...] = (D0, D1)) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.current = {d: FakeStream(self, f"main{d.index}", d) for d in devices}
        self.device = devices[0]
        self.capturing: dict[str, FakeGraph] = {}  # stream name -> graph capturing on it
        self.graphs: list[FakeGraph] = []
        self.streams = 0

    def cuda(self) -> Cuda:
        return Cuda(
            stream=self.stream,
            graph=lambda: FakeGraph(self),
            current=lambda d: self.current[d],
            use=self.use,
            pool=lambda: ("pool", len(self.graphs)),
            undo=FakeUndo(self),
        )

    def stream(self, device: torch.device) -> FakeStream:
        self.streams += 1
        return FakeStream(self, f"side{self.streams}", device)

    @contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        """As torch.cuda.stream: the stream current on its device, its device current."""
        before, device = self.current[stream.device], self.device
        self.current[stream.device], self.device = stream, stream.device
        try:
            yield
        finally:
            self.current[stream.device], self.device = before, device

    def work(self, device: torch.device, what: str = "work") -> None:
        """A kernel issued on ``device``'s current stream: captured or run."""
        stream = self.current[device]
        graph = self.capturing.get(stream.name)
        if graph is not None:
            graph.nodes.append(what)
            self.log.append(("captured", what, graph.index, stream.name))
        else:
            self.log.append(("ran", what, stream.name))


class FakeStream:
    def __init__(self, world: World, name: str, device: torch.device) -> None:
        self.world, self.name, self.device = world, name, device

    def wait_stream(self, other: FakeStream) -> None:
        self.world.log.append(("wait_stream", self.name, other.name))


class FakeGraph:
    def __init__(self, world: World) -> None:
        self.world = world
        self.index = len(world.graphs)
        world.graphs.append(self)
        self.stream = ""
        self.device: torch.device | None = None
        self.nodes: list[str] = []
        self.fail_end = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        assert capture_error_mode in ("thread_local", "relaxed") and pool is not None
        w = self.world
        stream = w.current[w.device].name
        assert stream not in w.capturing, "one capture per stream"
        assert not stream.startswith("main"), "no capture on a device's own stream"
        if capture_error_mode == "thread_local":
            assert not w.capturing, "side by side captures need relaxed mode"
        self.stream, self.device = stream, w.device
        w.capturing[stream] = self
        w.log.append(("begin", self.index, stream, capture_error_mode))

    def capture_end(self) -> None:
        w = self.world
        assert w.current[w.device].name == self.stream, "ended with its own stream current"
        del w.capturing[self.stream]
        w.log.append(("end", self.index))
        if self.fail_end:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.ended = True
        if not self.nodes:
            warnings.warn(
                "The CUDA Graph is empty. This usually means ...", UserWarning, stacklevel=2
            )

    def pool(self) -> Any:
        if not getattr(self, "ended", False):
            raise RuntimeError("the capture did not end")
        return ("pool", self.index)

    def replay(self) -> None:
        assert self.device is not None
        self.world.log.append(("replay", self.index, self.world.current[self.device].name))


class FakeUndo:
    """The calls that undo a failed capture, logged."""

    def __init__(self, world: World) -> None:
        self.world = world

    def device(self) -> int:
        return int(self.world.device.index or 0)

    def capturing(self) -> bool:
        w = self.world
        return w.current[w.device].name in w.capturing

    def end_routing(self, device: int, pool: Any) -> None:
        self.world.log.append(("end_routing", device, pool))

    def release(self, device: int, pool: Any) -> None:
        self.world.log.append(("release", device, pool))

    def keep(self, graph: Any) -> None:
        self.world.log.append(("keep", graph.index))

    def kept(self) -> int:
        return sum(1 for entry in self.world.log if entry[0] == "keep")

    def reset_generator(self) -> None:
        self.world.log.append(("reset_generator",))

    def adopt(self, graph: Any, owner: object | None) -> None:
        self.world.log.append(("adopt", graph.index, type(owner).__name__))

    def hold(self) -> AbstractContextManager[None]:
        return nullcontext()
