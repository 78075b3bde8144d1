"""Pipelining any module: trace it with ``torch.fx`` and split it at named calls.

``split_points`` name submodules (``"layer3"``, ``"blocks.6"``); a new stage
begins where the first of the traced operations inside that submodule runs.
``torch.fx.passes.split_module`` cuts the graph there: each stage becomes a
``GraphModule`` that takes the values it reads, wherever in the graph they
come from (so a skip connection reads an early stage's output directly), and
the top-level graph says which stage reads what, which becomes the
:class:`~mpstream.runtime.graph.StageGraph`. The stages keep referring to the
original module's submodules and tensors, so ``state_dict`` keys, optimizers
and checkpoints are those of the unsplit module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.fx.passes.split_module import split_module

from ..runtime.graph import StageGraph
from .fx_tracer import Tracer
from .inplace import changes_in_place, copy_changed_inputs
from .inplace_check import check_in_place
from .inplace_paths import updated_inputs
from .lookups import Lookup
from .module_hooks import HookError
from .points import begin_stages, split_candidates, units_in_order
from .shared_inputs import NO_CHANGES, ChangedInputs
from .stand_ins import Changed, stand_ins
from .surgery import inline_attrs, part_of, stage_graph
from .tracers import Binder
from .type_tests import answering_types
from .unrecorded import BufferChange, Unrecorded, current_modes

__all__ = ["Traced", "trace", "call_units", "traced_through", "lookup"]


@dataclass
class Traced:
    """A module split into stages.

    Attributes:
        partitions: one ``GraphModule`` per stage.
        graph: where each stage's arguments come from.
        bind: turns a call's ``(args, kwargs)`` into the positional inputs.
        tensors: per stage, the qualified names of the parameters and
            buffers it uses.
        changed: the inputs the forward changes in place.
    """

    partitions: list[fx.GraphModule]
    graph: StageGraph
    bind: Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, ...]]
    tensors: list[set[str]]
    changed: ChangedInputs = NO_CHANGES


def _trace(
    module: nn.Module,
    leaves: Sequence[str | type[nn.Module]],
    nones: frozenset[str] = frozenset(),
    values: Mapping[str, Any] | None = None,
    lookups: set[Lookup] | None = None,
) -> fx.GraphModule:
    # Argument names are identifiers; items inside one are not (``batch['m']``).
    arguments = {n: None for n in nones if n.isidentifier()}
    tracer = Tracer(leaves, nones.difference(arguments), values, lookups)
    try:
        # With grad enabled, so that a no_grad block in forward changes the
        # mode however the kind of call that traces it was called.
        with (
            torch.enable_grad(),
            stand_ins(module) as changed,
            answering_types(tracer, traced_through(module, leaves)),
        ):
            tracer.modes = current_modes()
            graph = tracer.trace(module, arguments or None)
            if moved := changed():
                raise BufferChange(_changed_tensors(moved))
    except HookError:
        raise  # it names the module and what to do
    except Exception as exc:
        inner = tracer.failed_in
        where = f" inside submodule '{inner}'" if inner else " in its own forward"
        if nones:
            where += " with " + ", ".join(f"{n}=None" for n in sorted(nones))
        advice = (
            "Let torch.export split the module (it records those: the default "
            "tracer='auto', without leaf_modules), or move that block into a submodule "
            "marked as a leaf (Pipe(..., leaf_modules=[...])), which runs whole as written."
            if isinstance(exc, Unrecorded)
            else f"Mark that submodule as a leaf (Pipe(..., leaf_modules=['{inner}'])), which runs "
            f"it whole inside one stage, or pass an nn.Sequential of stages."
            if inner
            else "Pass an nn.Sequential of stages, or move that code into a submodule and "
            "mark it as a leaf (Pipe(..., leaf_modules=[...]))."
        )
        raise TypeError(
            f"torch.fx could not trace {type(module).__name__}{where}: "
            f"{type(exc).__name__}: {exc}\n{advice}"
        ) from exc
    _none_inputs(graph, frozenset(arguments))
    for node in graph.nodes:
        # Under ``from __future__ import annotations`` fx records a forward's
        # annotations as strings; torch 2.11 cannot pickle a GraphModule
        # holding one (torch.save(pipe) fails), and they only decorate code.
        if isinstance(node.type, str):
            node.type = None
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


def _changed_tensors(moved: Sequence[Changed]) -> str:
    """Why a trace that changed the module's tensors ``moved`` is refused."""
    buffers = ", ".join(repr(c.name) for c in moved if c.buffer)
    plain = [c.name for c in moved if not c.buffer]
    what = [f"buffer(s) {buffers}"] if buffers else []
    if plain:
        what.append(f"the tensor attribute(s) {', '.join(repr(n) for n in plain)}")
    text = (
        f"forward changes {' and '.join(what)} in place or by assignment, which torch.fx "
        f"runs once while tracing instead of recording: the stages would never change them"
    )
    if plain:
        # torch.export records an assignment to a buffer, not to a plain attribute.
        attr = plain[0].rpartition(".")[2]
        text += (
            f". {plain[0]!r} is no buffer: register it as one in its module's __init__ "
            f"(self.register_buffer({attr!r}, ...)), which torch.export records however "
            f"forward changes it"
        )
    return text


def traced_through(
    module: nn.Module, leaf_modules: Sequence[str | type[nn.Module]] = ()
) -> list[nn.Module]:
    """The modules whose ``forward`` code a trace of ``module`` follows: the
    module and every submodule that is no leaf and not inside one. Only
    their training flags can change a trace (a leaf reads its own as it runs)."""
    tracer = Tracer(leaf_modules)
    found: dict[int, nn.Module] = {}

    def walk(m: nn.Module, name: str) -> None:
        found.setdefault(id(m), m)
        for child_name, child in m.named_children():
            qualname = f"{name}.{child_name}" if name else child_name
            # A ModuleList's or ModuleDict's items are called by the code
            # that holds the container (fx calls the container a leaf).
            container = isinstance(child, (nn.ModuleList, nn.ModuleDict))
            if id(child) not in found and (container or not tracer.is_leaf_module(child, qualname)):
                walk(child, qualname)

    walk(module, "")
    return list(found.values())


def _none_inputs(graph: fx.Graph, nones: frozenset[str]) -> None:
    """Turns the inputs a trace fixed to None back into plain, unused inputs
    named as the arguments: fx's checks that they are None go (the split of
    each kind of call is chosen by which arguments are None, see
    :mod:`~mpstream.stages.traced`), and every kind's split takes the same
    inputs, so two kinds whose code is the same share one split."""
    for node in list(graph.nodes):
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none":
            (fixed, _) = node.args
            graph.erase_node(node)
            assert isinstance(fixed, fx.Node) and fixed.op == "placeholder" and not fixed.users
            name = next(n for n in nones if fixed.target == f"{n}_1")  # fx's name for it
            default = fixed.args[0] if fixed.args else inspect.Signature.empty
            with graph.inserting_before(fixed):
                graph.placeholder(name, default_value=default)
            graph.erase_node(fixed)


def call_units(
    module: nn.Module,
    leaf_modules: Sequence[str | type[nn.Module]] = (),
    nones: frozenset[str] = frozenset(),
    values: Mapping[str, Any] | None = None,
) -> list[str]:
    """The split candidates the traced forward calls (with the arguments in
    ``nones`` None, the keys ``values`` leaves out of its dicts left out),
    in call order, finest first (a ModuleList's items rather than the
    list), except one that begins the forward (no stage could come before
    it)."""
    gm = _trace(module, leaf_modules, nones, values)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    return units_in_order(nodes, split_candidates(module), _owners)


def _owners(node: fx.Node) -> list[str]:
    """The submodules a node runs inside."""
    stack = node.meta.get("nn_module_stack", {})
    owners = list(stack)
    if node.op in ("call_module", "get_attr") and isinstance(node.target, str):
        owners.append(node.target)
    return owners


def _stage_of_nodes(
    gm: fx.GraphModule, points: Sequence[str], module: nn.Module
) -> dict[fx.Node, int]:
    """The stage of every compute node: how many split points began before it."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    begins, stage_of = begin_stages(nodes, points, _owners, module, split_candidates, "traced")
    bounds = [0, *begins, len(nodes)]
    for s in range(len(bounds) - 1):
        compute = [n for n in nodes[bounds[s] : bounds[s + 1]] if n.op != "get_attr"]
        if not compute:
            where = f"before split point '{points[s]}'" if s < len(points) else "at the end"
            raise ValueError(f"stage {s} would be empty ({where}); drop or move a split point")
    return stage_of


def _check_result(gm: fx.GraphModule) -> None:
    """Refuses a forward that returns one of the module's tensors as it is:
    every value a pipeline returns comes out of a stage.

    Raises:
        TypeError: naming the tensor and what to do.
    """
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    for node in output.all_input_nodes:
        if node.op == "get_attr":
            raise TypeError(
                f"{type(gm).__name__}'s forward returns its tensor '{node.target}' as it is; a "
                f"pipeline returns what its stages compute: return it from the module's own "
                f"state instead (module.{node.target}), or pass it through an operation"
            )


def _tensors_used(s: int, part: fx.GraphModule, qualnames: dict[str, str]) -> set[str]:
    """Qualified names (in the original module) of the tensors stage ``s`` uses."""
    names = set(getattr(part, "_mpstream_attrs", {}).values())
    for node in part.graph.nodes:
        if node.op == "call_module":
            sub = part.get_submodule(str(node.target))
            prefix = qualnames.get(f"submod_{s}.{node.target}", str(node.target))
            names |= {f"{prefix}.{n}" for n, _ in sub.named_parameters(remove_duplicate=False)}
            names |= {f"{prefix}.{n}" for n, _ in sub.named_buffers(remove_duplicate=False)}
    return names


@contextmanager
def _keep_training_flags(module: nn.Module) -> Iterator[None]:
    flags = {m: m.training for m in module.modules()}
    try:
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag


def trace(
    module: nn.Module,
    split_points: Sequence[str],
    *,
    leaf_modules: Sequence[str | type[nn.Module]] = (),
    nones: frozenset[str] = frozenset(),
    values: Mapping[str, Any] | None = None,
    lookups: set[Lookup] | None = None,
) -> Traced:
    """Traces ``module`` and splits it into ``len(split_points) + 1`` stages.

    The trace follows the Python code of ``forward`` with the module's
    training flags as they are, and every argument but those in ``nones``
    as a value (a test such as ``if mask is not None:`` is taken).

    Args:
        module: any module ``torch.fx`` can trace.
        split_points: qualified submodule names; a stage begins at each.
        leaf_modules: submodules (by qualified name or type) not to trace
            into: they run whole, inside one stage.
        nones: arguments traced as None (the split takes them, unused),
            and items inside arguments (``batch['mask']``, see
            :func:`~mpstream.stages.tracers.nones_of`), which the stages
            never read.
        values: the call traced (every argument by name), which answers
            the keys ``forward`` looks up in its dicts (``batch.get("s")``,
            ``"s" in batch``) as the module would; None: every key present.
        lookups: where to add those lookups (a failed trace's too), by
            :class:`~mpstream.stages.lookups.Lookup`.

    Returns:
        The stages, their graph and the argument binder.

    Raises:
        TypeError: tracing failed (the message says what and where, and
            what to do), or ``forward`` takes ``*args``/``**kwargs``.
        ValueError: an unknown split point (the candidates are listed), split
            points out of call order, or a stage left empty.
    """
    if isinstance(split_points, str):
        split_points = [split_points]
    with _keep_training_flags(module):
        gm = _trace(module, leaf_modules, nones, values, lookups)
    _check_result(gm)
    stage_of = _stage_of_nodes(gm, list(split_points), module)
    updates = updated_inputs(changes_in_place(gm))
    copied = copy_changed_inputs(gm, stage_of)
    check_in_place(gm, stage_of)
    qualnames: dict[str, str] = {}
    top = split_module(
        gm, module, lambda n: stage_of[n], qualname_map=qualnames, keep_original_order=True
    )
    inline_attrs(top, lambda target: (lookup(module, target), True))
    count = len(split_points) + 1
    graph, inputs = stage_graph(top, count)
    partitions = [part_of(top, f"submod_{s}") for s in range(count)]
    return Traced(
        partitions,
        graph,
        Binder(module, inputs),
        [_tensors_used(s, p, qualnames) for s, p in enumerate(partitions)],
        ChangedInputs.of(
            inputs,
            {inputs.index(str(h.target)): p for h, p in copied.items()},
            {inputs.index(str(h.target)): u for h, u in updates.items()},
        ),
    )


def lookup(module: nn.Module, name: str) -> Tensor:
    """The tensor a qualified name (``"blocks.0.weight"``) names in ``module``."""
    owner, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attr)  # type: ignore[no-any-return]
