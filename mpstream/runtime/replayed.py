"""A training step's graphed stages: their tasks drive the graphs directly.

Where a stage replays graphs (``Pipe(graphs=True)``), its training-step tasks
call the graphs without autograd (:class:`Replayed`): the forward task copies
the arguments into the call's static inputs and launches the forward graph,
the backward task copies the output gradients in and launches the backward
graph (which adds the parameter gradients into the stage's gradient buffers
itself), and a weight task launches W. So a task's host work is a few calls.
(In the user's own loop each replay is an autograd node instead:
:mod:`~.replay_autograd`.)

What passes between a training step's tasks is the graphs' own buffers,
kept valid by the slots and the event plan rather than by copies:

- a stage's outputs are handed on as its static outputs; a graphed reader
  copies them into its static inputs (in its forward task, on its stream),
  or reads them in place where each of its slots takes its micro-batches
  from one slot of the producer's (then its graph's first use of them is a
  copy inside the graph); an eager reader reads them (copied first where its
  backward is split: its weight pass may run after the producer's next
  forward into that slot; so does the loss of an eager last stage, for the
  values of the result it reads); the producer writes them again only after every
  reader's backward, which the schedule orders before the producer's own;
- an input gradient goes back as the reader's static input gradient, copied
  on the reader's stream straight into the producer's static output gradient
  (or written there by the reader's graph itself, where slots pair as above)
  where the value has no other reader on that device (the producer's
  previous backward from that slot finished before this micro-batch's
  forward could start); otherwise a copy of it goes the way the eager pipe
  routes gradients (summed by the producer, or by a gradient copy to another
  device);
- the last stage's outputs are cut (:mod:`~.boundary`) so that the loss can
  differentiate them; their gradients reach its backward like any other.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from .boundary import Cutting, Grads, sum_grads
from .graph import ALL, Ref, Routes
from .graphed import GraphedCall, StageGraphs
from .graphed.call import Source
from .handoffs import layout, single_readers
from .microbatch import leaves, rebuild_leaves

__all__ = ["Replayed"]

# Where the gradient of one tensor argument goes: (producer, output, leaf),
# or None for the pipeline's inputs (detached in a training step).
Key = tuple[int, int, int] | None


class Replayed:
    """The graphed stages of one training step.

    Args:
        graphs: the pipe's graphed stages (begun for this step).
        routes: the stage graph on this step's devices.
    """

    def __init__(self, graphs: StageGraphs, routes: Routes) -> None:
        self.graphs = graphs
        self.routes = routes
        self.hops = routes.hops  # read per task: a dict lookup, not a call
        self.outputs = routes.graph.outputs
        self.single = single_readers(routes.graph)
        self.calls: dict[tuple[int, int], tuple[GraphedCall, list[Key]]] = {}
        self.pushed: dict[tuple[int, int], set[int]] = {}
        self.weights: dict[tuple[int, int], GraphedCall] = {}
        self._paired: dict[tuple[int, int], bool] = {}

    def forward(
        self,
        s: int,
        m: int,
        stage: nn.Module,
        pairs: Sequence[tuple[Ref, Any]],
        checkpoint: bool,
        split: bool,
        carried: Mapping[tuple[int, int], Container[tuple[int, int]]],
    ) -> tuple[bool, Any]:
        """Replays stage ``s``'s forward of micro-batch ``m`` if it is graphed.

        Args:
            carried: per (stage, micro-batch), the (output, leaf) keys of its
                outputs that carry gradients (see :func:`~.boundary.cut_inputs`):
                the arguments that need one.

        Returns:
            Whether it was, and then the stage's output (static buffers).
        """
        # One pass over the arguments' leaves: per tensor whether it needs a
        # gradient, and for those where it goes and where it may be read.
        # Once per replayed task: loops and inline checks, not helpers and
        # comprehensions (each a call of its own before Python 3.12).
        tensors: list[Tensor] = []
        keys: list[Key] = []  # per tensor that needs a gradient
        needs: list[bool] = []
        sources: list[Source] = []
        args: list[Any] = []
        for ref, value in pairs:
            args.append(value)
            keys_of = carried.get((ref.stage, m), ()) if ref.stage >= 0 else ()
            j = 0
            for x in (value,) if type(value) is Tensor else leaves(value)[0]:
                if isinstance(x, Tensor):
                    tensors.append(x)
                    need = (ref.index, j) in keys_of
                    needs.append(need)
                    if need:
                        keys.append((ref.stage, ref.index, j))
                        sources.append(self._source(ref, j, x, s, m))
                    else:
                        sources.append(None)
                    j += 1
        call = self.graphs.find(s, m, stage, args, checkpoint, needs, split, sources)
        if call is None:
            return False, None
        outs = call.forward(tensors)
        if call.layout is None:  # found once per call: the tasks below read it as it is
            layout(call, self.outputs[s])
        self.calls[(s, m)] = (call, keys)
        return True, call.rebuild(outs)

    def unalias(self, s: int, m: int, pairs: Sequence[tuple[Ref, Any]]) -> list[tuple[Ref, Any]]:
        """``pairs`` (an eager stage's arguments, or the values of the result
        an eager last stage's loss reads) with what replayed producers on
        this device handed on copied: the stage's split backward may run its
        weight pass after the producer's next forward into that slot."""
        out: list[tuple[Ref, Any]] = []
        for ref, value in pairs:
            if self.graphed(ref.stage, m) and self.routes.hop(ref.stage, s) is None:
                items, spec = leaves(value)
                value = rebuild_leaves(
                    [x.clone() if isinstance(x, Tensor) else x for x in items], spec
                )
            out.append((ref, value))
        return out

    def _source(self, ref: Ref, j: int, x: Tensor, s: int, m: int) -> Source:
        """Where stage ``s``'s graphs may read argument ``x`` (leaf ``j`` of
        ``ref``) in place, and write its gradient: the producer's call and
        output position, and whether the gradient may go straight into its
        buffer. Only a replayed producer on this device whose slot is the
        same for every micro-batch this stage's slot takes (else a copy into
        the buffer would overwrite another micro-batch's output); the
        gradient only where this is the value's one reader."""
        p = ref.stage
        rec = self.calls.get((p, m))
        if rec is None or ref.index == ALL or (p, s) in self.hops:
            return None
        producer = rec[0]
        pos = producer.layout.at.get((ref.index, j))
        if pos is None or producer.static_out[pos] is not x:
            return None
        paired = self._paired.get((p, s))
        if paired is None:
            paired = self._pairs(p, s)
        if not paired:
            return None
        return producer, pos, (p, ref.index) in self.single

    def _pairs(self, p: int, s: int) -> bool:
        """Whether each of stage ``s``'s slots takes its micro-batches from
        one slot of stage ``p``'s, in this step's schedule (found once per
        step: the caller looks in :attr:`_paired` first)."""
        slots = self.graphs.slots
        assert slots is not None
        seen: dict[int, int] = {}
        found = True
        for (q, m), b in slots.slot.items():
            if q == s and seen.setdefault(b, slots.slot[(p, m)]) != slots.slot[(p, m)]:
                found = False
        self._paired[(p, s)] = found
        return found

    def carried(self, s: int, m: int) -> Container[tuple[int, int]]:
        """The (output, leaf) keys of replayed stage ``s``'s outputs on
        micro-batch ``m`` that carry gradients (its buffers require none:
        this says which values do)."""
        grad_at: Container[tuple[int, int]] = self.calls[(s, m)][0].layout.grad_at
        return grad_at

    def graphed(self, s: int, m: int) -> bool:
        """Whether stage ``s``'s forward of micro-batch ``m`` was replayed."""
        return (s, m) in self.calls

    def backward(self, s: int, m: int, reached: Grads, split: bool) -> Cutting | None:
        """Replays the backward of a replayed forward from the gradients that
        reached its outputs (plus those pushed into its buffers); pushes its
        input gradients to producers that take them so. Returns the rest, as
        a :class:`~.boundary.Cutting` to route like an eager stage's."""
        call, keys = self.calls.pop((s, m))
        diff = call.layout.grad_at
        grads: list[Tensor | None] = [None] * len(call.diff_out)
        pushed = self.pushed.pop((s, m), None)
        if pushed is not None:
            for i in pushed:
                grads[i] = call.static_grad_out[i]  # already there
        for where, parts in reached.items():
            at = diff.get(where)
            if at is not None and parts:
                grads[at] = parts[0] if len(parts) == 1 else sum_grads(parts)
        ins = call.backward(grads, self.graphs.token, weight=not split)
        if split:
            self.weights[(s, m)] = call
        left: list[tuple[int, int, int]] = []
        out: list[Tensor | None] = []
        for key, g in zip(keys, ins):
            if g is None or key is None:
                continue
            p, k, j = key
            if not self._push(p, k, j, s, m, g):
                left.append(key)
                out.append(g.clone())  # the buffer is this slot's: rewritten by its next backward
        if not left:
            return None  # the common case: every gradient pushed, no Cutting made
        rest = Cutting()
        rest.keys, rest.sink.grads = left, tuple(out)
        return rest

    def weight(self, s: int, m: int) -> bool:
        """Replays W of a split replayed backward; whether there was one."""
        call = self.weights.pop((s, m), None)
        if call is None:
            return False
        call.weight()
        return True

    def _push(self, p: int, k: int, j: int, s: int, m: int, g: Tensor) -> bool:
        """Copies ``g`` into producer ``p``'s static output gradient, if ``p``
        replayed micro-batch ``m`` on this device and this stage is the
        value's only reader; whether it did."""
        rec = self.calls.get((p, m))
        if rec is None or (p, k) not in self.single or (p, s) in self.hops:
            return False
        producer = rec[0]
        i = producer.layout.grad_at.get((k, j))
        if i is not None:
            target = producer.static_grad_out[i]
            if g is not target:  # else the reader's graph wrote it there
                # Neither buffer requires grad: autograd records nothing,
                # whatever the grad mode (no context manager per task).
                target.copy_(g)
            self.pushed.setdefault((p, m), set()).add(i)
        return True  # an output without a gradient in the producer takes none
