"""A stage's backward in two passes: input gradients first, weights later.

Zero-bubble schedules split the backward of a stage and micro-batch into B,
the gradients of the stage's inputs (what the stage before it waits for),
and W, the gradients of its parameters, which can run later, when the stage
would otherwise idle. Together they do the work of one backward, not two.

B runs autograd from the stage's outputs toward its cut inputs only (the
:mod:`~mpstream.runtime.boundary` nodes), so every node computes just the gradients
that path needs: a linear layer's matmul for its input, not the one for its
weight. Before it runs, B finds the *junctions*: nodes on the input path with
an edge into a subgraph that leads to parameters and not to the inputs (a
linear layer's addmm, whose other edges go to its weight and bias). A hook on
each junction keeps the gradient that flows into it. W then starts autograd
at those junctions with the kept gradients, toward the parameters below them:
each junction now computes the gradients it skipped in B, and nothing on the
input path runs twice.

One W call per group of junctions whose parameters overlap. B computes
three kinds of parameter gradients itself: those of a parameter reached from
several junctions, one below the other on the input path (a weight used
twice in a row), which W would count twice; groups of vectors only (a
norm's scale and shift), whose gradients are reductions over the batch that
the junction computes with the input gradient in the same pass: deferring
them would cost a second reduction and an autograd call each, to save
nothing; and those under a custom ``autograd.Function`` (a ``torch.compile``d
stage is one), whose backward computes every gradient each time it runs:
running it again in W would repeat all of it. W keeps the weight matrices
and kernels, the matmuls and convolutions that make a backward's second
half. B keeps the stage's graph (and its saved tensors) alive for W; each W
call frees the part it ran.

Checkpointed micro-batches are not split: non-reentrant checkpointing
recomputes the stage's forward once per autograd call, so separate W calls
would recompute it again each. Their B does the whole backward and their W
has nothing left to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from .boundary import _ANCHOR, Boundary

__all__ = ["WeightPass", "backward_inputs"]


class WeightPass:
    """The parameter-gradient work B left for W (see :func:`backward_inputs`).

    Attributes:
        groups: per autograd call, the edges to start from, their gradients
            and the parameters to accumulate into.
    """

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[tuple[list[GradientEdge], list[Tensor], list[Tensor]]] = []

    def run(self) -> None:
        """Accumulates the parameter gradients into ``.grad``, as a plain
        backward would (AccumulateGrad nodes, hooks included), and lets the
        graph go."""
        groups, self.groups = self.groups, []
        for edges, grads, params in groups:
            torch.autograd.backward(edges, grads, inputs=params)  # type: ignore[arg-type]


def _is_boundary(node: Node) -> bool:
    return getattr(node, "_forward_cls", None) is Boundary


def _walk(roots: Sequence[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """The nodes below ``roots`` in post-order (children first), and each
    node's children; the search stops at boundary nodes."""
    children: dict[Node, list[Node]] = {}
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        node, finished = stack.pop()
        if finished:
            order.append(node)
            continue
        if node in children:
            continue
        below = [] if _is_boundary(node) else [c for c, _ in node.next_functions if c is not None]
        children[node] = below
        stack.append((node, True))
        stack.extend((c, False) for c in below if c not in children)
    return order, children


def _leaves(head: Node, children: dict[Node, list[Node]]) -> list[Node]:
    """The accumulate-grad nodes (parameters) under ``head``."""
    found: list[Node] = []
    seen = {head}
    stack = [head]
    while stack:
        node = stack.pop()
        if hasattr(node, "variable"):
            found.append(node)
        for c in children[node]:
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return found


def _reaches(
    start: Node, targets: set[Node], inner: set[Node], children: dict[Node, list[Node]]
) -> bool:
    """Whether a path through ``inner`` nodes leads from ``start`` to a target."""
    seen = {start}
    stack = [start]
    while stack:
        for c in children[stack.pop()]:
            if c in targets:
                return True
            if c in inner and c not in seen:
                seen.add(c)
                stack.append(c)
    return False


def backward_inputs(tensors: Sequence[Tensor], grads: Sequence[Tensor] | None) -> WeightPass:
    """B: back-propagates ``tensors`` to the stage's cut inputs only.

    The boundary sinks receive the input gradients, as with a plain
    backward. Parameter gradients are left for the returned pass.

    Args:
        tensors: the stage's outputs that get a gradient (or its loss).
        grads: their gradients (None for a loss).

    Returns:
        W, to :meth:`~WeightPass.run` later (on the same stream).
    """
    weight = WeightPass()
    roots = [t.grad_fn for t in tensors]
    if not tensors:
        return weight
    if any(r is None for r in roots):
        # A leaf as an output: nothing to split.
        torch.autograd.backward(list(tensors), grads)
        return weight
    order, children = _walk([r for r in roots if r is not None])
    to_input: dict[Node, bool] = {}
    to_param: dict[Node, bool] = {}
    for node in order:
        if _is_boundary(node):
            to_input[node], to_param[node] = True, False
        elif hasattr(node, "variable"):
            to_input[node], to_param[node] = False, True
        else:
            below = children[node]
            to_input[node] = any(to_input[c] for c in below)
            to_param[node] = any(to_param[c] for c in below)
    given = list(grads) if grads is not None else [torch.ones_like(t) for t in tensors]
    if not any(to_input[r] for r in roots if r is not None):
        # Nothing flows to the inputs (the first stage): all of it is W.
        everything = _params(order, to_param)
        if everything:
            weight.groups.append(([get_gradient_edge(t) for t in tensors], given, everything))
        return weight
    inner = {n for n in order if to_input[n] and not _is_boundary(n)}
    # Junction -> parameter nodes under its branches; roots off the input
    # path count as junctions whose gradient is already known.
    branches: dict[Node, list[Node]] = {}
    for node in inner:
        heads = [c for c in children[node] if to_param[c] and not to_input[c]]
        if heads:
            branches[node] = [leaf for h in heads for leaf in _leaves(h, children)]
    outside = [
        (t, g, r)
        for t, g, r in zip(tensors, given, roots)
        if r is not None and not to_input[r] and to_param[r]
    ]
    for _, _, r in outside:
        branches[r] = _leaves(r, children)
    groups = _group(branches)
    eager: list[Node] = []
    kept: list[tuple[list[Node], list[Node]]] = []
    for junctions, params in groups:
        on_path = [j for j in junctions if j in inner]
        tangled = len(on_path) > 1 and any(
            _reaches(j, set(on_path) - {j}, inner, children) for j in on_path
        )
        vectors = all(_variable(p).dim() <= 1 for p in params)
        opaque = any(hasattr(j, "_forward_cls") for j in on_path)
        if tangled or vectors or opaque:
            eager.extend(params)
        else:
            kept.append((junctions, params))
    captured: dict[Node, list[Any]] = {}
    handles = []
    for junctions, _ in kept:
        for j in junctions:
            if j in inner:

                def keep(grad_outputs: tuple[Any, ...], j: Node = j) -> None:
                    captured[j] = list(grad_outputs)

                handles.append(j.register_prehook(keep))
    try:
        torch.autograd.backward(
            list(tensors),
            grads,
            retain_graph=True,
            inputs=[_ANCHOR, *(_variable(n) for n in eager)],
        )
    finally:
        for h in handles:
            h.remove()
    known = {r: (t, g) for t, g, r in outside}
    for junctions, params in kept:
        tensors_of = [_variable(p) for p in params]
        edges: list[GradientEdge] = []
        values: list[Tensor] = []
        for j in junctions:
            if j in known:
                t, g = known[j]
                edges.append(get_gradient_edge(t))
                values.append(g)
            else:
                for i, g in enumerate(captured.get(j, ())):
                    if g is not None:
                        edges.append(GradientEdge(j, i))
                        values.append(g)
        if edges and tensors_of:
            weight.groups.append((edges, values, tensors_of))
    return weight


def _variable(node: Node) -> Tensor:
    return node.variable  # type: ignore[attr-defined,no-any-return]


def _params(order: Sequence[Node], to_param: dict[Node, bool]) -> list[Tensor]:
    return [_variable(n) for n in order if hasattr(n, "variable") and to_param[n]]


def _group(branches: dict[Node, list[Node]]) -> list[tuple[list[Node], list[Node]]]:
    """Junctions grouped so that no parameter is under two groups (union-find)."""
    parent: dict[Node, Node] = {}

    def find(x: Node) -> Node:
        while parent.setdefault(x, x) is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[Node, Node] = {}
    for j, leaves in branches.items():
        find(j)
        for leaf in leaves:
            if leaf in owner:
                parent[find(j)] = find(owner[leaf])
            else:
                owner[leaf] = j
    groups: dict[Node, tuple[list[Node], list[Node]]] = {}
    for j in branches:
        groups.setdefault(find(j), ([], []))[0].append(j)
    for leaf, j in owner.items():
        groups[find(j)][1].append(leaf)
    return list(groups.values())
