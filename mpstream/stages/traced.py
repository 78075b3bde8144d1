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
And which keys it looks up in a dict (``batch.get("s")``, ``"s" in
batch``) the call leaves out: the trace answers each as the module would
(see :mod:`~mpstream.stages.lookups`), and the type of each argument
``isinstance`` tests (see :mod:`~mpstream.stages.type_tests`). Which keys the traces look up is
known only once they are made: a call's kind is taken over those of every
trace so far, and a new trace's split is kept under the kind its call has
with the trace's own added. A kind new only by keys that a later trace
looked up takes the split of the trace it agrees with (on its own lookups,
None items and flags), not traced again.

The first trace is made when the pipe is built, with the module's flags as
they are and every argument and key a value, or as the call ``sample=``
gives (None where it holds None, a key missing where it leaves it out).
Another kind is traced when it first comes: the same split points, the
module's tensors placed where earlier traces placed them, and the pipe
switches to it (see :mod:`~mpstream.stages.kinds`). Every split takes
every argument (those traced as None unused), so a trace whose code
equals an earlier one's is not kept: that split serves both kinds, with
its runtime. That is the usual case for a change of mode, or a None
argument the code does not test. A kind that failed to trace fails again
at once.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..runtime.graphed import generation
from .fx import Traced, trace, traced_through
from .fx_constants import drop_constants, same_code
from .kinds import Kinds, Split, operations
from .lookups import NOTHING, Lookup, missing_keys, value_at
from .module_hooks import HookError, check_traced_hooks, check_unsized, entering
from .placement import place
from .replaced import check_forwards, check_replaced
from .tracers import Binder, SplitReport, call_arguments, nones_of, sample_call

__all__ = ["FxSplit"]

# A kind of call: the arguments and items traced as None, every way code
# reads them (``nones_of(..., reads=True)``), the keys a trace looked up
# that the call leaves out (``missing_keys``), and the traced modules'
# training flags.
Key = tuple[frozenset[str], frozenset[str], tuple[bool, ...]]

_NONE = frozenset[str]()

# A trace made: the None items and flags of its call, the lookups it made
# and which of them the call left out, and its split. Its code depends on
# the call through these only, so it serves a call that agrees on them,
# whatever other traces looked up since (which the call's Key covers).
_Run = tuple[frozenset[str], tuple[bool, ...], frozenset[Lookup], frozenset[str], "_Trace"]


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
            and all(same_code(p, q) for p, q in zip(other.partitions, self.partitions))
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
    lookups: set[Lookup] = field(default_factory=set)  # every trace's, a failed one's too
    runs: list[_Run] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.watched = traced_through(self.module, self.leaf_modules)

    def __getstate__(self) -> dict[str, Any]:
        # A key that does not pickle (an enum defined in a function) goes,
        # with the runs that looked it up. The kinds are taken over every
        # lookup, so without it two kinds would fall together (a call that
        # leaves the key out would take the split traced with it): they go
        # too, and the loaded pipe takes each call's kind again, from the
        # runs kept or by a trace that looks the key up anew and shares a
        # split whose code is the same.
        state = super().__getstate__()
        lost = {lookup for lookup in self.lookups if not _pickles(lookup)}
        if lost:
            state["lookups"] = self.lookups - lost
            state["runs"] = [run for run in self.runs if not run[2] & lost]
            state["kinds"], state["untraceable"] = {}, {}
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> FxSplit:
        # A copy is no pickle: every lookup and kind goes with it, so the
        # copy traces no kind its original traced. Through ``memo``, it
        # splits the copy of the module the pipe's copy holds.
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(super().__getstate__(), memo))
        return copied

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("lookups", set())  # pickled by an mpstream without them
        state.setdefault("runs", [])
        self.__dict__.update(state)

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
            TypeError: tracing failed, or ``forward`` takes ``*args``/``**kwargs``;
                a module the trace entered holds a hook (see
                :mod:`~mpstream.stages.module_hooks`).
            ValueError: a bad split point, or a tensor shared by stages on
                different devices.
        """
        check_forwards(self, self.module, self.watched, "torch.fx")
        values = None if sample is None else call_arguments(self.module, *sample_call(sample))
        split = self._trace(values, self._flags())
        self.current = split
        return split

    def _flags(self) -> tuple[bool, ...]:
        return tuple(m.training for m in self.watched)

    def _key(self, values: dict[str, Any] | None, flags: tuple[bool, ...]) -> Key:
        """A call's kind (see :data:`Key`); no call: every argument and key given."""
        if values is None:
            return _NONE, _NONE, flags
        # Only a pipe whose traces looked a key up pays for a look at its dicts.
        missing = missing_keys(values, self.lookups) if self.lookups else _NONE
        return nones_of(values, reads=True), missing, flags

    def _trace(self, values: dict[str, Any] | None, flags: tuple[bool, ...]) -> _Trace:
        """The split of a kind of call not met before, traced now: the call
        ``values`` (every argument by name; None: every argument and key
        given) and the module's training ``flags``.

        The keys the trace looks up (``batch.get("s")``) are part of the
        kind from now on, so the split is kept under the key the call has
        with them: the trace answered each from the call.

        Raises:
            TypeError, ValueError: as :meth:`first`, the message naming the
                kind of call.
        """
        key = self._key(values, flags)
        failed = self.untraceable.get(key)
        if failed is not None:  # no second trace of a kind that failed
            raise failed[0](failed[1])
        for nones, run_flags, run_lookups, missing, run_split in self.runs:
            # A kind new only by keys that later traces looked up.
            if values is not None and nones == key[0] and run_flags == flags:
                if missing_keys(values, run_lookups) == missing:
                    self.kinds[key] = run_split
                    return run_split
        check_unsized(self.module, self.watched, "fx")
        traced: Traced | None = None
        looked = set[Lookup]()  # this trace's own lookups
        try:
            # Constants fx computes become the stages' tensors: never
            # inference tensors, though a kind may first come in inference.
            with torch.inference_mode(False), entering(self.module, "fx") as entered:
                traced = trace(
                    self.module,
                    self.split_points,
                    leaf_modules=self.leaf_modules,
                    nones=key[0],
                    values=values,
                    lookups=looked,
                )
            split = next((t for t in self.traces if t.same_as(traced)), None)
            if split is None:
                earlier = [t.traced.tensors for t in self.traces]
                place(self.module, traced.partitions, traced.tensors, self.devices, earlier)
        except (TypeError, ValueError) as exc:
            self.lookups |= looked
            if traced is not None:
                drop_constants(self.module, traced)
            if isinstance(exc, HookError):
                raise  # not this kind's: it traces once the hook is removed
            described = _describe(values, flags, self.lookups)
            message = f"{exc}\n(traced for this kind of call: {described})"
            self.untraceable[self._key(values, flags)] = (type(exc), message)
            raise type(exc)(message) from exc
        self.lookups |= looked
        if split is not None:
            drop_constants(self.module, traced)  # the shared split holds its own
            # Code alike, though one trace may enter a module the other did
            # not (one that adds no operation): each call it serves checks both.
            known = split.entered or ()
            ids = {id(m) for m in known}
            split.entered = (*known, *(m for m in entered if id(m) not in ids))
        else:
            split = _Trace.of(traced, _describe(values, flags, self.lookups))
            split.entered = tuple(entered)
            self.traces.append(split)
        key = self._key(values, flags)
        self.kinds[key] = split
        given = _NONE if values is None else missing_keys(values, looked)
        self.runs.append((key[0], flags, frozenset(looked), given, split))
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
            TypeError: the call does not bind to ``forward``; tracing failed;
                a module the call's trace entered holds a hook (see
                :mod:`~mpstream.stages.module_hooks`), or one the trace
                follows has another instance ``forward`` than it had (see
                :mod:`~mpstream.stages.replaced`).
            ValueError: a split point this kind of call does not reach, or a
                tensor the new trace reads where an earlier one placed it
                elsewhere.
        """
        assert self.current is not None
        check_forwards(self, self.module, self.watched, "torch.fx")
        values = self.current.bind.arguments(args, kwargs)  # every trace's forward binds alike
        flags = self._flags()
        split = self.kinds.get(self._key(values, flags)) or self._trace(values, flags)
        check_traced_hooks(self.module, split.entered or self.watched, "fx")
        return split, tuple(values[n] for n in split.bind.names)

    def refresh(self, force: bool = False) -> None:
        """:meth:`Kinds.refresh`, refusing first a split whose submodules
        were replaced since (see :mod:`~mpstream.stages.replaced`)."""
        if force or self.__dict__.get("_bound") != generation():
            assert self.current is not None
            check_replaced(self.module, self.watched, self.current.partitions)
        super().refresh(force)

    def report(self) -> SplitReport:
        """The tracer, why, and each kind of call traced so far."""
        return SplitReport(
            "torch.fx",
            self.reason,
            tuple(self.split_points),
            traces=tuple(t.described for t in self.traces),
        )


def _pickles(lookup: Lookup) -> bool:
    """Whether a lookup pickles (its key, and those on the way to its dict)."""
    try:
        pickle.dumps(lookup)
    except (pickle.PicklingError, AttributeError, TypeError):
        return False
    return True


def _describe(values: dict[str, Any] | None, flags: tuple[bool, ...], lookups: set[Lookup]) -> str:
    """One line for the report: the mode, the arguments traced as None,
    the keys looked up that the call leaves out of its dicts and the types
    of the arguments whose type a trace tested."""
    mode = "training" if flags[0] else "eval"
    if len(set(flags)) > 1:
        mode += f" ({flags.count(not flags[0])} submodules in {'eval' if flags[0] else 'training'})"
    given: list[str] = []
    if values is not None:
        given += [f"{n}=None" for n in sorted(nones_of(values))]  # each None once
        given += sorted(f"{k.name} missing" for k in lookups if k.present(values) is False)
        # Of what the call holds: None and a key left out are named above.
        held = [k for k in lookups if k.typed and value_at(values, k.owner) is not None]
        given += sorted(k.type_in(values) for k in held if value_at(values, k.owner) is not NOTHING)
    return f"{mode}: {', '.join(given) or 'every argument given'}"
