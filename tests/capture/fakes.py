"""Fake CUDA streams, graphs and events that log into one shared world, so
GraphEdges and CapturedStep(groups=...) can be checked on the CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mpstream.capture.edges import Cuda

CPU = torch.device("cpu")


class World:
    """Fake streams, graphs and events sharing one log and one current stream."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.main = FakeStream(self, "main")
        self.current = self.main
        self.capturing: dict[str, FakeGraph] = {}  # stream name -> graph capturing on it
        self.graphs: list[FakeGraph] = []
        self.streams = 0

    def cuda(self) -> Cuda:
        return Cuda(
            stream=self.stream,
            graph=lambda: FakeGraph(self),
            event=lambda: FakeEvent(self),
            marker=lambda: FakeMarker(self),
            use=self.use,
            pool=lambda: ("pool", len(self.graphs)),
            undo=FakeUndo(self),
        )

    def stream(self, device: torch.device) -> FakeStream:
        self.streams += 1
        return FakeStream(self, f"launch{self.streams}")

    @contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


class FakeStream:
    def __init__(self, world: World, name: str) -> None:
        self.world, self.name = world, name

    def wait_stream(self, other: FakeStream) -> None:
        self.world.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, marker: FakeMarker) -> None:
        assert marker.on is not None, "waits on a recorded marker"
        self.world.log.append(("wait_stream", self.name, marker.on))


class FakeMarker:
    """An ordinary event: recorded and waited on outside captures only."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.on: str | None = None

    def record(self, stream: FakeStream) -> None:
        assert not self.world.capturing, "replay markers are not captured"
        self.on = stream.name


class FakeGraph:
    def __init__(self, world: World) -> None:
        self.world = world
        self.index = len(world.graphs)
        world.graphs.append(self)
        self.stream = ""
        self.fail_end = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        assert capture_error_mode in ("thread_local", "relaxed") and pool is not None
        assert self.world.current.name not in self.world.capturing, "one capture per stream"
        if capture_error_mode == "thread_local":
            assert not self.world.capturing, "side by side captures need relaxed mode"
        self.stream = self.world.current.name
        self.world.capturing[self.stream] = self
        self.world.log.append(("begin", self.index, self.stream, capture_error_mode))

    def capture_end(self) -> None:
        assert self.world.current.name == self.stream, "ended on its own stream"
        del self.world.capturing[self.stream]
        self.world.log.append(("end", self.index))
        if self.fail_end:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.ended = True

    def pool(self) -> Any:
        if not getattr(self, "ended", False):
            raise RuntimeError("the capture did not end")
        return ("pool", self.index)

    def replay(self) -> None:
        self.world.log.append(("replay", self.index, self.world.current.name))


class FakeUndo:
    """The calls that undo a failed capture, logged."""

    def __init__(self, world: World) -> None:
        self.world = world

    def device(self) -> int:
        return 0

    def capturing(self) -> bool:
        return self.world.current.name in self.world.capturing

    def end_routing(self, device: int, pool: Any) -> None:
        self.world.log.append(("end_routing", pool))

    def release(self, device: int, pool: Any) -> None:
        self.world.log.append(("release", pool))

    def keep(self, graph: Any) -> None:
        self.world.log.append(("keep", graph.index))

    def kept(self) -> int:
        return sum(1 for entry in self.world.log if entry[0] == "keep")

    def reset_generator(self) -> None:
        self.world.log.append(("reset_generator",))


class FakeEvent:
    def __init__(self, world: World) -> None:
        self.world = world
        self.recorded_in: int | None = None

    def _graph(self) -> int:
        # PyTorch makes a record or wait external only if the current stream captures.
        graph = self.world.capturing.get(self.world.current.name)
        assert graph is not None, "external event use outside a capturing current stream"
        return graph.index

    def record(self, stream: object) -> None:
        self.recorded_in = self._graph()
        self.world.log.append(("record", self.recorded_in, _name(stream)))

    def wait(self, stream: object) -> None:
        graph = self._graph()
        assert self.recorded_in is not None and self.recorded_in < graph, "recorded earlier"
        self.world.log.append(("wait", graph, self.recorded_in, _name(stream)))


def _name(stream: object) -> str | None:
    """What the log says of the stream an event was given (None: none)."""
    return None if stream is None else getattr(stream, "name", repr(stream))
