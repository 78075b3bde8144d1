"""Timing a stage's backward when autograd, not the scheduler, runs it.

After ``pipe(x)``, ``loss.backward()`` runs each stage's backward inside
autograd, so no scheduler task brackets it. While timing is on, the forward
wraps each tensor of a stage's outputs in a :class:`_Begin` and each of its
inputs in an :class:`_End`: identities whose backward records a start mark
when the first gradient reaches the stage's outputs and an end mark when the
last one the backward pass computes leaves its inputs. Autograd runs them on
the stage's compute stream (the stream their forward ran on), so on a GPU
the marks are events on that stream. Each mark counts in the run whose
forward built the graph, however many runs came in between.

A node per tensor, as for copies (:class:`~mpstream.runtime.copy.Copy`):
one node over several values would, reached through one, run the backward
of what made the others with no gradient, and call their tensor hooks with
None, where the plain model never reaches them. An output that requires
grad only through the anchor (every parameter it reads frozen, no input it
reads requiring grad) is marked non-differentiable: it requires grad exactly
where the plain model's does. Which of a stage's input
marks a backward pass runs, autograd knows when the pass starts; the first
output mark asks it (:meth:`StageMarks.open`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _ext
from . import private
from .microbatch import grad_dtype, gradless, leaves, rebuild_leaves

__all__ = ["StageMarks", "enter", "leave"]

_BACKWARD = _ext.load().Kind.backward

# Requires grad so the end mark fires even when the stage input does not.
_ANCHOR = torch.empty(0, requires_grad=True)


class StageMarks:
    """Links the begin and end marks of one stage's backward on one
    micro-batch, in each backward pass through them.

    Attributes:
        ends: the stage's input marks (:class:`_End` nodes, weakly held).
        pending: how many of them the open span's pass has yet to run (0:
            no span open).
        task: the backward pass that opened the latest span.
    """

    __slots__ = ("native", "stage", "micro", "run", "mark", "ends", "pending", "task")

    def __init__(self, native: Any, stage: int, micro: int) -> None:
        self.native = native
        self.stage = stage
        self.micro = micro
        self.run = native.run_tag  # the forward's run: the backward may come later
        self.mark = -1
        self.ends: list[weakref.ref[Any]] = []
        self.pending = 0
        self.task = -2  # no pass yet (-1: a pass this torch cannot tell)

    def open(self) -> None:
        """At an output mark: begins the span, unless this pass has one."""
        task = private.current_graph_task_id()
        if task == self.task and (self.pending or task != -1):
            return  # open, or ended by this pass's last input mark
        self.task = task
        # Every node a pass reaches runs (with no gradient where none came),
        # and an input mark runs only after an output mark of its stage.
        self.pending = 0
        for ref in self.ends:
            node = ref()
            if node is not None and private.will_engine_execute_node(node):
                self.pending += 1
        # A pass that reaches no input mark (the stage reads integers only,
        # or backward(inputs=) stops inside it) times nothing.
        if self.pending:
            self.mark = self.native.begin_mark(_BACKWARD, self.stage, self.micro, self.run)

    def close(self) -> None:
        """At an input mark: ends the span at the pass's last one."""
        if self.pending:
            self.pending -= 1
            if not self.pending:
                self.native.end_mark(self.mark)


def _detached(x: Tensor, ctx: Any, *, anchored: bool) -> Tensor:
    out = x.detach()
    # Anchored, every float input gets a gradient path, so that the stage's
    # backward ends with this mark even where its inputs need none.
    gradless_out = not grad_dtype(out) if anchored else bool(gradless((x,), (out,)))
    if gradless_out:
        ctx.mark_non_differentiable(out)
    ctx.set_materialize_grads(False)
    return out


def _needs_grad(output: Tensor) -> bool:
    """Whether ``output`` would require grad without the anchor: whether its
    graph reaches, short of the stage's input marks, a leaf that requires
    grad other than the anchor (a parameter), or an input mark whose input
    required grad. Depth first: a parameter is most often a step away."""
    seen: set[Any] = set()
    fn = output.grad_fn
    stack = [fn]
    call: Any = getattr(fn, "call", None)
    if fn is not None and hasattr(call, "param_reach"):
        # A graphed stage's replay: autograd sees none of its parameters.
        k = output.output_nr  # a replay returns one alias per output
        if any(p.requires_grad and k in r for p, r in zip(call.params, call.param_reach())):
            return True
        needing = [i for i, t in enumerate(call.static_in) if t.requires_grad]
        edges = fn.next_functions  # the anchor's, then one per input
        stack = [edges[1 + i][0] for n, i in enumerate(needing) if k in call.reached_from[n]]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, _End._backward_cls):  # type: ignore[attr-defined]
            if getattr(node, "real", True):  # set by _End.forward
                return True
            continue
        if getattr(node, "variable", None) is _ANCHOR:
            continue
        if not node.next_functions:  # a leaf (or a node of a graph made elsewhere)
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


class _Begin(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, marks: StageMarks, output: Tensor) -> Tensor:  # type: ignore[override]
        ctx.marks = marks
        out = _detached(output, ctx, anchored=False)
        if output.requires_grad and not _needs_grad(output):
            # Only the anchor made it require grad: as in the plain model, it does not.
            ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[Any, ...]:
        # Reached with no gradient too: the stage's nodes below run all the same.
        ctx.marks.open()
        return (None, grad)


class _End(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, marks: StageMarks, anchor: Tensor, input: Tensor) -> Tensor:  # type: ignore[override]
        ctx.marks = marks
        ctx.real = input.requires_grad  # else only the anchor gives it a gradient path
        marks.ends.append(weakref.ref(ctx))  # ctx is the node autograd runs
        return _detached(input, ctx, anchored=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[Any, ...]:
        ctx.marks.close()
        return (None, None, grad)


def _wrap(value: Any, apply: Any) -> Any:
    items, spec = leaves(value)
    where = [i for i, t in enumerate(items) if isinstance(t, Tensor)]
    if not where:
        return value
    for i in where:
        items[i] = apply(items[i])
    return rebuild_leaves(items, spec)


def enter(native: Any, stage: int, micro: int, args: Sequence[Any]) -> tuple[list[Any], StageMarks]:
    """Wraps a stage's arguments; call inside the stage's task."""
    marks = StageMarks(native, stage, micro)
    wrapped = _wrap(tuple(args), lambda t: _End.apply(marks, _ANCHOR, t))
    return list(wrapped), marks


def leave(marks: StageMarks, y: Any) -> Any:
    """Wraps a stage's outputs; call inside the stage's task."""
    return _wrap(y, lambda t: _Begin.apply(marks, t))
