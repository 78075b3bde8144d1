"""Submodules, or their ``forward``, replaced after a trace: refused, naming them.

A ``torch.fx`` stage calls the layers the trace met (its leaves) as
modules of its own, and holds the code of the modules it traced through:
``model.blocks[1] = Block(...)`` or ``block.proj = nn.Linear(...)`` puts a
new module in the model that no stage would run (the stage would go on
calling the old one, silently). A Sequential's stages hold its layers
themselves, and a ``torch.export`` split is exported again when its
modules change, so only the splits ``torch.fx`` made check that.

Either tracer follows a ``forward`` set on a module instance
(``block.forward = patched``) when it traces, and a stage holds what it
did: one set, replaced or deleted later, on a module whose code a trace
follows, is refused at every call until it is put back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import fx, nn

from .module_hooks import name_in

__all__ = ["check_forwards", "check_replaced"]


def check_replaced(
    root: nn.Module, watched: Iterable[nn.Module], partitions: Sequence[fx.GraphModule]
) -> None:
    """Refuses a split whose modules are no longer the module's.

    Args:
        root: the traced module.
        watched: the modules whose code the trace followed.
        partitions: the split's stages.

    Raises:
        TypeError: a module a stage calls, or one whose code it holds, is
            no longer in ``root`` (it was replaced), naming it and what to do.
    """
    present = {id(m) for m in root.modules()}
    gone: str | None = None
    for s, part in enumerate(partitions):
        for node in part.graph.nodes:
            if node.op == "call_module":
                called = part.get_submodule(str(node.target))
                if id(called) not in present:
                    name = type(called).__name__
                    gone = f"the {name} stage {s} calls (traced as '{node.target}')"
                    break
        if gone is not None:
            break
    if gone is None:
        old = next((m for m in watched if id(m) not in present), None)
        if old is not None:
            gone = f"a {type(old).__name__} whose code the trace holds"
    if gone is not None:
        raise TypeError(
            f"{gone} was replaced in the module after torch.fx traced it: the stages would go "
            f"on running the old one, not the new. Change the submodule in place instead "
            f"(load_state_dict, or assign its tensors), or build a new Pipe over the module"
        )


def check_forwards(split: Any, root: nn.Module, modules: Iterable[nn.Module], tracer: str) -> None:
    """Refuses a ``forward`` set on (or deleted from) a module instance
    since the split's first call or trace.

    Args:
        split: the pipe's split (:class:`~mpstream.stages.kinds.Kinds`),
            which keeps the instance forwards it first saw (not pickled: a
            loaded pipe takes its module's as they are).
        root: the traced module.
        modules: the modules whose code the traces follow.
        tracer: ``"torch.fx"`` or ``"torch.export"``, for the message.

    Raises:
        TypeError: one of ``modules`` has another instance ``forward`` than
            it had, naming the module and what to do.
    """
    seen: dict[int, Any] = split.__dict__.setdefault("_forwards", {})
    for module in modules:
        now = module.__dict__.get("forward")
        before = seen.setdefault(id(module), now)
        if before is not now:
            name = name_in(root, module)
            what = "deleted" if now is None else "set" if before is None else "replaced"
            raise TypeError(
                f"the forward of module '{name or type(root).__name__}' was {what} on the "
                f"instance after {tracer} traced its code, which the stages hold as it was: "
                f"they would not run the new one. Put it back, or build a new Pipe over the "
                f"module (it traces the forward the module has then)"
            )
