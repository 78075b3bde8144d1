"""One graphed stage's state, and the rules that keep its graphs valid.

:class:`StageState` is what :class:`~.stages.StageGraphs` keeps per stage:
its graphed calls (least recently used first), what they baked in
(:class:`~.keys.Baked`), its gradient buffers and memory pool, why it runs
eagerly if it does, and its counts. :meth:`StageState.prepare` is the check
each run begins with (graphs dropped for room or invalidated by a replaced
tensor go, a tensor hook turns the stage eager); :meth:`StageState.room`
bounds the calls kept.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from itertools import islice
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from .backends import pool_bytes
from .call import GraphedCall
from .grads import GradStore
from .keys import Baked, Scalars, hooks_registered
from .report import StageReport

__all__ = ["StageState", "drop_stale", "static_buffers", "storage_bytes"]

_hooks = operator.attrgetter("_backward_hooks")
#: Tuples of training flags a stage keeps numbers for (see StageState.modes).
_MODES_KEPT = 64
#: Call keys a stage keeps numbers for, at least (see StageState.number).
_NUMBERS_KEPT = 4096


class StageState:
    """One stage's graphs and state.

    Args:
        index: the stage's index in the pipe.
        module: the stage's module (what its graphs differentiate).
        device: the stage's device.
        label: how warnings name the stage.
        graphable: whether the backend may graph a stage on ``device``.
    """

    def __init__(
        self, index: int, module: nn.Module, device: torch.device, label: str, graphable: bool
    ) -> None:
        self.index, self.module, self.device, self.label = index, module, device, label
        self.reason: str | None = (
            None if graphable else f"on {device}: CUDA graphs need a CUDA device"
        )
        #: The modules' training flags this run, as a number (part of each
        #: call's key): hashing the flags themselves, one per module, at
        #: every call cost as much as the rest of the key on a large stage.
        self.modes = -1
        # Each tuple of flags seen, and its number; numbers are never
        # reused, so forgetting the tuples (past _MODES_KEPT) only costs
        # captures again.
        self._modes: dict[tuple[bool, ...], int] = {}
        self._next_modes = 0
        #: Each call key captured (all of it but the generation), as a
        #: number: the calls are kept under (number, generation), so a
        #: replay hashes its key once, not again to look up, reorder and
        #: mark its call. Numbers are never reused, and past
        #: ``_NUMBERS_KEPT`` the keys of calls no longer kept are forgotten
        #: (shapes that keep changing, producers captured again: their
        #: keys would pile up), which costs at most a capture again.
        self.numbers: dict[tuple[Any, ...], int] = {}
        self._next_number = 0
        # The keys forgotten whose calls were dropped, with the generations
        # dropped: met again, each is a recapture still. At most
        # _NUMBERS_KEPT, the oldest going first: keys that never come back
        # (shapes that keep changing, a producer's call captured again)
        # would pile up, and one forgotten here costs only a capture
        # counted as a first one.
        self.forgotten: dict[tuple[Any, ...], frozenset[int]] = {}
        self.calls: OrderedDict[tuple[Any, ...], GraphedCall] = OrderedDict()
        self.used: set[tuple[Any, ...]] = set()  # keys the current run replayed
        self.baked: Baked | None = None
        # The hook counter when the baked parameters were last found free
        # of tensor hooks (see prepare); -1: not yet, or baked anew since.
        self._hooks_seen = -1
        self.store: GradStore | None = None
        self.pool: Any = None  # the stage's shared memory pool (see backends)
        self.scalars = Scalars()
        self.overflow = False  # warned that calls beyond a bound run eagerly
        self.warned = False  # warned that the stage runs eagerly (reason)
        self.lazy = False  # a lazy module not yet initialised: eager this run
        self.failed = False  # its capture failed just now (see StageGraphs.eager)
        self.slots = 0
        self.captures = 0
        self.recaptures = 0
        # Keys whose graphs were dropped (a replaced tensor; the stage's
        # graphs going together after one was dropped for room).
        self.dropped: set[tuple[Any, ...]] = set()
        # Calls dropped for room since the last run began: their graphs wait
        # for the stage's others (lifetimes), so a run that needs none of
        # them busy drops them all, and the memory goes.
        self.evicted = False
        # A call reading a dropped call in place stays while busy (drop_stale).
        self.waiting = False

    @property
    def removed(self) -> int:
        """Calls dropped so far, however (each is added once, under a key of its own)."""
        return self.captures - len(self.calls)

    def prepare(self, slots: int) -> None:
        """Begins a run that uses ``slots`` slots of this stage: drops what
        the graphs can no longer replay, and says whether the stage is
        graphed this run (``reason`` None and ``lazy`` False)."""
        self.used.clear()
        self._release()
        if self.reason is not None:
            return
        self.slots = max(self.slots, slots)
        if self.baked is None:
            # A lazy module is initialised by its first (eager) run; its
            # stage is captured from the next run on.
            tensors = (*self.module.parameters(), *self.module.buffers())
            self.lazy = any(is_lazy(t) for t in tensors)
            if self.lazy:
                return
            self.baked, self._hooks_seen = Baked(self.module), -1
        elif self.baked.changed():
            self._drop_all()
            self.baked, self.store, self._hooks_seen = Baked(self.module), None, -1
        # The parameters are scanned again only after a hook was registered
        # somewhere (or they changed): once found free of hooks, they stay
        # so until then.
        hooks = hooks_registered()
        if hooks != self._hooks_seen:
            if any(map(_hooks, self.baked.params)):
                name = next(n for n, p in self.module.named_parameters() if p._backward_hooks)
                self.reason = (
                    f"parameter '{name}' has a tensor hook (register_hook), which a replayed "
                    f"backward would not run"
                )
                self.calls.clear()
                return
            self._hooks_seen = hooks
        modes = self.baked.modes()
        found = self._modes.get(modes)
        if found is None:
            if len(self._modes) >= _MODES_KEPT:
                self._modes.clear()
            found = self._modes[modes] = self._next_modes
            self._next_modes += 1
        self.modes = found

    def check_frozen(self) -> None:
        """Refuses a backward whose stage's parameters stopped requiring
        grad since this run began (``requires_grad_(False)`` in a training
        step's loss_fn, or a hook): the replayed backward differentiates
        the parameters the forwards saw, and would add into the ``.grad``
        of one that eager autograd leaves alone.

        Raises:
            RuntimeError: naming the parameter and what to do instead.
        """
        # One C++ call per backward task, reading one flag per tensor; the
        # names only once it fires.
        baked = self.baked
        if baked is None:
            return
        found = baked.watch.frozen()
        if not found:
            return
        frozen = {id(baked.tensors[i]) for i in found}
        name = next((n for n, p in self.module.named_parameters() if id(p) in frozen), None)
        if name is not None:
            raise RuntimeError(
                f"parameter '{name}' of {self.label} stopped requiring grad (requires_grad_"
                f"(False)) between the forward the stage's graphs replayed and its backward: a "
                f"replayed backward differentiates the parameters its forward saw. Freeze "
                f"parameters between steps (before train_step or pipe(x)): the next step "
                f"runs with it frozen"
            )

    def number(self, key: tuple[Any, ...]) -> int:
        """The number of call key ``key`` (a new one the first time: its
        first capture)."""
        found = self.numbers.get(key)
        if found is None:
            if len(self.numbers) >= max(_NUMBERS_KEPT, 2 * len(self.calls)):
                self._forget()
            found = self.numbers[key] = self._next_number
            self._next_number += 1
            generations = self.forgotten.pop(key, None)
            if generations is not None:  # its calls were dropped: recaptures
                self.dropped.update((found, g) for g in generations)
        return found

    def _forget(self) -> None:
        """Forgets the numbers of the keys no kept call holds; those whose
        calls were dropped are kept aside with the generations dropped
        (``forgotten``), so that capturing them again counts."""
        kept = {number for number, *_ in self.calls}
        dropped: dict[int, set[int]] = {}
        for number, generation in self.dropped:
            if number not in kept:
                dropped.setdefault(number, set()).add(generation)
        for key, n in self.numbers.items():
            if n in dropped:
                self.forgotten[key] = frozenset(dropped[n])
        for key in list(islice(self.forgotten, max(0, len(self.forgotten) - _NUMBERS_KEPT))):
            del self.forgotten[key]
        self.numbers = {key: n for key, n in self.numbers.items() if n in kept}
        self.dropped = {key for key in self.dropped if key[0] in kept}

    def drop_stale(self, kept: Collection[GraphedCall]) -> bool:
        """Drops the idle calls that read in place a producer's call no
        longer in ``kept`` (every stage's calls): their keys name it, so no
        run finds them again, yet they would hold its graphs, buffers and
        gradient buffers alive. Their graphs go with the stage's others, now
        if none is busy (as calls dropped for room); a busy one stays until
        a run finds it idle (``waiting``). Whether any call was dropped."""
        before = len(self.calls)
        stale = [
            key
            for key, c in self.calls.items()
            if any(src is not None and src[0] not in kept for src in c.sources)
        ]
        idle = [key for key in stale if not self.calls[key].busy()]
        self.waiting = len(idle) < len(stale)
        for key in idle:
            del self.calls[key]
        self.evicted = self.evicted or bool(idle)
        self._release()
        return len(self.calls) != before

    def _release(self) -> None:
        """After calls were dropped: the stage's others too once none is
        busy, so that the memory of their graphs goes (see :mod:`.lifetimes`)."""
        if self.evicted and not any(c.busy() for c in self.calls.values()):
            self._drop_all()
            self.evicted = False

    def _drop_all(self) -> None:
        self.dropped |= set(self.calls)  # their captures again count as recaptures
        self.calls.clear()

    def room(self, max_calls: int) -> bool:
        """Makes room for one more graphed call under ``max_calls``, dropping
        the least recently used that neither the current run nor a pending
        backward needs; whether there is room."""
        for old in list(self.calls):
            if len(self.calls) < max_calls:
                break
            if old not in self.used and not self.calls[old].busy():
                del self.calls[old]
                self.evicted = True
        return len(self.calls) < max_calls

    def add(self, key: tuple[Any, ...], graphed: GraphedCall) -> None:
        """Keeps a call just captured (a recapture if its key's graphs were
        dropped before)."""
        graphed.label = self.label
        graphed.check_frozen = self.check_frozen
        self.captures += 1
        if key in self.dropped:
            self.dropped.discard(key)
            self.recaptures += 1
        self.calls[key] = graphed
        self.used.add(key)

    def report(self) -> StageReport:
        """Whether the stage is graphed, its graphs, and their memory."""
        names = {p for c in self.calls.values() for p in c.passes}
        return StageReport(
            stage=self.index,
            device=self.device,
            graphed=self.reason is None,
            reason=self.reason,
            graphs=sum(len(c.passes) for c in self.calls.values()),
            passes=tuple(p for p in ("forward", "backward", "weight") if p in names),
            slots=self.slots,
            captures=self.captures,
            recaptures=self.recaptures,
            reserved_bytes=sum(c.reserved for c in self.calls.values()) + pool_bytes(self.pool),
            static_bytes=storage_bytes(t for c in self.calls.values() for t in static_buffers(c)),
            grad_bytes=0 if self.store is None else self.store.nbytes(),
        )


def static_buffers(call: GraphedCall) -> list[Tensor]:
    """The buffers ``call`` allocated outside any memory pool: its static
    inputs (but a producer's buffer read in place), its static outputs
    (unless :attr:`~.call.GraphedCall.pooled_out`), output gradients and
    input gradients (but those written into a producer's buffer). A
    producer's buffers are its own call's to count."""
    borrowed = {id(t) for t in call.grad_to if t is not None}
    return [
        *(t for t, g in zip(call.static_in, call.given) if g is None),
        *(() if call.pooled_out else call.static_out),
        *call.static_grad_out,
        *(t for t in call.static_grad_in if t is not None and id(t) not in borrowed),
    ]


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each counted once (views
    and aliases share one)."""
    seen: dict[tuple[torch.device, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def drop_stale(stages: Sequence[StageState]) -> None:
    """Drops the calls keyed to a producer's call no longer kept (see
    :meth:`StageState.drop_stale`), then their readers' in turn."""
    while True:
        kept = {c for st in stages for c in st.calls.values()}
        if not any([st.drop_stale(kept) for st in stages]):  # every stage
            return
