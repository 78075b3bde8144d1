"""A failed capture is undone completely, in order, and its own error propagates.

:class:`FakeGraph` does what torch 2.11's ``CUDAGraph`` does to the world
(``aten/src/ATen/cuda/CUDAGraph.cpp``): ``capture_begin`` puts the generator
in capture mode, then routes the allocator to the pool (one use of it),
then begins the stream capture; ``capture_end`` ends the stream capture
(raising first if it was invalidated), then the routing, checks the graph,
ends the generator's capture mode, marks the capture ended and instantiates;
the destructor releases the pool only after an ended capture. Each failure
point is injected, and afterwards the world must be clean."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import pytest

from mpstream.runtime.graphed import capturing as capturing_module
from mpstream.runtime.graphed.capturing import capturing

POOL = (0, 7)


@dataclass
class World:
    """What a capture touches: the stream, the allocator, the generator."""

    log: list[str] = field(default_factory=list)
    stream: str = "idle"  # idle, capturing or invalidated
    routes: list[Any] = field(default_factory=list)
    uses: int = 0
    generator_capturing: bool = False

    def clean(self) -> bool:
        return (self.stream, self.routes, self.uses, self.generator_capturing) == (
            "idle", [], 0, False
        )  # fmt: skip


class FakeGraph:
    """torch 2.11's CUDAGraph, failing where ``fail`` says."""

    def __init__(self, world: World, fail: str | None = None) -> None:
        self.world, self.fail, self.ended, self.pool_id = world, fail, False, None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        w = self.world
        w.log.append("capture_begin")
        w.generator_capturing = True  # the generator's prologue comes first
        if self.fail == "begin, before routing":
            raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
        self.pool_id = pool
        w.routes.append(pool)
        w.uses += 1
        if self.fail == "begin, after routing":
            raise RuntimeError("CUDA error: operation not permitted")
        w.stream = "capturing"

    def capture_end(self) -> None:
        w = self.world
        w.log.append("capture_end")
        if w.stream == "idle":
            raise RuntimeError("CUDA error: illegal state")
        invalidated, w.stream = w.stream == "invalidated", "idle"
        if invalidated:
            raise RuntimeError(
                "CUDA error: operation failed due to a previous error during capture"
            )
        w.routes.remove(self.pool_id)
        if self.fail == "end, invalid capture":
            raise RuntimeError("Invalid capture.")
        w.generator_capturing = False
        self.ended = True
        if self.fail == "end, instantiate":
            raise RuntimeError("CUDA error: out of memory")

    def pool(self) -> Any:
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self.pool_id

    def destroy(self) -> None:
        """~CUDAGraph: its pool's use goes only after an ended capture."""
        if self.ended:
            self.world.uses -= 1


class FakeApi:
    """The cleanup's torch calls, on the fake world."""

    def __init__(self, world: World, broken: str | None = None) -> None:
        self.world, self.broken = world, broken

    def device(self) -> int:
        return 0

    def capturing(self) -> bool:
        return self.world.stream != "idle"

    def end_routing(self, device: int, pool: Any) -> None:
        self.world.log.append("end_routing")
        if pool not in self.world.routes:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.world.routes.remove(pool)

    def release(self, device: int, pool: Any) -> None:
        self.world.log.append("release")
        if self.broken == "release":
            raise RuntimeError("uc >= 0 INTERNAL ASSERT FAILED\ndetail")
        self.world.uses -= 1

    def keep(self, graph: Any) -> None:
        self.world.log.append("keep")

    def kept(self) -> int:
        return self.world.log.count("keep")

    def reset_generator(self) -> None:
        self.world.log.append("reset_generator")
        self.world.generator_capturing = False

    def adopt(self, graph: Any, owner: object | None) -> None:
        self.world.log.append("adopt")
        self.adopted = (graph, owner)

    def hold(self) -> AbstractContextManager[None]:
        return nullcontext()


def host_sync(world: World) -> None:
    world.stream = "invalidated"  # .item() inside the capture
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def silent_invalidation(world: World) -> None:
    world.stream = "invalidated"


def python_error(world: World) -> None:
    raise ValueError("a shape the stage refuses")


def nothing(world: World) -> None:
    pass


UNDO = ["keep", "end_routing", "release", "reset_generator"]

#: fail point, body, what propagates, the calls made (in order).
CASES: dict[str, tuple[str | None, Callable[[World], None], str | None, list[str]]] = {
    "success": (None, nothing, None, ["capture_begin", "capture_end", "adopt"]),
    "a host sync inside": (
        None, host_sync, "not permitted when stream is capturing",
        ["capture_begin", "capture_end", *UNDO],
    ),
    "an invalidation only capture_end sees": (
        None, silent_invalidation, "previous error during capture",
        ["capture_begin", "capture_end", *UNDO],
    ),
    "a Python error in a valid capture": (
        None, python_error, "a shape the stage refuses",
        ["capture_begin", "capture_end", "adopt"],
    ),
    "capture_begin before routing": (
        "begin, before routing", nothing, "non-default stream",
        ["capture_begin", "keep", "end_routing", "reset_generator"],
    ),
    "capture_begin after routing": (
        "begin, after routing", nothing, "operation not permitted", ["capture_begin", *UNDO],
    ),
    "capture_end after routing ended": (
        "end, invalid capture", nothing, "Invalid capture", ["capture_begin", "capture_end", *UNDO],
    ),
    "capture_end after the capture ended": (
        "end, instantiate", nothing, "out of memory", ["capture_begin", "capture_end", "adopt"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_failed_capture_is_undone_in_order_and_its_own_error_propagates(case: str) -> None:
    fail, body, raised, calls = CASES[case]
    world = World()
    graph = FakeGraph(world, fail)
    if raised is None:
        with capturing(graph, POOL, FakeApi(world)):
            body(world)
    else:
        with pytest.raises(Exception, match=raised) as info:
            with capturing(graph, POOL, FakeApi(world)):
                body(world)
        assert not getattr(info.value, "__notes__", None)  # expected cleanup errors are dropped
    assert world.log == calls
    graph.destroy()
    assert world.clean(), world


def test_a_captured_graph_is_handed_to_the_lifetimes_with_its_owner() -> None:
    world, owner = World(), object()
    graph, api = FakeGraph(world), FakeApi(world)
    with capturing(graph, POOL, api, owner=owner):
        pass
    assert api.adopted == (graph, owner)  # kept until the stream's graphs can all go


def test_an_unexpected_cleanup_error_is_a_note_on_the_original() -> None:
    world = World()
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing") as info:
        with capturing(FakeGraph(world), POOL, FakeApi(world, broken="release")):
            host_sync(world)
    assert info.value.__notes__ == [
        "while undoing the failed capture, releasing the graph's pool raised RuntimeError: "
        "uc >= 0 INTERNAL ASSERT FAILED"
    ]
    assert world.log[-1] == "reset_generator"  # the steps after it still ran
    assert not world.generator_capturing and not world.routes


def test_failed_captures_kept_alive_are_bounded() -> None:
    world = World()
    api = FakeApi(world)
    for _ in range(capturing_module.MAX_KEPT):
        with pytest.raises(RuntimeError, match="operation not permitted"):
            with capturing(FakeGraph(world), POOL, api):
                host_sync(world)
    assert api.kept() == capturing_module.MAX_KEPT and world.clean()
    # No more are tried (nothing begun, nothing more kept alive), saying why.
    begun = world.log.count("capture_begin")
    with pytest.raises(RuntimeError, match="16 graph captures failed in this process"):
        with capturing(FakeGraph(world), POOL, api):
            pass
    assert world.log.count("capture_begin") == begun and api.kept() == capturing_module.MAX_KEPT
