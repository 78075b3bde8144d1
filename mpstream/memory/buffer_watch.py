"""Buffers a module run whole writes, seen at its first call.

A module the stages call whole (a layer of a ``Sequential`` stage, a leaf
module of a traced one) shows no graph: whether its forward writes its
buffers (``self.calls += 1``, ``self.ema.mul_(d).add_(x.mean())``) is known
only by running it. One reached from two stages would be written from two
streams at once, or written by one while the other reads it: on a GPU a
race. Refusing every shared module with buffers would refuse the common
safe case, buffers only read (a rotary embedding's frequencies, a mask).

:class:`Watch` looks at such modules' first call in each of their own modes
(their ``training`` flag, which the user may set apart from the pipe's): a
hook before it notes its buffers' version counters and keeps a copy of them,
one after it compares the counters (the values, for inference tensors, which
keep no counter). A write is refused there, with the buffers put back,
before a second stage's call can race with it; each later run while the
module is in that mode is refused before it starts. What ran before that
first call in the run (layers of earlier stages) ran, as with any error
raised in a stage (``train_step`` puts its norms and gradients back).
No probe runs the module beforehand: its input is made by the layers before
it, and a second run of its forward would repeat its other side effects. A
module called without a write is not watched again in that mode; one seen
writing is refused while it is in that mode (its forward may skip the write
in another).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["Owner", "Watch"]


def _version(b: Tensor) -> int | None:
    """``b``'s version counter; None for an inference tensor, which keeps
    none (a model built under ``torch.inference_mode()``)."""
    return None if b.is_inference() else b._version


def _written(b: Tensor, version: int | None, copy: Tensor) -> bool:
    """Whether the call wrote ``b``: its counter moved on from ``version``,
    or, with no counter, its values differ from ``copy`` (NaN equal to NaN)."""
    if version is not None:
        return b._version != version
    same = b == copy
    if b.is_floating_point() or b.is_complex():
        same |= b.isnan() & copy.isnan()
    return not bool(same.all())


@dataclass
class Owner:
    """A module run whole by several stages, and its buffers.

    Attributes:
        module: the module.
        name: its name in the model.
        buffers: its own buffers, each with its name in the model.
        stages: the stages that reach it.
    """

    module: nn.Module
    name: str
    buffers: list[tuple[str, Tensor]]
    stages: list[int]

    def message(self, written: list[str], names: Sequence[str]) -> str:
        """The refusal: ``written`` the buffers written, ``names`` the
        stages' labels."""
        which = ", ".join(f"'{w}'" for w in written)
        stages = ", ".join(map(str, self.stages[:-1])) + f" and {self.stages[-1]}"
        where = "; ".join(names[s] for s in self.stages)
        return (
            f"the buffer{'s' * (len(written) > 1)} {which} of '{self.name}' "
            f"({type(self.module).__name__}) {'are' if len(written) > 1 else 'is'} written by "
            f"its forward, which stages {stages} run, whose forwards run at once on their own "
            f"streams ({where}); a write from one stream while another reads or writes a "
            f"buffer races (on a GPU its values come out wrong without an error). Seen at its "
            f"first call, and put back as it was. Keep its calls in one stage (split points "
            f"that do not fall between them), give each stage a module of its own, or have "
            f"its forward skip the write in this mode"
        )


@dataclass
class Watch:
    """Watches the first call of each :class:`Owner` per mode; see the module."""

    owners: list[Owner]
    # Keyed by (owner index, the owner's own training flag): its forward
    # reads its own flag, which the user may set apart from the pipe's
    # (a shared module frozen with .eval() while the pipe trains).
    #: The owners' modes seen called without writing.
    clean: set[tuple[int, bool]] = field(default_factory=set)
    #: The refusal found per owner's mode (raised again before each run).
    found: dict[tuple[int, bool], str] = field(default_factory=dict)
    handles: list[RemovableHandle] = field(default_factory=list)

    def arm(self, labels: Callable[[], Sequence[str]]) -> None:
        """Before a run: refuses it where an owner was seen writing in the
        mode it is now in, else watches the owners not yet seen called in
        their mode.

        Args:
            labels: gives each stage's label (called only to refuse).

        Raises:
            ValueError: an earlier run saw an owner write in its mode.
        """
        self.disarm()
        keys = [(i, owner.module.training) for i, owner in enumerate(self.owners)]
        for key in keys:
            if key in self.found:
                raise ValueError(self.found[key])
        for key, owner in zip(keys, self.owners):
            if key not in self.clean:
                self._watch(key, owner, labels)

    def disarm(self) -> None:
        """After a run: removes the hooks left on modules it never called (it
        raised before their call, or they sit on a branch not taken). Left
        on the user's modules, those local functions would keep them from
        being pickled, and a copy of them would watch the original's buffers."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _watch(
        self, key: tuple[int, bool], owner: Owner, labels: Callable[[], Sequence[str]]
    ) -> None:
        seen: list[tuple[int | None, Tensor]] = []
        mine: list[RemovableHandle] = []

        def before(module: nn.Module, args: Any) -> None:
            with torch.no_grad():
                seen[:] = [(_version(b), b.detach().clone()) for _, b in owner.buffers]

        def after(module: nn.Module, args: Any, output: Any) -> None:
            for handle in mine:  # the first call only
                handle.remove()
            written = []
            for (name, b), (version, copy) in zip(owner.buffers, seen):
                if _written(b, version, copy):
                    written.append(name)
                    b.data.copy_(copy)  # .data: the counter stays as the run left it
            if not written:
                self.clean.add(key)
                return
            self.found[key] = owner.message(written, labels())
            raise ValueError(self.found[key])

        mine += [
            owner.module.register_forward_pre_hook(before),
            owner.module.register_forward_hook(after),
        ]
        self.handles += mine
