"""Submodules replaced after a ``torch.fx`` trace: refused, naming them.

A ``torch.fx`` stage calls the layers the trace met (its leaves) as
modules of its own, and holds the code of the modules it traced through:
``model.blocks[1] = Block(...)`` or ``block.proj = nn.Linear(...)`` puts a
new module in the model that no stage would run (the stage would go on
calling the old one, silently). A Sequential's stages hold its layers
themselves, and a ``torch.export`` split is exported again when its
modules change, so only the splits ``torch.fx`` made check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import fx, nn

__all__ = ["check_replaced"]


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
