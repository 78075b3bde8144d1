"""What graphed stages hand each other uncopied in the user's own loop.

In a forward run with gradients (``pipe(x)``, then the user's
``loss.backward()``), a replayed stage's outputs go on as the aliases of its
call's static outputs that its :class:`~.replay_autograd.Replay` node returns. A
graphed reader that gets such an alias itself (on the same device: no hop
copied it) is given the producer's call as the argument's
:data:`~.graphed.call.Source`, as a training step's tasks give it: its
graphs read the producer's buffer in place, and where the reader is the
value's only one, write the value's gradient straight into the producer's
static output gradient. Neither side copies. Anything else (a hop's copy,
an eager producer's output, the clones a producer that needs no gradient
hands on) is copied in as before.
Why this holds:

- the reader's graphs read the buffer only in their forward replay (their
  first use of it is a copy, which their backward never reads again), where
  a copy into its own inputs would have read it; the producer's call writes
  it again only at its next forward replay, and a forward run gives each
  micro-batch a slot of its own: a second ``pipe(x)`` before the backward
  finds the producer's call busy (the reader's Replay node holds the
  producer's) and replays another generation of it;
- the reader's key names the producer's call (:meth:`StageGraphs.find
  <.graphed.StageGraphs.find>`), so its graphs only ever read the buffer
  they were captured with, and hold that call alive;
- the gradient reaches the producer's Replay node through autograd as the
  producer's buffer itself, which its backward takes as already there (no
  copy onto itself; another tensor would be copied in); as the value's only
  reader, the reader is the buffer's only writer.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .graph import ALL, Routes, StageGraph
from .graphed import GraphedCall
from .graphed.call import Source
from .microbatch import leaves

__all__ = ["Handoffs", "Layout", "single_readers", "leaf_counts", "layout"]


def single_readers(graph: StageGraph) -> set[tuple[int, int]]:
    """The (producer, output) pairs read by one stage argument only (a
    result ref counts as a reader: the loss's gradient comes back through it)."""
    count: dict[tuple[int, int], int] = {}
    for refs in graph.args:
        for r in refs:
            if r.stage >= 0:
                for k in range(graph.outputs[r.stage]) if r.index == ALL else (r.index,):
                    count[(r.stage, k)] = count.get((r.stage, k), 0) + 1
    for r in graph.result_refs():
        count[(r.stage, r.index)] = count.get((r.stage, r.index), 0) + 1
    return {key for key, n in count.items() if n == 1}


def leaf_counts(call: GraphedCall, outputs: int) -> list[int]:
    """Tensors per output of ``call``: one output, or with several the
    items of the tuple it returns (as :class:`~.values.Flow` stores them)."""
    if outputs == 1:
        return [len(call.static_out)]
    out = call.rebuild(call.static_out)
    return [sum(isinstance(x, Tensor) for x in leaves(v)[0]) for v in out]


class Layout:
    """Where the static outputs of one call (a stage's) sit among the
    stage's outputs.

    Attributes:
        keys: per static output, its (output, leaf).
        at: per (output, leaf), its position among the static outputs.
        grad_at: per (output, leaf) that carries a gradient, its position
            among the call's differentiable outputs (``diff_out``).
    """

    __slots__ = ("keys", "at", "grad_at")

    def __init__(self, call: GraphedCall, outputs: int) -> None:
        counts = leaf_counts(call, outputs)
        self.keys = [(k, j) for k, n in enumerate(counts) for j in range(n)]
        self.at = {key: pos for pos, key in enumerate(self.keys)}
        where = {pos: i for i, pos in enumerate(call.diff_out)}
        self.grad_at = {key: where[pos] for key, pos in self.at.items() if pos in where}


def layout(call: GraphedCall, outputs: int) -> Layout:
    """The :class:`Layout` of ``call``, a stage's with ``outputs`` outputs.
    Fixed by the call's structure: found once per call (held by it), as
    rebuilding it per micro-batch, or per step, would cost the host each
    time (both loops read it)."""
    found: Layout | None = call.layout
    if found is None:
        found = call.layout = Layout(call, outputs)
    return found


class Handoffs:
    """The aliases one forward run's replays handed on, and where each is
    a buffer a reader may take in place (see the module).

    Args:
        routes: the stage graph on the run's devices.
    """

    def __init__(self, routes: Routes) -> None:
        self.outputs = routes.graph.outputs
        plan = _PLANS.get(routes)
        if plan is None:
            plan = _PLANS[routes] = _plan(routes)
        #: Which (producer, output) one stage argument alone reads; per
        #: stage, whether it reads a producer on its device with no copy
        #: between, and whether such a stage reads its outputs.
        self.single, self.reads, self.hands = plan
        # id() of each alias handed on -> the alias (held, so that no other
        # tensor takes its id during the run) and the Source it is.
        self.made: dict[int, tuple[Tensor, Source]] = {}

    def keep(self, call: GraphedCall, s: int, aliases: Sequence[Tensor]) -> None:
        """Notes the aliases stage ``s``'s replay of ``call`` returned; only
        for a stage that hands on (:attr:`hands`): the caller looks, as it
        calls this once per replayed task."""
        made = self.made
        if self.outputs[s] == 1:
            grads = (s, 0) in self.single
            for pos in call.diff_out:  # the others need no gradient: copied in
                t = aliases[pos]
                made[id(t)] = (t, (call, pos, grads))
            return
        keys = layout(call, self.outputs[s]).keys
        for pos in call.diff_out:
            t = aliases[pos]
            made[id(t)] = (t, (call, pos, (s, keys[pos][0]) in self.single))

    def sources(self, items: Sequence[Any]) -> Sequence[Source]:
        """Per tensor among a stage's argument leaves ``items``, the Source
        it is, if an alias this run handed on; ``()`` where none is (the key
        of a call without)."""
        made = self.made
        out: list[Source] = []
        found = False
        for t in items:
            if isinstance(t, Tensor):
                rec = made.get(id(t))
                if rec is not None and rec[0] is t:
                    out.append(rec[1])
                    found = True
                else:
                    out.append(None)
        return out if found else ()


_Plan = tuple[set[tuple[int, int]], list[bool], list[bool]]
#: Per stage graph on its devices, what :class:`Handoffs` reads of it.
_PLANS: weakref.WeakKeyDictionary[Routes, _Plan] = weakref.WeakKeyDictionary()


def _plan(routes: Routes) -> _Plan:
    """What :class:`Handoffs` keeps of ``routes`` (see its ``__init__``)."""
    graph = routes.graph
    reads = [False] * graph.stages
    hands = [False] * graph.stages
    for s, refs in enumerate(graph.args):
        for r in refs:
            if r.stage >= 0 and routes.hop(r.stage, s) is None:
                reads[s] = hands[r.stage] = True
    return single_readers(graph), reads, hands
