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
input path runs twice. (A junction's hooks run in B, and W mutes them;
see :mod:`~mpstream.runtime.split_hooks`.)

One W call per group of junctions whose parameters overlap. B computes
four kinds of parameter gradients itself: those of a parameter reached from
several junctions, one below the other on the input path (a weight used
twice in a row), which W would count twice; groups of vectors only (a
norm's scale and shift), whose gradients are reductions over the batch that
the junction computes with the input gradient in the same pass: deferring
them would cost a second reduction and an autograd call each, to save
nothing; and those under a custom ``autograd.Function`` (a ``torch.compile``d
stage is one), whose backward computes every gradient each time it runs:
running it again in W would repeat all of it; and those under a junction
holding a posthook (``grad_fn.register_hook``, the deprecated
``Module.register_backward_hook``), which sees every gradient its node
computes, in the one call a plain backward makes. W keeps the weight matrices
and kernels, the matmuls and convolutions that make a backward's second
half. B keeps the stage's graph (and its saved tensors) alive for W; each W
call frees the part it ran.

The same analysis cuts the backward inside a stage replayed from graphs
when its graphs are captured (:class:`Split` with the captured inputs as
the sinks); a training step then replays B and W itself.

Checkpointed micro-batches are not split: non-reentrant checkpointing
recomputes the stage's forward once per autograd call, so separate W calls
would recompute it again each. Their B does the whole backward and their W
has nothing left to do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils.checkpoint import CheckpointFunction

from .boundary import _ANCHOR, Boundary
from .split_hooks import Group, has_post_hooks, pinned, zeros_like

__all__ = ["Split", "WeightPass", "backward_inputs"]


class WeightPass:
    """The parameter-gradient work B left for W (see :func:`backward_inputs`).

    Attributes:
        groups: per autograd call, the edges to start from, their gradients
            and the parameters to accumulate into.
    """

    __slots__ = ("groups", "kept")

    def __init__(
        self, groups: Sequence[Group] = (), kept: dict[Node, list[Any]] | None = None
    ) -> None:
        self.groups: list[Group] = list(groups)
        #: The gradients B kept at each junction (see :func:`~.split_hooks.pinned`).
        self.kept: dict[Node, list[Any]] = kept or {}

    def run(self) -> None:
        """Accumulates the parameter gradients into ``.grad``, as a plain
        backward would (AccumulateGrad nodes, hooks included), and lets the
        graph go."""
        groups, self.groups = self.groups, []
        kept, self.kept = self.kept, {}
        with pinned(kept):
            for edges, grads, params in groups:
                torch.autograd.backward(edges, grads, inputs=params)  # type: ignore[arg-type]


def _is_boundary(node: Node) -> bool:
    return getattr(node, "_forward_cls", None) is Boundary


def _walk(
    roots: Sequence[Node], is_input: Callable[[Node], bool]
) -> tuple[list[Node], dict[Node, list[Node]]]:
    """The nodes below ``roots`` in post-order (children first), and each
    node's children; the search stops at the inputs."""
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
        below = [] if is_input(node) else [c for c, _ in node.next_functions if c is not None]
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


class Split:
    """Where B stops and what it leaves for W, for one backward (the
    analysis of the module docstring).

    Args:
        tensors: the outputs that get a gradient (or a loss).
        grads: their gradients (None: ones, for a loss).
        is_input: which nodes are the inputs, where B's gradients go (the
            boundary nodes of a cut stage, by default).

    Attributes:
        whole: an output is a leaf, or the stage holds a reentrant
            checkpoint: nothing to split, B does everything.
        reaches: a gradient flows to the inputs (else B has nothing to do
            and W does everything).
        eager: the parameters whose gradients B computes itself.
    """

    def __init__(
        self,
        tensors: Sequence[Tensor],
        grads: Sequence[Tensor] | None,
        is_input: Callable[[Node], bool] = _is_boundary,
    ) -> None:
        self.tensors = list(tensors)
        self.given = list(grads) if grads is not None else [torch.ones_like(t) for t in tensors]
        self.whole = any(t.grad_fn is None for t in tensors)
        self.reaches = False
        self.eager: list[Tensor] = []
        self._all: list[Tensor] = []  # every parameter, where W does everything
        self._kept: list[tuple[list[Node], list[Node]]] = []
        self._known: dict[Node, list[tuple[Tensor, Tensor]]] = {}
        self._captured: dict[Node, list[Any]] = {}
        self._hooked: list[Node] = []
        if not tensors or self.whole:
            return
        roots = [t.grad_fn for t in tensors]
        order, children = _walk(roots, is_input)  # type: ignore[arg-type]
        # A reentrant checkpoint's backward refuses an autograd call given
        # ``inputs`` (as B and W both are): such a stage is not split.
        self.whole = any(getattr(n, "_forward_cls", None) is CheckpointFunction for n in order)
        if self.whole:
            return
        to_input: dict[Node, bool] = {}
        to_param: dict[Node, bool] = {}
        for node in order:
            if is_input(node):
                to_input[node], to_param[node] = True, False
            elif hasattr(node, "variable"):
                to_input[node], to_param[node] = False, True
            else:
                below = children[node]
                to_input[node] = any(to_input[c] for c in below)
                to_param[node] = any(to_param[c] for c in below)
        self.reaches = any(to_input[r] for r in roots)  # type: ignore[index]
        if not self.reaches:
            self._all = [_variable(n) for n in order if hasattr(n, "variable") and to_param[n]]
            return
        inner = {n for n in order if to_input[n] and not is_input(n)}
        compiled = any(type(n).__name__.startswith("CompiledFunction") for n in inner)
        # Junction -> parameter nodes under its branches; roots off the input
        # path count as junctions whose gradient is already known.
        branches: dict[Node, list[Node]] = {}
        for node in inner:
            heads = [c for c in children[node] if to_param[c] and not to_input[c]]
            if heads:
                branches[node] = [leaf for h in heads for leaf in _leaves(h, children)]
        for t, g, r in zip(tensors, self.given, roots):
            if r is not None and not to_input[r] and to_param[r]:
                self._known.setdefault(r, []).append((t, g))
                branches[r] = _leaves(r, children)
        for junctions, params in _group(branches):
            on_path = [j for j in junctions if j in inner]
            tangled = len(on_path) > 1 and any(
                _reaches(j, set(on_path) - {j}, inner, children) for j in on_path
            )
            vectors = all(_variable(p).dim() <= 1 for p in params)
            # A compiled (AOTAutograd) backward anywhere on the input path
            # may refuse the kept graph W needs (donated buffers), not only
            # one W would start from.
            opaque = any(hasattr(j, "_forward_cls") for j in on_path) or compiled
            watched = any(has_post_hooks(j) for j in on_path)
            if tangled or vectors or opaque or watched:
                self.eager.extend(_variable(p) for p in params)
            else:
                self._kept.append((junctions, params))
        self._hooked = [j for junctions, _ in self._kept for j in junctions if j in inner]

    @property
    def defers(self) -> bool:
        """Whether W has anything to do."""
        if self.whole:
            return False
        return bool(self._kept) if self.reaches else bool(self._all)

    @contextmanager
    def keeping(self) -> Iterator[None]:
        """Around B's autograd call: keeps the gradients flowing into the
        junctions."""
        handles = []
        for j in self._hooked:

            def keep(grad_outputs: tuple[Any, ...], j: Node = j) -> None:
                self._captured[j] = list(grad_outputs)

            handles.append(j.register_prehook(keep))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def groups(self) -> list[Group]:
        """W's autograd calls, once B has run."""
        if not self.reaches:
            if not self._all:
                return []
            roots = [get_gradient_edge(t) for t in self.tensors]
            return [(roots, list(self.given), list(self._all))]
        out: list[Group] = []
        for junctions, params in self._kept:
            edges: list[GradientEdge] = []
            values: list[Tensor] = []
            for j in junctions:
                for t, g in self._known.get(j, ()):
                    edges.append(get_gradient_edge(t))
                    values.append(g)
                if j not in self._known:
                    # Zeros (one element: no memory or memset per
                    # junction) for a retained .grad to add; pinned()
                    # hands the junction what B kept.
                    for i, g in enumerate(self._captured.get(j, ())):
                        if g is not None:
                            edges.append(GradientEdge(j, i))
                            values.append(zeros_like(g))
            if edges and params:
                out.append((edges, values, [_variable(p) for p in params]))
        return out

    def pinned(self) -> AbstractContextManager[None]:
        """Around W's autograd calls, those of :meth:`groups` (see
        :func:`~.split_hooks.pinned`)."""
        return pinned(self._captured)

    def weight_pass(self) -> WeightPass:
        """W, to :meth:`~WeightPass.run` later (on the same stream)."""
        weight = WeightPass(self.groups(), self._captured)
        self._captured = {}
        return weight


def backward_inputs(tensors: Sequence[Tensor], grads: Sequence[Tensor] | None) -> WeightPass:
    """B: back-propagates ``tensors`` to the stage's cut inputs only.

    The boundary sinks receive the input gradients, as with a plain
    backward. Parameter gradients are left for the returned pass. A tensor
    hook where W starts runs once, here (see :func:`~.split_hooks.pinned`).

    Args:
        tensors: the stage's outputs that get a gradient (or its loss).
        grads: their gradients (None for a loss).

    Returns:
        W, to :meth:`~WeightPass.run` later (on the same stream).
    """
    split = Split(tensors, grads)
    if split.whole:
        torch.autograd.backward(list(tensors), grads)
        return WeightPass()
    if split.reaches:
        # The graph is kept for W only where W will use it: a compiled
        # stage's backward (AOTAutograd, with donated buffers) refuses
        # retain_graph, and B computes all of its gradients anyway.
        with split.keeping():
            torch.autograd.backward(
                list(tensors), grads, retain_graph=split.defers, inputs=[_ANCHOR, *split.eager]
            )
    return split.weight_pass()


def _variable(node: Node) -> Tensor:
    return node.variable  # type: ignore[attr-defined,no-any-return]


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
