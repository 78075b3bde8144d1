"""Graphs captured on one stream go together (:mod:`mpstream.runtime.graphed.lifetimes`):
a graph whose owner died waits while another owner's graph on its stream
lives, then they all go at once; streams are independent; an owner's death
met while the registry is busy is handled when it is next used. On a GPU, a
graph replays right after its stream's other graph was let go."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from mpstream.runtime.graphed.capturing import capturing
from mpstream.runtime.graphed.lifetimes import Lifetimes


class Graph:
    """Stands for a ``torch.cuda.CUDAGraph``: only its destruction matters."""


class Owner:
    pass


S, T = (0, 1111), (0, 2222)


def test_a_graph_let_go_waits_for_the_other_graphs_of_its_stream() -> None:
    reg = Lifetimes()
    a, b = Owner(), Owner()
    ga, gb, gt = Graph(), Graph(), Graph()
    reg.adopt(ga, S, a)
    reg.adopt(gb, S, b)
    reg.adopt(gt, T, a)  # the same owner on another stream
    alive = [weakref.ref(g) for g in (ga, gb, gt)]
    del ga, gb, gt
    assert reg.held() == 3
    del a  # its graph on S waits for b's; on T nothing else: it goes
    gc.collect()
    assert [r() is not None for r in alive] == [True, True, False]
    assert reg.held(S) == 2 and reg.held(T) == 0
    del b
    gc.collect()
    assert all(r() is None for r in alive) and reg.held() == 0


def test_a_graph_nobody_owns_goes_at_once_unless_its_stream_has_owned_ones() -> None:
    reg = Lifetimes()
    scratch = Graph()
    gone = weakref.ref(scratch)
    reg.adopt(scratch, S, None)
    del scratch
    assert gone() is None  # nothing else on S
    owner, scratch = Owner(), Graph()
    reg.adopt(Graph(), S, owner)
    gone = weakref.ref(scratch)
    reg.adopt(scratch, S, None)
    del scratch
    assert gone() is not None  # waits for the owned graph on S
    del owner
    gc.collect()
    assert gone() is None and reg.held() == 0


def test_an_owner_that_dies_while_the_registry_is_busy_is_reaped_on_its_next_use() -> None:
    reg = Lifetimes()
    owner, graph = Owner(), Graph()
    reg.adopt(graph, S, owner)
    gone = weakref.ref(graph)
    del graph
    with reg._lock:  # as when a garbage collection runs inside adopt()
        del owner
        gc.collect()
    assert gone() is not None  # the death is queued, not lost
    assert reg.held() == 0 and gone() is None


def test_a_capture_underway_keeps_its_streams_graphs_when_their_owners_die() -> None:
    # Another capture on the stream may bake in the workspace the others'
    # destruction would drop: nothing of the stream goes until it ends.
    reg = Lifetimes()
    owner, graph = Owner(), Graph()
    reg.adopt(graph, S, owner)
    gone = weakref.ref(graph)
    del graph
    with reg.pinned(S):
        del owner
        gc.collect()
        assert gone() is not None
        new_owner = Owner()
        reg.adopt(Graph(), S, new_owner)  # the capture's own graph, adopted at its end
    assert gone() is not None  # the new graph's owner lives
    del new_owner
    gc.collect()
    assert gone() is None and reg.held() == 0


def test_a_death_queued_while_another_thread_held_the_lock_is_reaped_when_it_lets_go() -> None:
    reg = Lifetimes()
    owner, graph = Owner(), Graph()
    reg.adopt(graph, S, owner)
    gone = weakref.ref(graph)
    del graph
    with reg.pinned(T):  # any use that takes and releases the lock
        with reg._lock:
            del owner
            gc.collect()
        assert gone() is not None  # queued: the lock was held
    assert gone() is None  # reaped as the pin let go, with no further adopt()


def test_an_owners_many_graphs_are_one_entry() -> None:
    reg = Lifetimes()
    owner = Owner()
    graphs = [Graph() for _ in range(3)]
    for g in graphs:
        reg.adopt(g, S, owner)
    assert reg.held(S) == 3 and len(reg._groups[S].owners) == 1


@pytest.mark.cuda
def test_a_graph_replays_right_after_another_graph_of_its_stream_was_let_go() -> None:
    # Torch 2.11's CUDAGraph destructor drops its stream's cuBLAS workspace,
    # whose address the other graph baked in: the registry keeps it alive.
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    a, b = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    owners, graphs, outs = [Owner(), Owner()], [], []
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for owner in owners:
            a @ b  # warm-up: the stream's workspace exists before capture
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, torch.cuda.graph_pool_handle(), owner=owner):
                outs.append(a @ b)
            graphs.append(graph)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    del graphs[0], owners[0]
    gc.collect()
    # What a dropped workspace's memory would become next: filled tensors.
    junk = [torch.full((1 << 22,), 7.0, device="cuda") for _ in range(16)]
    outs[1].zero_()
    graphs[0].replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(outs[1], a @ b)
    assert all(bool((j == 7.0).all()) for j in junk)
