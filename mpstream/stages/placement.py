"""Where a split module's stages live: their tensors on their devices.

A traced or exported split keeps referring to the original module's
parameters and buffers (its ``state_dict`` keys stay those of the unsplit
module). :func:`place` moves each tensor to the device of the stages that
read it, in the original module. It refuses a tensor that stages on
different devices share (tied weights are not silently copied), and a
tensor an earlier split (another kind of call) put on another device: the
splits of a module share its tensors. What earlier splits placed is read
from their stages (names, not tensor ids, so a pickled or copied pipe
keeps it), not recorded beside them. :func:`rebind`
points a stage's own references at the module's current tensors after
they were replaced; :func:`check_parametrized` refuses, before anything
changes, a tensor it could not point at.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence

import torch
from torch import Tensor, fx, nn
from torch.nn.utils import parametrize

from .fx import lookup
from .hf import is_transformers_model

__all__ = ["check_parametrized", "place", "rebind"]


def place(
    module: nn.Module,
    partitions: Sequence[fx.GraphModule],
    tensors: Sequence[Collection[str]],
    devices: Sequence[torch.device],
    earlier: Iterable[Sequence[Collection[str]]] = (),
) -> None:
    """Moves each stage's tensors to its device, in the original module,
    and points the stages at them.

    Args:
        module: the module split.
        partitions: its stages.
        tensors: per stage, the qualified names of the module's tensors it reads.
        devices: one device per stage.
        earlier: ``tensors`` of each earlier split of the module (placed
            on the same ``devices``).

    Raises:
        ValueError: a tensor read by stages on different devices (tied
            weights), or one an earlier split placed on another device.
    """
    aliases: dict[int, list[str]] = defaultdict(list)
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    )
    for name, tensor in named:
        aliases[id(tensor)].append(name)
    readers: dict[int, set[int]] = defaultdict(set)
    names: dict[int, set[str]] = defaultdict(set)
    for s, used in enumerate(tensors):
        for name in used:
            key = id(lookup(module, name))
            readers[key].add(s)
            names[key].add(name)
    placed: dict[int, tuple[str, torch.device]] = {}
    for split in earlier:
        for s, used in enumerate(split):
            for name in used:
                placed.setdefault(id(lookup(module, name)), (name, devices[s]))
    wanted: dict[str, torch.device] = {}
    for key, stages in readers.items():
        label = " = ".join(aliases.get(key) or sorted(names[key]))
        if len({devices[s] for s in stages}) > 1:
            raise ValueError(_tied(module, label, stages, devices))
        device = devices[min(stages)]
        was, there = placed.get(key, (label, device))
        if there != device:
            raise ValueError(
                f"this call's split reads {label} in a stage on {device}, but an earlier "
                f"split (another kind of call) placed {was} on {there}: a tensor that kinds "
                f"of call read in different stages needs those stages on one device, or split "
                f"points that keep it in one stage"
            )
        wanted.update(dict.fromkeys(names[key], device))
    # Normal tensors even when a kind of call is first traced (and placed)
    # under torch.inference_mode(): training later must be able to use them.
    with torch.inference_mode(False), torch.no_grad():
        for name, device in sorted(wanted.items()):
            _move(module, name, device)
    for part in partitions:
        rebind(part, module)


def _tied(module: nn.Module, label: str, stages: set[int], devices: Sequence[torch.device]) -> str:
    where = ", ".join(f"stage {s} ({devices[s]})" for s in sorted(stages))
    tie = (
        " (a Hugging Face model ties its input and output embeddings unless its config has "
        "tie_word_embeddings=False)"
        if is_transformers_model(module)
        else ""
    )
    return (
        f"{label} is used by {where}: a tensor shared by stages must sit on one device (tied "
        f"weights are not copied between devices); put those stages on one device or untie "
        f"the weights{tie}"
    )


def _move(module: nn.Module, name: str, device: torch.device) -> None:
    tensor = lookup(module, name)
    if not isinstance(tensor, Tensor) or tensor.device == device:
        return
    moved = tensor.data.to(device)
    try:
        # In place: whoever holds the tensor (the module, a pipe that
        # adopted the module's tensors, an optimizer) holds the moved one.
        tensor.data = moved
        grad = tensor.grad
        if grad is not None and grad.device != device:
            # As Module.to() moves it: the next backward adds into it there.
            tensor.grad = grad.to(device)
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


def check_parametrized(part: fx.GraphModule, root: nn.Module) -> None:
    """Refuses a stage that reads a tensor itself which has been
    parametrized (``torch.nn.utils.parametrize``) since it was traced, or
    which the module no longer has.

    Args:
        part: a stage of ``root``'s split.
        root: the split module.

    Raises:
        TypeError: such a tensor, naming it and what to do.
    """
    for target in getattr(part, "_mpstream_attrs", {}).values():
        owner, _, attr = target.rpartition(".")
        module = _submodule(root, owner)
        if module is None or not hasattr(module, attr):
            raise TypeError(
                f"a stage reads '{target}', which the module no longer has (deleted or "
                f"renamed since the pipe traced the code that reads it, as "
                f"torch.nn.utils.remove_spectral_norm or remove_weight_norm do): the stage "
                f"holds the code traced then. Build a new Pipe around the changed module (the "
                f"old one's state_dict() loads into it where the names still match)"
            )
        if parametrize.is_parametrized(module, attr):
            # Its value is computed at each read; the stage holds one tensor.
            raise TypeError(
                f"'{target}' was parametrized (torch.nn.utils.parametrize) after the pipe "
                f"traced the code that reads it, and a stage holds the tensor it read then: "
                f"it would not compute the parametrization at each call. Register the "
                f"parametrization before building the Pipe (the trace then computes it), or "
                f"remove it (parametrize.remove_parametrizations)"
            )


def _submodule(root: nn.Module, name: str) -> nn.Module | None:
    """``root``'s submodule ``name`` ("" for ``root``), or None if it has none."""
    try:
        return root.get_submodule(name) if name else root
    except AttributeError:
        return None


def rebind(part: fx.GraphModule, root: nn.Module) -> None:
    """Points a stage's own references at ``root``'s current tensors (after
    ``.to(dtype)``, or a ``load_state_dict(assign=True)``).

    Raises:
        TypeError: a tensor the stage reads itself has been parametrized
            (``torch.nn.utils.parametrize``) since it was traced (see
            :func:`check_parametrized`); no reference has changed then.
    """
    check_parametrized(part, root)
    for name, target in getattr(part, "_mpstream_attrs", {}).items():
        current = lookup(root, target)
        # A parameter replaced by a buffer of the same name (or the other way
        # round) leaves the other dict: an old entry would shadow the new one.
        if isinstance(current, nn.Parameter):
            part._buffers.pop(name, None)
            part._parameters[name] = current
        else:
            part._parameters.pop(name, None)
            part._buffers[name] = current
