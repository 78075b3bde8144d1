"""Surgery on a graph split by ``split_module``, shared by both tracers.

``torch.fx.passes.split_module`` (and the ``torch.export`` path, which
splits the same way) leaves a top-level graph that calls one ``GraphModule``
per stage. :func:`inline_attrs` lets each stage hold the module's tensors it
reads instead of receiving them as arguments; :func:`read_stage_call` and
:func:`stage_graph` read the top-level graph into a
:class:`~mpstream.runtime.graph.StageGraph`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, cast

from torch import Tensor, fx, nn
from torch.fx import graph_module

from ..runtime.graph import Ref, StageGraph

__all__ = ["inline_attrs", "hold", "stage_graph", "read_stage_call", "part_of"]

# Where a GraphModule's meta lists the attributes its deepcopy keeps.
_PRESERVED = getattr(graph_module, "_USER_PRESERVED_ATTRIBUTES_KEY", "_user_preserved_attributes")


def part_of(top: fx.GraphModule, name: str) -> fx.GraphModule:
    """The stage module ``name`` (``submod_<s>``) of a split graph."""
    return cast(fx.GraphModule, top.get_submodule(name))


def _attr_name(part: fx.GraphModule, target: str, held: dict[str, str]) -> str:
    """The stage's attribute for the module's tensor ``target``: the one
    it already holds it as, else a free one. Flattening is not one-to-one
    (``a.b_c`` and ``a_b.c`` both give ``_attr_a_b_c``), and a second
    tensor registered under a taken name would replace the first."""
    if target in held:
        return held[target]
    base = name = "_attr_" + target.replace(".", "_")
    k = 1
    while hasattr(part, name):
        name, k = f"{base}_{k}", k + 1
    held[target] = name
    return name


def inline_attrs(top: fx.GraphModule, resolve: Callable[[str], tuple[Any, bool]]) -> None:
    """Lets each stage read the module's tensors itself.

    ``split_module`` lifts ``get_attr`` nodes to the top-level graph and
    passes the tensors to the stages as arguments; a parameter would then
    travel between stages like an activation. Each stage instead gets its
    own reference to the tensor (the same object), read in place, and the
    top-level call drops the argument. ``_mpstream_attrs`` maps the stage's
    attribute to the tensor's qualified name in the module.

    Args:
        top: the split graph.
        resolve: for a lifted attribute's qualified name, its value and
            whether the module holds it (else the stage keeps its own).
    """
    for call in [n for n in top.graph.nodes if n.op == "call_module"]:
        part = part_of(top, str(call.target))
        attrs: dict[str, str] = getattr(part, "_mpstream_attrs", {})
        holders = [n for n in part.graph.nodes if n.op == "placeholder"]
        held: dict[str, str] = {}  # this stage's attribute per qualified name
        keep_args = []
        for arg, placeholder in zip(call.args, holders):
            if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
                keep_args.append(arg)
                continue
            target = str(arg.target)
            name = _attr_name(part, target, held)
            value, owned = resolve(target)
            hold(part, placeholder, name, value)
            if owned:
                attrs[name] = target
        part._mpstream_attrs = attrs  # type: ignore[assignment]
        # GraphModule's deepcopy keeps only the attributes listed here (a
        # copied pipe rebinds through them after .to() or a replacement).
        part.meta.setdefault(_PRESERVED, {})["_mpstream_attrs"] = attrs
        part.graph.lint()
        part.recompile()
        call.args = tuple(keep_args)
    # Only the lifted tensors go: a stage whose values nothing reads is
    # still called, as the module calls it (eliminate_dead_code would drop it).
    for node in [n for n in top.graph.nodes if n.op == "get_attr" and not n.users]:
        top.graph.erase_node(node)
    top.graph.lint()
    top.recompile()


def hold(part: fx.GraphModule, placeholder: fx.Node, name: str, value: Any) -> None:
    """Makes a stage hold ``value`` itself, as attribute ``name``, and read it
    where ``placeholder`` (an input the top-level graph fed it) was: a
    parameter stays a parameter, another tensor becomes a buffer, anything
    else a submodule. Shared by the ``torch.fx`` and ``torch.export`` paths."""
    if isinstance(value, nn.Parameter):
        part.register_parameter(name, value)
    elif isinstance(value, Tensor):
        part.register_buffer(name, value)
    else:
        part.add_module(name, value)
    with part.graph.inserting_after(placeholder):
        fetched = part.graph.get_attr(name)
    placeholder.replace_all_uses_with(fetched)
    part.graph.erase_node(placeholder)


def stage_graph(top: fx.GraphModule, count: int) -> tuple[StageGraph, list[str]]:
    """Reads the split graph: what each stage reads, what the module returns."""
    refs: dict[fx.Node, Ref] = {}
    inputs: list[str] = []
    args: list[tuple[Ref, ...]] = [()] * count
    outputs = [0] * count
    result: Any = None
    for node in top.graph.nodes:
        if node.op == "placeholder":
            refs[node] = Ref(-1, len(inputs))
            inputs.append(str(node.target))
        elif node.op == "output":
            result = fx.node.map_arg(node.args[0], lambda n: refs[n])  # type: ignore[arg-type, return-value]
        else:
            read_stage_call(top, node, refs, args, outputs)
    return StageGraph(tuple(args), tuple(outputs), result), inputs


def read_stage_call(
    top: fx.GraphModule,
    node: fx.Node,
    refs: dict[fx.Node, Ref],
    args: list[tuple[Ref, ...]],
    outputs: list[int],
) -> None:
    """Reads one node of a split graph between its placeholders and output:
    a stage's call (what it reads, how many values it returns) or the pick
    of one of its outputs. Shared by the ``torch.fx`` and ``torch.export``
    paths.

    Raises:
        TypeError: any other node (work outside every stage).
    """
    if node.op == "call_module":
        s = int(str(node.target).rsplit("_", 1)[1])
        args[s] = tuple(refs[a] for a in node.args)  # type: ignore[index]
        part = part_of(top, str(node.target))
        returned = next(n for n in part.graph.nodes if n.op == "output").args[0]
        outputs[s] = len(returned) if isinstance(returned, (tuple, list)) else 1
        refs[node] = Ref(s, 0)
    elif node.op == "call_function" and node.target is operator.getitem:
        source, index = node.args
        refs[node] = Ref(refs[source].stage, int(index))  # type: ignore[index, arg-type]
    else:
        raise TypeError(f"unexpected node between stages: {node.op} {node.target}")
