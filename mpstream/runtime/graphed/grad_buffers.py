"""A graphed stage's gradient buffers: how they are laid out, and saved.

:func:`lay_out` cuts one flat tensor (per device and dtype) into a view per
parameter, each laid out as autograd would lay out that parameter's
gradient; :class:`GradBuffers` keeps a stage's buffers so (and
:class:`~.grads.GradStore`, built on it, the passes that add into them), and a stage's
gradients are reduced that way across processes too
(:mod:`mpstream.distributed.gradients`). :class:`Saved` is what a training
step that may fail keeps of a store's gradients, to put back after a
failure.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor, nn

from ... import _ext
from ..stream import current_stream, record_stream

__all__ = ["GradBuffers", "Saved", "lay_out"]

_C = _ext.load()


def lay_out(
    params: Sequence[nn.Parameter], make: Callable[..., Tensor] = torch.empty
) -> tuple[Tensor, list[Tensor]]:
    """One flat tensor for the gradients of ``params`` (one device and dtype),
    made by ``make`` (``torch.empty``, ``torch.zeros``), and a view per
    parameter, one after another, each laid out as autograd lays out a
    gradient of it (channels-last weights keep their strides:
    ``torch.empty_like``'s contract)."""
    p0 = params[0]
    flat = make(sum(p.numel() for p in params), dtype=p0.dtype, device=p0.device)
    views, offset = [], 0
    for p in params:
        strides = torch.empty_like(p, device="meta").stride()
        views.append(flat.as_strided(p.shape, strides, offset))
        offset += p.numel()
    return flat, views


class GradBuffers:
    """A graphed stage's gradient buffers, laid out: one flat tensor per
    device and dtype cut into a view per parameter (:func:`lay_out`), or a
    side buffer of its own for a parameter another stage holds too.

    Args:
        params: the stage's parameters that require grad, each once.
        shared: those another stage holds too (tied), by ``id()``.
        names: how warnings name each of ``params``.

    Attributes:
        params: as given.
        names: as given, or by position.
        flats: the flat buffers.
        views: per parameter what its graphs add into: its view of a flat
            buffer (its ``.grad`` while attached), or its side buffer.
        device: the parameters' device.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        shared: Collection[int] = frozenset(),
        names: Sequence[str] = (),
    ) -> None:
        self.params = list(params)
        self.names = list(names) or [f"parameter {i}" for i in range(len(self.params))]
        self.flats: list[Tensor] = []
        self.views: list[Tensor] = [torch.empty(0)] * len(self.params)
        self._owned: list[int] = []  # positions whose .grad is their view
        self._side: list[int] = []
        layouts: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self.params):
            if id(p) in shared:
                self._side.append(i)
                self.views[i] = torch.zeros_like(p)
            else:
                self._owned.append(i)
                layouts.setdefault((p.device, p.dtype), []).append(i)
        for where in layouts.values():
            flat, views = lay_out([self.params[i] for i in where], torch.zeros)
            self.flats.append(flat)
            for i, view in zip(where, views):
                self.views[i] = view
        self._owned_params = [self.params[i] for i in self._owned]
        self._owned_views = [self.views[i] for i in self._owned]
        # Which of them are attached, asked in one C++ call.
        self._attached = _C.Attached(self._owned_params, self._owned_views)
        self.device = self.params[0].device if self.params else torch.device("cpu")

    def owned(self) -> list[tuple[nn.Parameter, Tensor]]:
        """Each parameter with a view in the flat buffers, and its view."""
        return list(zip(self._owned_params, self._owned_views))

    def nbytes(self) -> int:
        """Bytes of the flat and side buffers."""
        return sum(f.numel() * f.element_size() for f in [*self.flats, *self._sides()])

    def tied_params(self) -> list[nn.Parameter]:
        """The parameters held in side buffers (another stage holds them too)."""
        return [self.params[i] for i in self._side]

    def _sides(self) -> list[Tensor]:
        return [self.views[i] for i in self._side]


class Saved:
    """A store's gradients as a training step found them, for :meth:`put_back`.

    Args:
        flats: the store's flat buffers.
        owned: each parameter with a view in them (``.grad`` is that view
            while attached).
        detached: the positions in ``owned`` not attached (their ``.grad``
            is kept as it is, tensor or None).
        zeroed: every attached gradient is known zero (a captured zeroing
            just ran): the flat buffers are not copied, but zeroed again.
        every: parameters whose gradient is kept one by one, tensor and
            copy (see :meth:`~.grads.GradStore.save`).
    """

    def __init__(
        self,
        flats: Sequence[Tensor],
        owned: Sequence[nn.Parameter],
        detached: Collection[int],
        zeroed: bool,
        every: Sequence[nn.Parameter] = (),
    ) -> None:
        self.odd = {j: owned[j].grad for j in detached}
        copy = not zeroed and len(detached) < len(owned)
        self.flats = [f.clone() for f in flats] if copy else []
        self.zeroed = zeroed
        # Each parameter with its gradient tensor and a copy (None: none,
        # or known zero).
        self.grads: list[tuple[nn.Parameter, Tensor | None, Tensor | None]] = []
        for p in every:
            g = p.grad
            copied = None if g is None or zeroed else g.detach().clone()
            self.grads.append((p, g, copied))

    def put_back(
        self, flats: Sequence[Tensor], owned: Sequence[nn.Parameter], views: Sequence[Tensor]
    ) -> None:
        """Puts the gradients back (on the current stream): ``flats``,
        ``owned`` and their ``views`` as given when saved."""
        odd = self.odd
        with torch.no_grad():
            if self.zeroed:
                # Only the views attached at save: a detached one's region
                # holds nothing of its parameter's until it is attached again.
                attached = [v for j, v in enumerate(views) if j not in odd]
                if attached:
                    torch._foreach_zero_(attached)
            for flat, saved in zip(flats, self.flats):
                flat.copy_(saved)
        for j, p in enumerate(owned):
            p.grad = odd[j] if j in odd else views[j]
        for p, before, copied in self.grads:
            if before is not None:
                with torch.no_grad():
                    if copied is None:
                        before.zero_()
                    else:
                        # Copied on a stage's stream; the caller's reads it now.
                        record_stream(copied, current_stream(copied.device))
                        before.copy_(copied)
            p.grad = before
