"""How the runtime drives graphed stages' calls: a training step's tasks,
and autograd in the user's own loop.

Where a stage replays graphs (``Pipe(graphs=True)``), its training-step tasks
call the graphs directly (:class:`Replayed`): the forward task copies the
arguments into the call's static inputs and launches the forward graph, the
backward task copies the output gradients in and launches the backward graph
(which adds the parameter gradients into the stage's gradient buffers
itself), and a weight task launches W. Autograd never runs for such a stage,
so a task's host work is a few calls. In the user's own loop (``pipe(x)``
then ``loss.backward()``) each replay is one autograd node (:class:`Replay`)
that shows autograd the inputs only, never a parameter; a graphed reader
takes what a replay on its device handed on in place, as below
(:mod:`~.handoffs`: each micro-batch of a forward run has slots of its own).

What passes between a training step's tasks is the graphs' own buffers,
kept valid by the slots and the event plan rather than by copies:

- a stage's outputs are handed on as its static outputs; a graphed reader
  copies them into its static inputs (in its forward task, on its stream),
  or reads them in place where each of its slots takes its micro-batches
  from one slot of the producer's (then its graph's first use of them is a
  copy inside the graph); an eager reader reads them (copied first where its
  backward is split: its weight pass may run after the producer's next
  forward into that slot); the producer writes them again only after every
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

What escapes to the user is copied: the gradient of a tensor the pipe did
not produce, a single micro-batch's output (see :mod:`~.forward`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node, get_gradient_edge

from . import private
from .boundary import _ANCHOR, Cutting, Grads, sum_grads
from .graph import ALL, Ref, Routes
from .graphed import GraphedCall, StageGraphs
from .graphed.call import Source
from .handoffs import Handoffs, output_keys, single_readers
from .microbatch import grad_dtype, leaves, rebuild_leaves

__all__ = ["Replayed", "Replay", "replay", "run_stage"]

# Where the gradient of one tensor argument goes: (producer, output, leaf),
# or None for the pipeline's inputs (detached in a training step).
Key = tuple[int, int, int] | None


class Replay(torch.autograd.Function):
    """A replay inside autograd (the user's own loop): its backward replays
    the backward graph, whose parameter gradients go to the stage's store."""

    @staticmethod
    def forward(
        ctx: Any, call: GraphedCall, anchor: Tensor, *tensors: Tensor
    ) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.call = call
        ctx.set_materialize_grads(False)  # backward tells "no gradient" from zeros
        # The gradient of a tensor no replay or copy of the pipe made goes
        # to the user (or their autograd graph): a copy, not the buffer.
        ctx.escapes = [not _ours(t) for t in tensors]
        outs = call.forward(tensors)
        call.replays += 1
        ctx.replay = call.replays
        call.pending = weakref.ref(ctx)
        # Aliases: a Function's outputs are new tensors (the buffers are not).
        aliases = tuple(t.detach() for t in outs)
        keep = set(call.diff_out)
        ctx.mark_non_differentiable(*(t for k, t in enumerate(aliases) if k not in keep))
        return aliases

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        call: GraphedCall = ctx.call
        if torch.is_grad_enabled():  # autograd runs a backward with grad mode = create_graph
            raise RuntimeError(
                f"{call.label}: a backward with create_graph=True (a gradient penalty, a "
                f"higher-order gradient) differentiates the backward, which a replayed graph "
                f"cannot: its gradients would carry no history; run the pipe with graphs=False "
                f"for that"
            )
        if getattr(ctx, "done", False):
            raise RuntimeError(
                f"{call.label}: a second backward through the same graphed forward "
                f"(retain_graph=True) would read activations its first backward reused; "
                f"run the pipe with graphs=False for that"
            )
        ctx.done = True
        if ctx.replay != call.replays:
            raise RuntimeError(
                f"{call.label}: its graphs replayed another micro-batch's forward before this "
                f"backward, so the activations it needs are gone (a backward run twice with "
                f"retain_graph=True after a new forward?); run the pipe with graphs=False for that"
            )
        call.pending = None
        picked = [grads[k] for k in call.diff_out]
        if all(g is None for g in picked):
            # No gradient reached the call: eager autograd computes nothing here.
            return (None,) * (2 + len(call.static_in))
        store = call.store
        if store is not None and not _accumulates():
            # torch.autograd.grad or backward(inputs=...): autograd leaves
            # .grad alone, and so must the graph that adds into it (no hook
            # runs on a gradient that is then taken back).
            store.save()
            try:
                got = call.backward(picked, object(), hooks=False)
            finally:
                store.restore()
        else:
            got = call.backward(picked, _graph_task(), autograd=True)
        it = iter(got)
        out: list[Tensor | None] = []
        for t, escapes in zip(call.static_in, ctx.escapes):
            g = next(it) if t.requires_grad else None
            out.append(g.clone() if g is not None and escapes else g)
        return (None, None, *out)


def replay(call: GraphedCall, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """The user's loop's replay of ``call`` (through autograd when it needs
    gradients); returns its output tensors."""
    if call.diff_out and torch.is_grad_enabled():
        out: tuple[Tensor, ...] = Replay.apply(call, _ANCHOR, *tensors)
        return out
    outs = call.forward(tensors)
    if call.grad:
        # No Replay node keeps the call busy (a frozen stage): an eager
        # reader's autograd may save these buffers for a backward after the
        # next forward replays this call and rewrites them.
        return tuple(t.clone() for t in outs)
    return tuple(outs)


def run_stage(
    graphs: StageGraphs,
    s: int,
    m: int,
    stage: nn.Module,
    args: Sequence[Any],
    checkpoint: bool,
    handoffs: Handoffs | None = None,
) -> Any:
    """Stage ``s`` on micro-batch ``m`` in a forward run: replayed (inside
    autograd where it needs gradients) if it can be, else eagerly; with
    ``handoffs`` (the run's, with gradients), reading what replays before it
    handed on in place where it may (see :mod:`~.handoffs`)."""
    items: list[Any] | None = None
    sources: Sequence[Source] = ()
    if handoffs is not None and handoffs.reads[s] and handoffs.made:
        items = leaves(tuple(args))[0]
        sources = handoffs.sources([x for x in items if isinstance(x, Tensor)])
    call = graphs.find(s, m, stage, args, checkpoint, sources=sources)
    if call is None:
        return graphs.eager(s, stage, args, checkpoint)
    if items is None:
        items = leaves(tuple(args))[0]
    outs = replay(call, [items[i] for i in call.where])
    if handoffs is not None and call.diff_out:
        handoffs.keep(call, s, outs)  # Replay's aliases: the run has gradients
    return call.rebuild(outs)


class Replayed:
    """The graphed stages of one training step.

    Args:
        graphs: the pipe's graphed stages (begun for this step).
        routes: the stage graph on this step's devices.
    """

    def __init__(self, graphs: StageGraphs, routes: Routes) -> None:
        self.graphs = graphs
        self.routes = routes
        self.outputs = routes.graph.outputs
        self.single = single_readers(routes.graph)
        self.calls: dict[tuple[int, int], tuple[GraphedCall, list[Key]]] = {}
        self.pushed: dict[tuple[int, int], set[int]] = {}
        self.weights: dict[tuple[int, int], GraphedCall] = {}
        self._outs: dict[int, dict[tuple[int, int], int]] = {}
        self._diff: dict[int, dict[tuple[int, int], int]] = {}
        self._paired: dict[tuple[int, int], bool] = {}

    def forward(
        self,
        s: int,
        m: int,
        stage: nn.Module,
        pairs: Sequence[tuple[Ref, Any]],
        checkpoint: bool,
        split: bool,
    ) -> tuple[bool, Any]:
        """Replays stage ``s``'s forward of micro-batch ``m`` if it is graphed.

        Returns:
            Whether it was, and then the stage's output (static buffers).
        """
        items: list[Any] = []
        keys: list[Key] = []
        needs: list[bool] = []
        sources: list[Source] = []
        for ref, value in pairs:
            flat = [value] if type(value) is Tensor else leaves(value)[0]
            j = 0
            for x in flat:
                items.append(x)
                if isinstance(x, Tensor):
                    need = ref.stage >= 0 and grad_dtype(x)
                    needs.append(need)
                    keys.append((ref.stage, ref.index, j) if need else None)
                    sources.append(self._source(ref, j, x, s, m) if need else None)
                    j += 1
        args = [v for _, v in pairs]
        call = self.graphs.find(s, m, stage, args, checkpoint, needs, split, sources)
        if call is None:
            return False, None
        tensors = [x for x in items if isinstance(x, Tensor)]
        y = call.rebuild(call.forward(tensors))
        self.calls[(s, m)] = (call, [k for k, n in zip(keys, needs) if n])
        return True, y

    def unalias(self, s: int, m: int, pairs: Sequence[tuple[Ref, Any]]) -> list[tuple[Ref, Any]]:
        """``pairs`` (an eager stage's arguments) with what replayed producers
        on this device handed on copied: the stage's split backward may run
        its weight pass after the producer's next forward into that slot."""
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
        if rec is None or ref.index == ALL or self.routes.hop(p, s) is not None:
            return None
        producer = rec[0]
        pos = self._layout(producer, p).get((ref.index, j))
        if pos is None or producer.static_out[pos] is not x or not self._pairs(p, s):
            return None
        return producer, pos, (p, ref.index) in self.single

    def _pairs(self, p: int, s: int) -> bool:
        """Whether each of stage ``s``'s slots takes its micro-batches from
        one slot of stage ``p``'s, in this step's schedule."""
        found = self._paired.get((p, s))
        if found is None:
            slots = self.graphs.slots
            assert slots is not None
            seen: dict[int, int] = {}
            found = True
            for (q, m), b in slots.slot.items():
                if q == s and seen.setdefault(b, slots.slot[(p, m)]) != slots.slot[(p, m)]:
                    found = False
            self._paired[(p, s)] = found
        return found

    def cuts(self, s: int, m: int) -> Callable[[tuple[int, int, int]], bool]:
        """Which (stage, output, leaf) keys the loss of replayed last stage
        ``s`` reads on micro-batch ``m`` are cut: other stages' outputs, and
        ``s``'s own that carry gradients (the others, cut, would give a loss
        computed from them a gradient eager autograd refuses)."""
        diff = self._diffs(self.calls[(s, m)][0], s)
        return lambda key: key[0] != s or (key[1], key[2]) in diff

    def graphed(self, s: int, m: int) -> bool:
        """Whether stage ``s``'s forward of micro-batch ``m`` was replayed."""
        return (s, m) in self.calls

    def backward(self, s: int, m: int, reached: Grads, split: bool) -> Cutting | None:
        """Replays the backward of a replayed forward from the gradients that
        reached its outputs (plus those pushed into its buffers); pushes its
        input gradients to producers that take them so. Returns the rest, as
        a :class:`~.boundary.Cutting` to route like an eager stage's."""
        call, keys = self.calls.pop((s, m))
        diff = self._diffs(call, s)
        pushed = self.pushed.pop((s, m), set())
        grads: list[Tensor | None] = [None] * len(call.diff_out)
        for i in pushed:
            grads[i] = call.static_grad_out[i]  # already there
        for where, parts in reached.items():
            at = diff.get(where)
            if at is not None and parts:
                grads[at] = sum_grads(parts)
        ins = call.backward(grads, self.graphs.token, weight=not split)
        if split:
            self.weights[(s, m)] = call
        rest = Cutting()
        out: list[Tensor | None] = []
        for key, g in zip(keys, ins):
            if g is None or key is None:
                continue
            p, k, j = key
            if not self._push(p, k, j, s, m, g):
                rest.keys.append(key)
                out.append(g.clone())  # the buffer is this slot's: rewritten by its next backward
        rest.sink.grads = tuple(out)
        return rest if rest.keys else None

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
        if rec is None or (p, k) not in self.single or self.routes.hop(p, s) is not None:
            return False
        producer = rec[0]
        i = self._diffs(producer, p).get((k, j))
        if i is not None:
            target = producer.static_grad_out[i]
            if g is not target:  # else the reader's graph wrote it there
                with torch.no_grad():
                    target.copy_(g)
            self.pushed.setdefault((p, m), set()).add(i)
        return True  # an output without a gradient in the producer takes none

    def _layout(self, call: GraphedCall, s: int) -> dict[tuple[int, int], int]:
        """Per (output, leaf) of stage ``s`` (``call``'s), its position among
        the call's static outputs."""
        found = self._outs.get(id(call))
        if found is None:
            pairs = output_keys(call, self.outputs[s])
            found = self._outs[id(call)] = {key: pos for pos, key in enumerate(pairs)}
        return found

    def _diffs(self, call: GraphedCall, s: int) -> dict[tuple[int, int], int]:
        """Per (output, leaf), its position among the call's differentiable outputs."""
        found = self._diff.get(id(call))
        if found is None:
            where = {pos: i for i, pos in enumerate(call.diff_out)}
            layout = self._layout(call, s).items()
            found = self._diff[id(call)] = {k: where[pos] for k, pos in layout if pos in where}
        return found


_OURS = ("ReplayBackward", "CopyBackward", "HostWaitBackward")


def _ours(t: Tensor) -> bool:
    """Whether ``t`` came out of a replay or a copy of a pipe (whose backward
    copies or consumes the gradient it is given)."""
    fn = t.grad_fn
    return fn is not None and type(fn).__name__ in _OURS


# The anchor's gradient accumulator, held: a leaf keeps only a weak
# reference to its own, and finding it again costs an operator (a view) in
# every replayed backward task.
_ANCHOR_NODE: Node = get_gradient_edge(_ANCHOR).node


def _accumulates() -> bool:
    """Whether the running backward accumulates into leaves: a plain
    ``backward()``, not ``torch.autograd.grad`` nor ``backward(inputs=)``
    (where the anchor, an input of every replay, is not asked for)."""
    try:
        return private.will_engine_execute_node(_ANCHOR_NODE)
    except private.PrivateApiError:
        raise  # a torch without the call: no silent loss of every gradient
    except RuntimeError:
        return False


def _graph_task() -> int:
    """The running backward pass's id (-1 where torch cannot tell)."""
    return private.current_graph_task_id()
