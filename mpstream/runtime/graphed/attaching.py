"""Making a gradient store's views the ``.grad`` of its parameters, and
which store a ``.grad`` view belongs to.

A parameter two stores hold as their own (the splits of a traced pipe's two
kinds of call; two pipes over one module) is the ``.grad`` of the one that
attached it last: :func:`attach` copies the other store's view into its own
after the streams the other's graphs added on, and tells that store to check
its parameters again before its next replay. :func:`owner_of` finds the
store a view belongs to.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch import Tensor, nn

from ..stream import AnyStream, record_stream
from .passes import after

__all__ = ["Holder", "attach", "own", "owner_of"]


class Holder(Protocol):
    """What attaching reads and sets of a gradient store: a
    :class:`~.grads.GradStore` (which imports this module: imports go one
    way, tests/test_layering.py)."""

    params: list[nn.Parameter]
    views: list[Tensor]
    flats: list[Tensor]
    _owned: list[int]
    _owned_views: list[Tensor]
    _streams: dict[int, torch.cuda.Stream]
    _taken_from: bool
    ready: dict[tuple[object, frozenset[int]], list[nn.Parameter]]


#: The store of each flat buffer's view, by the view's ``id()`` (the view
#: lives as long as its store): a store taking a ``.grad`` over finds its owner.
_owners: weakref.WeakValueDictionary[int, Holder] = weakref.WeakValueDictionary()


def own(store: Holder) -> None:
    """Notes ``store`` as the owner of its views (once, as it is made)."""
    for view in store._owned_views:
        _owners[id(view)] = store


def owner_of(grad: Tensor | None) -> Holder | None:
    """The store whose view ``grad`` is, if any lives."""
    return _owners.get(id(grad))


def attach(store: Holder, fresh: list[int], stream: AnyStream) -> None:
    """Makes ``store``'s views of ``fresh`` (positions in its parameters) their
    parameters' gradients: zeroed where ``.grad`` was None, filled with it
    where it was another tensor (on ``stream``, after the streams another
    store's graphs added on)."""
    with torch.no_grad():
        had = [(i, store.params[i].grad) for i in fresh]
        nones = [i for i, g in had if g is None]
        others = [(i, g) for i, g in had if g is not None]
        if len(nones) == len(store._owned):
            # The common case, after zero_grad(): a kernel per flat buffer
            # (per dtype), where one list of views of several dtypes would
            # miss the multi-tensor kernel (a launch per view on a GPU).
            for flat in store.flats:
                flat.zero_()
        elif nones:
            torch._foreach_zero_([store.views[i] for i in nones])
        owners: dict[int, Holder] = {}
        if others:
            grads = [g for _, g in others]
            for g in grads:
                owner = _owners.get(id(g))
                if owner is not None and owner is not store:
                    owners[id(owner)] = owner
            after(stream, [s for o in owners.values() for s in list(o._streams.values())])
            torch._foreach_copy_([store.views[i] for i, _ in others], grads)
            for g in grads:
                # Freed once .grad lets go of it (the user's), while
                # this stream may still read it.
                record_stream(g, stream)
        for i in fresh:
            store.params[i].grad = store.views[i]
    for owner in owners.values():
        # After .grad changed (see GradStore.__init__).
        owner._taken_from, owner.ready = True, {}
