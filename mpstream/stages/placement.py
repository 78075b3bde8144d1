"""Where a split module's stages live: their tensors on their devices.

A traced or exported split keeps referring to the original module's
parameters and buffers (its ``state_dict`` keys stay those of the unsplit
module). :func:`place` moves each tensor to the device of the stages that
use it, in the original module, and refuses a tensor that stages on
different devices share (tied weights are not silently copied);
:func:`rebind` points a stage's own references at the module's current
tensors after they were replaced.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor, fx, nn

from .fx import Traced, lookup

__all__ = ["place", "rebind"]


def place(module: nn.Module, traced: Traced, devices: Sequence[torch.device]) -> None:
    """Moves each stage's tensors to its device, in the original module.

    Raises:
        ValueError: a tensor is used by stages on different devices (tied
            weights are not silently copied).
    """
    users: dict[str, list[int]] = defaultdict(list)
    for s, used in enumerate(traced.tensors):
        for name in sorted(used):
            users[name].append(s)
    by_identity: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for name, stages in users.items():
        tensor = lookup(module, name)
        for s in stages:
            by_identity[id(tensor)].append((name, s))
    for uses in by_identity.values():
        devs = {devices[s] for _, s in uses}
        if len(devs) > 1:
            names = sorted({n for n, _ in uses})
            where = ", ".join(f"stage {s} ({devices[s]})" for s in sorted({s for _, s in uses}))
            raise ValueError(
                f"{' = '.join(names)} is used by {where}: a tensor shared by stages must sit on "
                f"one device (tied weights are not copied between devices); put those stages "
                f"on one device or untie the weights"
            )
    # Normal tensors even when a kind of call is first traced (and placed)
    # under torch.inference_mode(): training later must be able to use them.
    with torch.inference_mode(False), torch.no_grad():
        for name, stages in users.items():
            _move(module, name, devices[stages[0]])
    for part in traced.partitions:
        rebind(part, module)


def _move(module: nn.Module, name: str, device: torch.device) -> None:
    tensor = lookup(module, name)
    if not isinstance(tensor, Tensor) or tensor.device == device:
        return
    moved = tensor.data.to(device)
    try:
        # In place: whoever holds the tensor (the module, a pipe that
        # adopted the module's tensors, an optimizer) holds the moved one.
        tensor.data = moved
    except RuntimeError:
        if isinstance(tensor, nn.Parameter):
            raise
        # A buffer of a layout .data cannot carry across (sparse, say).
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if attr in owner._buffers:
            owner._buffers[attr] = moved
        else:
            setattr(owner, attr, moved)


def rebind(part: fx.GraphModule, root: nn.Module) -> None:
    """Points a stage's own references at ``root``'s current tensors (after
    ``.to(dtype)``, or a ``load_state_dict(assign=True)``)."""
    for name, target in getattr(part, "_mpstream_attrs", {}).items():
        current = lookup(root, target)
        if isinstance(current, nn.Parameter):
            part._parameters[name] = current
        else:
            part._buffers[name] = current
