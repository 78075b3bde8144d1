"""Gradients changed within a pass through graphed stages, and what each
store tracks of a pass to tell.

A store checks once per pass whether each parameter's ``.grad`` is still the
view its graphs add into, and keeps that answer (:attr:`~.grads.GradStore.ready`)
for the rest of the pass: a replay asks the store nothing. Code that may
change ``.grad`` between two replays of one pass says so here, and every
store checks again (one C++ call) before its next replay adds:
post-accumulate hooks that ran (:mod:`.call`, :func:`grads_changed`), and
``Pipe.zero_grad`` (:func:`grads_zeroed`), which zeroes as torch's does. What
nobody says (torch's own ``Module.zero_grad`` on a layer, an optimizer's
``zero_grad``, ``p.grad = None``) is not seen then; at the pass's end a
store that finds a ``.grad`` it added into since it last checked no longer
its buffer warns (:func:`unseen`), once per store and pass.

A backward pass of the user's loop is the other case: autograd accumulates
a parameter once its uses in the pass are all done, where the graphs add as
they run, and which uses are still to come is not known cheaply. A
``Pipe.zero_grad`` from a hook within such a pass matches autograd where a
parameter's uses were done (all of the pass's gradient zeroed), and where
none had run (all of it added after); a parameter the graphs added into both
before and after the zeroing holds only the part after, where autograd holds
all of it: the store notes that (:class:`PassChanges`, on the few
:meth:`~.grads.GradStore.ensure` calls that check, none per replayed task)
and warns at the pass's end (:func:`zeroed_midway`). A tied weight's side
buffer is added into ``.grad`` whole at the pass's end (:mod:`.tied`), after
any zeroing.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Protocol

from torch import nn

from ..._warn import warn
from .report import GraphWarning

__all__ = [
    "PassChanges",
    "Store",
    "grads_changed",
    "grads_zeroed",
    "track",
    "unseen",
    "warn_all",
    "zeroed_midway",
]


class Store(Protocol):
    """What is asked of a :class:`~.grads.GradStore` here (which imports this)."""

    def recheck(self, zeroed: frozenset[int] = frozenset()) -> None: ...


#: Every store alive.
_stores: weakref.WeakSet[Store] = weakref.WeakSet()


def track(store: Store) -> None:
    """Registers a new store with :func:`grads_changed`."""
    _stores.add(store)


def grads_changed(zeroed: frozenset[int] = frozenset()) -> None:
    """After ``.grad`` may have changed within a pass, of any parameter of
    any store: post-accumulate hooks ran (a training step's, per
    micro-batch: an optimizer in backward, an offload, ``zero_grad()`` from
    a hook). Every store checks its parameters again (one C++ call) before
    its next replay adds, as after a take: a parameter whose ``.grad`` was
    set to None is attached again, so that the next micro-batch's gradient
    is added into a fresh ``.grad``, and no replay adds into a view ``.grad``
    no longer is. Only when called: a pass without hooks pays nothing.

    Args:
        zeroed: the ``id()`` of parameters whose gradients ``Pipe.zero_grad``
            zeroed (see :func:`grads_zeroed`).
    """
    for store in list(_stores):
        store.recheck(zeroed)


def grads_zeroed(params: Iterable[nn.Parameter]) -> None:
    """After ``Pipe.zero_grad`` zeroed the gradients of ``params`` (to None
    or in place): every store checks again, and one in a backward pass of
    the user's loop notes which of them its replays had added into in that
    pass (see the module)."""
    grads_changed(frozenset(id(p) for p in params))


class PassChanges:
    """What one store's replays added into in the current pass (positions
    among its parameters), noted where :meth:`~.grads.GradStore.ensure`
    checks, never per replayed task.

    Attributes:
        added: reached by this pass's replays.
        since: those reached since the store last checked ``.grad``.
        zeroed: reached before a ``Pipe.zero_grad`` of a backward pass of the
            user's loop zeroed them.
        again: those of ``zeroed`` reached again after it.
    """

    __slots__ = ("added", "again", "since", "zeroed")

    def __init__(self) -> None:
        self.added: set[int] = set()
        self.since: set[int] = set()
        self.zeroed: set[int] = set()
        self.again: set[int] = set()


def unseen(name: str, autograd: bool) -> str:
    """The warning for a gradient, of ``name``, changed within a pass (a
    backward pass of the user's loop, ``autograd``, or a training step)
    unseen, after or before replays that added into the buffer ``.grad``
    was: ``.grad`` misses what they added."""
    what = "backward pass of your loop" if autograd else "training step"
    return (
        f"the gradient of {name} was set to None or to another tensor during a {what} "
        f"by code graphed stages do not see (torch's zero_grad on a layer or an optimizer, "
        f"p.grad = ...), and the stage's graphs added that {what}'s gradients, or some of "
        f"them, into the buffer that was .grad: if the change came before the stage's "
        f"last replay of the {what}, .grad misses what it added (which the stage cannot "
        f"tell without a check per replay). Call pipe.zero_grad() there instead (graphed "
        f"stages see it), or build the pipe with graphs=False"
    )


def zeroed_midway(name: str) -> str:
    """The warning for a gradient, of ``name``, that ``Pipe.zero_grad``
    zeroed within a backward pass of the user's loop between replays of that
    pass that added into it (see the module)."""
    return (
        f"pipe.zero_grad() ran during a backward pass of your loop (from a hook?) between "
        f"replays of a graphed stage that both added into the gradient of {name}: the graphs "
        f"add as they run, where autograd accumulates a parameter once the pass is done with "
        f"it, so .grad holds only the part of that pass's gradient added after the zeroing, "
        f"where eager autograd would hold all of it. Zero the gradients before the backward, "
        f"or build the pipe with graphs=False"
    )


def warn_all(messages: Iterable[str]) -> None:
    """Issues ``messages`` as :class:`~.report.GraphWarning` (a store's, at
    its pass's end, once its state is consistent), located at the user's
    line: the pass's end runs under autograd's engine or a training step,
    frames of varying depth below it."""
    for message in messages:
        warn(message, GraphWarning)
