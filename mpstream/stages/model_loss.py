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
sums over the batch (``reduction='sum'``) is not weighted: the
micro-batches' sums add up to it. A loss the graph computes otherwise (a
mean squared error, a binary cross entropy, anything else) is weighted by
examples, which is exact when every example holds as many elements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, fx
from torch.utils import _pytree as pytree

from ..runtime.gathering import gather
from ..runtime.microbatch import NoChunk, leaves, rebuild_leaves

__all__ = ["LossShare", "weigh_loss", "loss_leaf", "gather_with_loss"]

SHARE = "mpstream_loss_share"  # the pipeline input holding each example's share


class LossShare:
    """How one exported graph's loss is weighted per micro-batch.

    Args:
        count: a graph computing the cross entropy's target from the inputs
            at ``inputs`` (their positions among the pipeline's inputs), or
            None to weight by examples.
        ignore_index: the target value the cross entropy ignores.
        how: what :meth:`shares` counts, for the split report.
    """

    def __init__(
        self, count: fx.GraphModule | None, inputs: Sequence[int], ignore_index: int, how: str
    ) -> None:
        self.count = count
        self.inputs = list(inputs)
        self.ignore_index = ignore_index
        self.how = how

    def shares(self, inputs: Sequence[Any], batch: int) -> Tensor:
        """Each example's share of the batch's loss (summing to 1), as a
        float64 tensor of ``batch`` entries on the inputs' device."""
        device = next((x.device for x in inputs if isinstance(x, Tensor)), torch.device("cpu"))
        if self.count is not None:
            args = [inputs[i].tensor if isinstance(inputs[i], NoChunk) else inputs[i]
                    for i in self.inputs]  # fmt: skip
            with torch.no_grad():
                target = self.count(*args)
            if isinstance(target, Tensor) and target.numel() % batch == 0:
                kept = (target != self.ignore_index).reshape(batch, -1).sum(1)
                return (kept.to(torch.float64) / kept.sum()).to(device)
        return torch.full((batch,), 1.0 / batch, dtype=torch.float64, device=device)


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


def _count_graph(gm: fx.GraphModule, target: fx.Node) -> tuple[fx.GraphModule, list[int]] | None:
    """The operations making ``target`` from the inputs, as a graph of its
    own, and which inputs it takes; None if it reads a parameter."""
    needed: set[fx.Node] = set()
    stack = [target]
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
    graph.output(env[target])
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


def weigh_loss(gm: fx.GraphModule, out_spec: pytree.TreeSpec) -> LossShare | None:
    """Multiplies the graph's ``loss`` output by the micro-batch's share.

    Adds the input :data:`SHARE` (after the module's own) and returns how
    to compute it, or None (and changes nothing) when the output holds no
    scalar ``loss``.
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
    count: fx.GraphModule | None = None
    positions: list[int] = []
    ignore, how = -100, "by examples (not a mean over label tokens the pipe can count)"
    aten = torch.ops.aten
    args = _arguments(loss) if hasattr(loss.target, "_schema") else {}
    summed = loss.target in _REDUCING and args.get("reduction") == 2
    if summed:
        how = "not at all: the loss is a sum, and the micro-batches' sums add up to it"
    elif loss.target in (aten.cross_entropy_loss.default, aten.nll_loss_nd.default):
        target = args.get("target")
        plain = args.get("weight") is None and args.get("reduction") == 1  # a mean, unweighted
        if plain and isinstance(target, fx.Node):
            found = _count_graph(gm, target)
            if found is not None:
                count, positions = found
                ignore = int(args.get("ignore_index", -100))
                how = f"by label tokens other than {ignore} (as the model's loss counts)"
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(holders[-1]):
        share = gm.graph.placeholder(SHARE)  # every graph takes it, a summed loss unused
    if summed:
        return LossShare(None, [], ignore, how)
    with gm.graph.inserting_before(output):
        total = gm.graph.call_function(aten.sum.default, (share,))
        total = gm.graph.call_function(aten.to.dtype, (total, val.dtype))
        weighted = gm.graph.call_function(aten.mul.Tensor, (loss, total))
        # A micro-batch with nothing to count has a NaN loss (0 / 0) and
        # weighs nothing: it adds 0, as it adds nothing to the batch's loss.
        kept = gm.graph.call_function(aten.ne.Scalar, (total, 0))
        zero = gm.graph.call_function(aten.zeros_like.default, (weighted,))
        chosen = gm.graph.call_function(aten.where.self, (kept, weighted, zero))
    items[index] = chosen
    output.args = (type(flat)(items) if isinstance(flat, (tuple, list)) else items[0],)
    return LossShare(count, positions, ignore, how)


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
