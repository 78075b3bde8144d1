"""A model's own loss over micro-batches: weighted so they add up to the batch's.

A model that computes its loss (a Hugging Face model given ``labels``
returns ``output.loss``) averages it over what it counts in the batch: the
label tokens not equal to ``ignore_index`` for cross entropy (after the
causal shift of a language model), the elements for a mean squared error.
Micro-batches hold different numbers of those, so the mean of the
micro-batches' losses is not the batch's loss. In the graph of a module
split by ``torch.export`` (:mod:`~mpstream.stages.export`) the loss output of each
micro-batch is multiplied by the micro-batch's share of the batch, an input
the pipeline gives it: per example, its count over the batch's count. The
losses of the micro-batches then add up to the batch's loss, gradients
included, whatever the schedule, and the pipe's output ``loss`` is their
sum.

The counts come from the model's own label handling: the operations that
make the cross entropy's target from the inputs (a shift, a view) are copied
out of the exported graph and run on the whole batch before it is split.
The same holds for a negative log likelihood (``nll_loss``). A loss that
averages over the elements a boolean mask selects (``x[mask]``: ELECTRA's
discriminator over the attention mask) is counted by the mask. A loss that
sums over the batch (``reduction='sum'``) is not weighted: the
micro-batches' sums add up to it. A loss the graph computes otherwise (a
mean squared error, a binary cross entropy, anything else) is weighted by
examples, which is exact when every example holds as many elements.

A loss that adds several such losses (a question answering model's start
and end losses, BERT's masked LM and next sentence losses), subtracts or
scales them by plain numbers, has each term weighted by its own count:
their counts differ between micro-batches. Anything else (a constant
added, a product of two losses) is weighted whole, by examples.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, fx
from torch.utils import _pytree as pytree

from ..runtime.gathering import gather
from ..runtime.microbatch import NoChunk, leaves, rebuild_leaves

__all__ = ["Count", "LossShare", "weigh_loss", "loss_leaf", "gather_with_loss"]

SHARE = "mpstream_loss_share"  # the pipeline input holding each example's shares

# What the split report says of a term weighted by examples, or a sum.
BY_EXAMPLES = "by examples (not a mean over label tokens the pipe can count)"
SUMMED = "not at all: the loss is a sum, and the micro-batches' sums add up to it"


class Count:
    """How one term of a loss is counted over the batch's examples.

    Args:
        graph: a graph computing, from the inputs at ``inputs`` (their
            positions among the pipeline's inputs), what the term averages
            over: its target (``ignore_index`` given), the boolean mask
            selecting its elements (``masked``), or both in that order; None
            to weight by examples.
        inputs: the inputs ``graph`` takes.
        ignore_index: the target value the term ignores, or None.
        masked: whether ``graph``'s last output is a selecting mask.
        how: what it counts, for the split report.
    """

    def __init__(
        self,
        graph: fx.GraphModule | None,
        inputs: Sequence[int],
        ignore_index: int | None,
        masked: bool,
        how: str,
    ) -> None:
        self.graph = graph
        self.inputs = list(inputs)
        self.ignore_index = ignore_index
        self.masked = masked
        self.how = how

    def shares(self, inputs: Sequence[Any], batch: int, device: torch.device) -> Tensor:
        """Each example's share of the term (summing to 1), float64, on
        ``device``."""
        if self.graph is not None:
            args = [inputs[i].tensor if isinstance(inputs[i], NoChunk) else inputs[i]
                    for i in self.inputs]  # fmt: skip
            with torch.no_grad():
                found = self.graph(*args)
            kept = self._kept(list(found) if isinstance(found, (tuple, list)) else [found])
            if kept is not None and kept.numel() % batch == 0:
                counts = kept.reshape(batch, -1).sum(1)
                return (counts.to(torch.float64) / counts.sum()).to(device)
        return torch.full((batch,), 1.0 / batch, dtype=torch.float64, device=device)

    def _kept(self, found: list[Any]) -> Tensor | None:
        if not all(isinstance(t, Tensor) for t in found):
            return None
        kept: Tensor | None = found[-1] if self.masked else None
        if self.ignore_index is not None:
            target = found[0] != self.ignore_index
            if kept is not None and kept.shape != target.shape:
                return None
            kept = target if kept is None else target & kept
        return kept


class LossShare:
    """How one exported graph's loss is weighted per micro-batch.

    The loss is a sum of terms (one, or several the model adds: a question
    answering model's start and end losses), each weighted by its own
    share of the batch.

    Args:
        terms: how each term is counted, in the order of the share input's
            columns.
        how: what :meth:`shares` counts, for the split report.
    """

    def __init__(self, terms: Sequence[Count], how: str) -> None:
        self.terms = list(terms)
        self.how = how

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "terms" not in state:  # pickled by an mpstream weighting one term
            count = state.pop("count")
            term = Count(count, state.pop("inputs"), state.pop("ignore_index"), False, "")
            state["terms"] = [term] if count is not None else []
        self.__dict__.update(state)

    def shares(self, inputs: Sequence[Any], batch: int) -> Tensor:
        """Each example's share of each term of the batch's loss (each
        column summing to 1), as a float64 tensor of ``batch`` rows (one
        column per term, one at least) on the inputs' device."""
        device = next((x.device for x in inputs if isinstance(x, Tensor)), torch.device("cpu"))
        columns = [term.shares(inputs, batch, device) for term in self.terms]
        if not columns:  # a summed loss: the column is read by no graph
            columns = [torch.full((batch,), 1.0 / batch, dtype=torch.float64, device=device)]
        return torch.stack(columns, 1)


def loss_leaf(out_spec: pytree.TreeSpec) -> int | None:
    """Which leaf of an output structured by ``out_spec`` is ``loss`` (a
    ``ModelOutput`` or dict key), or None."""
    n = out_spec.num_leaves
    index = pytree.tree_unflatten(list(range(n)), out_spec)
    if isinstance(index, Mapping) and isinstance(index.get("loss"), int):
        return cast(int, index["loss"])
    return None


def _arguments(node: fx.Node) -> dict[str, Any]:
    schema = node.target._schema  # type: ignore[union-attr]
    values = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    values.update(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    return values


def _count_graph(
    gm: fx.GraphModule, targets: Sequence[fx.Node]
) -> tuple[fx.GraphModule, list[int]] | None:
    """The operations making ``targets`` from the inputs, as a graph of its
    own returning them, and which inputs it takes; None if it reads a
    parameter."""
    needed: set[fx.Node] = set()
    stack = list(targets)
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        if node.op == "get_attr":
            return None
        needed.add(node)
        stack.extend(node.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    positions = []
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in gm.graph.nodes:
        if node in needed:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.op == "placeholder":
                positions.append(holders.index(node))
    graph.output(tuple(env[t] for t in targets))
    return fx.GraphModule(torch.nn.Module(), graph, "LabelCount"), positions


def _reducing() -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset(
        (
            aten.cross_entropy_loss.default,
            aten.nll_loss_nd.default,
            aten.mse_loss.default,
            aten.l1_loss.default,
            aten.smooth_l1_loss.default,
            aten.huber_loss.default,
            aten.binary_cross_entropy.default,
            aten.binary_cross_entropy_with_logits.default,
        )
    )


# Losses with a ``reduction`` argument (2: a sum over the batch).
_REDUCING = _reducing()


def _terms(node: fx.Node, path: set[fx.Node]) -> list[fx.Node] | None:
    """The losses ``node`` is a linear combination of (sums, differences,
    multiples by plain numbers, casts), adding the nodes combining them to
    ``path``; None if it is anything else. An added constant is not linear:
    each micro-batch would add it."""
    aten = torch.ops.aten
    if node.target in _REDUCING:
        return [node]
    args = node.args
    parts: Sequence[Any]
    if node.target in (aten.add.Tensor, aten.sub.Tensor):
        parts = args[:2]
    elif node.target in (aten.mul.Tensor, aten.mul.Scalar):
        parts = [a for a in args[:2] if isinstance(a, fx.Node)]
        if len(parts) != 1 or not isinstance(next(a for a in args[:2] if a is not parts[0]),
                                             (int, float)):  # fmt: skip
            return None
    elif node.target in (aten.div.Tensor, aten.div.Scalar):
        parts = args[:1] if isinstance(args[1], (int, float)) and not node.kwargs else []
    elif node.target in (aten.neg.default, aten.to.dtype, aten.clone.default):
        parts = args[:1]
    else:
        return None
    nodes = [p for p in parts if isinstance(p, fx.Node)]
    if not nodes or len(nodes) != len(parts):
        return None
    path.add(node)
    terms: list[fx.Node] = []
    for part in nodes:
        found = _terms(part, path)
        if found is None:
            return None
        terms += [t for t in found if t not in terms]
    return terms


def _selected(node: Any) -> tuple[fx.Node, fx.Node] | None:
    """``(base, mask)`` when ``node`` is ``base[mask]`` with one boolean
    mask (the elements a loss keeps: Electra's tokens under the attention
    mask), else None."""
    aten = torch.ops.aten
    if (
        isinstance(node, fx.Node)
        and node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and node.args[0].target is aten.broadcast_tensors.default
    ):  # a mean squared error's input, broadcast to its target's shape first
        node = node.args[0].args[0][node.args[1]]  # type: ignore[index]
    if not isinstance(node, fx.Node) or node.target is not aten.index.Tensor:
        return None
    base, indices = node.args[0], node.args[1]
    if not (isinstance(indices, (list, tuple)) and len(indices) == 1):
        return None
    mask = indices[0]
    if not (isinstance(base, fx.Node) and isinstance(mask, fx.Node)):
        return None
    val = mask.meta.get("val")
    return (base, mask) if isinstance(val, Tensor) and val.dtype == torch.bool else None


def _count(gm: fx.GraphModule, term: fx.Node) -> Count | None:
    """How ``term`` (a loss) is counted, or None when it sums over the batch."""
    aten = torch.ops.aten
    args = _arguments(term)
    if args.get("reduction") == 2:
        return None
    examples = Count(None, [], None, False, BY_EXAMPLES)
    if args.get("reduction") != 1 or args.get("weight") is not None:
        return examples
    if term.target in (aten.cross_entropy_loss.default, aten.nll_loss_nd.default):
        target = args.get("target")
        ignore = int(args.get("ignore_index", -100))
        chosen = _selected(target)
        targets = [target] if chosen is None else [*chosen]
        how = f"by label tokens other than {ignore}"
    else:
        ignore, chosen = None, _selected(args.get("self"))
        if chosen is None:
            return examples
        targets = [chosen[1]]
        how = "by the elements its mask selects"
    nodes = [t for t in targets if isinstance(t, fx.Node)]
    found = _count_graph(gm, nodes) if len(nodes) == len(targets) else None
    if found is None:
        return examples
    return Count(
        found[0], found[1], ignore, chosen is not None, how + " (as the model's loss counts)"
    )


def weigh_loss(gm: fx.GraphModule, out_spec: pytree.TreeSpec) -> LossShare | None:
    """Multiplies each term of the graph's ``loss`` output by the
    micro-batch's share of it.

    Adds the input :data:`SHARE` (after the module's own; one column per
    term) and returns how to compute it, or None (and changes nothing) when
    the output holds no scalar ``loss``. A loss that is no linear
    combination of losses is weighted whole, by examples.
    """
    index = loss_leaf(out_spec)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat = output.args[0]
    items = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    if index is None or not isinstance(items[index], fx.Node):
        return None
    loss = items[index]
    val = loss.meta.get("val")
    if not isinstance(val, Tensor) or val.dim() != 0:
        return None
    path: set[fx.Node] = set()
    terms = _terms(loss, path)
    if terms is None or any(_scalar(t) is None for t in terms):
        terms, path = [loss], set()
        counts: list[Count | None] = [Count(None, [], None, False, BY_EXAMPLES)]
    else:
        counts = [_count(gm, t) for t in terms]
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(holders[-1]):
        share = gm.graph.placeholder(SHARE)  # every graph takes it, a summed loss unused
    weighted = [(t, c) for t, c in zip(terms, counts) if c is not None]
    for column, (term, _) in enumerate(weighted):
        with gm.graph.inserting_before(term.next):  # in order, before the term's users
            chosen = _weighted(gm.graph, term, share, column)
        term.replace_all_uses_with(chosen, delete_user_cb=lambda user: user in path)
        if term is loss:
            items[index] = chosen
    output.args = (type(flat)(items) if isinstance(flat, (tuple, list)) else items[0],)
    hows = [SUMMED if c is None else c.how for c in counts]
    how = hows[0] if len(hows) == 1 else f"term by term: {'; '.join(hows)}"
    return LossShare([c for _, c in weighted], how)


def _scalar(node: fx.Node) -> Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, Tensor) and val.dim() == 0 else None


def _weighted(graph: fx.Graph, term: fx.Node, share: fx.Node, column: int) -> fx.Node:
    """``term`` times the micro-batch's share of it (column ``column`` of
    ``share`` summed)."""
    aten = torch.ops.aten
    val = _scalar(term)
    assert val is not None
    total = graph.call_function(aten.select.int, (share, 1, column))
    total = graph.call_function(aten.sum.default, (total,))
    total = graph.call_function(aten.to.dtype, (total, val.dtype))
    weighted = graph.call_function(aten.mul.Tensor, (term, total))
    # A micro-batch with nothing to count has a NaN term (0 / 0) and
    # weighs nothing: it adds 0, as it adds nothing to the batch's loss.
    kept = graph.call_function(aten.ne.Scalar, (total, 0))
    zero = graph.call_function(aten.zeros_like.default, (weighted,))
    return graph.call_function(aten.where.self, (kept, weighted, zero))


def gather_with_loss(outputs: Sequence[Any]) -> Any:
    """:func:`~mpstream.runtime.gathering.gather`, with a scalar ``loss`` (already
    weighted by each micro-batch's share) summed over the micro-batches."""
    first = outputs[0]
    if not (isinstance(first, Mapping) and isinstance(first.get("loss"), Tensor)):
        return gather(outputs)
    if first["loss"].dim() != 0:
        return gather(outputs)
    index = loss_leaf(leaves(first)[1])
    if index is None:
        return gather(outputs)
    parts = []
    for out in outputs:
        items, spec = leaves(out)
        items[index] = items[index].reshape(1)
        parts.append(rebuild_leaves(items, spec))
    joined = gather(parts)
    items, spec = leaves(joined)
    items[index] = items[index].sum()
    return rebuild_leaves(items, spec)
