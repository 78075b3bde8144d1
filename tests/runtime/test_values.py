"""Flow: a run's values are dropped at their last read, in the order issued."""

from __future__ import annotations

import torch

from mpstream.runtime.graph import ALL, Ref, Routes, StageGraph
from mpstream.runtime.values import Flow, Wiring

# Stage 0 feeds stages 1 and 2, which do not read each other; stage 3 reads
# both. Stages 0 and 2 share device 0, stages 1 and 3 device 1.
FORK = StageGraph(
    args=((Ref(-1, ALL),), (Ref(0, 0),), (Ref(0, 0),), (Ref(1, 0), Ref(2, 0))),
    outputs=(1, 1, 1, 1),
    result=Ref(3, 0),
)


def flow_of(graph: StageGraph, devices: tuple[int, ...]) -> tuple[Flow, Routes]:
    routes = Routes(graph, devices, input_device=devices[0])
    return Flow(Wiring(routes), [(torch.zeros(2),)]), routes


def copy_into(flow: Flow, routes: Routes, q: int) -> None:
    """The copies of the hops stage ``q`` receives (run before its forward)."""
    for hop in routes.by_task.values():
        if hop.peer == q:
            flow.put_moved(hop, 0, flow.hop_values(hop, 0))


def run_forward(flow: Flow, routes: Routes, q: int) -> None:
    """What a run does for stage ``q``'s forward."""
    copy_into(flow, routes, q)
    flow.store(q, 0, torch.full((2,), float(q)))
    flow.release(q, 0)


def test_a_chain_drops_each_output_after_its_reader() -> None:
    flow, routes = flow_of(StageGraph.chain(3), (0, 1, 1))
    run_forward(flow, routes, 0)
    assert flow.outs[0][0] is None  # the inputs: stage 0 read them last
    run_forward(flow, routes, 1)
    assert flow.outs[0][1] is None and flow.moved[0] == {}
    run_forward(flow, routes, 2)
    assert flow.outs[0][2] is None
    assert flow.outs[0][3] is not None  # the result's stage keeps its output


def test_a_producer_stays_until_its_last_read_in_issue_order() -> None:
    # An order may issue stage 2 before stage 1 (neither reads the other):
    # stage 0's output and its copy to device 1 must outlive stage 2's
    # forward, though stage 2 is its highest reader.
    flow, routes = flow_of(FORK, (0, 1, 0, 1))
    run_forward(flow, routes, 0)
    run_forward(flow, routes, 2)
    assert flow.outs[0][1] is not None
    run_forward(flow, routes, 1)  # copies stage 0's output in, then reads it
    assert flow.outs[0][1] is None and (0, 1) not in flow.moved[0]
    run_forward(flow, routes, 3)
    assert flow.outs[0][2] is None and flow.outs[0][3] is None
    assert flow.moved[0] == {}


def test_keep_counts_reads_as_release_does() -> None:
    flow, routes = flow_of(FORK, (0, 1, 0, 1))
    for q in (0, 2, 1):
        copy_into(flow, routes, q)
        assert flow.keep(q, 0, torch.ones(2)) is None
    assert all(out is None for out in flow.outs[0][:2])
    copy_into(flow, routes, 3)
    torch.testing.assert_close(flow.keep(3, 0, torch.ones(2)), torch.ones(2))
    assert flow.moved[0] == {}


def test_result_and_result_sources_read_the_same_refs() -> None:
    # result() read the wiring's list, result_sources() the flow's mirror of
    # it: a wiring rebound after the flow was made split them.
    flow, routes = flow_of(StageGraph.chain(2), (0, 1))
    for q in (0, 1):
        run_forward(flow, routes, q)
    flow.wiring.result_refs = []
    assert flow.result_sources(0) == []  # the last stage's output alone
    torch.testing.assert_close(flow.result(0), torch.full((2,), 1.0))
