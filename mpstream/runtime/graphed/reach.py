"""Which outputs of a captured call reach each of its gradient targets.

A replayed backward computes every gradient it captured, zeros where an
output got no gradient. Eager autograd gives no gradient at all to an input
or parameter reached only from such outputs (an optimizer then leaves the
parameter alone, weight decay and momentum included), so a call notes at
capture which outputs reach each target, and hands back None where none of
them got a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

__all__ = ["reached_from"]


def reached_from(
    outs: Sequence[Tensor], diff_out: Sequence[int], targets: Sequence[Tensor]
) -> list[frozenset[int]]:
    """Per target, the positions in ``outs`` (among ``diff_out``) whose
    autograd graph reaches it.

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
