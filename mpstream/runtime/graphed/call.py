"""One stage call captured as graphs and replayed: forward, backward, weight.

:class:`GraphedCall` holds the graphs of one stage for one slot and one call
signature: static input buffers; a forward graph writing static outputs;
where the call needs gradients, a backward graph reading static output
gradients, writing the gradients of the differentiable inputs into static
buffers and *adding* the stage's parameter gradients into its
:class:`~.grads.GradStore` (or, where a zero-bubble schedule splits the
backward, an input-gradient graph B and a weight graph W, each adding the
parameter gradients it computes).

The runtime drives a call two ways. A training step calls :meth:`forward`,
:meth:`backward` and :meth:`weight` directly from its tasks: no autograd,
and the static buffers themselves are handed on (the slots and the event
plan keep them valid until their readers ran). The user's own loop
(``pipe(x)`` then ``loss.backward()``) goes through :class:`Replay`, the
autograd node of a replay, which shows autograd the inputs only, never a
parameter. What escapes to the user (the gradient of a tensor the pipe did
not produce) is copied.

A :class:`Backend` captures and replays (:mod:`.backends`: CUDA graphs, or
an emulation for tests); what capture changes on the stage is put back
(:func:`~.capturing.restored`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node, get_gradient_edge

from ...memory.batchnorm import deferred_norms
from ..boundary import _ANCHOR
from ..microbatch import leaves, rebuild_leaves
from .capturing import restored
from .grads import GradStore

__all__ = ["Backend", "GraphedCall", "Replay", "reached_from"]


class Backend(Protocol):
    """Captures and replays the graphs of one :class:`GraphedCall`."""

    #: Whether a replay runs the stage's Python (then its side effects,
    #: such as deferred BatchNorm's counting, happen by themselves).
    runs_python: bool

    def capture(self, call: GraphedCall, fn: Callable[..., Any]) -> None:
        """Fills ``call``'s static buffers and arms its replays."""

    def replay(self, call: GraphedCall, name: str) -> None:
        """Replays one pass: ``forward``, ``backward`` (all of it, or B where
        the call is split) or ``weight`` (W)."""


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
    ) -> None:
        self.device, self.grad, self.backend, self.pool = device, grad, backend, pool
        self.checkpoint = checkpoint
        self.split = split and grad and not checkpoint
        self.store = store if grad else None
        items, self.spec = leaves(tuple(args))
        self.where = [i for i, x in enumerate(items) if isinstance(x, Tensor)]
        need = [items[i].requires_grad for i in self.where] if needs is None else list(needs)
        self.static_in = [
            items[i].detach().clone().requires_grad_(grad and n) for i, n in zip(self.where, need)
        ]
        self.items = _plain(items)  # the example's tensors would live as long as the call
        self.params: list[nn.Parameter] = [] if self.store is None else list(self.store.params)
        self.norms = [n for n in deferred_norms(stage) if n.training]
        self.out_spec: Any = None
        self.out_items: list[Any] = []
        self.out_where: list[int] = []
        self.static_out: list[Tensor] = []
        self.diff_out: list[int] = []  # positions in static_out that carry gradients
        self.static_grad_out: list[Tensor] = []  # per diff_out
        #: Per input needing a gradient, its buffer (None: no output reaches it).
        self.static_grad_in: list[Tensor | None] = []
        #: Per gradient target (inputs needing one, then parameters), the outputs reaching it.
        self.reached_from: list[frozenset[int]] = []
        #: The graphs captured: forward; backward (all of it, or B); weight (W).
        self.passes: tuple[str, ...] = ("forward",)
        #: The passes whose replays draw random numbers (set by the backend).
        self.random_passes: frozenset[str] = frozenset()
        self.state: Any = None  # the backend's own: graphs, or the emulated activations
        self.keep: Any = None  # what capture allocated that replays still use
        self.reserved = 0  # bytes of the call's own memory pool
        self.replays = 0  # forward replays whose backward may follow
        self.pending: Any = None  # a weak reference to what may still run B or W
        self.label = "the stage"
        self._reached: dict[frozenset[int], tuple[frozenset[int], frozenset[int]]] = {}
        self._hooked: list[nn.Parameter] = []  # hooks a split call's W still runs
        with restored(stage):
            backend.capture(self, fn)
        self.full = frozenset(j for j, outs in enumerate(self.param_reach()) if outs)

    # -- what capture calls ---------------------------------------------
    def inputs(self) -> tuple[Any, ...]:
        """The arguments rebuilt around the static input buffers. One that
        needs a gradient goes in as a copy (inside the graph): the buffer is a
        leaf, which a stage beginning with an in-place op
        (``ReLU(inplace=True)``) may not modify."""
        items = list(self.items)
        for i, t in zip(self.where, self.static_in):
            items[i] = t.clone() if t.requires_grad else t
        return tuple(rebuild_leaves(items, self.spec))

    def outputs(self, out: Any) -> list[Tensor]:
        """Records the structure of a captured call's outputs; returns its tensors."""
        items, self.out_spec = leaves(out)
        self.out_items = _plain(items)
        self.out_where = [i for i, x in enumerate(items) if isinstance(x, Tensor)]
        tensors = [items[i] for i in self.out_where]
        self.diff_out = [k for k, t in enumerate(tensors) if self.grad and t.requires_grad]
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
        with torch.no_grad():
            for static, t in zip(self.static_in, tensors):
                if t is not static:
                    static.copy_(t)
            self.backend.replay(self, "forward")
        if not self.backend.runs_python:
            for norm in self.norms:
                norm.count_forward()
        return self.static_out

    def rebuild(self, outs: Sequence[Tensor]) -> Any:
        """The call's output structure around ``outs``."""
        result = list(self.out_items)
        for i, t in zip(self.out_where, outs):
            result[i] = t
        return rebuild_leaves(result, self.out_spec)

    def backward(
        self,
        grads: Sequence[Tensor | None],
        token: object,
        weight: bool = True,
        autograd: bool = False,
    ) -> list[Tensor | None]:
        """Replays the backward from the output gradients ``grads`` (per
        :attr:`diff_out`; None: no gradient, the buffer itself: already
        there), adding the parameter gradients into the store during pass
        ``token`` (a backward pass of autograd's, with ``autograd``); with
        ``weight`` a split call's W too. Returns the static input gradients,
        None where no output that got a gradient reaches."""
        none = frozenset(k for k, g in zip(self.diff_out, grads) if g is None)
        unreached, params = self._reach(none)
        store = self.store
        hooked = store.ensure(params, token, autograd) if store is not None else []
        with torch.no_grad():
            for static, g in zip(self.static_grad_out, grads):
                if g is None:
                    static.zero_()
                elif g is not static:
                    static.copy_(g)
            if "backward" in self.passes:
                self.backend.replay(self, "backward")
        self._hooked = hooked
        if weight or "weight" not in self.passes:
            self.weight()
        return [None if i in unreached else g for i, g in enumerate(self.static_grad_in)]

    def weight(self) -> None:
        """Replays a split call's W (after its B); runs the post-accumulate
        hooks of the parameters the backward added into."""
        if "weight" in self.passes:
            with torch.no_grad():
                self.backend.replay(self, "weight")
        hooked, self._hooked = self._hooked, []
        self.pending = None  # the slot may take another forward
        for p in hooked:
            for hook in p._post_accumulate_grad_hooks.values():  # type: ignore[union-attr]
                hook(p)

    def _reach(self, none: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
        """The inputs (positions among those needing gradients) and the
        parameters (store positions) that no output with a gradient reaches
        (eager autograd gives them none), given the outputs without one."""
        if not none:
            return frozenset(), self.full
        cached = self._reached.get(none)
        if cached is None:
            n = len(self.static_grad_in)
            dead = {i for i, outs in enumerate(self.reached_from) if outs and outs <= none}
            inputs = frozenset(i for i in dead if i < n)
            params = frozenset(j for j in self.full if n + j not in dead)
            cached = self._reached[none] = (inputs, params)
        return cached


class Replay(torch.autograd.Function):
    """A replay inside autograd (the user's own loop): its backward replays
    the backward graph, whose parameter gradients go to the stage's store."""

    @staticmethod
    def forward(
        ctx: Any, call: GraphedCall, anchor: Tensor, *tensors: Tensor
    ) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.call = call
        ctx.set_materialize_grads(False)  # backward tells "no gradient" from zeros
        # The gradient of a tensor no replay or copy of the pipe made goes
        # to the user (or their autograd graph): a copy, not the buffer.
        ctx.escapes = [not _ours(t) for t in tensors]
        outs = call.forward(tensors)
        call.replays += 1
        ctx.replay = call.replays
        call.pending = weakref.ref(ctx)
        # Aliases: a Function's outputs are new tensors (the buffers are not).
        aliases = tuple(t.detach() for t in outs)
        keep = set(call.diff_out)
        ctx.mark_non_differentiable(*(t for k, t in enumerate(aliases) if k not in keep))
        return aliases

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        call: GraphedCall = ctx.call
        if torch.is_grad_enabled():  # autograd runs a backward with grad mode = create_graph
            raise RuntimeError(
                f"{call.label}: a backward with create_graph=True (a gradient penalty, a "
                f"higher-order gradient) differentiates the backward, which a replayed graph "
                f"cannot: its gradients would carry no history; run the pipe with graphs=False "
                f"for that"
            )
        if getattr(ctx, "done", False):
            raise RuntimeError(
                f"{call.label}: a second backward through the same graphed forward "
                f"(retain_graph=True) would read activations its first backward reused; "
                f"run the pipe with graphs=False for that"
            )
        ctx.done = True
        none: tuple[None, ...] = (None,) * (2 + len(call.static_in))
        if ctx.replay != call.replays:
            raise RuntimeError(
                f"{call.label}: its graphs replayed another micro-batch's forward before this "
                f"backward, so the activations it needs are gone (a backward run twice with "
                f"retain_graph=True after a new forward?); run the pipe with graphs=False for that"
            )
        call.pending = None
        picked = [grads[k] for k in call.diff_out]
        if all(g is None for g in picked):
            # No gradient reached the call: eager autograd computes nothing here.
            return none
        store = call.store
        if store is not None and not _accumulates():
            # torch.autograd.grad or backward(inputs=...): autograd leaves
            # .grad alone, and so must the graph that adds into it.
            saved = store.save()
            try:
                got = call.backward(picked, object())
            finally:
                store.restore()
            del saved
        else:
            got = call.backward(picked, _graph_task(), autograd=True)
        it = iter(got)
        out: list[Tensor | None] = []
        for t, escapes in zip(call.static_in, ctx.escapes):
            g = next(it) if t.requires_grad else None
            out.append(g.clone() if g is not None and escapes else g)
        return (None, None, *out)


def replay(call: GraphedCall, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """The user's loop's replay of ``call`` (through autograd when it needs
    gradients); returns its output tensors."""
    if call.diff_out and torch.is_grad_enabled():
        out: tuple[Tensor, ...] = Replay.apply(call, _ANCHOR, *tensors)
        return out
    return tuple(call.forward(tensors))


def reached_from(
    outs: Sequence[Tensor], diff_out: Sequence[int], targets: Sequence[Tensor]
) -> list[frozenset[int]]:
    """Per target, the positions in ``outs`` (among ``diff_out``) whose
    autograd graph reaches it: a replayed backward computes zeros for a
    target only outputs without a gradient reach, where eager autograd gives
    it none.

    Raises:
        ValueError: the graph reaches a leaf that is not a target (a tensor
            the stage holds without registering it): the backward graph
            would not compute its gradient.
    """
    known = {id(t): i for i, t in enumerate(targets)}
    reached: list[set[int]] = [set() for _ in targets]
    for k in diff_out:
        seen: set[Any] = set()
        stack: list[Any] = [outs[k].grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None:
                if id(variable) not in known:
                    raise ValueError(
                        f"a tensor of shape {tuple(variable.shape)} that is not a parameter of "
                        f"the stage needs a gradient: register it (nn.Parameter on the stage's "
                        f"module)"
                    )
                reached[known[id(variable)]].add(k)
            stack.extend(n for n, _ in node.next_functions if n is not None)
    return [frozenset(r) for r in reached]


def _plain(items: Sequence[Any]) -> list[Any]:
    """``items`` with None where a tensor was (a replay puts its own there)."""
    return [None if isinstance(x, Tensor) else x for x in items]


_OURS = ("ReplayBackward", "CopyBackward", "HostWaitBackward")


def _ours(t: Tensor) -> bool:
    """Whether ``t`` came out of a replay or a copy of a pipe (whose backward
    copies or consumes the gradient it is given)."""
    fn = t.grad_fn
    return fn is not None and type(fn).__name__ in _OURS


def _accumulates() -> bool:
    """Whether the running backward accumulates into leaves: a plain
    ``backward()``, not ``torch.autograd.grad`` nor ``backward(inputs=)``
    (where the anchor, an input of every replay, is not asked for)."""
    node: Node = get_gradient_edge(_ANCHOR).node
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def _graph_task() -> int:
    """The running backward pass's id (-1 where torch cannot tell)."""
    query = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if query is None else int(query())
