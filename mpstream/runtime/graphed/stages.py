"""Graphed stages: each stage's calls replayed from CUDA graphs, per slot.

One host thread issuing every kernel of every micro-batch sets the pace of
an eager pipeline on a fast GPU. :class:`StageGraphs` replaces a stage's
forward and backward by replays of graphs captured the first time a call of
that kind is seen: one :class:`~.call.GraphedCall` per stage, per slot
(:mod:`mpstream.schedules.slots`: as many as the schedule keeps
micro-batches in flight on the stage, so no replay overwrites activations a
pending backward reads; in a forward run, one per micro-batch) and per call
signature (argument shapes, strides, dtypes and devices, grad mode,
autocast, checkpointing, training modes). The scheduler issues the same
tasks under the same event plan; a task's work is a graph launch. The
runtime drives the calls (:mod:`mpstream.runtime.replayed`,
:mod:`mpstream.runtime.replay_autograd`); the graphs add the parameter gradients
into each stage's :class:`~.grads.GradStore`.

Before each run, what the graphs baked in is checked (:class:`~.keys.Baked`):
a parameter or module replaced, or a tensor moved, drops them and the next
call captures again; parameters updated in place (an optimizer's step) are
read by the next replay as they are. A stage that cannot be graphed runs
eagerly, with one warning naming it and why: on a CPU, a capture that
failed (a host sync such as ``.item()``, an unsupported op), a parameter's
tensor hook. Calls are bounded: past ``max_calls`` per stage the least
recently used graphs not needed by the run are dropped, with their
readers' calls keyed to them (their memory goes with the stage stream's
other graphs, :mod:`.lifetimes`: once none is busy, all are dropped and
captured again); a call that finds no room, a slot with
``MAX_GENERATIONS`` forwards awaiting their backward, or a plain argument
past its values (:class:`~.keys.Scalars`) runs eagerly, with one warning.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..._warn import warn
from ...memory.checkpoint import run_eagerly
from ...schedules.schedule import Schedule
from ...schedules.slots import Slots, plan_slots
from .. import private
from .backend import Backend
from .backends import CudaGraphs
from .call import GraphedCall, Source
from .first_calls import capture, overflow
from .grads import GradStore
from .keys import any_autocast, autocast_key, signature
from .report import GraphReport, GraphWarning
from .state import StageState, drop_stale
from .tied import TiedHooks, tied_ids

__all__ = ["StageGraphs", "MAX_CALLS", "MAX_GENERATIONS"]

#: Graphed calls kept per stage (slots x signatures) before the least
#: recently used are dropped.
MAX_CALLS = 64
#: Sets of graphs per slot and signature for forwards whose backward is
#: still pending; beyond, such forwards run eagerly.
MAX_GENERATIONS = 4
#: What a training step's forward leaves pending on its call until its backward.
_STEP = object()


class StageGraphs:
    """The graphs of one pipeline's stages.

    Args:
        modules: each stage's module (what its graphs differentiate).
        devices: each stage's device.
        labels: how warnings name each stage.
        backend: what captures (:class:`~mpstream.runtime.graphed.backends.CudaGraphs`
            unless a test gives another); only CUDA stages use it.
        max_calls: graphed calls kept per stage.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        devices: Sequence[torch.device],
        labels: Sequence[str] | None = None,
        backend: Backend | None = None,
        max_calls: int = MAX_CALLS,
    ) -> None:
        n = len(modules)
        names = list(labels) if labels else [f"stage {s} of {n}" for s in range(n)]
        self.backend: Backend = backend or CudaGraphs()
        self.stages = [
            StageState(s, m, d, names[s], self.graphable(d))
            for s, (m, d) in enumerate(zip(modules, devices))
        ]
        self.max_calls = max_calls
        self.slots: Slots | None = None
        self.token: object = None  # the current training step's pass (see GradStore.ensure)
        self.tied = TiedHooks()  # tied parameters' side buffers and hooks, once per pass
        #: (stage, slot) of each capture (the first ones), in the order they
        #: happened: the schedule's execution order (see Slots.order).
        self.order: list[tuple[int, int]] = []
        # The stores a training step saved (None: no step's save pending),
        # and whether every gradient was known zero then.
        self._saved: list[GradStore] | None = None
        self._zeroed = False
        self._plans: weakref.WeakKeyDictionary[Schedule, dict[bool, Slots]] = (
            weakref.WeakKeyDictionary()
        )
        #: Runs begun so far, and the calls the latest forward run replayed
        #: (see :meth:`abandon`).
        self.runs = 0
        self._forwarded: list[GraphedCall] = []
        self._removed = 0  # calls the stages had dropped when readers were last checked

    def graphable(self, device: torch.device) -> bool:
        """Whether stages on ``device`` may be graphed by this backend."""
        return device.type == "cuda" or not isinstance(self.backend, CudaGraphs)

    def begin(self, schedule: Schedule, step: bool) -> None:
        """Prepares a run: its slots, and the graphs still valid.

        Args:
            schedule: the run's schedule.
            step: a training step (its tasks drive the calls); else a
                forward run, whose micro-batches each
                get a slot of their own (a backward may follow through
                autograd; without one, outputs are handed on uncopied).

        Raises:
            RuntimeError: gradients through a DistributedDataParallel's
                forward, whose reducer cannot see gradients added inside
                graphs.
        """
        if not step and torch.is_grad_enabled() and _inside_ddp():
            raise RuntimeError(
                "a pipe with graphs=True adds its parameter gradients inside its CUDA graphs, "
                "where DistributedDataParallel's reducer hooks cannot see them; train with "
                "mpstream.distributed.train_step(ddp, inputs, target, loss_fn), which reduces "
                "the gradient buffers itself, or build the pipe with graphs=False"
            )
        if private.current_graph_task_id() == -1:
            # Not inside a backward (a backward inside a backward changes
            # the pass mid-way): a pass still open here failed.
            for st in self.stages:
                if st.store is not None:
                    st.store.discard()
            # A final callback that raised (a hook) leaves the tied side
            # buffers' add queued for a callback that never ran.
            self.tied.discard()
        plans = self._plans.setdefault(schedule, {})
        slots = plans.get(step)
        if slots is None:
            slots = plans[step] = plan_slots(schedule, backward_later=not step)
        self.slots = slots
        self.token = object() if step else None
        self.runs += 1
        self._forwarded = []
        for st in self.stages:
            st.prepare(slots.counts[st.index])
        # The weights tied now: a store dropped since (its stage changed)
        # may have held the only side buffer of one.
        self.tied.shared = {
            id(p)
            for st in self.stages
            if st.store is not None and st.reason is None
            for p in st.store.tied_params()
        }
        # A reader's calls keyed to a producer's call dropped since, then
        # their readers' in turn; looked for only then (a pass over every call).
        removed = sum(st.removed for st in self.stages)
        if removed != self._removed or any(st.waiting for st in self.stages):
            drop_stale(self.stages)
            self._removed = sum(st.removed for st in self.stages)

    def eager(self, s: int, stage: nn.Module, args: Sequence[Any], checkpoint: bool) -> Any:
        """Runs stage ``s`` eagerly; the first time a stage that was to be
        graphed does so, says why."""
        st = self.stages[s]
        failed, st.failed = st.failed, False
        try:
            out = run_eagerly(stage, args, checkpoint)
        except BaseException:
            if failed:  # the stage's own error, not a capture's: graphs stay on
                st.reason = None
            raise
        if st.reason is not None and not st.warned:  # a CPU stage, or a failed capture
            st.warned = True
            warn(f"{st.label} runs eagerly: {st.reason}", GraphWarning)
        return out

    def abandon(self, before: int) -> None:
        """After a forward run that failed: its outputs reached no caller,
        so its calls' activations wait for no backward, even while the
        exception's traceback keeps their autograd graph alive (else each
        such exception held would keep a generation of graphs busy, and
        later calls ran eagerly). ``before``: :attr:`runs` when the call
        started; nothing is released unless its run is the latest, and a
        run that never began (refused inside another) leaves the latest
        one's calls to that run's own failure."""
        if self.runs == before + 1:
            for graphed in self._forwarded:
                graphed.pending = None
            self._forwarded = []

    def end(self) -> None:
        """After a training step (or its failure): its side gradients added
        into ``.grad``, its calls no longer pending."""
        self.token = None
        for st in self.stages:
            if st.store is not None:
                st.store.flush(autograd=False)
            for graphed in st.calls.values():
                if graphed.pending is _STEP:
                    graphed.pending = None
        self.tied.run()

    def stores(self) -> list[GradStore | None]:
        """Each stage's gradient buffers, where its graphs add into them."""
        return [st.store if st.reason is None else None for st in self.stages]

    def save(self, zeroed: bool = False) -> dict[int, list[nn.Parameter]]:
        """Saves the gradient buffers for :meth:`restore` (a training step),
        and those a stage changed since makes during the step.

        Args:
            zeroed: every gradient is known to be zero (see
                :meth:`~.grads.GradStore.save`): nothing is copied.

        Returns:
            Per stage whose buffers were saved, its parameters they do not
            cover (tied ones, added into ``.grad`` at the step's end).
        """
        self._saved, self._zeroed = [], zeroed
        left: dict[int, list[nn.Parameter]] = {}
        for st in self.stages:
            if st.store is not None and st.reason is None:
                self._saved.append(st.store)
                left[st.index] = st.store.save(zeroed)
        return left

    def restore(self, keep: bool) -> None:
        """Puts the saved gradients back (``keep`` False), or forgets them."""
        stores, self._saved = self._saved or [], None
        for store in stores:
            if keep:
                store.release()
            else:
                store.restore()

    def find(
        self,
        s: int,
        m: int,
        stage: nn.Module,
        args: Sequence[Any],
        checkpoint: bool,
        needs: Sequence[bool] | None = None,
        split: bool = False,
        sources: Sequence[Source] = (),
    ) -> GraphedCall | None:
        """The call this run replays for stage ``s`` and micro-batch ``m``
        (captured now if new), or None where it runs eagerly (:meth:`eager`).

        Args:
            needs: per tensor argument, whether a training step needs its
                gradient (default: its ``requires_grad``, as autograd sees it).
            split: the schedule splits this backward (a weight task follows).
            sources: per tensor argument, the producer's call and output
                it is, for the graphs to read in place (and to write its
                gradient into the producer's buffer, where the last item is
                true); None where not (see :class:`~.call.GraphedCall`).
        """
        st = self.stages[s]
        if st.reason is not None or st.lazy or self.slots is None:
            return None
        assert self.slots is not None
        sig = signature(args, needs)
        if sig is None:
            return None
        grad = torch.is_grad_enabled()
        ckpt = checkpoint and grad
        # Once per replayed task: loops and inline checks, not helpers and
        # comprehensions (each a call of its own before Python 3.12).
        given: list[Any] = []
        for x in sources:
            given.append(None if x is None else (id(x[0]), x[1], x[2]))
        key: tuple[Any, ...] = (
            self.slots.slot[(s, m)],
            ckpt,
            grad,
            torch.is_inference_mode_enabled(),  # its buffers are inference tensors
            autocast_key() if any_autocast() else (),
            sig,
            split and grad and not ckpt,
            st.modes,  # the modules' training flags, numbered (StageState.modes)
            tuple(given),
        )
        number = st.numbers.get(key)  # the one time a replay hashes its key
        graphed: GraphedCall | None = None
        generation = 0
        if number is None:
            # A key met before had its plain values admitted then (and
            # admitted values stay): only a new one is checked.
            why = st.scalars.admit(sig)
            if why is not None:
                overflow(st, why)
                return None
        else:
            # A call whose activations still wait for their backward (a
            # second forward before the first backward, in the user's loop)
            # gets graphs of its own: one more generation of the slot, up to
            # MAX_GENERATIONS.
            for generation in range(MAX_GENERATIONS):
                graphed = st.calls.get((number, generation))
                if graphed is None or graphed.pending is None or not graphed.busy():
                    break
            else:
                overflow(st, f"{MAX_GENERATIONS} forwards awaiting their backward")
                return None
        if graphed is not None:
            st.calls.move_to_end((number, generation))
            st.used.add((number, generation))
        elif st.room(self.max_calls):
            at = (st.number(key), generation)
            if grad and st.store is None:
                self._make_store(st)
            graphed = capture(self, st, key, at, stage, args, needs, ckpt, sources)
        else:
            overflow(st, f"max_calls={self.max_calls} graphed calls in use")
        if graphed is not None and self.token is not None and graphed.diff_out:
            graphed.pending = _STEP  # until the step's backward (or weight) task
        elif graphed is not None and self.token is None:
            self._forwarded.append(graphed)
        return graphed

    def _make_store(self, st: StageState) -> None:
        """Makes stage ``st``'s gradient store (if it has parameters to
        train), before its first capture with gradients."""
        assert st.baked is not None
        if not st.baked.params:
            return
        others = [o.module for o in self.stages if o is not st]
        names = {id(p): n for n, p in st.module.named_parameters()}
        labels = [f"{names.get(id(p), '?')!r} in {st.label}" for p in st.baked.params]
        st.store = GradStore(st.baked.params, tied_ids(st.module, others), self.tied, labels)
        if self._saved is not None:
            # A store made during a step that saved the others (the stage
            # changed since): its parameters' gradients as they were, for a
            # failure to put back. The step's snapshot, taken before, left
            # them to the stage's old store, which may not have had them (a
            # new or newly tied parameter).
            st.store.save(self._zeroed, every=True)
            self._saved.append(st.store)

    def report(self) -> GraphReport:
        """Which stages and passes are graphed, how many graphs, what memory."""
        # A backend of a test's own may keep no count.
        out = GraphReport(replays=getattr(self.backend, "replays", 0))
        out.stages.extend(st.report() for st in self.stages)
        return out


def _inside_ddp() -> bool:
    """Whether a DistributedDataParallel forward is running (it wraps the pipe)."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch without distributed support
        return False
    active = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    return active is not None and active() is not None
