"""A pipeline call's inputs: positional, checked, detached, sized.

``Pipe.forward`` and ``Pipe.train_step`` turn the call's arguments into the
pipeline's positional inputs (a traced module binds them to its signature)
and split them into micro-batches (:mod:`~mpstream.runtime.microbatch`);
where they sit in pageable host memory bound for a GPU, each micro-batch
gets a slice of one pinned buffer per tensor
(:func:`~mpstream.runtime.transfer.micro_staging`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..runtime.microbatch import PLAIN, NoChunk, describe, leaves, split

__all__ = ["positional", "check_holds_tensor", "detached", "micro_sizes", "keywords_of"]


def positional(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A Sequential pipeline's positional inputs for a call: positional
    arguments only (a list is the batch as a tuple of tensors, torchgpipe's
    style). A traced module binds a call itself (see :mod:`~mpstream.stages.kinds`).

    Raises:
        TypeError: keyword arguments, no input, or only plain values (a
            string, a list of numbers, ...), no tensor.
    """
    if kwargs:
        names = ", ".join(sorted(kwargs))
        raise TypeError(
            f"a Pipe over an nn.Sequential takes positional inputs only; got keyword "
            f"argument(s) {names}"
        )
    if not args:
        raise TypeError("Pipe needs at least one input")
    check_holds_tensor(args, kwargs)
    return tuple(tuple(a) if isinstance(a, list) else a for a in args)


def check_holds_tensor(
    args: tuple[Any, ...], kwargs: dict[str, Any], root: nn.Module | None = None
) -> None:
    """Refuses a call that holds only plain values, no tensor to split, or
    an object holding tensors that pytree does not look into (a dataclass,
    a ``types.SimpleNamespace``): its tensors could be neither split into
    micro-batches nor copied where the forward changes them in place.

    Args:
        args: the call's positional arguments.
        kwargs: its keyword arguments.
        root: the traced module, whose ``forward`` names the arguments.

    Raises:
        TypeError: naming what was passed (the argument, for an object) and
            what to do.
    """
    # Checked before a list becomes a tuple, so the message shows what the
    # caller passed; other leaves (arrays, ...) get scatter's message. A
    # call of tensor arguments alone, the usual one, skips the flattening;
    # one of tensors and plain values (``pipe(x, mask=None)``) needs none,
    # and the keys to a leaf are looked up only to name an object refused.
    if args and not kwargs and all(type(a) is Tensor for a in args):
        return
    given = (*args, *kwargs.values())
    found = given if all(isinstance(v, _FLAT) for v in given) else pytree.tree_leaves(given)
    if not all(isinstance(v, _FLAT) for v in found):
        _check_objects(args, kwargs, root)
    if not any(type(a) is Tensor for a in args) and all(isinstance(v, PLAIN) for v in found):
        given = args[0] if len(args) == 1 and not kwargs else given
        raise TypeError(
            f"Pipe input holds no tensor; got {describe(given)}. Pass the batch as a Tensor "
            f"(torch.as_tensor converts numbers, lists and arrays), or a tuple, list or dict "
            f"holding tensors"
        )


# Leaves mpstream splits or passes as they are, holding no object to look into.
_FLAT = (Tensor, NoChunk, *PLAIN)


def _check_objects(args: tuple[Any, ...], kwargs: dict[str, Any], root: nn.Module | None) -> None:
    """Refuses an object among the call's leaves that holds tensors (see
    :func:`check_holds_tensor`), naming the argument."""
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if held := _tensors_held(leaf):
            name = _argument(path, root)
            advice = (
                "Pass a dict of its items instead, or the items as keyword arguments"
                if isinstance(leaf, Mapping)
                else "Pass a namedtuple of its tensors instead (forward reads the fields as "
                "attributes, as now), or a dict"
            )
            raise TypeError(
                f"Pipe input {name} is a {type(leaf).__name__} holding tensors "
                f"({', '.join(map(str, held))}), which mpstream cannot look into: it splits "
                f"the tensors of tuples, lists, dicts and namedtuples into micro-batches "
                f"(and copies those the forward changes in place). {advice}"
            )


def _tensors_held(leaf: Any) -> list[Any]:
    """The attributes of ``leaf``, a pytree leaf, that hold a tensor (of
    an object's ``__dict__`` or a slotted dataclass's fields; a mapping's
    keys)."""
    if isinstance(leaf, _FLAT):
        return []
    if isinstance(leaf, Mapping):  # a mapping pytree does not flatten (a UserDict)
        attributes = dict(leaf)
    else:
        try:
            attributes = dict(vars(leaf))
        except TypeError:  # no __dict__
            attributes = {}
    if dataclasses.is_dataclass(leaf):
        attributes.update((f.name, getattr(leaf, f.name, None)) for f in dataclasses.fields(leaf))
    return [
        name
        for name, value in attributes.items()
        if any(isinstance(t, Tensor) for t in pytree.tree_leaves(value))
    ]


def _argument(path: tuple[Any, ...], root: nn.Module | None) -> str:
    """The argument at ``path`` into a call's ``(args, kwargs)``, by the name
    ``root.forward`` gives it where known (``batch``, ``batch['x']``)."""
    where, key, *rest = path
    name = f"argument {key.idx}" if where.idx == 0 else str(key.key)
    if where.idx == 0 and root is not None:
        try:
            params = list(inspect.signature(root.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if key.idx < len(params) and params[key.idx].kind in positional:
            name = params[key.idx].name
    return name + pytree.keystr(tuple(rest))


def detached(value: Any) -> Any:
    """``value`` with every tensor detached, :class:`NoChunk` ones included."""

    def detach(leaf: Any) -> Any:
        if isinstance(leaf, Tensor):
            return leaf.detach()
        return NoChunk(leaf.tensor.detach()) if isinstance(leaf, NoChunk) else leaf

    return pytree.tree_map(detach, value)


def micro_sizes(value: Any, chunks: int | None, split_size: int | None) -> list[int]:
    """The batch size of each micro-batch ``value`` splits into: that of its
    tensors, split along dim 0 (:class:`NoChunk` tensors are not split).

    Raises:
        TypeError: it holds no tensor to split.
    """
    for leaf in leaves(value)[0]:
        if isinstance(leaf, Tensor):
            return [len(part) for part in split(leaf, chunks, split_size)]
    raise TypeError("the batch holds no tensor to split")


def keywords_of(root: nn.Module, inputs: Mapping[Any, Any]) -> bool:
    """Whether ``inputs`` is ``root.forward``'s keyword arguments rather than
    one input: its keys are strings and one at least names a parameter (a
    key ``forward`` does not take is then refused by name, or goes to its
    ``**kwargs``: a Hugging Face batch's extra keys)."""
    try:
        params = inspect.signature(root.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {p.name for p in params if p.kind in keyword}
    keys = list(inputs)
    return all(isinstance(k, str) for k in keys) and any(k in named for k in keys)
