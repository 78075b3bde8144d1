"""A graphed stage's replay in the user's own loop (``pipe(x)``, then
``loss.backward()``).

Where a stage replays graphs (``Pipe(graphs=True)``), a forward run calls
:func:`run_stage` for it: the call's graphs replay if it has them (else the
stage runs eagerly), each replay one autograd node (:class:`Replay`) that
shows autograd the inputs only, never a parameter. The node's backward
replays the backward graph, which adds the parameter gradients into the
stage's gradient buffers itself (``.grad`` views them), unless the running
backward does not accumulate into leaves (``torch.autograd.grad``,
``backward(inputs=...)``). A graphed reader takes what a replay on its
device handed on in place (:mod:`~.handoffs`: each micro-batch of a forward
run has slots of its own).

What escapes to the user is copied: the gradient of a tensor the pipe did
not produce, the outputs of a replay no :class:`Replay` node keeps busy
while autograd records (a frozen stage's), a single micro-batch's output
(see :mod:`~.forward`). A training step drives the same calls without
autograd (:mod:`~.replayed`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node, get_gradient_edge

from . import private
from .boundary import _ANCHOR
from .graphed import GraphedCall, StageGraphs
from .graphed.call import Source
from .handoffs import Handoffs
from .microbatch import leaves

__all__ = ["Replay", "replay", "run_stage"]


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
        sources = handoffs.sources(items)
    call = graphs.find(s, m, stage, args, checkpoint, sources=sources)
    if call is None:
        return graphs.eager(s, stage, args, checkpoint)
    tensors: Sequence[Tensor]
    if type(call.spec) is tuple:
        # A flat tuple of tensors (its key says so: the call's structure is
        # these arguments'): they are the call's tensors, as they are.
        tensors = args
    else:
        if items is None:
            items = leaves(tuple(args))[0]
        tensors = [items[i] for i in call.where]
    # Once per replayed task: replay()'s common case, inline.
    if call.unreached_in:
        tensors = _reached(call, tensors)
    outs = (
        Replay.apply(call, _ANCHOR, *tensors)
        if call.diff_out and torch.is_grad_enabled()
        else replay(call, tensors)
    )
    if handoffs is not None and call.diff_out and handoffs.hands[s]:
        handoffs.keep(call, s, outs)  # Replay's aliases: the run has gradients
    return call.rebuild(outs)


def replay(call: GraphedCall, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """The user's loop's replay of ``call`` (through autograd when it needs
    gradients); returns its output tensors."""
    if call.diff_out and torch.is_grad_enabled():
        if call.unreached_in:
            tensors = _reached(call, tensors)
        out: tuple[Tensor, ...] = Replay.apply(call, _ANCHOR, *tensors)
        return out
    outs = call.forward(tensors)
    if call.grad:
        # No Replay node keeps the call busy (a frozen stage): an eager
        # reader's autograd may save these buffers for a backward after the
        # next forward replays this call and rewrites them.
        return tuple(t.clone() for t in outs)
    return tuple(outs)


def _reached(call: GraphedCall, tensors: Sequence[Tensor]) -> list[Tensor]:
    """``tensors``, those no output of the call reaches detached
    (``call.unreached_in``). Eager autograd leaves such an input out of the
    graph, so nothing upstream of it runs; given to the node, its
    backward's None would still run the upstream graph, and a tensor hook
    there would be called with None."""
    out = list(tensors)
    for i in call.unreached_in:
        out[i] = out[i].detach()
    return out


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
        # (A loop: once per replayed task; a comprehension is a call of its
        # own before Python 3.12.)
        escapes: list[bool] = []
        for t in tensors:
            fn = t.grad_fn
            escapes.append(fn is None or type(fn).__name__ not in _OURS)
        ctx.escapes = escapes
        outs = call.forward(tensors)
        call.replays += 1
        ctx.replay = call.replays
        call.pending = weakref.ref(ctx)
        # Aliases: a Function's outputs are new tensors (the buffers are not).
        aliases: list[Tensor] = []
        for t in outs:
            aliases.append(t.detach())
        if call.plain_out:
            ctx.mark_non_differentiable(*[aliases[k] for k in call.plain_out])
        return tuple(aliases)

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
        picked: list[Tensor | None] = []
        reached = False
        for k in call.diff_out:
            g = grads[k]
            picked.append(g)
            reached = reached or g is not None
        if not reached:
            # No gradient reached the call: eager autograd computes nothing here.
            return (None,) * (2 + len(call.static_in))
        store, task = call.store, private.current_graph_task_id()
        # The answer for this pass, if asked before in it (an unknown pass,
        # -1, is asked every time); read inline: once per replayed task.
        seen, accumulates = _ANSWERED
        if store is not None and (task != seen or task == -1):
            accumulates = _accumulates(task)
        if store is not None and not accumulates:
            # torch.autograd.grad or backward(inputs=...): autograd leaves
            # .grad alone, and so must the graph that adds into it (no hook
            # runs on a gradient that is then taken back).
            with store.undone(task):
                got = call.backward(picked, object(), hooks=False)
        else:
            got = call.backward(picked, task, autograd=True)
        # The input gradients are the call's buffers, which its next backward
        # replay rewrites on this stream. An escaping one is cloned here,
        # before that replay in stream order; one handed to our own nodes is
        # read on a stage's or copy stream the next call's tasks wait on, or,
        # for the pipe's input, on the io stream the next call waits on
        # (CallerStreams.note_read) unless the host waited (HostWait).
        it = iter(got)
        out: list[Tensor | None] = []
        for t, escapes in zip(call.static_in, ctx.escapes):
            g = next(it) if t.requires_grad else None
            out.append(g.clone() if g is not None and escapes else g)
        return (None, None, *out)


#: The nodes of what came out of a replay or a copy of a pipe (whose
#: backward copies or consumes the gradient it is given): a tensor of
#: theirs does not escape (Replay.forward).
_OURS = ("ReplayBackward", "CopyBackward", "HostWaitBackward")


# The anchor's gradient accumulator, held: a leaf keeps only a weak
# reference to its own, and finding it again costs an operator (a view) in
# every replayed backward task.
_ANCHOR_NODE: Node = get_gradient_edge(_ANCHOR).node


# The latest backward pass _accumulates answered for, and its answer: what
# a pass executes is fixed when it starts, and its replayed backward tasks
# (one per stage and micro-batch) would each ask torch again. One tuple,
# replaced whole: the engine's device threads may read it concurrently.
# Read by Replay.backward, which asks again only for another pass.
_ANSWERED: tuple[int, bool] = (-1, False)


def _accumulates(task: int) -> bool:
    """Whether the running backward (pass ``task``, -1: unknown) accumulates
    into leaves: a plain ``backward()``, not ``torch.autograd.grad`` nor
    ``backward(inputs=)`` (where the anchor, an input of every replay, is
    not asked for). Asks torch, and notes the answer in :data:`_ANSWERED`."""
    global _ANSWERED
    try:
        answer = private.will_engine_execute_node(_ANCHOR_NODE)
    except private.PrivateApiError:
        raise  # a torch without the call: no silent loss of every gradient
    except RuntimeError:
        answer = False
    _ANSWERED = (task, answer)
    return answer
