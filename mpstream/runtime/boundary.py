"""Cutting the autograd graph between stages for explicitly scheduled backward.

In ``train_step`` each stage's backward is its own task, so the graph is cut
at stage inputs. :class:`Boundary` returns its inputs detached (no copy) and,
in backward, hands the gradient that reached the cut to a :class:`GradSink`
instead of passing it on. A constant anchor that requires grad makes the
outputs require grad, so autograd reaches the boundary from the stage's
roots; and because the outputs are not leaves, a stage may start with an
in-place op (``ReLU(inplace=True)``), which a ``detach().requires_grad_()``
leaf would forbid.

Around it, what a training step (:mod:`.training`) does at each cut: cut a
stage's inputs for one micro-batch (:class:`Cutting`, :func:`cut_inputs`),
root its backward at its outputs (:func:`roots_of`), start it there from
the gradients that reached them (:func:`backward_starts`, :func:`backward_from`),
and hand each gradient that reached the cut to its producer
(:func:`route_grads`): summed by the producer's backward on its device, or by
a gradient copy to another one.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .graph import Hop, Ref
from .microbatch import leaves, rebuild_leaves
from .stream import AnyStream, record_stream

__all__ = [
    "Boundary",
    "Cutting",
    "GradSink",
    "Grads",
    "backward_from",
    "backward_starts",
    "cut",
    "cut_inputs",
    "roots_of",
    "route_grads",
    "sum_grads",
]

# Requires grad so the boundary's outputs do; never receives a gradient.
_ANCHOR = torch.empty(0, requires_grad=True)


class GradSink:
    """Receives the gradients that reach one stage input of one micro-batch."""

    __slots__ = ("grads",)

    def __init__(self) -> None:
        self.grads: tuple[Tensor | None, ...] | None = None


class Boundary(torch.autograd.Function):
    """Identity on the values; stops and captures the gradient."""

    @staticmethod
    def forward(ctx: Any, sink: GradSink, anchor: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.sink = sink
        # Every value of a dtype with gradients gets one: the stage's backward
        # computes the input gradients its producer waits for. (Loops, the
        # dtype check inline: a cut runs per task, and each helper, and each
        # comprehension before Python 3.12, is a call.)
        outputs: list[Tensor] = []
        plain: list[Tensor] = []
        for x in inputs:
            y = x.detach()
            outputs.append(y)
            if not (y.is_floating_point() or y.is_complex()):
                plain.append(y)
        if plain:
            ctx.mark_non_differentiable(*plain)
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, ...]:
        ctx.sink.grads = grads
        return (None,) * (len(grads) + 2)


def cut(sink: GradSink, tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Detaches ``tensors`` from their producer; their gradients go to ``sink``."""
    # Detach before the boundary too: otherwise its node would link back to
    # the producer's graph, and autograd would walk (and free) that graph
    # with empty gradients during this stage's backward. A tensor with no
    # graph (a replayed stage's output buffer) links nowhere: one operator
    # fewer per input on the host.
    linked: list[Tensor] = []
    for t in tensors:
        linked.append(t.detach() if t.requires_grad else t)
    out: tuple[Tensor, ...] = Boundary.apply(sink, _ANCHOR, *linked)
    return out


# Gradient contributions: (output index, tensor leaf index) -> tensors to sum.
Grads = dict[tuple[int, int], list[Tensor]]


class Cutting:
    """One stage's inputs for one micro-batch, cut from their producers.

    ``keys[i]`` names what the sink's gradient ``i`` belongs to: the
    producing stage, its output and the leaf within it.
    """

    __slots__ = ("sink", "keys")

    def __init__(self) -> None:
        self.sink = GradSink()
        self.keys: list[tuple[int, int, int]] = []


def cut_inputs(
    values: Sequence[tuple[Ref, Any]],
    cutting: Cutting,
    carried: Mapping[tuple[int, int], Container[tuple[int, int]]],
    m: int,
) -> list[Any]:
    """``values`` with the stage outputs' tensors that carry a gradient cut;
    the rest stay as they are.

    Args:
        values: (where it comes from, value) pairs.
        cutting: takes the cut tensors' keys (stage, output, leaf).
        carried: per (stage, micro-batch), the (output, leaf) keys of its
            outputs that carry a gradient (a stage that requires none hands
            on values that require none, as in the plain model; a replayed
            stage's buffers never require grad, and a copy's only where it
            ran with gradients, so the flag of the tensor read here does not
            tell).
        m: the micro-batch.
    """
    spots: list[tuple[int, list[Any], Any, list[int]]] = []
    tensors: list[Tensor] = []
    out: list[Any] = []
    # Loops, not comprehensions: the last stage's forward task cuts per
    # micro-batch, and before Python 3.12 each comprehension is a call.
    for v, (ref, value) in enumerate(values):
        out.append(value)
        if ref.stage < 0:
            continue
        keys = carried.get((ref.stage, m))
        if not keys:
            continue
        items, spec = leaves(value)
        picked: list[int] = []
        j = 0
        for i, t in enumerate(items):
            if isinstance(t, Tensor):
                if (ref.index, j) in keys:
                    picked.append(i)
                    tensors.append(t)
                    cutting.keys.append((ref.stage, ref.index, j))
                j += 1
        if picked:
            spots.append((v, items, spec, picked))
    if not tensors:
        return out
    detached = iter(cut(cutting.sink, tuple(tensors)))
    for v, items, spec, where in spots:
        for i in where:
            items[i] = next(detached)
        out[v] = rebuild_leaves(items, spec)
    return out


def roots_of(outs: tuple[Any, ...]) -> list[tuple[tuple[int, int], Tensor]]:
    """A stage's output tensors that require grad, keyed (output, leaf)."""
    roots = []
    for k, out in enumerate(outs):
        tensors = [t for t in leaves(out)[0] if isinstance(t, Tensor)]
        roots += [((k, j), t) for j, t in enumerate(tensors) if t.requires_grad]
    return roots


def sum_grads(parts: list[Tensor]) -> Tensor:
    """The sum of a value's gradient contributions (one: itself, no kernel)."""
    total = parts[0]
    for g in parts[1:]:
        total = total + g
    return total


def backward_starts(
    roots: list[tuple[tuple[int, int], Tensor]], grads: Grads | None, seed: Tensor | None
) -> tuple[list[Tensor], list[Tensor] | None]:
    """Where one stage's backward starts.

    Args:
        roots: the stage's outputs that require grad (:func:`roots_of`).
        grads: the gradients that reached them, by (output, leaf); None for
            the last stage, whose root is its loss.
        seed: the micro-batch's weight, the loss's gradient (None: one).

    Returns:
        The outputs that gradients reached and those gradients, summed (the
        loss and ``seed`` for the last stage): :func:`torch.autograd.backward`'s
        arguments, or a split backward's
        (:func:`~.split_backward.backward_inputs`).
    """
    if grads is None:  # the last stage: the loss
        return [t for _, t in roots], None if seed is None else [seed]
    pairs = [(t, sum_grads(grads[key])) for key, t in roots if key in grads]
    return [t for t, _ in pairs], [g for _, g in pairs]


def backward_from(
    roots: list[tuple[tuple[int, int], Tensor]], grads: Grads | None, seed: Tensor | None
) -> None:
    """Runs one stage's backward from its outputs' gradients (the arguments
    as :func:`backward_starts` takes them); nothing when none reached them."""
    tensors, start = backward_starts(roots, grads, seed)
    if tensors:
        torch.autograd.backward(tensors, start)


def route_grads(
    cutting: Cutting,
    s: int,
    m: int,
    hops: Mapping[tuple[int, int], Hop],
    local: dict[tuple[int, int], Grads],
    remote: dict[tuple[int, int, int], Grads],
    readers: Sequence[AnyStream | None],
    copiers: Sequence[AnyStream | None],
) -> None:
    """Hands the gradients that reached stage ``s``'s inputs to their
    producers (``hops``: :attr:`~.graph.Routes.hops`, the copy from a
    producer to a reader where there is one)."""
    for (p, k, j), g in zip(cutting.keys, cutting.sink.grads or ()):
        if g is None:
            continue
        hop = hops.get((p, s))
        if hop is None:
            # Summed by the producer's backward, on its stream.
            if readers[p] is not None and p != s:
                record_stream(g, readers[p])  # type: ignore[arg-type]
            local.setdefault((p, m), {}).setdefault((k, j), []).append(g)
        else:
            # Sent back by a gradient-copy task, which reads it on hop.peer's copy stream.
            if copiers[hop.peer] is not None:
                record_stream(g, copiers[hop.peer])  # type: ignore[arg-type]
            remote.setdefault((p, hop.peer, m), {}).setdefault((k, j), []).append(g)
