"""Graphed stages: each stage's calls replayed from CUDA graphs, per slot.

One host thread issuing every kernel of every micro-batch sets the pace of
an eager pipeline on a fast GPU. :class:`StageGraphs` replaces a stage's
forward (and its backward) by the replay of graphs captured the first time a
call of that kind is seen: one :class:`~mpstream.runtime.graphed.call.GraphedCall`
per stage, per slot (:mod:`mpstream.schedules.slots`: as many as the
schedule keeps micro-batches in flight on the stage, so no replay
overwrites activations a pending backward reads) and per call signature
(argument shapes, dtypes and devices, grad mode, autocast, checkpointing,
training mode). The scheduler issues the same tasks under the same event
plan; a task's work is a handful of launches instead of every kernel.

Before each run the stage's fingerprint (its modules, and each parameter and
buffer's identity, storage, dtype, shape, device and ``requires_grad``) is
compared with the one its graphs were captured from: anything replaced
drops them, and the next call captures again, so a replay never reads stale
pointers. Parameters updated in place (any optimizer's step) are read by the
next replay as they are.

A stage that cannot be graphed runs eagerly, with one warning naming the
stage and the reason: it sits on a CPU, or its capture failed (a host sync
such as ``.item()``, data-dependent control flow, an unsupported op).
:meth:`StageGraphs.report` says which stages and passes are graphed, how
many graphs exist and the memory their capture reserved. Signatures are
bounded: past ``max_calls`` per stage, the least recently used graphs not
needed by the current run are dropped, and a call that finds no room (or a
slot with ``MAX_GENERATIONS`` forwards awaiting their backward) runs eagerly,
with one warning.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ...memory.checkpoint import checkpointed
from ...schedules.schedule import Schedule
from ...schedules.slots import Slots, plan_slots
from .backends import CudaGraphs
from .call import Backend, GraphedCall
from .grads import StageGrads, Switch
from .keys import Fingerprint, autocast_key, signature
from .report import GraphReport, GraphWarning, StageReport

__all__ = [
    "StageGraphs",
    "GraphReport",
    "StageReport",
    "GraphWarning",
    "Fingerprint",
    "MAX_CALLS",
    "MAX_GENERATIONS",
]

#: Graphed calls kept per stage (slots x signatures) before the least
#: recently used are dropped.
MAX_CALLS = 64
#: Sets of graphs per slot and signature for forwards whose backward is
#: still pending; beyond, such forwards run eagerly.
MAX_GENERATIONS = 4
#: Captures whose order :attr:`StageGraphs.order` keeps (the first ones).
_ORDER_KEPT = 1024


class _Stage:
    """One stage's graphs and state."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        device: torch.device,
        label: str,
        graphable: bool,
        switch: Switch,
    ) -> None:
        self.index, self.module, self.device, self.label = index, module, device, label
        self.reason: str | None = (
            None if graphable else f"on {device}: CUDA graphs need a CUDA device"
        )
        self.modes: tuple[bool, ...] = ()
        self.calls: OrderedDict[tuple[Any, ...], GraphedCall] = OrderedDict()
        self.used: set[tuple[Any, ...]] = set()  # keys the current run replayed
        self.print: Fingerprint | None = None
        self.overflow = False  # warned that calls beyond the bound run eagerly
        self.warned = False  # warned that the stage runs eagerly (reason)
        self.lazy = False  # a lazy module not yet initialised: eager this run
        self.slots = 0
        self.captures = 0
        self.recaptures = 0
        self.dropped: set[tuple[Any, ...]] = set()  # keys a replaced tensor invalidated
        self.reserved = 0
        self.sums = StageGrads(switch)


class StageGraphs:
    """The graphs of one pipeline's stages.

    Args:
        modules: each stage's module (what its graphs differentiate and
            fingerprint).
        devices: each stage's device.
        labels: how warnings name each stage.
        backend: what captures (:class:`~mpstream.runtime.graphed.backends.CudaGraphs`
            unless a test gives another); only CUDA stages use it.
        max_calls: graphed calls kept per stage.
        switch: whether stages may sum their parameter gradients (the
            pipe's, shared by its runtimes; see :mod:`.grads`).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        devices: Sequence[torch.device],
        labels: Sequence[str] | None = None,
        backend: Backend | None = None,
        max_calls: int = MAX_CALLS,
        switch: Switch | None = None,
    ) -> None:
        n = len(modules)
        names = list(labels) if labels else [f"stage {s} of {n}" for s in range(n)]
        self.backend: Backend = backend or CudaGraphs()
        self.switch = switch or Switch()
        self.stages = [
            _Stage(s, m, d, names[s], self.graphable(d), self.switch)
            for s, (m, d) in enumerate(zip(modules, devices))
        ]
        self.max_calls = max_calls
        self.slots: Slots | None = None
        #: (stage, slot) of each capture (the first ones), in the order they
        #: happened: the schedule's execution order (see Slots.order).
        self.order: list[tuple[int, int]] = []
        # Per schedule (held weakly: a schedule's slots live as long as it does).
        self._plans: weakref.WeakKeyDictionary[Schedule, dict[bool, Slots]] = (
            weakref.WeakKeyDictionary()
        )

    def graphable(self, device: torch.device) -> bool:
        """Whether stages on ``device`` may be graphed by this backend."""
        return device.type == "cuda" or not isinstance(self.backend, CudaGraphs)

    def begin(self, schedule: Schedule, backward_later: bool) -> None:
        """Prepares a run: its slots, and the graphs still valid.

        Args:
            schedule: the run's schedule.
            backward_later: the backward runs after the schedule, through
                autograd (``pipe(x)`` with gradients).
        """
        plans = self._plans.setdefault(schedule, {})
        slots = plans.get(backward_later)
        if slots is None:
            slots = plans[backward_later] = plan_slots(schedule, backward_later=backward_later)
        self.slots = slots
        if _inside_ddp():
            # DDP's reducer hooks on AccumulateGrad need every micro-batch's
            # gradient there (its wrap() says so too; a plain DDP is seen here).
            self.switch.on = False
        for st in self.stages:
            st.used.clear()
            if st.reason is not None:
                continue
            st.slots = max(st.slots, slots.counts[st.index])
            st.modes = tuple(m.training for m in st.module.modules())
            # A lazy module is initialised by its first (eager) run; its
            # stage is captured from the next run on.
            st.lazy = any(is_lazy(t) for t in (*st.module.parameters(), *st.module.buffers()))
            if st.lazy:
                continue
            now = Fingerprint(st.module)
            if st.print is not None and now != st.print and st.calls:
                st.dropped = set(st.calls)  # their captures again count as recaptures
                st.calls.clear()  # replaced tensors or modules: capture again
            st.print = now

    def hold(self) -> None:
        """From now until :meth:`release`, replays add their parameter
        gradients into each stage's sums (see :mod:`.grads`), except on a
        stage with a parameter's post-accumulate-grad hook."""
        for st in self.stages:
            # A post-accumulate hook would run once per step instead of once
            # per micro-batch: such a stage keeps returning its gradients.
            hooked = any(p._post_accumulate_grad_hooks for p in st.module.parameters())
            st.sums.discard()  # what a failed backward in the user's loop left
            st.sums.holding = st.sums.enabled and not hooked

    def release(self, keep: bool) -> None:
        """Ends holding; ``keep``: hand each stage's sums to ``.grad`` on the
        current streams, else drop them (a failed run)."""
        try:
            if keep:
                for st in self.stages:
                    st.sums.flush()
        finally:
            for st in self.stages:
                st.sums.holding = False
                st.sums.discard()

    def call(
        self,
        s: int,
        m: int,
        stage: nn.Module,
        args: Sequence[Any],
        checkpoint: bool,
        split: bool = False,
    ) -> Any:
        """Runs stage ``s`` on micro-batch ``m``: replayed if it can be, else
        eagerly. ``split``: the schedule splits this backward (its weight
        pass runs later), so the backward is captured as two graphs."""
        st = self.stages[s]
        failed = False  # a capture failed just now
        if st.reason is None and not st.lazy and self.slots is not None:
            key = self._key(s, m, args, checkpoint, split)
            if key is not None:
                graphed = self._graphed(st, key, stage, args, checkpoint)
                if graphed is not None:
                    return graphed(*args)
                failed = st.reason is not None
        try:
            out = checkpointed(stage, *args) if checkpoint else stage(*args)
        except BaseException:
            if failed:  # the stage's own error, not a capture's: graphs stay on
                st.reason = None
            raise
        if st.reason is not None and not st.warned:  # a CPU stage, or a failed capture
            st.warned = True
            warnings.warn(f"{st.label} runs eagerly: {st.reason}", GraphWarning, stacklevel=3)
        return out

    def _key(
        self, s: int, m: int, args: Sequence[Any], checkpoint: bool, split: bool
    ) -> tuple[Any, ...] | None:
        """slot, checkpointed, grad, inference, autocast, signature, split."""
        assert self.slots is not None
        sig = signature(args)
        if sig is None:
            return None
        grad = torch.is_grad_enabled()
        inference = torch.is_inference_mode_enabled()  # its buffers are inference tensors
        ckpt = checkpoint and grad
        splits = split and grad and not ckpt
        return (self.slots.slot[(s, m)], ckpt, grad, inference, autocast_key(), sig, splits)

    def _graphed(
        self,
        st: _Stage,
        key: tuple[Any, ...],
        stage: nn.Module,
        args: Sequence[Any],
        checkpoint: bool,
    ) -> GraphedCall | None:
        key = (*key, st.modes)
        # A call whose activations still wait for their backward (a second
        # forward before the first backward, in the user's loop) gets graphs
        # of its own: one more generation of the slot, up to MAX_GENERATIONS
        # (outputs kept without a backward, say in an evaluation loop with
        # gradients on, would otherwise capture at every call).
        for generation in range(MAX_GENERATIONS):
            graphed = st.calls.get((*key, generation))
            if graphed is None or not graphed.busy():
                break
        else:
            self._overflow(st, f"{MAX_GENERATIONS} forwards awaiting their backward")
            return None
        key = (*key, generation)
        if graphed is not None:
            st.calls.move_to_end(key)
            st.used.add(key)
            return graphed
        if not self._room(st):
            self._overflow(st, f"max_calls={self.max_calls} graphed calls in use")
            return None
        checkpointing = bool(key[1])
        fn: Callable[..., Any] = (lambda *a: checkpointed(stage, *a)) if checkpointing else stage
        try:
            graphed = GraphedCall(
                fn, args, st.module, st.device, key[2], self.backend, checkpointing, key[6]
            )
        except Exception as exc:  # anything a graph cannot hold: run eagerly from now on
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            st.reason = f"capture failed: {type(exc).__name__}: {first}"
            st.calls.clear()
            return None
        graphed.label = st.label
        graphed.sums = st.sums
        st.captures += 1
        if key in st.dropped:
            st.dropped.discard(key)
            st.recaptures += 1
        st.calls[key] = graphed
        st.used.add(key)
        if len(self.order) < _ORDER_KEPT:
            self.order.append((st.index, key[0]))
        return graphed

    def _room(self, st: _Stage) -> bool:
        """Makes room for one more graphed call under ``max_calls``, dropping
        the least recently used that neither the current run nor a pending
        backward needs; whether there is room."""
        for old in list(st.calls):
            if len(st.calls) < self.max_calls:
                break
            if old not in st.used and not st.calls[old].busy():
                del st.calls[old]
        return len(st.calls) < self.max_calls

    def _overflow(self, st: _Stage, why: str) -> None:
        """A call beyond the bound runs eagerly; the first one says so."""
        if not st.overflow:
            st.overflow = True
            warnings.warn(
                f"{st.label}: {why}; further such calls run eagerly (run fewer forwards "
                f"before a backward, or fewer batch shapes)",
                GraphWarning,
                stacklevel=5,
            )

    def report(self) -> GraphReport:
        """Which stages and passes are graphed, how many graphs, what memory."""
        out = GraphReport()
        for st in self.stages:
            names = {p for c in st.calls.values() for p in c.passes}
            passes = [p for p in ("forward", "backward", "weight") if p in names]
            out.stages.append(
                StageReport(
                    stage=st.index,
                    device=st.device,
                    graphed=st.reason is None,
                    reason=st.reason,
                    graphs=sum(len(c.passes) for c in st.calls.values()),
                    passes=tuple(passes),
                    slots=st.slots,
                    captures=st.captures,
                    recaptures=st.recaptures,
                    reserved_bytes=sum(c.reserved for c in st.calls.values()),
                )
            )
        return out


def _inside_ddp() -> bool:
    """Whether a DistributedDataParallel forward is running (it wraps the pipe)."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch without distributed support
        return False
    active = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    return active is not None and active() is not None
