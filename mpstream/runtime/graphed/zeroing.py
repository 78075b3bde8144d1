"""Telling graphed stages' gradient stores that ``.grad`` changed within a pass.

A store checks once per pass whether each parameter's ``.grad`` is still the
view its graphs add into, and keeps that answer (:attr:`~.grads.GradStore.ready`)
for the rest of the pass: a replay asks the store nothing. Code that may
change ``.grad`` between two replays of one pass says so here, and every
store checks again (one C++ call) before its next replay adds:
post-accumulate hooks that ran (:mod:`.call`), and ``Pipe.zero_grad``
(:func:`kept_in_pass`). What nobody says (torch's own ``Module.zero_grad`` on a
layer, an optimizer's ``zero_grad``, ``p.grad = None``) is not seen then;
at the pass's end a store that finds a ``.grad`` it added into since it last
checked no longer its buffer warns (:func:`lost`), once per store and pass.

A backward pass of the user's loop is the other case: autograd accumulates
a parameter once, when the pass's whole gradient of it is in, where the
graphs add as they run. ``Pipe.zero_grad`` from a hook within such a pass
(a tensor hook on a value between two calls of the pipe) must leave alone
what the pass added so far, which eager autograd would accumulate after the
zeroing: :func:`kept_in_pass` says which gradients hold only that, and refuses
where one also holds earlier passes' gradients, which cannot be told apart.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Protocol
from warnings import warn

from torch import nn

from .report import GraphWarning

__all__ = ["Store", "grads_changed", "kept_in_pass", "lost", "track"]


class Store(Protocol):
    """What is asked of a :class:`~.grads.GradStore` here (which imports this)."""

    def recheck(self) -> None: ...

    def added_in_pass(self) -> tuple[list[nn.Parameter], list[nn.Parameter]] | None: ...


#: Every store alive.
_stores: weakref.WeakSet[Store] = weakref.WeakSet()


def track(store: Store) -> None:
    """Registers a new store with :func:`grads_changed`."""
    _stores.add(store)


def grads_changed() -> None:
    """After ``.grad`` may have changed within a pass, of any parameter of
    any store: post-accumulate hooks ran (a training step's, per
    micro-batch: an optimizer in backward, an offload, ``zero_grad()`` from
    a hook), or ``Pipe.zero_grad``. Every store checks its parameters again
    (one C++ call) before its next replay adds, as after a take: a
    parameter whose ``.grad`` was set to None is attached again, so that the
    next micro-batch's gradient is added into a fresh ``.grad``, and no
    replay adds into a view ``.grad`` no longer is. Only when called: a pass
    without hooks pays nothing."""
    for store in list(_stores):
        store.recheck()


def kept_in_pass(named: Iterable[tuple[str, nn.Parameter]]) -> list[nn.Parameter]:
    """Before ``Pipe.zero_grad`` zeroes the gradients of ``named``: those
    to leave as they are, whose ``.grad`` holds what a backward pass of the
    user's loop still running added so far into a gradient that was None
    when it began (see the module).

    Raises:
        RuntimeError: such a pass added into a ``.grad`` that held earlier
            gradients too (the first such parameter named); nothing is
            zeroed then.
    """
    fresh: dict[int, nn.Parameter] = {}
    held: set[int] = set()
    for store in list(_stores):
        added = store.added_in_pass()
        if added is not None:
            fresh.update((id(p), p) for p in added[0])
            held.update(id(p) for p in added[1])
    if not fresh and not held:
        return []  # no pass of the user's loop added into a gradient so far
    named = list(named)
    for name, p in named:
        if id(p) in held:
            raise RuntimeError(
                f"pipe.zero_grad() ran during a backward pass of your own loop (a tensor "
                f"hook?) after a graphed stage's replays of that pass had added into the "
                f"gradient of {name!r}, which also held earlier passes' gradients: the graphs "
                f"add as they run, where autograd accumulates at the pass's end, so the pass's "
                f"own gradient cannot be told apart. Zero the gradients (set_to_none=True) "
                f"before that backward, or build the pipe with graphs=False"
            )
    return [p for _, p in named if id(p) in fresh]


def lost(name: str, autograd: bool) -> None:
    """Warns that the gradient of ``name`` was changed within a pass (a
    backward pass of the user's loop, ``autograd``, or a training step)
    unseen, after or before replays that added into the buffer ``.grad``
    was: ``.grad`` misses what they added."""
    what = "backward pass of your loop" if autograd else "training step"
    warn(
        f"the gradient of {name} was set to None or to another tensor during a {what} "
        f"by code graphed stages do not see (torch's zero_grad on a layer or an optimizer, "
        f"p.grad = ...), and the stage's graphs added that {what}'s gradients, or some of "
        f"them, into the buffer that was .grad: .grad misses them. Call pipe.zero_grad() "
        f"there instead (graphed stages see it), or build the pipe with graphs=False",
        GraphWarning,
        stacklevel=3,
    )
