"""A stage's parameter gradients summed over a backward, handed over once.

Returned to autograd at every replay, a graphed stage's parameter gradients
cost two operations per parameter and micro-batch: a copy out of the
graph's buffers and autograd's accumulation into ``.grad``. With ten
micro-batches of ResNet50 that is thousands of small launches per step, the
host work graphs exist to remove. Instead, a stage's replays add their
gradients into one sum per parameter, on the stage's stream, with one
multi-tensor add per replay, and the sums reach ``.grad`` once
(:meth:`StageGrads.flush`): at the end of ``train_step`` (its run ends in
one place), or, in the user's own loop, where one ``loss.backward()`` covers
every micro-batch, from autograd's final callback at the end of that pass.
Under ``train_step`` the replays do not even show autograd their parameters
(one keeps a first stage in the graph), so a micro-batch's backward walks no
edge per parameter; after a stage's first micro-batch, its add is one
multi-tensor add with no Python per parameter.

A replay whose parameters autograd would not accumulate
(``torch.autograd.grad``) still returns its gradients, and so does a stage
with a parameter's post-accumulate-grad hook, or a pipe under DDP (its
reducer hooks on each AccumulateGrad need every micro-batch's gradient;
:class:`Switch`). Hooks on a parameter's AccumulateGrad node that DDP does
not own (DeepSpeed's, Megatron's style) see no gradient during a held
backward: its gradients reach ``.grad`` at its end.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..stream import current_stream, record_stream

__all__ = ["StageGrads", "Switch"]


@dataclass
class Switch:
    """Whether a pipe's stages may sum their gradients (one per pipe, shared
    by every runtime it builds). Off under DDP: its reducer hooks on each
    parameter's AccumulateGrad need every micro-batch's gradient there."""

    on: bool = True


class _Pass:
    """A held backward pass; its final callback holds it, so a pass that
    failed (its callbacks dropped unrun) lets it go."""

    __slots__ = ("__weakref__",)


class StageGrads:
    """The gradients one stage's replays summed during a run or a backward.

    While a backward runs, the sums are one gradient-sized buffer per
    parameter beside ``.grad``; at the end a sum becomes the gradient of a
    parameter that has none.

    Args:
        switch: the pipe's :class:`Switch` (a private one by default).

    Attributes:
        holding: replays add into the sums (during ``train_step``) instead
            of returning their gradients to autograd; outside it, a
            backward pass is held by :meth:`hold_task`.
    """

    def __init__(self, switch: Switch | None = None) -> None:
        self.switch = switch or Switch()
        self.holding = False
        self._sums: dict[int, tuple[Tensor, Tensor]] = {}  # id(parameter) -> (it, its sum)
        # The last add's parameters (by id) and their sums, in its order: the
        # next micro-batch of the stage adds the same ones.
        self._last: tuple[tuple[int, ...], list[Tensor]] | None = None
        self._streams: dict[int, torch.cuda.Stream] = {}  # where the adds ran
        self._passes: weakref.WeakValueDictionary[int, _Pass] = weakref.WeakValueDictionary()

    @property
    def enabled(self) -> bool:
        """Whether replays may hold their gradients at all."""
        return self.switch.on

    def hold_task(self) -> bool:
        """Holds for the running backward pass (``loss.backward()`` in the
        user's own loop: one pass, every micro-batch), flushed by autograd's
        final callback at its end; whether it holds. A pass inside another
        (a backward run within a backward) is held too, each flushing at its
        own end; sums left by passes that failed are dropped first."""
        task = _graph_task()
        if task < 0 or not self.enabled:
            return False
        if task not in self._passes:
            if not self._passes:
                self.discard()  # no pass alive: what is left was a failed one's
            held = _Pass()
            self._passes[task] = held
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._end_pass(task, held)
            )
        return True

    def _end_pass(self, task: int, _held: _Pass) -> None:
        self._passes.pop(task, None)
        self.flush()

    def add(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        """Adds ``grads`` into the sums of ``params`` on the current stream,
        with one multi-tensor add (the first gradient of a parameter is
        copied)."""
        if not params:
            return
        ids = tuple(map(id, params))
        if self._last is not None and self._last[0] == ids:
            # Every micro-batch after the first: one multi-tensor add and no
            # per-parameter Python (a stage holds hundreds of parameters).
            torch._foreach_add_(self._last[1], list(grads))
            self._note_stream(grads)
            return
        into: list[tuple[Tensor, Tensor]] = []
        new: list[tuple[Tensor, Tensor]] = []
        for p, g in zip(params, grads):
            held = self._sums.get(id(p))
            if held is None:
                new.append((p, g))
            else:
                into.append((held[1], g))
        if into:
            torch._foreach_add_([t for t, _ in into], [g for _, g in into])
        for p, g in new:
            self._sums[id(p)] = (p, g.clone())
        self._last = (ids, [self._sums[i][1] for i in ids])
        self._note_stream(grads)

    def _note_stream(self, grads: Sequence[Tensor]) -> None:
        """Remembers the stream the adds ran on, for :meth:`flush`."""
        if grads and grads[0].is_cuda:
            stream = torch.cuda.current_stream(grads[0].device)
            self._streams[stream.stream_id] = stream

    def flush(self) -> None:
        """Hands the sums to ``.grad`` on the current streams, after the
        streams the adds ran on, and starts over: a sum becomes the gradient
        of a parameter that has none, or is added into the one it has
        (autograd accumulates what fits neither, a sparse gradient)."""
        pairs, self._sums, self._last = list(self._sums.values()), {}, None
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        into: list[tuple[Tensor, Tensor]] = []
        rest: list[tuple[Tensor, Tensor]] = []
        for p, total in pairs:
            # Made on the stage's stream, read (and, as a new .grad, kept)
            # on the caller's from now on.
            record_stream(total, current_stream(total.device))
            if p.grad is None and total.layout == torch.strided:
                p.grad = total
            elif _addable(p.grad, total):
                into.append((p.grad, total))  # type: ignore[arg-type]
            else:
                rest.append((p, total))
        if into:
            torch._foreach_add_([g for g, _ in into], [t for _, t in into])
        if rest:
            torch.autograd.backward([p for p, _ in rest], [t for _, t in rest])

    def discard(self) -> None:
        """Drops the sums (a failed run or pass: its gradients are put back)."""
        self._sums = {}
        self._last = None
        self._streams = {}


def _addable(grad: Tensor | None, g: Tensor) -> bool:
    """Whether ``g`` can be added into ``grad`` in place as autograd would."""
    return (
        grad is not None
        and grad.layout == g.layout == torch.strided
        and grad.shape == g.shape
        and grad.dtype == g.dtype
        and grad.device == g.device
    )


def _graph_task() -> int:
    """The running backward pass's id; -1 outside one (or in a torch
    without the query)."""
    query = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if query is None else int(query())
