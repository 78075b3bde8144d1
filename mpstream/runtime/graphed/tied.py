"""Tied parameters' gradients in graphed stages: side buffers added in once a pass.

A parameter two stages hold (tied weights on one device) cannot be the
``.grad`` view both stages' graphs add into: the graphs run on two streams
and would race on one gradient. Each :class:`~.grads.GradStore` adds such a
parameter's gradients into a side buffer of its own instead, and
:class:`TiedHooks`, one per pipe's graphed stages, adds every side buffer
into ``.grad`` once at the end of the pass, after every store's
:meth:`~.grads.GradStore.flush` ordered the current streams after its
graphs, then runs the parameter's post-accumulate hooks once (a store made
before the weights were tied holds one as its own, its graphs adding into
``.grad``, and leaves its hooks to this object).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["TiedHooks", "tied_ids"]


class TiedHooks:
    """The side buffers of tied parameters (held by two stages), added into
    their ``.grad`` once per pass after every store's flush, and then their
    post-accumulate hooks, each parameter's once: one object per pipe's
    graphed stages, which each store's :meth:`~.grads.GradStore.flush` tells what
    its pass reached."""

    def __init__(self) -> None:
        self._sides: list[tuple[nn.Parameter, Tensor]] = []
        self._pending: dict[int, nn.Parameter] = {}
        # The final callback queued to run them, held by autograd until its
        # pass ends: dead while set, that pass failed before running it.
        self._queued: weakref.ref[_Run] | None = None
        #: The ``id()`` of the parameters a store holds in a side buffer: a
        #: store that holds one as its own (made before the weights were
        #: tied) leaves its hooks to this object, or they ran twice a pass.
        self.shared: set[int] = set()

    def add(
        self,
        sides: Sequence[tuple[nn.Parameter, Tensor]],
        autograd: bool,
        hooked: Sequence[nn.Parameter] = (),
    ) -> None:
        """Remembers the side buffers ``sides`` (per parameter), and the
        parameters ``hooked`` whose hooks wait for them; inside a backward
        pass (``autograd``), adds them after the other stores' flushes, as a
        final callback queued behind theirs (queued once per pass). What a
        pass that failed before that callback left is forgotten first."""
        if self._queued is not None and self._queued() is None:
            self.discard()
        for p, side in sides:
            self._sides.append((p, side))
            if p._post_accumulate_grad_hooks:
                self._pending.setdefault(id(p), p)
        for p in hooked:
            self._pending.setdefault(id(p), p)
        if autograd and (self._sides or self._pending) and self._queued is None:
            run = _Run(self)
            self._queued = weakref.ref(run)
            torch.autograd.Variable._execution_engine.queue_callback(run)

    def run(self) -> None:
        """Adds the side buffers remembered into their ``.grad`` (on the
        current streams, which every store's flush ordered after its
        graphs), then runs the hooks, each parameter's once."""
        sides, self._sides = self._sides, []
        pending, self._pending, self._queued = list(self._pending.values()), {}, None
        with torch.no_grad():
            for p, side in sides:
                if p.grad is None:
                    p.grad = side.clone()
                else:
                    p.grad.add_(side)
        for p in pending:
            for hook in p._post_accumulate_grad_hooks.values():  # type: ignore[union-attr]
                hook(p)

    def discard(self) -> None:
        """Forgets a failed pass's."""
        self._sides, self._pending, self._queued = [], {}, None


class _Run:
    """A :class:`TiedHooks`' run, queued as a final callback: autograd
    holds it until the pass ends or fails (a weak reference tells which)."""

    __slots__ = ("tied", "__weakref__")

    def __init__(self, tied: TiedHooks) -> None:
        self.tied = tied

    def __call__(self) -> None:
        self.tied.run()


def tied_ids(stage: nn.Module, others: Iterable[nn.Module]) -> set[int]:
    """The ``id()`` of ``stage``'s parameters one of ``others`` holds too."""
    mine = {id(p) for p in stage.parameters()}
    return mine & {id(p) for o in others for p in o.parameters()}
