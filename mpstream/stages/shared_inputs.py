"""Inputs a forward changes in place, and the inputs sharing their memory.

A pipeline gives each input tensor the forward changes in place a copy of
its own per micro-batch (:func:`~mpstream.stages.inplace.copy_changed_inputs`).
In the module, a change of ``x`` also shows in every other input sharing
its memory (``forward(x, y)`` called with ``t`` and ``t[:, :2]``, or a
batch ``{"x": t, "y": t[:, :2]}``): the copy would hide it, so a reader of
``y`` would see it unchanged; so would a loss reading ``train_step``'s
target after the forward (``train_step(t, t, loss_fn)``). Sharing is a
property of a call's tensors, not of the trace, so
:meth:`ChangedInputs.check` looks for it on every call of a split that
changes an input, and refuses before anything runs. So does it for a dict
the forward updates (``batch["p"] |= {...}``) that the call holds at
another place too (``{"p": d, "q": d}``): the micro-batches hold a dict
of their own at each place; and for a ``.update`` the trace took for a
dict's where the call holds no dict.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ..runtime.microbatch import NoChunk
from .inplace_paths import no_dict_update
from .lookups import NOTHING, item_name, value_at

__all__ = ["ChangedInputs", "NO_CHANGES"]

Path = tuple[Any, ...]
# Keys into an input as pytree names them (``batch['x']``, ``batch.x``, ``batch[1]``).
KeyPath = tuple[Any, ...]
# The steps from an input to an item of it (see lookups.Item).
Steps = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class ChangedInputs:
    """The inputs a split's forward changes in place.

    Attributes:
        names: every pipeline input's name as the caller knows it
            (``"batch"``, ``"x"``), in the pipeline's input order.
        paths: per input changed (by position), the items changed: keys
            and indices into it, ``("x",)`` for ``batch["x"]``; ``()`` for
            the whole input.
    """

    names: tuple[str, ...]
    paths: tuple[tuple[int, tuple[Path, ...]], ...]
    # A default: pickled before it was a field.
    updates: tuple[tuple[int, tuple[tuple[Steps, bool], ...]], ...] = ()

    @classmethod
    def of(
        cls,
        names: Sequence[str],
        paths: dict[int, tuple[Path, ...]],
        updates: dict[int, tuple[tuple[Steps, bool], ...]] | None = None,
    ) -> ChangedInputs:
        """The inputs named ``names`` (in order), of which those at the keys
        of ``paths`` are changed at those paths, and those at the keys of
        ``updates`` hold a dict the forward updates at each of its steps
        (True: by ``.update``, see :func:`~mpstream.stages.inplace_paths.updated_inputs`)."""
        return cls(
            tuple(names), tuple(sorted(paths.items())), tuple(sorted((updates or {}).items()))
        )

    def check(self, module: str, inputs: Sequence[Any], target: Any = None) -> None:
        """Refuses a call where an input the forward changes in place
        shares memory with another input tensor (another argument, another
        item of the same one, or the same tensor passed twice), or with the
        target, which the loss reads after the forward; or where a dict the
        forward updates is held at another place of the call too, or is
        no dict where the forward calls its ``.update``.

        Args:
            module: the module's class name, for the message.
            inputs: the pipeline's inputs for the call.
            target: ``train_step``'s target (None: a call of the pipe).

        Raises:
            ValueError: naming both and what to do.
            TypeError: ``.update`` is called on what is no dict in the call.
        """
        for index, updates in self.updates:
            for steps, method in updates:
                self._check_update(module, inputs, index, steps, method)
        if not self.paths:
            return
        given = [*enumerate(inputs), *([] if target is None else [(_TARGET, target)])]
        leaves = [
            (i, keys, t, span)
            for i, value in given
            for keys, t in _tensors(value)
            if (span := _span(t)) is not None
        ]
        for index, paths in self.paths:
            for path in paths:
                for at, t in _tensors(*_at(inputs[index], path)):
                    if (mine := _span(t)) is None:
                        continue
                    for i, other_at, other, span in leaves:
                        if (i, other_at) != (index, at) and _share(t, mine, other, span):
                            self._refuse(module, (index, at), (i, other_at))

    def _check_update(
        self, module: str, inputs: Sequence[Any], index: int, steps: Steps, method: bool
    ) -> None:
        """Refuses a call holding no dict where the forward calls ``.update``
        (traced as a dict's), or holding the dict the forward updates at
        another place too: the pipeline splits the call into micro-batches
        with a dict of their own at each place, so the update would not
        show through the other."""
        held = value_at({"": inputs[index]}, ("", steps))
        if held is NOTHING:
            return  # the call holds nothing there: the stage says what it lacks
        here = item_name((self.names[index], steps))
        if method and not isinstance(held, dict):
            raise no_dict_update(type(held).__name__, f"{here}.update(...)")
        if not isinstance(held, dict):
            return  # ``|=`` on another object: its own operator, run as the module runs it
        places = [
            self._name(i, tuple(keys))
            for i, value in enumerate(inputs)
            for keys, leaf in pytree.tree_flatten_with_path(value, is_leaf=lambda v: v is held)[0]
            if leaf is held
        ]
        if len(places) < 2:
            return
        # Its own place is one of them (as pytree spells it: an index from the front).
        there = next((p for p in places if p != f"input {here}"), places[1])
        raise ValueError(
            f"{module}.forward updates the dict input {here} in place, and {there} of the "
            f"same call is that same dict. In the module the update shows through both; a "
            f"pipeline splits the call into micro-batches holding a dict of their own at "
            f"each place, so {there} would miss it. Hold the dict at one place and read it "
            f"there, or pass a copy at the other (dict(...)) where forward means them apart"
        )

    def _name(self, index: int, keys: KeyPath) -> str:
        if index == _TARGET:
            return "the target" + pytree.keystr(keys)
        name = self.names[index] if index < len(self.names) else str(index)
        return f"input {name}{pytree.keystr(keys)}"

    def _refuse(self, module: str, changed: tuple[int, KeyPath], at: tuple[int, KeyPath]) -> None:
        here, other = self._name(*changed), self._name(*at)
        inside = "" if at[0] == _TARGET else f", or take it from {here} inside forward"
        raise ValueError(
            f"{module}.forward changes {here} in place, and {other} of the same call shares "
            f"its memory. In the module the change shows through {other}; a pipeline gives "
            f"each micro-batch of {here} a copy of its own, so {other} would stay unchanged. "
            f"Pass {other} as a tensor of its own (.clone()){inside}"
        )


# Where the target stands among the inputs (see :meth:`ChangedInputs.check`).
_TARGET = -1


def _tensors(value: Any, prefix: KeyPath = ()) -> Iterator[tuple[KeyPath, Tensor]]:
    """Each tensor in ``value`` (a ``NoChunk``'s too) with the keys to it."""
    if isinstance(value, (Tensor, NoChunk)):  # most inputs: no walk
        yield prefix, value.tensor if isinstance(value, NoChunk) else value
        return
    leaves, _ = pytree.tree_flatten_with_path(value, is_leaf=lambda x: isinstance(x, NoChunk))
    for keys, leaf in leaves:
        if isinstance(leaf, NoChunk):
            leaf = leaf.tensor
        if isinstance(leaf, Tensor):
            yield prefix + tuple(keys), leaf


def _at(value: Any, path: Path) -> tuple[Any, KeyPath]:
    """What ``path`` reaches in ``value``, and the keys to it as
    :func:`_tensors` names them (a namedtuple's field by name, an index
    from the front): as far as it leads (a path that stops at a tensor, or
    leads nowhere known, changes all under it)."""
    walked: KeyPath = ()
    entry: Any
    for key in path:
        fields = getattr(value, "_fields", ())
        if isinstance(value, Tensor):
            break
        if fields and _indexes(key, fields):
            key = fields[key]
        if isinstance(key, str) and key in fields:
            value, entry = getattr(value, key), pytree.GetAttrKey(key)
        elif isinstance(value, dict) and key in value:
            value, entry = value[key], pytree.MappingKey(key)
        elif isinstance(value, (list, tuple)) and _indexes(key, value):
            # ``batch[-1]`` is the item a walk of the batch names [1].
            value, entry = value[key], pytree.SequenceKey(key % len(value))
        else:
            break
        walked += (entry,)
    return value, walked


def _indexes(key: Any, items: Sequence[Any]) -> bool:
    return isinstance(key, int) and -len(items) <= key < len(items)


# Where a tensor's elements may lie: its device and the bytes from its
# first element to past its last, [start, end).
Span = tuple[torch.device, int, int]


def _span(t: Tensor) -> Span | None:
    """The memory ``t`` may read; None where it reads none (empty, not
    strided, on the meta device)."""
    if t.layout != torch.strided or not t.numel() or t.device.type == "meta":
        return None
    if t.is_contiguous():  # most inputs: no walk over the dimensions
        count = t.numel()
    else:
        count = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return t.device, start, start + count * t.element_size()


def _share(a: Tensor, a_span: Span, b: Tensor, b_span: Span) -> bool:
    """Whether ``a`` and ``b`` (at ``a_span`` and ``b_span``) have an
    element's memory in common."""
    (device, a_start, a_end), (other, b_start, b_end) = a_span, b_span
    if device != other or a_end <= b_start or b_end <= a_start:
        return False
    size = a.element_size()
    if b.element_size() != size or (b_start - a_start) % size:
        return True  # not one array of elements (two dtypes): overlapping bytes share
    # Both read one array of elements: mark a's and look for them in b
    # (``t[:, :2]`` and ``t[:, 2:]`` interleave without sharing). The marks
    # cover the two alone, on the CPU: no device memory, no wait for it.
    low = min(a_start, b_start)
    marks = torch.zeros((max(a_end, b_end) - low) // size, dtype=torch.bool)
    marks.as_strided(a.shape, a.stride(), (a_start - low) // size).fill_(True)
    return bool(marks.as_strided(b.shape, b.stride(), (b_start - low) // size).any())


#: A split that changes no input.
NO_CHANGES = ChangedInputs((), ())
