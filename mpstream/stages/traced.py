"""A Pipe over a module split by ``torch.fx``: one trace per kind of call.

``torch.fx`` follows ``forward``'s Python code once, with what it knows
then. A test of a module's training flag (``F.dropout(x, p,
self.training)``, ``if self.training:``) is fixed to the flag's value,
and every argument is traced as a value, so ``if mask is not None:`` is
taken. :class:`FxSplit` keeps a trace per kind of call: the modules'
training flags, and which arguments are None. A None argument is
specialized only where the trace computes with it.

The first trace is made when the pipe is built: training mode, every
argument a value. Another kind is traced when it first comes. It uses the
same split points and is placed as the earlier traces placed the
module's tensors, and the pipe switches to it (see
:mod:`~mpstream.stages.kinds`). A trace whose code equals an earlier one's
is not kept: that split serves both kinds, with its runtime. This is the
usual case for a change of mode, because leaf modules such as
``nn.Dropout`` read their flag when they run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..runtime.graph import StageGraph
from .fx import Traced, lookup, trace
from .kinds import Kinds
from .placement import place
from .tracers import Binder, SplitReport

__all__ = ["FxSplit"]

# A kind of call: the arguments traced as None, and every module's training flag.
Key = tuple[frozenset[str], tuple[bool, ...]]


@dataclass
class _Trace:
    """The split for one or more kinds of call, and its pipe runtime once used."""

    traced: Traced
    modules: nn.ModuleList
    balance: list[int]
    described: str
    runtime: Any = None
    checked: bool = False

    @property
    def graph(self) -> StageGraph:
        return self.traced.graph

    @property
    def partitions(self) -> list[fx.GraphModule]:
        return self.traced.partitions

    @property
    def bind(self) -> Binder:
        bind = self.traced.bind
        assert isinstance(bind, Binder)
        return bind

    def __getstate__(self) -> dict[str, Any]:
        # Pickled or copied with its pipe, whose streams and C++ scheduler
        # are rebuilt on first use.
        state = dict(self.__dict__)
        state["runtime"] = None
        return state

    def same_as(self, other: Traced) -> bool:
        """Whether ``other`` computes what this split does."""
        other_bind = other.bind
        return (
            isinstance(other_bind, Binder)
            and other_bind.names == self.bind.names
            and other.graph == self.graph
            and [p.code for p in other.partitions] == [p.code for p in self.partitions]
        )


@dataclass
class FxSplit(Kinds):
    """A module pipelined by ``torch.fx``.

    Args:
        module: the module (its tensors are placed on the stages' devices).
        split_points: where the stages begin.
        devices: one device per stage.
        leaf_modules: submodules ``torch.fx`` does not trace into.
        reason: why ``torch.fx`` splits it (for the report).
    """

    module: nn.Module
    split_points: list[str]
    devices: list[torch.device]
    leaf_modules: Sequence[str | type[nn.Module]]
    reason: str
    traces: list[_Trace] = field(default_factory=list)
    kinds: dict[Key, _Trace] = field(default_factory=dict)
    current: _Trace | None = None
    placed: dict[str, torch.device] = field(default_factory=dict)

    def first(self) -> _Trace:
        """Traces the split in training mode with every argument a value,
        and places the module's tensors.

        Raises:
            TypeError: tracing failed, or ``forward`` takes ``*args``/``**kwargs``.
            ValueError: a bad split point, or a tensor shared by stages on
                different devices.
        """
        self.module.training = True  # a new pipe is in training mode
        split = self._trace(frozenset(), self._flags())
        self.current = split
        return split

    def _flags(self) -> tuple[bool, ...]:
        return tuple(m.training for m in self.module.modules())

    def _trace(self, nones: frozenset[str], flags: tuple[bool, ...]) -> _Trace:
        """The split for a kind of call not met before (traced now)."""
        traced = trace(self.module, self.split_points, leaf_modules=self.leaf_modules, nones=nones)
        split = next((t for t in self.traces if t.same_as(traced)), None)
        if split is None:
            self._place(traced)
            split = _Trace(
                traced,
                nn.ModuleList(traced.partitions),
                [sum(n.op.startswith("call") for n in p.graph.nodes) for p in traced.partitions],
                _describe(nones, flags),
            )
            self.traces.append(split)
        self.kinds[(nones, flags)] = split
        return split

    def _place(self, traced: Traced) -> None:
        """Puts each stage's tensors on its device, where no earlier trace
        placed them elsewhere.

        Raises:
            ValueError: a tensor an earlier trace placed on another device.
        """
        earlier = {id(lookup(self.module, n)): (n, d) for n, d in self.placed.items()}
        wanted: dict[str, torch.device] = {}
        for s, names in enumerate(traced.tensors):
            for name in names:
                wanted.setdefault(name, self.devices[s])
        for name, device in sorted(wanted.items()):
            was, placed = earlier.get(id(lookup(self.module, name)), (name, device))
            if placed != device:
                raise ValueError(
                    f"this call's trace reads {name} in a stage on {device}, but an earlier "
                    f"trace placed {was} on {placed}: a kind of call that reaches a tensor "
                    f"from another stage needs that stage on the same device"
                )
        place(self.module, traced, self.devices)
        self.placed.update(wanted)

    # -- every call -----------------------------------------------------
    def select(
        self, training: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[_Trace, tuple[Any, ...]]:
        """The split of a call's kind (traced now if it is new) and the
        pipeline's inputs for the call.

        Args:
            training: the pipe's mode (the module's root is not registered
                on the pipe, so it is set here).
            args: the call's positional arguments.
            kwargs: its keyword arguments.

        Raises:
            TypeError: the call does not bind to ``forward``; tracing failed.
            ValueError: the new trace places a tensor elsewhere than an
                earlier one did.
        """
        assert self.current is not None
        values = self.current.bind.arguments(args, kwargs)
        self.module.training = training
        flags = self._flags()
        nones = frozenset(n for n, v in values.items() if v is None)
        fixed: frozenset[str] = frozenset()
        while True:
            # An argument is fixed to None only where the trace uses it; a
            # trace with one fixed may use another (``if a is None: use b``).
            split = self.kinds.get((fixed, flags)) or self._trace(fixed, flags)
            more = (nones & split.bind.used) - fixed
            if not more:
                return split, tuple(values[n] for n in split.bind.names)
            fixed |= more

    def report(self) -> SplitReport:
        """The tracer, why, and each kind of call traced so far."""
        return SplitReport(
            "torch.fx",
            self.reason,
            tuple(self.split_points),
            traces=tuple(t.described for t in self.traces),
        )


def _describe(nones: frozenset[str], flags: tuple[bool, ...]) -> str:
    """One line for the report: the mode and the arguments traced as None."""
    mode = "training" if flags[0] else "eval"
    if len(set(flags)) > 1:
        mode += f" ({flags.count(not flags[0])} submodules in {'eval' if flags[0] else 'training'})"
    given = ", ".join(f"{n}=None" for n in sorted(nones)) or "every argument given"
    return f"{mode}: {given}"
