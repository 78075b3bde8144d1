"""One stage call captured as graphs and replayed: forward, and backward.

:class:`GraphedCall` holds the graphs of one stage for one slot and one
call signature: static input buffers, a forward graph writing static
outputs and, when the call needs gradients, a backward graph reading static
output gradients and writing the gradients of the differentiable inputs and
of the stage's parameters. Where a zero-bubble schedule splits the
backward, it is two graphs, input gradients (B) and parameter gradients
(W): the backward task's autograd call marks the node to defer (see
:mod:`~mpstream.runtime.split_backward`), B replays, and the node hands
back the replay of W, which the weight task runs.

A call copies the arguments' tensors into the static inputs, replays the
forward and returns *copies* of the outputs; its backward (an autograd
node, so ``loss.backward()``, ``train_step`` and the user's own loop all
reach it) replays the backward graph and returns copies of the input
gradients. Copies, because the next replay of the slot overwrites the
static buffers while readers on other streams (a copy to the next device, a
gradient copy back) may still be queued; with them, the runtime's event
plan and allocator protection apply unchanged. Parameter gradients go
to autograd's accumulation, on the stage's stream, before any later replay;
under ``train_step`` into the stage's sums instead (:mod:`.grads`).

A :class:`Backend` captures and replays (:mod:`~mpstream.runtime.graphed.backends`:
CUDA graphs, or an emulation for tests); what the captured backward
computes, whole or split, is :mod:`~mpstream.runtime.graphed.passes`; what
capture changes on the stage, :mod:`~mpstream.runtime.graphed.restore`
puts back.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node, get_gradient_edge

from ...memory.batchnorm import deferred_norms
from ..microbatch import leaves, rebuild_leaves
from .grads import StageGrads
from .reach import reached_from
from .replay import Replay
from .restore import restored

__all__ = ["Backend", "GraphedCall"]


class Backend(Protocol):
    """Captures and replays the graphs of one :class:`GraphedCall`."""

    #: Whether a replay runs the stage's Python (then its side effects,
    #: such as deferred BatchNorm's counting, happen by themselves).
    runs_python: bool

    def capture(self, call: GraphedCall, fn: Callable[..., Any]) -> None:
        """Fills ``call``'s static outputs and gradients and arms its replays."""

    def forward(self, call: GraphedCall) -> None:
        """Replays the forward: static inputs to static outputs."""

    def backward(self, call: GraphedCall) -> None:
        """Replays the backward: static output gradients to static gradients
        (input gradients and B's parameter gradients only, when split)."""

    def weight(self, call: GraphedCall) -> None:
        """Replays a split backward's weight pass (W's parameter gradients)."""


class GraphedCall:
    """The graphs of one stage call: static buffers and their replays.

    Args:
        fn: the stage's call (checkpointed or not), taking the arguments.
        args: an example of the arguments (their tensors' shapes, dtypes,
            devices and ``requires_grad`` are the call's signature; plain
            values are baked in).
        stage: the stage module (its parameters get gradients, its deferred
            BatchNorm layers are counted per replay).
        device: the stage's device.
        grad: whether the call builds an autograd graph.
        backend: what captures and replays.
        checkpoint: ``fn`` checkpoints the stage (its backward recomputes
            the forward).
        split: capture the backward as two graphs, input gradients and
            parameter gradients, so that a split backward's weight pass can
            run later (ignored for a checkpointed call, which is not split).

    Raises:
        ValueError: what a graph cannot hold: a parameter with a tensor hook
            (the replay and autograd would both run it), or a tensor outside
            the stage's parameters that needs a gradient (the graph would
            leave it without one).
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
        checkpoint: bool = False,
        split: bool = False,
    ) -> None:
        self.device = device
        self.checkpoint = checkpoint
        self.split = split and grad and not checkpoint
        #: The captured backward leaves parameter gradients to a weight graph.
        self.weighs_later = False
        items, self.spec = leaves(tuple(args))
        self.where = [i for i, x in enumerate(items) if isinstance(x, Tensor)]
        self.static_in = [
            items[i].detach().clone().requires_grad_(grad and items[i].requires_grad)
            for i in self.where
        ]
        # The plain values only: the example's tensors would live as long as the call.
        self.items = _plain(items)
        self.grad = grad
        self.params = [p for p in stage.parameters() if p.requires_grad] if grad else []
        hooked = [n for n, p in stage.named_parameters() if p._backward_hooks]
        if hooked:
            raise ValueError(
                f"parameter '{hooked[0]}' has a tensor hook (register_hook): a replayed "
                f"backward would run it inside the graph and autograd again outside"
            )
        self.norms = [n for n in deferred_norms(stage) if n.training]
        self.out_spec: Any = None
        self.out_items: list[Any] = []
        self.out_where: list[int] = []
        self.static_out: list[Tensor] = []
        self.diff_out: list[int] = []  # positions in static_out that carry gradients
        self.static_grad_out: list[Tensor] = []
        self.static_grad_in: list[Tensor | None] = []
        self.static_grad_params: list[Tensor | None] = []
        self.backend = backend
        self.state: Any = None  # the backend's own: graphs, or the emulated activations
        self.reserved = 0  # device memory reserved while capturing
        self.replays = 0  # forward replays whose backward may follow
        self.pending: weakref.ref[Any] | None = None  # the node of the last such replay
        self.label = "the stage"
        #: The stage's gradient sums (set by StageGraphs; None: always return).
        self.sums: StageGrads | None = None
        self._accumulators: list[Node] | None = None
        #: Per gradient target (:meth:`grad_targets`), the outputs it is reached from.
        self.reached_from: list[frozenset[int]] = []
        #: The gradient targets the last backward reached from no output that
        #: got a gradient: eager autograd gives them none, where a replay
        #: computes zeros.
        self.unreached: frozenset[int] = frozenset()
        #: The graphs captured: forward; backward (all of it, or B); weight (W).
        self.passes: tuple[str, ...] = ("forward",)
        #: The passes whose replays draw random numbers (set by the backend).
        self.random_passes: frozenset[str] = frozenset()
        with restored(stage):
            backend.capture(self, fn)

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
        self.out_items = _plain(items)  # the outputs (and their autograd graph) not kept
        self.out_where = [i for i, x in enumerate(items) if isinstance(x, Tensor)]
        tensors = [items[i] for i in self.out_where]
        self.diff_out = [k for k, t in enumerate(tensors) if self.grad and t.requires_grad]
        return tensors

    def grad_targets(self) -> list[Tensor]:
        """What the backward differentiates: inputs needing gradients, then parameters."""
        return [t for t in self.static_in if t.requires_grad] + self.params

    def check_leaves(self, outs: Sequence[Tensor]) -> None:
        """Notes which outputs reach each input and parameter (see
        :func:`~.reach.reached_from`).

        Raises:
            ValueError: the outputs' gradients reach a tensor other than the
                inputs and the stage's parameters.
        """
        self.reached_from = reached_from(outs, self.diff_out, self.grad_targets())

    def busy(self) -> bool:
        """Whether the static activations belong to a forward whose backward
        may still run: its autograd node is alive and has not run, or its
        deferred weight pass is held and has not run."""
        return self.pending is not None and self.pending() is not None

    # -- replay ------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        items, _ = leaves(tuple(args))
        tensors = [items[i] for i in self.where]
        if self.diff_out and torch.is_grad_enabled():
            # Under train_step every parameter gradient goes to the stage's
            # sums (grads.py), never through autograd, so autograd need not
            # walk an edge per parameter at every micro-batch's backward (on
            # the host, about 4 us each): one parameter keeps the replay in
            # autograd's graph where no input needs a gradient.
            held = self.sums is not None and self.sums.holding
            outs = Replay.apply(self, held, *tensors, *self.params[: 1 if held else None])
        else:
            outs = self._forward(tensors)
        result = list(self.out_items)
        for i, t in zip(self.out_where, outs):
            result[i] = t
        return rebuild_leaves(result, self.out_spec)

    def _forward(self, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
        with torch.no_grad():
            for static, t in zip(self.static_in, tensors):
                static.copy_(t)
            self.backend.forward(self)
            if not self.backend.runs_python:
                for norm in self.norms:
                    norm.count_forward()
            return tuple(t.clone() for t in self.static_out)

    def _backward(self, grads: Sequence[Tensor | None], defer: bool) -> list[Tensor | None]:
        """Replays the backward from ``grads``; returns the input gradients
        (the parameters' are :meth:`_params_out`'s or :meth:`_hold`'s, or
        :meth:`_weights`' where ``defer`` leaves them to the weight pass)."""
        none = {k for k in self.diff_out if grads[k] is None}
        self.unreached = (
            frozenset(i for i, outs in enumerate(self.reached_from) if outs and outs <= none)
            if none
            else frozenset()
        )
        with torch.no_grad():
            for k, static in zip(self.diff_out, self.static_grad_out):
                g = grads[k]
                if g is None:
                    static.zero_()
                else:
                    static.copy_(g)
            self.backend.backward(self)
            if self.weighs_later and not defer:
                self.backend.weight(self)
        in_grads = iter(enumerate(self.static_grad_in))
        out: list[Tensor | None] = []
        for t in self.static_in:
            i, g = next(in_grads) if t.requires_grad else (-1, None)
            out.append(None if g is None or i in self.unreached else g.clone())
        return out

    def _hold(self) -> None:
        """Adds every reached parameter gradient into the stage's sums (a
        replay under ``train_step``, which showed autograd one parameter
        only, to keep it in the graph, and returns None for it; or its
        deferred weight pass)."""
        assert self.sums is not None
        grads = self._reached_params()
        if any(g is None for g in grads):
            pairs = [(p, g) for p, g in zip(self.params, grads) if g is not None]
            params, grads = [p for p, _ in pairs], [g for _, g in pairs]
        else:
            params = self.params
        with torch.no_grad():
            self.sums.add(params, grads)  # type: ignore[arg-type]

    def _params_out(self) -> list[Tensor | None]:
        """The parameter gradients to return to autograd: None for those
        added to the stage's sums instead (see :mod:`.grads`)."""
        sums = self.sums
        if sums is None or not (sums.holding or self._holds_task(sums)):
            return self._param_grads()
        if self._accumulators is None:
            self._accumulators = [get_gradient_edge(p).node for p in self.params]
        out: list[Tensor | None] = []
        held: list[tuple[Tensor, Tensor]] = []
        for p, g, node in zip(self.params, self._reached_params(), self._accumulators):
            if g is not None and _accumulates(node):
                held.append((p, g))
                out.append(None)
            else:
                out.append(None if g is None else g.clone())
        with torch.no_grad():
            sums.add([p for p, _ in held], [g for _, g in held])
        return out

    def _holds_task(self, sums: StageGrads) -> bool:
        """Outside ``train_step``: hold for the running backward pass,
        unless a parameter has a post-accumulate hook (which would run once
        per pass instead of once per micro-batch)."""
        if any(p._post_accumulate_grad_hooks for p in self.params):
            return False
        return sums.hold_task()

    def _param_grads(self) -> list[Tensor | None]:
        # Copies: a parameter's gradient may outlive the next replay (kept by
        # a hook, or returned by torch.autograd.grad), which overwrites ours.
        return [None if g is None else g.clone() for g in self._reached_params()]

    def _reached_params(self) -> list[Tensor | None]:
        """The static parameter gradients, None for those the last backward
        did not reach (see :attr:`unreached`)."""
        if not self.unreached:
            return self.static_grad_params
        n = len(self.static_grad_in)
        return [
            None if n + j in self.unreached else g for j, g in enumerate(self.static_grad_params)
        ]

    def _weights(self, replay: int) -> None:
        """A deferred weight pass: replays W and accumulates every parameter
        gradient (B's and W's) into ``.grad`` through autograd, as the
        unsplit backward would have."""
        if replay != self.replays:
            raise RuntimeError(
                f"{self.label}: another micro-batch's forward replayed between this "
                f"backward's input and weight passes, so the activations W reads are gone"
            )
        with torch.no_grad():
            self.backend.weight(self)
        pairs: list[tuple[Tensor, Tensor]] = []
        if self.sums is not None and self.sums.holding:
            self._hold()
        else:
            reached = zip(self.params, self._reached_params())
            pairs = [(p, g.clone()) for p, g in reached if g is not None]
        self.pending = None
        if pairs:
            torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])


def _plain(items: Sequence[Any]) -> list[Any]:
    """``items`` with None where a tensor was (a replay puts its own there)."""
    return [None if isinstance(x, Tensor) else x for x in items]


def _accumulates(node: Node) -> bool:
    """Whether the running backward accumulates into this AccumulateGrad
    node's parameter (not so under ``torch.autograd.grad``, where asking
    about a leaf raises)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False
