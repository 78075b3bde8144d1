"""The stage graph: where each stage's arguments come from, and what moves.

Stages are numbered in call order. Stage ``s`` is called with positional
arguments, each a :class:`Ref` to one output of an earlier stage or to one of
the pipeline's inputs (stage ``-1``); the pipeline returns a structure of
such refs. A chain of ``nn.Sequential`` partitions is the special case where
each stage reads the one output of the stage before it.

:class:`Routes` adds the devices: a value read on another device moves in one
copy task per producer and receiving device (a :class:`Hop`), shared by every
stage there that reads it, received on the copy stream of the first of them
(with ``force_copies``, one per reading stage), exactly as the C++ schedule
generates its copy tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils import _pytree as pytree

from ..schedules.schedule import Topology

__all__ = ["INPUT", "ALL", "Ref", "StageGraph", "Hop", "Routes"]

INPUT = -1  # the producer "stage" of the pipeline's inputs
ALL = -1  # Ref index: every input, as positional arguments


@dataclass(frozen=True)
class Ref:
    """One value: output ``index`` of ``stage`` (input ``index`` for -1)."""

    stage: int
    index: int


@dataclass(frozen=True)
class StageGraph:
    """Where each stage's arguments come from, and what the pipeline returns.

    Attributes:
        args: per stage, its positional arguments. ``Ref(-1, ALL)`` passes
            every input of the pipeline.
        outputs: per stage, how many outputs it returns: with several it
            returns a tuple, whose items are its outputs; with one, whatever
            it returns is its output 0.
        result: the pipeline's output: a :class:`Ref` or a structure
            (tuple, list, dict) of refs and constants.
    """

    args: tuple[tuple[Ref, ...], ...]
    outputs: tuple[int, ...]
    result: Any

    @classmethod
    def chain(cls, stages: int) -> StageGraph:
        """Stage 0 takes the inputs; every later stage the output before it."""
        args = tuple((Ref(s - 1, ALL if s == 0 else 0),) for s in range(stages))
        return cls(args, (1,) * stages, Ref(stages - 1, 0))

    @property
    def stages(self) -> int:
        return len(self.args)

    def plain_result(self) -> Any:
        """:attr:`result` with ``torch.fx``'s immutable lists and dicts (what a
        traced graph's output holds) as the plain ones the module built."""
        return _thawed(self.result)

    def result_refs(self) -> list[Ref]:
        """The refs among the result's leaves (the others are constants)."""
        items = pytree.tree_leaves(self.result, is_leaf=lambda x: isinstance(x, Ref))
        return [x for x in items if isinstance(x, Ref)]

    def reads(self) -> tuple[tuple[int, ...], ...]:
        """Per stage, the producers it reads (``-1``: the pipeline's input);
        the last stage also reads those the result comes from (its task
        gathers the result and the loss).

        Returns:
            One sorted tuple of stage numbers per stage.
        """
        out = []
        last = self.stages - 1
        for s, refs in enumerate(self.args):
            producers = {r.stage for r in refs}
            if s == last:
                producers |= {r.stage for r in self.result_refs() if r.stage != last}
            out.append(tuple(sorted(producers)))
        return tuple(out)

    def is_chain(self) -> bool:
        """Whether this is :meth:`chain`'s graph (a Sequential's)."""
        return self == StageGraph.chain(self.stages)


def _thawed(value: Any) -> Any:
    if isinstance(value, immutable_list):
        return [_thawed(v) for v in value]
    if isinstance(value, immutable_dict):
        return {k: _thawed(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(_thawed(v) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_thawed(v) for v in value))
    return value


@dataclass(frozen=True)
class Hop:
    """One copy task per micro-batch: ``producer``'s outputs ``indices`` to
    the device of ``readers``, received on stage ``peer``'s copy stream (the
    io stream for the inputs)."""

    producer: int
    peer: int
    readers: tuple[int, ...]
    indices: tuple[int, ...]  # (ALL,) for every input


class Routes:
    """The copy tasks of a stage graph on given devices.

    Args:
        graph: the stage graph.
        devices: a label per stage (equal labels, one device).
        input_device: the label of the inputs' device.
        force_copies: copy between stages even on one device.
    """

    def __init__(
        self,
        graph: StageGraph,
        devices: Sequence[int],
        input_device: int,
        force_copies: bool = False,
    ) -> None:
        self.graph = graph
        self.topology = Topology(graph.reads(), tuple(devices), input_device, force_copies)
        reads = self.topology.reads
        needs: dict[tuple[int, int], set[int]] = {}  # (producer, reader) -> indices
        for q, refs in enumerate(graph.args):
            for r in refs:
                needs.setdefault((r.stage, q), set()).add(r.index)
        last = graph.stages - 1
        for r in graph.result_refs():
            if r.stage != last:
                needs.setdefault((r.stage, last), set()).add(r.index)
        # Readers grouped by device (by stage with force_copies, as if each
        # stage had a device; the inputs still go by device).
        groups: dict[tuple[int, int], list[int]] = {}
        for q in range(graph.stages):
            for p in reads[q]:
                key = q if force_copies and p >= 0 else devices[q]
                groups.setdefault((p, key), []).append(q)
        self.hops: dict[tuple[int, int], Hop] = {}  # (producer, reader) -> hop
        self.by_task: dict[tuple[int, int], Hop] = {}  # (producer, peer) -> hop
        for (p, _), readers in groups.items():
            if not self.topology.copies(p, readers[0]):
                continue
            indices = sorted(set().union(*(needs[(p, q)] for q in readers)))
            hop = Hop(p, readers[0], tuple(readers), (ALL,) if ALL in indices else tuple(indices))
            self.by_task[(p, hop.peer)] = hop
            for q in readers:
                self.hops[(p, q)] = hop

    def hop(self, producer: int, reader: int) -> Hop | None:
        """The copy that brings ``producer``'s value to ``reader``, or None."""
        return self.hops.get((producer, reader))
