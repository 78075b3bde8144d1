"""Graphed calls emulated: replay semantics without a device graph, for tests.

Its forward "replay" reruns the stage and replaces the slot's one set of
activations, so a slot reused while an earlier micro-batch's backward is
pending gives that backward the wrong activations, as a real graph would;
its backward passes are :mod:`.backends`' own (:func:`~.backends.whole`, or
B and W of a split call).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .backend import raised_eagerly
from .backends import input_pass, positions, prepare, split_of, weight_pass, whole
from .call import GraphedCall

__all__ = ["Emulated"]


class Emulated:
    """Replay semantics without a device graph, for tests on any device.

    "Capture" runs the stage once on the static inputs (adding nothing to
    the gradients); a forward "replay" runs it again and keeps that run's
    autograd graph as the slot's activations, replacing the previous one; a
    backward "replay" differentiates the slot's current activations. What
    differs from CUDA graphs: the stage's Python runs at every replay (its
    side effects too), and nothing is faster.
    """

    runs_python = True

    def __init__(self) -> None:
        self.captures = 0
        #: Passes "replayed" so far (each would be one graph launch).
        self.replays = 0
        self._count = threading.Lock()  # as CudaGraphs'
        # Weak: a backend outlives the pipes given it, and a call let go (a
        # stage's least recently used, a dead pipe's) must take its stage along.
        self.fns: weakref.WeakKeyDictionary[GraphedCall, Callable[..., Any]] = (
            weakref.WeakKeyDictionary()
        )

    # As CudaGraphs': a copy of a pipe captures its own calls again, so it
    # keeps none of these calls' functions.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_count"]
        del state["fns"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._count = threading.Lock()
        self.fns = weakref.WeakKeyDictionary()

    def capture(self, call: GraphedCall, fn: Callable[..., Any]) -> None:
        self.captures += 1
        self.fns[call] = fn
        try:
            with torch.enable_grad() if call.grad else torch.no_grad():
                outs = call.outputs(fn(*call.inputs()))
        except Exception as exc:  # where CUDA graphs would be warming up
            raised_eagerly(exc)
            raise
        call.static_out = [t.detach().clone() for t in outs]
        if call.diff_out:
            prepare(call, outs)
            if call.split:
                split_of(call, outs)
            else:
                call.passes = ("forward", "backward")

    def replay(self, call: GraphedCall, name: str) -> None:
        with self._count:
            self.replays += 1
        getattr(self, name)(call)

    def forward(self, call: GraphedCall) -> None:
        with torch.enable_grad() if call.grad else torch.no_grad():
            outs = call.outputs(self.fns[call](*call.inputs()))
        for static, t in zip(call.static_out, outs):
            static.copy_(t.detach())
        call.state = outs if call.diff_out else None  # the slot's one set of activations

    def backward(self, call: GraphedCall) -> None:
        if call.state is None:
            raise RuntimeError("the slot's activations were freed before its backward replayed")
        outs, call.state = call.state, None
        n = len(call.static_grad_in)
        with torch.enable_grad():
            if not call.split:
                got = whole(call, outs)
                call.write(got, positions(got, n), "backward")
                return
            split = split_of(call, outs)
            first = input_pass(call, outs, split)
            call.write(first, positions(first, n), "backward")
        if split.defers:
            call.state = ("weight", outs, split)  # W reads B's activations and gradients

    def weight(self, call: GraphedCall) -> None:
        if isinstance(call.state, tuple) and call.state[0] == "weight":
            _, _, split = call.state
        elif isinstance(call.state, list) and "backward" not in call.passes:
            split = split_of(call, call.state)  # no B: W does everything
        else:
            raise RuntimeError("a weight pass replayed without its input-gradient pass")
        call.state = None
        with torch.enable_grad():
            second = weight_pass(call, split)
        call.write(second, positions(second, len(call.static_grad_in)), "weight")
