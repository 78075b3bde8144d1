"""The values of one pipeline run, per micro-batch.

:class:`Flow` holds what the tasks of a run pass each other: every stage's
outputs on its own device, and the copies that hops brought to other
devices. It assembles a stage's arguments from them, stores its outputs,
drops values once their last reader has run (1F1B's memory bound counts on
it), and builds the pipeline's result on the last stage's device.
:func:`protect` marks values for the streams that read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.utils import _pytree as pytree

from .gathering import check_output
from .graph import ALL, Hop, Ref, Routes
from .microbatch import leaves
from .rebuilds import check_rebuilds
from .stream import AnyStream, is_cuda, record_stream

__all__ = ["Wiring", "Flow", "tensor_leaves", "protect", "cuda_only"]


def tensor_leaves(values: Sequence[Any]) -> list[Tensor]:
    """The tensors among ``values``' leaves, in order."""
    out: list[Tensor] = []
    for v in values:
        if type(v) is Tensor:
            out.append(v)
        else:
            out.extend(t for t in leaves(v)[0] if isinstance(t, Tensor))
    return out


def protect(values: Sequence[Any], stream: AnyStream | None) -> None:
    """Marks every tensor among ``values`` as used by ``stream`` (None: none)."""
    if stream is not None:
        for t in tensor_leaves(values):
            record_stream(t, stream)


def cuda_only(streams: Sequence[AnyStream | None]) -> list[AnyStream | None]:
    """The streams record_stream applies to: CUDA ones; None for the rest."""
    return [s if s is not None and is_cuda(s) else None for s in streams]


class Wiring:
    """What a run's values go through, computed once per stage graph and
    devices (a :class:`~mpstream.runtime.graph.Routes`): per stage the sources of
    its arguments, what can be dropped after it, and the result's leaves."""

    def __init__(self, routes: Routes) -> None:
        graph = routes.graph
        self.routes = routes
        self.stages = graph.stages
        self.outputs = graph.outputs
        # Per stage: (ref, hop) for each argument.
        self.plan = [
            [(r, routes.hop(r.stage, q)) for r in refs] for q, refs in enumerate(graph.args)
        ]
        # Per stage with one argument source (a chain's stages): where it is.
        self.only: list[tuple[int, int, tuple[int, int] | None] | None] = [
            (plan[0][0].stage, plan[0][0].index, None if plan[0][1] is None else
             (plan[0][1].producer, plan[0][1].peer)) if len(plan) == 1 else None
            for plan in self.plan
        ]  # fmt: skip
        # Per stage: whether every argument comes through a hop it receives
        # itself (then the copies marked them for its stream already).
        self.received = [
            all(hop is not None and hop.peer == q for _, hop in plan)
            for q, plan in enumerate(self.plan)
        ]
        last = self.stages - 1
        # The result's leaves: refs, or constants the module returns as such.
        items, self.result_spec = pytree.tree_flatten(
            graph.plain_result(), is_leaf=lambda x: isinstance(x, Ref)
        )
        self.result_items = [
            (x, routes.hop(x.stage, last)) if isinstance(x, Ref) else (x, None) for x in items
        ]
        self.result_refs = [(r, hop) for r, hop in self.result_items if isinstance(r, Ref)]
        self.single = isinstance(graph.result, Ref)
        # Per stage, the producers its forward reads, each with the copies
        # hops made of its values; and per producer, how many forwards read
        # it. A run counts the reads down and drops a producer's values at
        # its last read *in issue order*, which need not be its highest
        # reader's: an order may issue a stage before a lower one that does
        # not read it.
        self.read_by: list[list[tuple[int, list[tuple[int, int]]]]] = [
            [] for _ in range(self.stages)
        ]
        self.read_counts: dict[int, int] = {}
        for q, producers in enumerate(routes.topology.reads):
            for p in sorted(producers):
                hops = [key for key in routes.by_task if key[0] == p]
                self.read_by[q].append((p, hops))
                self.read_counts[p] = self.read_counts.get(p, 0) + 1


class Flow:
    """Values of one run.

    Args:
        wiring: the stage graph's wiring on this run's devices.
        batches: per micro-batch, the tuple of the pipeline's positional
            inputs.
    """

    def __init__(self, wiring: Wiring, batches: Sequence[tuple[Any, ...]]) -> None:
        self.wiring = wiring
        # What the per-task methods (and the handlers) read of the wiring,
        # one attribute load away rather than two; shared, not copied.
        self.stages = wiring.stages
        self.outputs = wiring.outputs
        self.plan = wiring.plan
        self.only = wiring.only
        self.received = wiring.received
        self.result_refs = wiring.result_refs
        self.read_by = wiring.read_by
        for b in batches:
            if not isinstance(b, tuple):
                raise TypeError(f"a micro-batch is the tuple of its inputs, got {type(b).__name__}")
        self.outs: list[list[tuple[Any, ...] | None]] = [
            [b] + [None] * self.stages for b in batches
        ]
        self.moved: list[dict[tuple[int, int], tuple[Any, ...]]] = [{} for _ in batches]
        # Per micro-batch, the forwards still to read each producer.
        self.unread = [dict(wiring.read_counts) for _ in batches]

    def _source(self, ref: Ref, hop: Hop | None, m: int) -> tuple[Any, ...]:
        if hop is not None:
            return self.moved[m][(hop.producer, hop.peer)]
        src = self.outs[m][ref.stage + 1]
        assert src is not None, f"stage {ref.stage}'s output of micro-batch {m} is gone"
        return src

    def values(self, q: int, m: int) -> Sequence[Any]:
        """Stage ``q``'s arguments for micro-batch ``m`` (the hot path of
        :meth:`args`, without the refs); read-only."""
        only = self.only[q]
        if only is not None:
            p, index, key = only
            src = self.outs[m][p + 1] if key is None else self.moved[m][key]
            assert src is not None
            return src if index == ALL else (src[index],)
        out: list[Any] = []
        for ref, hop in self.plan[q]:
            src = self._source(ref, hop, m)
            if ref.index == ALL:
                out.extend(src)
            else:
                out.append(src[ref.index])
        return out

    def args(self, q: int, m: int) -> tuple[list[tuple[Ref, Any]], bool]:
        """Stage ``q``'s arguments for micro-batch ``m``, each with what it is
        (``Ref(-1, ALL)`` expands to one ref per input), and whether all of
        them were copied to it by hops it receives itself (so the copies
        already marked them for its stream)."""
        out: list[tuple[Ref, Any]] = []
        outs = self.outs[m]
        for ref, hop in self.plan[q]:
            # _source, inline: once per argument of every forward task.
            src = outs[ref.stage + 1] if hop is None else self.moved[m][(hop.producer, hop.peer)]
            assert src is not None, f"stage {ref.stage}'s output of micro-batch {m} is gone"
            if ref.index == ALL:
                for i, v in enumerate(src):
                    out.append((Ref(ref.stage, i), v))
            else:
                out.append((ref, src[ref.index]))
        return out, self.received[q]

    def result_sources(self, m: int) -> list[tuple[Ref, Any]]:
        """The values of the result that other stages than the last produced."""
        last = self.stages - 1
        seen: dict[Ref, Any] = {}
        for ref, hop in self.result_refs:
            if ref.stage != last and ref not in seen:
                seen[ref] = self._source(ref, hop, m)[ref.index]
        return list(seen.items())

    def store(self, q: int, m: int, y: Any) -> None:
        """Keeps stage ``q``'s output (validated)."""
        if self.outputs[q] > 1:
            if not isinstance(y, tuple) or len(y) != self.outputs[q]:
                raise TypeError(
                    f"stage {q} returned {type(y).__name__}; it should return a tuple of its "
                    f"{self.outputs[q]} outputs"
                )
            for item in y:
                check_output(item, q)
                if not m:  # once per call: the same code builds every micro-batch's
                    check_rebuilds(item, f"stage {q}'s output", *leaves(item))
            self.outs[m][q + 1] = y
        else:
            if type(y) is not Tensor:
                check_output(y, q)
                if not m:
                    check_rebuilds(y, f"stage {q}'s output", *leaves(y))
            self.outs[m][q + 1] = (y,)

    def keep(self, q: int, m: int, y: Any) -> Any:
        """After stage ``q``'s forward of micro-batch ``m`` (the hot path):
        stores its output ``y``, takes the pipeline's result when ``q`` is
        the last stage (None otherwise), then drops what no later stage reads."""
        outs = self.outs[m]
        if self.outputs[q] == 1 and type(y) is Tensor:  # store()'s common case, inline
            outs[q + 1] = (y,)
        else:
            self.store(q, m, y)
        out = self.result(m) if q == self.stages - 1 else None
        unread = self.unread[m]
        for p, hops in self.read_by[q]:  # release(), inline
            unread[p] -= 1
            if not unread[p]:
                outs[p + 1] = None
                for key in hops:
                    self.moved[m].pop(key, None)
        return out

    def release(self, q: int, m: int) -> None:
        """Drops the values that stage ``q``'s forward of micro-batch ``m``
        was the last to read (call once, after that forward): a producer's
        outputs and the copies hops made of them.

        A hop's copy runs before each of its readers, so once every reader
        has run, every copy of the producer has too.
        """
        outs, moved, unread = self.outs[m], self.moved[m], self.unread[m]
        for p, hops in self.read_by[q]:
            unread[p] -= 1
            if not unread[p]:
                outs[p + 1] = None
                for key in hops:
                    moved.pop(key, None)

    def outputs_of(self, q: int, m: int) -> tuple[Any, ...]:
        out = self.outs[m][q + 1]
        assert out is not None
        return out

    def hop_values(self, hop: Hop, m: int) -> list[Any]:
        """The values a hop moves, in ``hop.indices`` order (every input for ALL)."""
        src = self.outs[m][hop.producer + 1]
        assert src is not None
        if hop.indices == (ALL,):
            return list(src)
        return [src[k] for k in hop.indices]

    def put_moved(self, hop: Hop, m: int, values: Sequence[Any]) -> None:
        """Keeps the values a hop brought, indexable like the producer's outputs."""
        if hop.indices == (ALL,):
            self.moved[m][(hop.producer, hop.peer)] = tuple(values)
            return
        size = max(hop.indices) + 1
        slots: list[Any] = [None] * size
        for k, v in zip(hop.indices, values):
            slots[k] = v
        self.moved[m][(hop.producer, hop.peer)] = tuple(slots)

    def result(self, m: int, replaced: dict[Ref, Any] | None = None) -> Any:
        """The pipeline's output for micro-batch ``m``, on the last stage's
        device (with ``replaced`` values instead of the stored ones)."""
        wiring = self.wiring
        if wiring.single and replaced is None:
            ref, hop = self.result_refs[0]  # as result_sources reads them
            return self._source(ref, hop, m)[ref.index]
        items = []
        for ref, hop in wiring.result_items:
            if not isinstance(ref, Ref):
                items.append(ref)
            elif replaced is not None and ref in replaced:
                items.append(replaced[ref])
            else:
                items.append(self._source(ref, hop, m)[ref.index])
        return pytree.tree_unflatten(items, wiring.result_spec)
