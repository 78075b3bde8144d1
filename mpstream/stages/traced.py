"""A Pipe over a module split by ``torch.fx``: one trace per kind of call.

``torch.fx`` follows ``forward``'s Python code once, with what it knows
then. A test of a module's training flag (``F.dropout(x, p,
self.training)``, ``if self.training:``) is fixed to the flag's value,
and every argument is traced as a value, so ``if mask is not None:`` is
taken. :class:`FxSplit` keeps a trace per kind of call: the training
flags of the modules whose code the trace follows (not of leaves such as
``nn.Dropout``, which read theirs as they run), and which arguments are
None, traced as None. So are None items inside an argument (a batch
``{"x": x, "mask": None}``, a registered dataclass's field): fx would
trace each item as a value, and take ``if batch["mask"] is not None:``.

The first trace is made when the pipe is built, with the module's flags as
they are and every argument a value, or the arguments ``sample=`` leaves
None traced as None. Another kind is traced when it first comes: the same
split points, the module's tensors placed where earlier traces placed them,
and the pipe switches to it (see :mod:`~mpstream.stages.kinds`). Every
split takes every argument (those traced as None unused), so a trace whose
code equals an earlier one's is not kept: that split serves both kinds,
with its runtime. That is the usual case for a change of mode, or a None
argument the code does not test. A kind that failed to trace fails again
at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from .fx import Traced, trace, traced_through
from .kinds import Kinds, Split, operations
from .placement import place
from .tracers import Binder, SplitReport, none_arguments, nones_of, sample_call

__all__ = ["FxSplit"]

# A kind of call: the arguments and items traced as None, every way code
# reads them (``nones_of(..., reads=True)``), and the traced modules'
# training flags.
Key = tuple[frozenset[str], tuple[bool, ...]]


@dataclass
class _Trace(Split):
    """The split of one or more kinds of call."""

    traced: Traced

    @classmethod
    def of(cls, traced: Traced, described: str) -> _Trace:
        return cls(
            traced,
            modules=nn.ModuleList(traced.partitions),
            balance=operations(traced.partitions),
            graph=traced.graph,
            described=described,
            changed=traced.changed,
        )

    @property
    def bind(self) -> Binder:
        bind = self.traced.bind
        assert isinstance(bind, Binder)
        return bind

    def same_as(self, other: Traced) -> bool:
        """Whether ``other`` computes what this split does."""
        bind = other.bind
        return (
            isinstance(bind, Binder)
            and bind.names == self.bind.names
            and other.graph == self.graph
            and all(_same_code(p, q) for p, q in zip(other.partitions, self.partitions))
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
    current: _Trace | None = None  # type: ignore[assignment]
    untraceable: dict[Key, tuple[type[Exception], str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.watched = traced_through(self.module, self.leaf_modules)

    @classmethod
    def adopt(
        cls,
        module: nn.Module,
        split_points: list[str],
        devices: list[torch.device],
        traced: Traced,
    ) -> FxSplit:
        """The split of a pipe pickled before it traced per kind of call:
        its one trace made current (the kind it was traced for is unknown,
        so each call's kind is traced again, sharing it where the code is
        the same), the modules it called whole as the leaves of later
        traces."""
        names = {id(m): n for n, m in module.named_modules() if n}
        leaves = sorted(
            {
                names[id(part.get_submodule(str(node.target)))]
                for part in traced.partitions
                for node in part.graph.nodes
                if node.op == "call_module" and id(part.get_submodule(str(node.target))) in names
            }
        )
        split = cls(module, split_points, devices, leaves, "torch.fx traced the module")
        kept = _Trace.of(traced, "a trace by an earlier mpstream, its kind unknown")
        split.traces.append(kept)
        split.current = kept
        return split

    def first(self, sample: Any = None) -> Split:
        """Traces the split of the first kind of call and places the
        module's tensors: the module's flags as they are, and every
        argument a value or, given ``sample`` (see
        :func:`~mpstream.stages.tracers.sample_call`), its None arguments
        as None.

        Raises:
            TypeError: tracing failed, or ``forward`` takes ``*args``/``**kwargs``.
            ValueError: a bad split point, or a tensor shared by stages on
                different devices.
        """
        nones = reads = frozenset[str]()
        if sample is not None:
            args, kwargs = sample_call(sample)
            nones = none_arguments(self.module, args, kwargs)
            reads = none_arguments(self.module, args, kwargs, reads=True)
        split = self._trace(reads, self._flags(), nones)
        self.current = split
        return split

    def _flags(self) -> tuple[bool, ...]:
        return tuple(m.training for m in self.watched)

    def _trace(
        self, reads: frozenset[str], flags: tuple[bool, ...], nones: frozenset[str]
    ) -> _Trace:
        """The split of a kind of call not met before (traced now): ``reads``
        (every way the code may read a None argument or item, see
        :func:`~mpstream.stages.tracers.nones_of`) and ``flags`` its key,
        ``nones`` (each None once) for the report.

        Raises:
            TypeError, ValueError: as :meth:`first`, the message naming the
                kind of call.
        """
        described = _describe(nones, flags)
        failed = self.untraceable.get((reads, flags))
        if failed is not None:  # no second trace of a kind that failed
            raise failed[0](failed[1])
        traced: Traced | None = None
        try:
            # Constants fx computes become the stages' tensors: never
            # inference tensors, though a kind may first come in inference.
            with torch.inference_mode(False):
                traced = trace(
                    self.module, self.split_points, leaf_modules=self.leaf_modules, nones=reads
                )
            split = next((t for t in self.traces if t.same_as(traced)), None)
            if split is None:
                earlier = [t.traced.tensors for t in self.traces]
                place(self.module, traced.partitions, traced.tensors, self.devices, earlier)
        except (TypeError, ValueError) as exc:
            if traced is not None:
                _drop_constants(self.module, traced)
            message = f"{exc}\n(traced for this kind of call: {described})"
            self.untraceable[(reads, flags)] = (type(exc), message)
            raise type(exc)(message) from exc
        if split is not None:
            _drop_constants(self.module, traced)  # the shared split holds its own
        else:
            split = _Trace.of(traced, described)
            self.traces.append(split)
        self.kinds[(reads, flags)] = split
        return split

    # -- every call -----------------------------------------------------
    def select(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Split, tuple[Any, ...]]:
        """The split of a call's kind (traced now if it is new) and the
        pipeline's inputs for the call. The module's training flags, which
        :meth:`mpstream.Pipe.train` sets, are part of the kind.

        Args:
            args: the call's positional arguments.
            kwargs: its keyword arguments.

        Raises:
            TypeError: the call does not bind to ``forward``; tracing failed.
            ValueError: a split point this kind of call does not reach, or a
                tensor the new trace reads where an earlier one placed it
                elsewhere.
        """
        assert self.current is not None
        values = self.current.bind.arguments(args, kwargs)  # every trace's forward binds alike
        flags = self._flags()
        key: Key = (nones_of(values, reads=True), flags)
        split = self.kinds.get(key) or self._trace(*key, nones_of(values))
        return split, tuple(values[n] for n in split.bind.names)

    def report(self) -> SplitReport:
        """The tracer, why, and each kind of call traced so far."""
        return SplitReport(
            "torch.fx",
            self.reason,
            tuple(self.split_points),
            traces=tuple(t.described for t in self.traces),
        )


# What fx names a tensor it computed while tracing (a fresh name per trace).
_CONSTANT = re.compile(r"_attr__tensor_constant\d+")


def _same_code(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Whether two stages run the same code on equal constants."""
    names_a, names_b = (list(dict.fromkeys(_CONSTANT.findall(p.code))) for p in (a, b))
    if len(names_a) != len(names_b):
        return False
    code_a, code_b = a.code, b.code
    for i, (x, y) in enumerate(zip(names_a, names_b)):
        code_a = re.sub(rf"\b{x}\b", f"_constant{i}_", code_a)
        code_b = re.sub(rf"\b{y}\b", f"_constant{i}_", code_b)
        s, t = getattr(a, x), getattr(b, y)
        if s.dtype != t.dtype or s.shape != t.shape or s.device != t.device:
            return False
        if not torch.equal(s, t):
            return False
    return code_a == code_b


def _drop_constants(module: nn.Module, traced: Traced) -> None:
    """Removes from ``module`` the constants fx put there for a trace that
    is not kept (each trace adds its own)."""
    for part in traced.partitions:
        for target in getattr(part, "_mpstream_attrs", {}).values():
            if _CONSTANT.fullmatch("_attr_" + target) and hasattr(module, target):
                delattr(module, target)


def _describe(nones: frozenset[str], flags: tuple[bool, ...]) -> str:
    """One line for the report: the mode and the arguments traced as None."""
    mode = "training" if flags[0] else "eval"
    if len(set(flags)) > 1:
        mode += f" ({flags.count(not flags[0])} submodules in {'eval' if flags[0] else 'training'})"
    given = ", ".join(f"{n}=None" for n in sorted(nones)) or "every argument given"
    return f"{mode}: {given}"
