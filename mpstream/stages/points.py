"""Split points over a forward's operations, shared by the two tracers.

A split point names a submodule (``"layer3"``, ``"blocks.6"``); its stage
begins at the first operation that runs inside it. ``torch.fx``
(:mod:`~mpstream.stages.fx`) and ``torch.export``
(:mod:`~mpstream.stages.export`) differ only in how they say which
submodules an operation runs inside (an ``owners`` function), so where
stages begin, and the call order that balancing walks, are worked out here
once for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import fx, nn

__all__ = [
    "SplitPointError",
    "split_candidates",
    "check_named",
    "units_in_order",
    "begin_stages",
]


class SplitPointError(ValueError):
    """Split points that cannot cut the forward: one names no submodule it
    calls, they are out of call order, or a stage would be empty. Its own
    class so that the export path tells it from ``torch.export``'s own
    ``ValueError``s, which it words as export failures."""


def split_candidates(module: nn.Module) -> list[str]:
    """Submodules a split point may name: the module's direct children, the
    items of its ``nn.ModuleList`` and ``nn.Sequential`` children, and the
    items of those a child holds (torchvision's ViT keeps its blocks in
    ``encoder.layers``: without them ``balance='time'`` could cut only
    around the whole encoder)."""
    names = []
    for name, child in module.named_children():
        names.append(name)
        if _is_list(child):
            names += [f"{name}.{item}" for item, _ in child.named_children()]
            continue
        for inner, held in child.named_children():
            if _is_list(held):
                names += [f"{name}.{inner}.{item}" for item, _ in held.named_children()]
    return names


def _is_list(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential))


def check_named(
    module: nn.Module, points: Sequence[str], candidates: Callable[[nn.Module], list[str]]
) -> None:
    """Checks that every split point names a submodule of ``module``: all
    that can be checked before the forward is traced (a module exported at
    its first call is checked at construction this far).

    Raises:
        SplitPointError: a split point that names no submodule (or names
            a parameter or buffer), with the ``candidates`` that may be
            named.
    """
    names = {name for name, _ in module.named_modules() if name}
    for point in points:
        if point not in names:
            listed = ", ".join(f"'{c}'" for c in candidates(module))
            raise SplitPointError(
                f"split point '{point}' names {_what_it_names(module, point)}; candidates: {listed}"
            )


def _what_it_names(module: nn.Module, point: str) -> str:
    """What a split point that is no submodule's name names, for its error:
    a parameter or buffer (``vit.class_token``) reads like a split point
    but cuts nothing, so the message says to name the submodule reading it."""
    owner, _, attr = point.rpartition(".")
    try:
        holder = module.get_submodule(owner)
    except AttributeError:
        holder = None
    kind = None
    if holder is not None and attr in holder._parameters:
        kind = "parameter"
    elif holder is not None and attr in holder._buffers:
        kind = "buffer"
    if kind is None:
        return f"no submodule of {type(module).__name__}"
    return (
        f"a {kind} of {type(module).__name__}, not a submodule: a split point names a "
        f"submodule (as in named_modules()), and its stage begins where that is first called; "
        f"name the submodule whose call should begin the stage"
    )


def units_in_order(
    nodes: Sequence[fx.Node], names: Sequence[str], owners: Callable[[fx.Node], list[str]]
) -> list[str]:
    """Of ``names``, those some node runs inside, in the order their first
    node runs, finest first (a ModuleList's items rather than the list), except
    one that begins at the first node or where the one before it begins (no
    stage could lie between). Shared by the ``torch.fx`` and ``torch.export``
    paths, which differ in what a node's owners are."""
    found = []
    for name in names:
        if any(other.startswith(name + ".") for other in names):
            continue  # a container whose items are candidates themselves
        first = next(
            (i for i, n in enumerate(nodes) if any(_inside(o, name) for o in owners(n))), None
        )
        if first is not None:
            found.append((first, name))
    units, last = [], 0
    for first, name in sorted(found):
        if first > last:
            units.append(name)
            last = first
    return units


def begin_stages(
    nodes: Sequence[fx.Node],
    points: Sequence[str],
    owners: Callable[[fx.Node], list[str]],
    module: nn.Module,
    candidates: Callable[[nn.Module], list[str]],
    what: str,
) -> tuple[list[int], dict[fx.Node, int]]:
    """Where each split point's stage begins among ``nodes`` (the first node
    ``owners`` places inside it) and the stage of every node (how many split
    points began before it); shared by the ``torch.fx`` and ``torch.export``
    paths, which differ in what a node's owners are.

    Raises:
        SplitPointError: a split point that names no submodule (a
            parameter, say), one no node runs inside (the ``candidates``
            some node runs inside are listed; ``what`` says which forward),
            or split points out of call order.
    """
    check_named(module, points, candidates)
    begins = []
    for point in points:
        first = next(
            (i for i, n in enumerate(nodes) if any(_inside(o, point) for o in owners(n))), None
        )
        if first is None:
            # A submodule called only in some calls (GoogLeNet's aux heads
            # run in training only), or inside a module that runs whole (a
            # leaf, nn.MultiheadAttention's out_proj): list what is called.
            called = [
                c
                for c in candidates(module)
                if any(_inside(o, c) for n in nodes for o in owners(n))
            ]
            names = ", ".join(f"'{c}'" for c in called)
            raise SplitPointError(
                f"split point '{point}' names a submodule of {type(module).__name__} that the "
                f"{what} forward does not call in this kind of call (it is called only in "
                f"another mode or with other arguments, never, or inside a module that runs "
                f"whole); split at a submodule that every kind of call you make calls: "
                f"candidates it calls: {names}"
            )
        begins.append(first)
    for (a, i), (b, j) in zip(zip(points, begins), zip(points[1:], begins[1:])):
        if j < i:
            raise SplitPointError(
                f"split points out of call order: '{b}' runs before '{a}'; list them in the "
                f"order the forward calls them"
            )
    stage_of: dict[fx.Node, int] = {}
    s = 0
    for i, n in enumerate(nodes):
        while s < len(begins) and i >= begins[s]:
            s += 1
        stage_of[n] = s
    return begins, stage_of


def _inside(owner: str, point: str) -> bool:
    return owner == point or owner.startswith(point + ".")
