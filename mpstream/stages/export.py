"""Splitting a module with ``torch.export``: one exported program cut into stages.

``torch.fx``'s symbolic tracer stops at the first Python branch on a traced
value (the shape checks, optional arguments and mask building of Hugging
Face transformers, for instance). ``torch.export`` (non-strict) runs the
module's Python code on fake tensors instead, so such branches take the path
the example inputs take, and records the ATen operations that run, each with
the stack of submodules it ran inside. :func:`export_stages` exports a
module for one kind of call, begins a stage at the first operation inside
each split point and cuts the graph with ``torch.fx.passes.split_module``,
as :mod:`~mpstream.stages.fx` does for ``torch.fx``: the stages are
``GraphModule`` partitions reading the module's own parameters and buffers
by their qualified names, wired by a :class:`~mpstream.runtime.graph.StageGraph`.

An exported program holds what the example inputs fixed: which optional
inputs were given, plain values, every shape but the batch dimension, the
training mode (dropout) and the dtypes. :mod:`~mpstream.stages.exported` keeps one
split per kind of call. The export runs on fake tensors standing in for the
module's parameters and buffers (no memory, no copy; the parameters may
already sit on several devices), on the first stage's device; each stage's
graph then creates its tensors on its own device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils import _pytree as pytree

from ..runtime.graph import Ref, StageGraph
from .fake_export import ExportGraphError, exported_graph, input_pattern
from .inplace import copy_changed_inputs
from .inplace_check import check_in_place
from .model_loss import LossShare, weigh_loss
from .points import SplitPointError, begin_stages, units_in_order
from .shared_inputs import NO_CHANGES, ChangedInputs
from .surgery import inline_attrs, read_stage_call

__all__ = [
    "ExportGraphError",
    "ExportedStages",
    "export_stages",
    "retarget_devices",
    "attribute",
    "call_order",
    "split_candidates",
]


@dataclass
class ExportedStages:
    """One exported program cut into stages.

    Attributes:
        partitions: one ``GraphModule`` per stage.
        graph: where each stage's arguments come from; its result is
            structured as the module returns (a ``ModelOutput``, a dict...).
        tensors: per stage, the qualified names of the tensors it reads.
        in_spec: the structure of the call's ``((), kwargs)`` it was
            exported for.
        patterns: per input leaf, what the export fixed: for a tensor its
            dtype and shape with ``None`` for a free (dynamic) dimension;
            for a plain value the value.
        loss: how the ``loss`` output is weighted per micro-batch (the
            pipeline's last input is then each example's share), or None.
        device: the device the graph was exported on.
        changed: the input leaves the forward changes in place.
    """

    partitions: list[fx.GraphModule]
    graph: StageGraph
    tensors: list[set[str]]
    in_spec: pytree.TreeSpec
    patterns: list[Any]
    loss: LossShare | None
    device: torch.device
    changed: ChangedInputs = NO_CHANGES


def split_candidates(module: nn.Module) -> list[str]:
    """Submodules a split point may name for ``torch.export``: the module's
    children and the items of every ``nn.ModuleList`` / ``nn.Sequential``
    inside it, at any depth (a transformer's blocks: ``"model.layers.4"``)."""
    names = [name for name, _ in module.named_children()]
    for name, child in module.named_modules():
        if name and isinstance(child, (nn.ModuleList, nn.Sequential)):
            names += [f"{name}.{item}" for item, _ in child.named_children()]
    return list(dict.fromkeys(names))


def _owners(node: fx.Node) -> list[str]:
    """The submodules an exported operation ran inside."""
    stack = node.meta.get("nn_module_stack") or {}
    return [str(v[0]) for v in stack.values()]


def _stage_of(gm: fx.GraphModule, points: Sequence[str], module: nn.Module) -> dict[fx.Node, int]:
    """The stage of every operation: how many split points began before it.

    A stage begins at the first operation inside its split point; parameter
    reads (``get_attr``) do not count: each stage reads its own.
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    begins, stage_of = begin_stages(nodes, points, _owners, module, split_candidates, "exported")
    for s, ((a, i), (b, j)) in enumerate(zip(zip(points, begins), zip(points[1:], begins[1:]))):
        if j == i:
            raise SplitPointError(
                f"split points '{a}' and '{b}' begin at the same operation: stage {s + 1} "
                f"would be empty; drop one"
            )
    if begins and begins[0] == 0:
        raise SplitPointError(f"stage 0 would be empty (before split point '{points[0]}'); drop it")
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            stage_of[n] = 0  # split_module lifts parameter reads out of the stages
    return stage_of


# aten's BatchNorm operators, which do not check their input as
# torch.nn.functional.batch_norm does in Python before calling them.
_NORMS = frozenset({
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm",
    "_native_batch_norm_legit_functional", "_batch_norm_impl_index",
})  # fmt: skip


def check_norm_input(x: torch.Tensor) -> None:
    """What ``F.batch_norm`` checks of a training input: more than one value
    per channel (one would give NaN statistics silently).

    Raises:
        ValueError: one value per channel, in torch's words.
    """
    if isinstance(x, fx.Proxy):
        # A stage's code traced again (a pickled pipe loaded): stay a call.
        x.tracer.create_proxy("call_function", check_norm_input, (x,), {})
        return
    values = x.shape[0]
    for side in x.shape[2:]:
        values *= side
    if values == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {x.shape}"
        )


def guard_norms(gm: fx.GraphModule) -> None:
    """Puts :func:`check_norm_input` before every training BatchNorm operator
    of an exported graph, inside the same submodule (so in the same stage)."""
    for node in list(gm.graph.nodes):
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        if op._schema.name.split("::")[-1] not in _NORMS:
            continue
        names = [a.name for a in op._schema.arguments]
        training = node.kwargs.get("training", node.args[names.index("training")])
        if training is not True:
            continue
        with gm.graph.inserting_before(node):
            check = gm.graph.call_function(check_norm_input, (node.args[0],))
        check.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})


def attribute(root: nn.Module, target: str) -> Any:
    """``root``'s attribute at the qualified name ``target``, or None."""
    owner, _, attr = target.rpartition(".")
    try:
        holder = root.get_submodule(owner) if owner else root
    except AttributeError:
        return None
    return getattr(holder, attr, None)


def _own_attrs(top: fx.GraphModule, root: nn.Module, gm: fx.GraphModule) -> None:
    """Lets each stage read the module's tensors itself, as the fx path does
    (:func:`~mpstream.stages.fx.inline_attrs`). What ``root`` does not hold
    (a constant the forward creates) the stage holds itself.

    Raises:
        TypeError: the export made a tensor constant it could not keep.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    def resolve(target: str) -> tuple[Any, bool]:
        value = attribute(root, target)
        if value is not None:
            return value, True
        value = attribute(gm, target)
        if isinstance(value, FakeTensor):
            raise ExportGraphError(
                f"the exported graph holds a tensor constant '{target}' that the module "
                f"creates in its forward; move it into a buffer (register_buffer) so the "
                f"stages can read it"
            )
        return value, False

    inline_attrs(top, resolve)


def _stage_graph(top: fx.GraphModule, count: int, out_spec: pytree.TreeSpec) -> StageGraph:
    """What each stage reads, and the module's result as refs in its own structure."""
    refs: dict[fx.Node, Ref] = {}
    inputs = 0
    args: list[tuple[Ref, ...]] = [()] * count
    outputs = [1] * count
    result: Any = None
    for node in top.graph.nodes:
        if node.op == "placeholder":
            refs[node] = Ref(-1, inputs)
            inputs += 1
        elif node.op == "output":
            flat = node.args[0]
            items = list(flat) if isinstance(flat, (tuple, list)) else [flat]
            leaves = [refs[x] if isinstance(x, fx.Node) else x for x in items]
            result = pytree.tree_unflatten(leaves, out_spec)
        else:
            read_stage_call(top, node, refs, args, outputs)
    for ref in pytree.tree_leaves(result, is_leaf=lambda x: isinstance(x, Ref)):
        if isinstance(ref, Ref) and ref.stage < 0:
            raise ExportGraphError(
                "the module returns one of its inputs unchanged; a pipeline returns what its "
                "stages compute: return a copy made in the forward (x.clone()), or take the "
                "input from the call's own arguments"
            )
    return StageGraph(tuple(args), tuple(outputs), result)


def _tensors_used(part: fx.GraphModule) -> set[str]:
    return set(getattr(part, "_mpstream_attrs", {}).values())


def call_order(gm: fx.GraphModule, module: nn.Module) -> list[str]:
    """The split candidates (see :func:`split_candidates`) the exported
    graph runs, in call order, finest first, except one that
    begins the graph or begins where the one before it does."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    return units_in_order(nodes, split_candidates(module), _owners)


def export_stages(
    module: nn.Module,
    split_points: Sequence[str],
    named: dict[str, Any],
    device: torch.device,
    weigh: bool = True,
    exported: tuple[fx.GraphModule, pytree.TreeSpec, pytree.TreeSpec] | None = None,
) -> ExportedStages:
    """Exports ``module(**named)`` and cuts it at ``split_points``.

    Args:
        module: the module (its own parameters and buffers stay untouched:
            fakes stand in for them while it is exported).
        split_points: qualified submodule names; a stage begins at each.
        named: the call's arguments by name (tensors, ``NoChunk`` tensors,
            plain values, in nested tuples/lists/dicts); only their dtypes,
            shapes and plain values matter.
        device: where the graph is exported (the first stage's device).
        weigh: weight a scalar ``loss`` output by each micro-batch's share
            of the batch (:mod:`~mpstream.stages.model_loss`); False when the call
            normalises it already (``num_items_in_batch``).
        exported: what :func:`exported_graph` returned for this call, to
            cut instead of exporting again (the graph is changed).

    Returns:
        The stages, their graph and what the export fixed.

    Raises:
        SplitPointError: an unknown split point, split points out of call
            order, a stage left empty.
        ExportGraphError: the graph holds a tensor constant the forward
            creates, or returns an input unchanged.
        Exception: whatever ``torch.export`` raised (the caller words it).
    """
    gm, in_spec, out_spec = exported or exported_graph(module, named, device)
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    patterns = [input_pattern(n) for n in holders]
    loss = weigh_loss(gm, out_spec) if weigh else None
    guard_norms(gm)
    gm.graph.lint()
    gm.recompile()
    stage_of = _stage_of(gm, list(split_points), module)
    _write_back_where_made(gm, stage_of)
    copied = copy_changed_inputs(gm, stage_of)
    check_in_place(gm, stage_of)
    top = split_module(gm, module, lambda n: stage_of[n], keep_original_order=True)
    _own_attrs(top, module, gm)
    count = len(split_points) + 1
    graph = _stage_graph(top, count, out_spec)
    partitions = [cast(fx.GraphModule, top.get_submodule(f"submod_{s}")) for s in range(count)]
    return ExportedStages(
        partitions,
        graph,
        [_tensors_used(p) for p in partitions],
        in_spec,
        patterns,
        loss,
        device,
        ChangedInputs.of(_leaf_names(named), {holders.index(h): p for h, p in copied.items()}),
    )


def _write_back_where_made(gm: fx.GraphModule, stage_of: dict[fx.Node, int]) -> None:
    """Moves each write-back of a buffer to the stage that computes the value.

    A forward that updates a buffer by assignment (``self.calls += 1`` on the
    module itself) gets a ``copy_`` into it from the export, where the
    forward ends: often a later stage than the update. That stage would
    write the buffer from its own stream while the updating stage reads it
    for the next micro-batch (a race), and with copies between the stages
    it would write back the copy it received, taken before the next update
    (counts lost). The value needs nothing from later stages; written where
    it is made, the buffer has one writer. Not before the last stage that
    reads the buffer (its old value, ``out = self.b(h) + self.seen`` after
    the split point, before ``self.seen = kept``): there the write would
    race with that read (a run refused by
    :mod:`~mpstream.memory.shared_writes`), where in that stage the buffer
    keeps one user.
    """
    for node in gm.graph.nodes:
        if node.target is not torch.ops.aten.copy_.default or node.users:
            continue
        target, value = node.args[0], node.args[1]
        if not (isinstance(target, fx.Node) and target.op == "get_attr"):
            continue
        if isinstance(value, fx.Node) and stage_of.get(value, -1) >= 0:
            where = max(stage_of[value], _last_reader(gm, target, node, stage_of))
            stage_of[node] = min(stage_of[node], where)


def _last_reader(
    gm: fx.GraphModule, target: fx.Node, write: fx.Node, stage_of: dict[fx.Node, int]
) -> int:
    """The last stage with a node other than ``write`` that reads the buffer
    ``target`` gets, or a view of it (through each ``get_attr`` of it); -1
    for none."""
    last = -1
    todo = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == target.target]
    while todo:
        for user in todo.pop().users:
            if user is write:
                continue
            last = max(last, stage_of.get(user, -1))
            schema = getattr(user.target, "_schema", None)
            if schema is not None and any(r.alias_info is not None for r in schema.returns):
                todo.append(user)  # a view: its readers read the buffer
    return last


def _leaf_names(named: dict[str, Any]) -> list[str]:
    """Each input leaf's name, as the caller passed it (``batch['x']``)."""
    leaves = pytree.tree_flatten_with_path(((), named))[0]
    return [f"{path[1].key}{pytree.keystr(path[2:])}" for path, _ in leaves]  # type: ignore[attr-defined]


def retarget_devices(part: fx.GraphModule, source: torch.device, device: torch.device) -> None:
    """Makes a stage create its tensors on its own ``device``: the exported
    graph names the device it was exported on (``source``) wherever the
    module created a tensor or moved one to its input's device."""
    if source == device:
        return

    def swap(x: Any) -> Any:
        return device if isinstance(x, torch.device) and x == source else x

    for node in part.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)  # type: ignore[assignment]
    part.recompile()
