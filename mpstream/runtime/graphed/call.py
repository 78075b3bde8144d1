"""One stage call captured as graphs and replayed: forward, backward, weight.

:class:`GraphedCall` holds the graphs of one stage for one slot and one call
signature: static input buffers; a forward graph writing static outputs;
where the call needs gradients, a backward graph reading static output
gradients, writing the gradients of the differentiable inputs into static
buffers and *adding* the stage's parameter gradients into its
:class:`~.grads.GradStore` (or, where a zero-bubble schedule splits the
backward, an input-gradient graph B and a weight graph W, each adding the
parameter gradients it computes).

The runtime drives a call from a training step's tasks
(:mod:`~mpstream.runtime.replayed`), or inside autograd in the user's own
loop (:mod:`~mpstream.runtime.replay_autograd`), through
:meth:`forward`, :meth:`backward` and :meth:`weight`.

A :class:`~.backend.Backend` captures and replays (:mod:`.backends`: CUDA graphs, or
an emulation for tests); what capture changes on the stage is put back
(:func:`~.capturing.restored`).
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn

from ...memory.batchnorm import deferred_norms
from .. import private
from ..microbatch import leaves, placed, untensored
from .backend import Backend
from .capturing import restored
from .grads import GradStore
from .zeroing import grads_changed

__all__ = ["GraphedCall", "Source"]


class GraphedCall:
    """The graphs of one stage call: static buffers and their replays.

    Args:
        fn: the stage's call (checkpointed or not), taking the arguments.
        args: an example of the arguments (their tensors' shapes, dtypes,
            strides and devices are the call's signature; plain values are
            baked in).
        stage: the stage module (its deferred BatchNorm layers are counted
            per replay).
        device: the stage's device.
        grad: whether the call builds an autograd graph.
        backend: what captures and replays.
        store: the stage's gradient buffers (their parameters get the
            backward's gradients); None without gradients.
        checkpoint: ``fn`` checkpoints the stage (its backward recomputes
            the forward).
        split: capture the backward as B and W (ignored for a checkpointed
            call, which is not split).
        needs: per tensor argument, whether it needs a gradient (default:
            its own ``requires_grad``).
        pool: the stage's shared memory pool (see :mod:`.backends`).
        sources: per tensor argument needing a gradient, None, or the call
            whose static output (at a position) it always is: the graphs
            then read that buffer in place (their first use of an input
            needing a gradient is a copy inside the graph), and, where the
            last item is true, write the argument's gradient straight into
            that call's static output gradient. The caller vouches that
            every replay passes that buffer, or an alias of it (see
            ``runtime/replayed.py`` and ``runtime/handoffs.py``).

    Raises:
        ValueError: what a graph cannot hold: a tensor outside the stage's
            parameters that needs a gradient, or a sparse gradient.
        Exception: whatever capture raised; the stage's buffers, deferred
            BatchNorm counters and random number generators are put back
            first.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        stage: nn.Module,
        device: torch.device,
        grad: bool,
        backend: Backend,
        store: GradStore | None,
        checkpoint: bool = False,
        split: bool = False,
        needs: Sequence[bool] | None = None,
        pool: Any = None,
        sources: Sequence[Source] = (),
    ) -> None:
        self.device, self.grad, self.backend, self.pool = device, grad, backend, pool
        self.checkpoint = checkpoint
        self.split = split and grad and not checkpoint
        self.store = store if grad else None
        items, self.spec = leaves(tuple(args))
        self.where = [i for i, x in enumerate(items) if isinstance(x, Tensor)]
        need = [items[i].requires_grad for i in self.where] if needs is None else list(needs)
        #: Per tensor argument, the producer's buffer it always is (None: copied in).
        self.given: list[Tensor | None] = [None] * len(self.where)
        #: Per tensor argument, the buffer its gradient goes to, if the producer's.
        self.grad_to: list[Tensor | None] = [None] * len(self.where)
        self.sources = list(sources)  # holds the producers' buffers alive
        for i, src in enumerate(self.sources):
            if src is not None and grad and need[i]:
                producer, pos, grads_too = src
                self.given[i] = producer.static_out[pos]
                if grads_too and pos in producer.diff_out:
                    self.grad_to[i] = producer.static_grad_out[producer.diff_out.index(pos)]
        self.static_in = [
            (items[i].detach().clone() if g is None else g.detach()).requires_grad_(grad and n)
            for i, n, g in zip(self.where, need, self.given)
        ]
        self.items = untensored(items)  # the example's tensors would live as long as the call
        self.params: list[nn.Parameter] = [] if self.store is None else list(self.store.params)
        self.norms = [n for n in deferred_norms(stage) if n.training]
        self.out_spec: Any = None
        self.out_items: list[Any] = []
        #: The output structure around a replay's output tensors: the one
        #: tensor itself (the common case, once per replayed task: a C call,
        #: no Python frame), else the structure rebuilt (see outputs()).
        self.rebuild: Callable[[Sequence[Tensor]], Any] = _ONE
        self.out_where: list[int] = []
        self.static_out: list[Tensor] = []
        self.diff_out: list[int] = []  # positions in static_out that carry gradients
        self.plain_out: list[int] = []  # the others (non-differentiable outputs)
        self.static_grad_out: list[Tensor] = []  # per diff_out
        #: Per input needing a gradient, its buffer (None: no output reaches it).
        self.static_grad_in: list[Tensor | None] = []
        #: Positions in static_in of the inputs needing a gradient that no
        #: output reaches (replay_autograd hands them to autograd detached).
        self.unreached_in: tuple[int, ...] = ()
        #: Per gradient target (inputs needing one, then parameters), the outputs reaching it.
        self.reached_from: list[frozenset[int]] = []
        #: The graphs captured: forward; backward (all of it, or B); weight (W).
        self.passes: tuple[str, ...] = ("forward",)
        #: The passes whose replays draw random numbers (set by the backend).
        self.random_passes: frozenset[str] = frozenset()
        self.state: Any = None  # the backend's own: graphs, or the emulated activations
        self.reserved = 0  # bytes of the call's own memory pool
        #: Whether the backend left the static outputs in the call's own pool
        #: (counted in :attr:`reserved`), not in buffers of their own.
        self.pooled_out = False
        self.replays = 0  # forward replays whose backward may follow
        self.pending: Any = None  # a weak reference to what may still run B or W
        self.label = "the stage"
        #: Refuses a backward once a parameter stopped requiring grad (the
        #: stage's :meth:`~.state.StageState.check_frozen`, set when kept).
        self.check_frozen: Callable[[], None] | None = None
        #: What the runtime derives once from the outputs' structure (see
        #: ``runtime/handoffs.py``): fixed per call, read per task.
        self.layout: Any = None
        self._reached: dict[frozenset[int], tuple[frozenset[int], frozenset[int]]] = {}
        self._hooked: list[nn.Parameter] = []  # hooks a split call's W still runs
        # What B ensured, for a W run later to ensure again (see weight()).
        self._ensured: tuple[frozenset[int], object, bool] | None = None
        with restored(stage):
            backend.capture(self, fn)
        self.full = frozenset(j for j, outs in enumerate(self.param_reach()) if outs)

    # -- what capture calls ---------------------------------------------
    def inputs(self) -> tuple[Any, ...]:
        """The arguments rebuilt around the static input buffers. One that
        needs a gradient goes in as a copy (inside the graph): the buffer is a
        leaf, which a stage beginning with an in-place op
        (``ReLU(inplace=True)``) may not modify."""
        tensors = [t.clone() if t.requires_grad else t for t in self.static_in]
        return tuple(placed(self.items, self.where, self.spec, tensors))

    def outputs(self, out: Any) -> list[Tensor]:
        """Records the structure of a captured call's outputs; returns its tensors."""
        items, self.out_spec = leaves(out)
        self.out_items = untensored(items)
        self.out_where = [i for i, x in enumerate(items) if isinstance(x, Tensor)]
        tensors = [items[i] for i in self.out_where]
        # Not a bound method: the call would hold itself in a cycle (freed,
        # graphs and all, only by the garbage collector).
        self.rebuild = (
            _ONE
            if self.out_spec is None
            else functools.partial(placed, self.out_items, self.out_where, self.out_spec)
        )
        self.diff_out = [k for k, t in enumerate(tensors) if self.grad and t.requires_grad]
        self.plain_out = [k for k in range(len(tensors)) if k not in self.diff_out]
        return tensors

    def targets(self) -> list[Tensor]:
        """What the backward differentiates: inputs needing gradients, then parameters."""
        return [t for t in self.static_in if t.requires_grad] + self.params

    def param_reach(self) -> list[frozenset[int]]:
        """Per parameter, the outputs whose gradient reaches it."""
        return self.reached_from[len(self.reached_from) - len(self.params) :]

    def write(self, grads: Sequence[Tensor | None], params: Sequence[int], name: str) -> None:
        """Inside a pass: input gradients into their buffers (B, or the whole
        backward; W has none), parameter gradients added into the store."""
        n = len(self.static_grad_in)
        if name != "weight":
            for buf, g in zip(self.static_grad_in, grads[:n]):
                if buf is not None and g is not None:
                    buf.copy_(g)
        assert self.store is not None or not params
        pairs = [(j, g) for j in params if (g := grads[n + j]) is not None]
        for _, g in pairs:
            if g.layout != torch.strided:
                raise ValueError(
                    f"a parameter's gradient is {g.layout} (nn.Embedding(sparse=True)?): "
                    f"graphs add gradients into dense buffers"
                )
        if pairs and self.store is not None:
            views = [self.store.views[j] for j, _ in pairs]
            torch._foreach_add_(views, [g for _, g in pairs])

    def busy(self) -> bool:
        """Whether the static activations belong to a forward whose backward
        (or weight pass) may still run."""
        pending = self.pending
        if pending is None:
            return False
        return pending() is not None if isinstance(pending, weakref.ref) else True

    # -- replay --------------------------------------------------------
    def forward(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Replays the forward on ``tensors`` (copied into the static inputs
        unless they are them); returns the static outputs."""
        on = torch.is_grad_enabled()  # grad off, inline (private.grad_mode_switch)
        if on:
            _set_grad(False)
        try:
            for static, t, given in zip(self.static_in, tensors, self.given):
                if given is not None:
                    # The buffer, or (the user's loop) a Replay's alias of it.
                    if t is not given and t.data_ptr() != given.data_ptr():
                        raise RuntimeError(f"{self.label}: a replay read another buffer in place")
                elif t is not static:
                    static.copy_(t)
            self.backend.replay(self, "forward")
        finally:
            if on or torch.is_grad_enabled():
                _set_grad(on)
        if not self.backend.runs_python:
            for norm in self.norms:
                norm.count_forward()
        return self.static_out

    def backward(
        self,
        grads: Sequence[Tensor | None],
        token: object,
        weight: bool = True,
        autograd: bool = False,
        hooks: bool = True,
    ) -> list[Tensor | None]:
        """Replays the backward from the output gradients ``grads`` (per
        :attr:`diff_out`; None: no gradient, the buffer itself: already
        there), adding the parameter gradients into the store during pass
        ``token`` (a backward pass of autograd's, with ``autograd``); with
        ``weight`` a split call's W too; without ``hooks`` no
        post-accumulate hook runs (a pass whose adds are then undone).
        Returns the static input gradients, None where no output that got
        a gradient reaches."""
        check = self.check_frozen
        if check is not None:
            check()
        # Loops, not comprehensions: before Python 3.12 each of those is a
        # call of its own, once per task.
        missing: list[int] = []
        for k, g in zip(self.diff_out, grads):
            if g is None:
                missing.append(k)
        unreached, params = self._reach(frozenset(missing)) if missing else (frozenset(), self.full)
        store = self.store  # ensure()'s answer where it holds, inline (GradStore.ready)
        hooked = None if store is None else store.ready.get((token, params))
        if hooked is None:
            hooked = [] if store is None else store.ensure(params, token, autograd)
        if not hooks:
            hooked = []
        on = torch.is_grad_enabled()  # grad off, inline (private.grad_mode_switch)
        if on:
            _set_grad(False)
        try:
            for static, g in zip(self.static_grad_out, grads):
                if g is None:
                    static.zero_()
                elif g is not static:
                    static.copy_(g)
            if "backward" in self.passes:
                self.backend.replay(self, "backward")
        finally:
            if on or torch.is_grad_enabled():
                _set_grad(on)
        if "weight" not in self.passes:  # what weight() does after W, with no W
            self.pending = None
            if hooked:
                self._run_hooks(hooked)
        else:
            self._hooked = hooked
            if weight:
                self.weight()
            elif store is not None:
                self._ensured = (params, token, autograd)
        if not unreached:
            return list(self.static_grad_in)
        return [None if i in unreached else g for i, g in enumerate(self.static_grad_in)]

    def weight(self) -> None:
        """Replays a split call's W (after its B); runs the post-accumulate
        hooks of the parameters the backward added into."""
        if "weight" in self.passes:
            ensured, self._ensured = self._ensured, None
            if ensured is not None and self.store is not None:
                # Another micro-batch's W ran hooks in between, and one may
                # have taken .grad away: attached again before W adds.
                self.store.ensure(*ensured)
            on = torch.is_grad_enabled()  # grad off, inline (private.grad_mode_switch)
            if on:
                _set_grad(False)
            try:
                self.backend.replay(self, "weight")
            finally:
                if on or torch.is_grad_enabled():
                    _set_grad(on)
        hooked, self._hooked = self._hooked, []
        self.pending = None  # the slot may take another forward
        if hooked:
            self._run_hooks(hooked)

    def _run_hooks(self, hooked: list[nn.Parameter]) -> None:
        """After a backward's last pass: the post-accumulate hooks of ``hooked``."""
        for p in hooked:
            for hook in p._post_accumulate_grad_hooks.values():  # type: ignore[union-attr]
                hook(p)
        grads_changed()  # a hook may have taken any store's .grad away

    def _reach(self, none: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
        """The inputs (positions among those needing gradients) and the
        parameters (store positions) that no output with a gradient reaches
        (eager autograd gives them none), given the outputs without one."""
        cached = self._reached.get(none)
        if cached is None:
            n = len(self.static_grad_in)
            dead = {i for i, outs in enumerate(self.reached_from) if outs and outs <= none}
            inputs = frozenset(i for i in dead if i < n)
            params = frozenset(j for j in self.full if n + j not in dead)
            cached = self._reached[none] = (inputs, params)
        return cached


#: What a tensor argument always is: a call, a position among its static
#: outputs, and whether its gradient goes into that call's buffer.
Source: TypeAlias = tuple[GraphedCall, int, bool] | None


#: Sets grad mode without making an object per call. Each pass's copies and
#: replay run with grad mode off: an input buffer needing a gradient is a leaf.
_set_grad = private.grad_mode_switch()


#: A one-tensor call's output around its tensors (see GraphedCall.rebuild).
_ONE = operator.itemgetter(0)
