"""A graphed stage's parameter gradients: persistent buffers its graphs add into.

Each graphed stage owns one flat buffer per device and dtype, cut into a
view per parameter, and while a parameter is *attached* its ``.grad`` is its
view. The stage's backward graphs (and zero-bubble weight graphs) end with
one multi-tensor add of every micro-batch's parameter gradients into these
views: no gradient leaves a graph, autograd never sees a parameter, and no
host work per parameter runs per task. ``.grad`` keeps PyTorch's meaning:
it accumulates across backward passes and steps until ``zero_grad()``; a
parameter whose ``.grad`` was set to None (``zero_grad(set_to_none=True)``)
or to another tensor is attached again before the next replay adds into it
(its view zeroed, or filled with that tensor's value), with one zeroing per
buffer at most, and without capturing again. :meth:`GradStore.ensure` does
that once per backward pass per set of parameters, so a parameter that no
micro-batch's gradient reached keeps ``.grad=None``, as in eager autograd;
code that changes ``.grad`` within a pass says so (:mod:`.zeroing`).

A parameter another stage also holds (tied weights on one device) is added
into a side buffer instead, which :mod:`.tied` adds into ``.grad`` at the
end of the pass.

A parameter two stores hold as their own (the splits of a traced pipe's
two kinds of call; two pipes over one module) is the ``.grad`` of the one
that attached it last. One that takes it over copies the other's view on its
own stream, which is another where the parameter sits in stages of other
indices in the two splits: the copy waits for the streams the other's graphs
added on this pass, and the view is marked for that stream (the allocator's
rule): :mod:`.attaching`. The store taken from, alone, checks its parameters
again before its next replay within the pass. How a pass ends:
:mod:`.passes`; how the buffers are laid out, and saved around a training
step: :mod:`.grad_buffers`.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ..stream import CPUStream, current_stream
from .attaching import attach, own, owner_of
from .grad_buffers import GradBuffers, Saved
from .keys import hooks_registered
from .passes import CallerWaits, PassEnd, after, closed, finish_part, opened
from .tied import TiedHooks
from .zeroing import PassChanges, grads_changed, track, unseen, warn_all, zeroed_midway

__all__ = ["GradStore"]

_hooks = operator.attrgetter("_post_accumulate_grad_hooks")


class GradStore(GradBuffers):
    """The gradient buffers of one graphed stage (laid out by
    :class:`~.grad_buffers.GradBuffers`), and the passes that add into them.

    Args:
        params: the stage's parameters that require grad, each once.
        shared: those another stage holds too (tied): added into side buffers.
        tied: the side buffers' sums, shared by the stages of one pipe.
        names: how warnings name each of ``params``.

    Attributes:
        ready: :meth:`ensure`'s answers that still hold (see ``__init__``).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        shared: set[int] = frozenset(),  # type: ignore[assignment]
        tied: TiedHooks | None = None,
        names: Sequence[str] = (),
    ) -> None:
        super().__init__(params, shared, names)
        self.tied = tied or TiedHooks()
        self.tied.shared.update(id(self.params[i]) for i in self._side)
        own(self)
        track(self)
        self._detached: set[int] = set()  # positions detached at the pass's start, not since
        self._changes = PassChanges()  # this pass's, checked at its end (see flush)
        self._hooked: list[int] = []  # positions with post-accumulate hooks, this pass
        self._hooks_at: list[int] = []  # the same, as last scanned (see _with_hooks)
        self._hooks_seen = -1  # the hook counter then
        self._pass: object = None  # the backward pass (or run) ensure() last saw
        self._end: weakref.ref[PassEnd] | None = None  # its end, if the user's loop's
        self._waits: CallerWaits | None = None  # see undone()
        # Set by a store taking a .grad over from this one (in any thread),
        # or after .grad may have changed (zeroing.grads_changed), after it changed,
        # before :attr:`ready` is replaced; cleared before a check: no take
        # is missed.
        self._taken_from = False
        #: What :meth:`ensure` returned in the current pass, by (pass,
        #: reached-set), while it still holds: a caller that finds its key
        #: here need not call it (once per replayed task). Replaced, never
        #: emptied in place, wherever an answer may no longer hold.
        self.ready: dict[tuple[object, frozenset[int]], list[nn.Parameter]] = {}
        self._reached_side: set[int] = set()
        self._hooks: set[nn.Parameter] = set()  # run at the end of the pass
        self._tied_hooks: set[nn.Parameter] = set()  # owned but tied: run by tied
        self._streams: dict[int, torch.cuda.Stream] = {}  # where this pass's graphs added
        self._saved: Saved | None = None  # what save() kept

    def ensure(
        self, reached: frozenset[int], token: object, autograd: bool = False
    ) -> list[nn.Parameter]:
        """Before a replay that adds into the views of ``reached`` (positions
        in :attr:`params`) during pass ``token``: attaches those whose
        ``.grad`` is not their view. The parameters are checked once per pass
        (one C++ call), each set of them once.

        Returns the parameters among them with post-accumulate-grad hooks,
        for the caller to run after the replay, as autograd runs them after
        each accumulation (a training step's, per micro-batch). A backward
        pass of the user's loop (``autograd``) ends in :meth:`flush`
        (autograd's final callback): autograd accumulates once per pass
        there, so the hooks run then, and nothing else orders the caller's
        stream after the stage's, where the graphs added into ``.grad``. A
        pass run inside that one ends its part so far first (see
        :mod:`.passes`)."""
        # Read before the flag: a take after this replaces the dict, so an
        # answer noted in it below is never read.
        ready = self.ready
        if token != self._pass:
            self._leave_open_pass()
            ready = {}
            self._pass, self.ready, self._taken_from = token, ready, False
            self._detached = {self._owned[j] for j in self._attached.detached()}
            self._changes = PassChanges()
            self._hooked = self._with_hooks()
            if autograd:
                self._end = opened(self, token)
        elif self._taken_from:
            # Another store took a .grad over from this one within this pass
            # (the other kind's split replayed in between), or a hook ran
            # that may have taken one away: the next replay must not add
            # into this store's view, no longer .grad.
            ready = {}
            self.ready, self._taken_from = ready, False
            self._changes.since = set()
            self._detached = {self._owned[j] for j in self._attached.detached()}
        # By value: each slot's call holds an equal set of its own. Its
        # replay runs on the stream the first one's did (the stage's, where
        # autograd runs a Replay's backward too), already noted below.
        key = (token, reached)
        hooked = ready.get(key)
        if hooked is not None:
            return hooked
        stream = current_stream(self.device)
        if not isinstance(stream, CPUStream):
            self._streams[stream.stream_id] = stream
        fresh = [i for i in self._detached if i in reached]
        if fresh:
            attach(self, fresh, stream)
            self._detached.difference_update(fresh)
        changes = self._changes  # inline: no Python call here (see zeroing.PassChanges)
        changes.added.update(reached)
        changes.since.update(reached)
        if changes.zeroed:
            changes.again.update(changes.zeroed.intersection(reached))
        sides = [i for i in self._side if i in reached and i not in self._reached_side]
        for i in sides:
            self.views[i].zero_()
        self._reached_side.update(sides)
        hooked = [self.params[i] for i in self._hooked if i in reached and i not in self._side]
        if self.tied.shared and any(id(p) in self.tied.shared for p in hooked):
            # Another store adds into its .grad too: hooks once, at the end.
            self._tied_hooks.update(p for p in hooked if id(p) in self.tied.shared)
            hooked = [p for p in hooked if id(p) not in self.tied.shared]
        if autograd:
            self._hooks.update(hooked)
            hooked = []
        ready[key] = hooked
        return hooked

    def recheck(self, zeroed: frozenset[int] = frozenset()) -> None:
        """Checks the parameters again before the next replay adds (after
        ``.grad`` may have changed: :func:`~.zeroing.grads_changed`); in a
        backward pass of the user's loop, notes those of ``zeroed``
        (``id()``, by ``Pipe.zero_grad``) its replays added into so far."""
        self._taken_from, self.ready = True, {}  # after .grad changed (see __init__)
        changes = self._changes
        changes.since = set()  # what changed .grad said so: nothing lost (see flush)
        if not zeroed:
            return
        if self._end is None or self._end() is None:
            # A training step: a side buffer's sum so far is dropped with
            # .grad (zeroed again when next reached), not added at the end.
            self._reached_side -= {i for i in self._reached_side if id(self.params[i]) in zeroed}
        elif changes.added:
            # Not side buffers: each is added into .grad whole at the pass's end.
            changes.zeroed.update(
                i for i in changes.added if id(self.params[i]) in zeroed and i not in self._side
            )

    def _with_hooks(self) -> list[int]:
        """The positions of the parameters with post-accumulate-grad hooks,
        scanned again only after a hook was registered somewhere since the
        last scan. A hook removed since leaves its (now empty) dictionary
        listed: running it runs nothing."""
        count = hooks_registered()
        if count != self._hooks_seen:
            self._hooks_at = list(
                itertools.compress(range(len(self.params)), map(_hooks, self.params))
            )
            self._hooks_seen = count
        return self._hooks_at

    def flush(self, autograd: bool = True) -> list[torch.cuda.Stream]:
        """Ends a pass: orders the current streams after those the graphs
        added on, and runs the post-accumulate hooks left for its end; the
        side buffers it reached go to :attr:`tied`, which adds them into
        their ``.grad`` and runs their hooks once every store's flush
        ordered the streams (queued behind the other stores' flushes inside
        a backward pass, ``autograd``; else the caller runs it): another
        store's graphs may add into that ``.grad`` on another stream.
        Returns the streams the graphs added on.

        Warns where ``.grad`` of a parameter the graphs added into since the
        store last checked is no longer its view, nor another store's that
        took it over (:func:`~.zeroing.unseen`), and where ``Pipe.zero_grad``
        ran between replays of the pass that added into it
        (:func:`~.zeroing.zeroed_midway`)."""
        changes = self._changes  # replaced as the next pass begins (ensure)
        warnings = [zeroed_midway(self.names[min(changes.again)])] if changes.again else []
        if changes.since:
            # A C++ call per store and pass; a loop, not a comprehension
            # (a Python call before 3.12), where nothing was lost.
            for j in self._attached.detached():
                if self._owned[j] in changes.since:
                    warnings += self._lost(changes.since, autograd)
                    break
        reached, self._reached_side = sorted(self._reached_side), set()
        streams, self._streams = list(self._streams.values()), {}
        hooks, self._hooks = list(self._hooks), set()
        tied_hooks, self._tied_hooks = list(self._tied_hooks), set()
        self._pass, self.ready, self._end = None, {}, None
        closed(self)
        after(current_stream(self.device), streams)
        # A tied parameter's hooks run once, after every stage's side buffer
        # is in (eager autograd would run them after each accumulation).
        self.tied.add([(self.params[i], self.views[i]) for i in reached], autograd, tied_hooks)
        for p in hooks:
            for hook in p._post_accumulate_grad_hooks.values():  # type: ignore[union-attr]
                hook(p)
        if hooks:
            grads_changed()  # a hook may take another store's .grad before its flush
        if warnings:
            warn_all(warnings)  # the store's state consistent first (-W error raises)
        return streams

    def _lost(self, since: set[int], autograd: bool) -> list[str]:
        """The warning about the first parameter of ``since`` whose ``.grad``
        is neither its view nor another store's (see :meth:`flush`)."""
        for i in sorted(since):
            g = self.params[i].grad
            if i in self._side or g is self.views[i] or owner_of(g) not in (None, self):
                continue
            return [unseen(self.names[i], autograd)]
        return []

    def discard(self) -> None:
        """Forgets a backward pass of the user's loop that failed before its
        end (autograd runs no final callback then, so :meth:`flush` never
        came): what its graphs added into the views stays, as autograd keeps
        what it accumulated before the failure; side buffers it reached are
        dropped, not added later into a ``.grad`` the user may have zeroed
        since, and its hooks do not run. The current streams are ordered
        after the graphs' adds."""
        if self._pass is None:
            return
        after(current_stream(self.device), self._streams.values())
        self._pass, self.ready, self._reached_side, self._end = None, {}, set(), None
        self._hooks, self._tied_hooks, self._streams = set(), set(), {}
        self._changes = PassChanges()
        self.tied.discard()
        closed(self)

    def _leave_open_pass(self) -> None:
        """Before another pass, or a training step, adds into the buffers: a
        pass of the user's loop still running around it has its part so far
        ended (:func:`~.passes.finish_part`); one whose end autograd dropped
        unrun failed, and is forgotten (:meth:`discard`), so that nothing of
        it (hooks, side sums) joins the next pass's."""
        if self._end is not None and self._end() is not None:
            finish_part(self)
        else:
            self.discard()

    def save(self, zeroed: bool = False, every: bool = False) -> list[nn.Parameter]:
        """Saves the gradients for :meth:`restore` (a training step that may
        fail): copies the flat buffers only if a parameter is attached, and
        not when the caller knows every attached gradient is zero
        (``zeroed``: a captured zeroing just ran), whose restore zeroes them
        again instead of holding a gradient-sized copy. Returns the
        parameters it does not save (those with side buffers), unless
        ``every``: a store made during a step, after the step's snapshot
        was taken, saves every parameter's gradient itself, tensor and
        copy (the snapshot left them to the stage's old store, which may
        not have had them: a tied one, which the step's end adds into, or
        one eager autograd accumulates into in place, the capture failed)."""
        self._leave_open_pass()  # a step inside a pass of the user's loop, or after one
        detached = self._attached.detached()
        one_by_one = self.params if every else ()
        self._saved = Saved(self.flats, self._owned_params, detached, zeroed, one_by_one)
        self._pass, self.ready, self._reached_side = None, {}, set()
        return [self.params[i] for i in self._side]

    def restore(self) -> None:
        """Puts back what :meth:`save` saved (on the current stream)."""
        saved, self._saved = self._saved, None
        if saved is None:
            return
        saved.put_back(self.flats, self._owned_params, self._owned_views)
        self._pass, self.ready, self._reached_side, self._streams = None, {}, set(), {}
        self._changes = PassChanges()  # .grad as it was: nothing lost

    @contextmanager
    def undone(self, task: int = -1) -> Iterator[None]:
        """Takes back, at the end, what the replays inside add into the
        gradients: a backward (pass ``task``, -1: unknown) that leaves
        ``.grad`` alone (``torch.autograd.grad``, ``backward(inputs=...)``),
        whose end orders the caller's streams after the put-back (see
        :mod:`.passes`). One may run
        inside a backward pass of the user's loop (from a hook or a custom
        Function's backward); that pass keeps what it reached so far, which
        its :meth:`flush` needs: the streams its graphs added on, its side
        buffers' sums, its hooks (:meth:`save` would drop them, as it does
        a failed pass's)."""
        kept = (self._pass, self.ready, self._reached_side, self._hooks, self._tied_hooks)
        streams, taken, end = self._streams, self._taken_from, self._end
        detached, hooked, saved = self._detached, self._hooked, self._saved
        changes = self._changes
        stream = current_stream(self.device)
        after(stream, streams.values())  # the copies below read what the pass added
        sides = [(self.views[i], self.views[i].clone()) for i in self._reached_side]
        self._pass, self._streams, self._hooks, self._tied_hooks = None, {}, set(), set()
        self._end = None  # that pass stays open: not ended here
        self.save()
        try:
            yield
        finally:
            self.restore()
            with torch.no_grad():
                for view, before in sides:
                    view.copy_(before)
            self._pass, self.ready, self._reached_side, self._hooks, self._tied_hooks = kept
            self._detached, self._hooked = detached, hooked
            self._changes = changes
            self._saved = saved
            self._taken_from = taken or self._taken_from  # one more check costs nothing
            if self._taken_from:
                self.ready = {}  # as the flag asks: checked again before the next replay
            self._end = end
            self._waits = CallerWaits.note(self._waits, task, stream)
            if self._pass is not None:
                # The pass's flush orders the caller's stream after these
                # copies too: they rewrote its buffers on this stream.
                self._streams = streams
                if not isinstance(stream, CPUStream):
                    self._streams[stream.stream_id] = stream

    def release(self) -> None:
        """Forgets what :meth:`save` saved (a step that succeeded)."""
        self._saved = None
