"""Splitting an ``nn.Sequential`` into pipeline stages and placing them.

Two styles are accepted. Either every child of the Sequential is one stage and
already sits on its device (the tutorial's and the removed ``torch Pipe``'s
style), or a ``balance`` (layers per stage) and ``devices`` partition the
layers and move each partition (torchgpipe's style).
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .._words import count_of
from ..runtime.calls import Chain
from ..runtime.stream import as_device, device_type_code, explicit_device

__all__ = [
    "Stages",
    "split_module",
    "stage_devices",
    "module_device",
    "check_positive",
    "check_flag",
    "check_shared",
    "check_devices_exist",
]

DeviceLike = str | int | torch.device


@dataclass
class Stages:
    """The result of splitting: layers in order and their grouping."""

    layers: list[tuple[str, nn.Module]]
    partitions: Sequence[nn.Module]
    devices: list[torch.device]
    balance: list[int]


def check_positive(name: str, value: object) -> int:
    """Returns ``value`` as an int if it is an integer >= 1.

    Any integer type counts (numpy's too, as ``Schedule`` and
    ``record_plan`` take them), but not a bool: ``True`` is no count.

    Raises:
        TypeError: not an integer.
        ValueError: smaller than 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def check_flag(name: str, value: object) -> bool:
    """Returns ``value`` as a bool if it is one: numpy's bool too, and 0
    and 1, but not a string (``"false"`` would read as true) or a float.

    Raises:
        TypeError: anything else.
    """
    try:
        wrong = isinstance(value, (str, bytes, float)) or value not in (0, 1)
    except (RuntimeError, ValueError):  # an array or tensor of several values
        wrong = True
    if wrong:
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def module_device(module: nn.Module, what: str) -> torch.device | None:
    """The one device of ``module``'s parameters and buffers (None if it has none).

    Raises:
        ValueError: they sit on several devices.
    """
    devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"{what} has parameters on several devices ({names}); a stage sits on one")
    return next(iter(devices)) if devices else None


def _layers(module: nn.Module, balance_given: bool) -> list[tuple[str, nn.Module]]:
    if not isinstance(module, nn.Sequential):
        kind = type(module).__name__
        if balance_given:
            raise TypeError(
                f"balance= layer counts partition an nn.Sequential; got {kind}: "
                f"{_split_points_hint(module)}"
            )
        raise TypeError(
            f"Pipe got {kind}, not an nn.Sequential, and no split_points: "
            f"{_split_points_hint(module)}"
        )
    layers = [(name, child) for name, child in module._modules.items() if child is not None]
    if not layers:
        raise ValueError("Pipe got an empty nn.Sequential")
    seen: dict[int, str] = {}
    for name, child in layers:
        if id(child) in seen:
            raise ValueError(
                f"layers '{seen[id(child)]}' and '{name}' are the same module; each layer may "
                f"appear once in a pipeline"
            )
        seen[id(child)] = name
    return layers


def _split_points_hint(module: nn.Module) -> str:
    """What to do with a module that is not a Sequential, with its own names."""
    kind = type(module).__name__
    names = [name for name, _ in module.named_children()]
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    # The second child is the first place a stage can begin.
    example = (
        f" ({kind}'s children: {shown}; e.g. split_points=[{names[1]!r}])" if len(names) > 1 else ""
    )
    return (
        f"give split_points=, the submodules where stages begin{example}, and devices= "
        f"for the stages; or balance='time' or 'size' with devices= and sample= to pick "
        f"split points"
    )


def check_shared(
    layers: Sequence[tuple[str, nn.Module]],
    balance: Sequence[int],
    devices: Sequence[torch.device],
) -> None:
    """Rejects parameters or buffers shared by layers on different devices.

    Layers on one device may share (tie) a parameter: autograd accumulates
    its gradient from every use, as in the plain model. Across devices it
    would need a copy kept in sync, which mpstream does not make silently.

    Raises:
        ValueError: naming the tensor's qualified names, stages and devices.
    """
    first: dict[int, tuple[str, int]] = {}
    start = 0
    for s, count in enumerate(balance):
        for name, layer in layers[start : start + count]:
            params = layer.named_parameters(prefix=name, remove_duplicate=False)
            buffers = layer.named_buffers(prefix=name, remove_duplicate=False)
            tensors: list[tuple[str, str, torch.Tensor]] = [("parameter", q, t) for q, t in params]
            tensors += [("buffer", q, t) for q, t in buffers]
            for what, qualified, t in tensors:
                owner, stage = first.setdefault(id(t), (qualified, s))
                if devices[stage] != devices[s]:
                    raise ValueError(
                        f"{what} '{owner}' (stage {stage}, {devices[stage]}) is shared with "
                        f"'{qualified}' (stage {s}, {devices[s]}); layers on different devices "
                        f"cannot share a {what} (mpstream does not copy tied weights between "
                        f"devices): put those layers on one device, or untie them"
                    )
        start += count


def _absent(d: torch.device) -> str | None:
    """Why this machine has no ``d`` (with the devices it has), or None."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if d.type != "cuda" or (count and (d.index is None or d.index < count)):
        return None
    available = ", ".join(["cpu"] + [f"cuda:{i}" for i in range(count)])
    why = "CUDA is not available" if not count else f"only {count} CUDA device(s) exist"
    return f"{why} here; available devices: {available}"


def check_devices_exist(devices: Sequence[torch.device]) -> None:
    """Rejects CUDA devices this machine does not have, before anything moves.

    Raises:
        ValueError: naming the stage, its device and the devices available.
    """
    for s, d in enumerate(devices):
        why = _absent(d)
        if why is not None:
            raise ValueError(f"stage {s} is on {d}, but {why}")


def check_device_exists(device: torch.device, what: str) -> torch.device:
    """Returns ``device`` if this machine has it: checked before a model
    moves there, since torch's own error (no driver) names no argument.

    Args:
        device: the device.
        what: the argument that gave it, as the message names it (``device``).

    Raises:
        ValueError: naming ``what``, the device and the devices available.
    """
    why = _absent(device)
    if why is not None:
        raise ValueError(f"{what} is {device}, but {why}")
    return device


def _as_partition(group: list[tuple[str, nn.Module]]) -> Chain:
    return Chain(OrderedDict(group))


def _placed(layers: list[tuple[str, nn.Module]]) -> Stages:
    found = [
        module_device(child, f"stage {i} ('{name}')") for i, (name, child) in enumerate(layers)
    ]
    devices: list[torch.device] = []
    for i, d in enumerate(found):
        if d is None:
            before = [x for x in found[:i] if x is not None]
            after = [x for x in found[i:] if x is not None]
            d = before[-1] if before else (after[0] if after else torch.device("cpu"))
        device_type_code(d)
        devices.append(d)
    return Stages(layers, [_as_partition([lay]) for lay in layers], devices, [1] * len(layers))


def _default_devices(stages: int) -> list[torch.device]:
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * stages
    count = torch.cuda.device_count()
    if stages > count:
        raise ValueError(
            f"balance has {stages} stages but only {count} CUDA device(s) exist; pass "
            f"devices= explicitly (several stages may share a device, e.g. "
            f"devices=['cuda:0'] * {stages})"
        )
    return [torch.device("cuda", i) for i in range(stages)]


def stage_devices(
    devices: Sequence[DeviceLike] | None, stages: int, what: str
) -> list[torch.device]:
    """One device per stage: ``devices`` checked, or the default placement.

    Args:
        devices: the user's list, or None for one CUDA device per stage (the
            CPU without CUDA).
        stages: how many stages there are.
        what: how errors name the source of ``stages`` ("balance has").

    Raises:
        TypeError: ``devices`` is not a list.
        ValueError: an entry is not a device, the list has the wrong length,
            or a device type is unsupported.
    """
    if devices is None:
        devs = _default_devices(stages)
    else:
        if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
            raise TypeError("devices must be a list with one device per stage")
        devs = [
            explicit_device(as_device(d, f"devices[{i}] (stage {i})"))
            for i, d in enumerate(devices)
        ]
        if len(devs) != stages:
            raise ValueError(
                f"devices has {count_of(len(devs), 'entry', 'entries')} but {what} "
                f"{count_of(stages, 'stage')}; give one device per stage"
            )
    for d in devs:
        device_type_code(d)
    check_devices_exist(devs)
    return devs


def _check_balance(balance: Sequence[int], total: int) -> list[int]:
    if not isinstance(balance, Sequence) and hasattr(balance, "tolist"):
        balance = balance.tolist()  # a numpy array or a tensor of counts
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"balance must be a list of ints, got {type(balance).__name__}")
    out = [check_positive(f"balance[{i}]", b) for i, b in enumerate(balance)]
    if not out:
        raise ValueError("balance is empty; it needs one entry (layer count) per stage")
    if sum(out) != total:
        raise ValueError(
            f"balance {out} sums to {sum(out)} but the module has {count_of(total, 'layer')}"
        )
    return out


def _check_one_device_per_layer(devices: Sequence[DeviceLike] | None, layers: int) -> None:
    # torchgpipe's users give devices= for the stages they mean, forgetting
    # that without balance= each layer is one: say how to group the layers.
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
        return  # stage_devices says what devices must be
    stages = len(devices)
    if stages == layers:
        return
    grouped = ""
    if 0 < stages < layers:
        q, r = divmod(layers, stages)
        example = [q + (i < r) for i in range(stages)]
        grouped = (
            f"give balance= (layers per stage, e.g. balance={example}) to group them into "
            f"{stages} stages, or "
        )
    raise ValueError(
        f"devices has {count_of(stages, 'entry', 'entries')} but the module has "
        f"{count_of(layers, 'layer')}, and without balance= each layer is a stage: "
        f"{grouped}give one device per layer"
    )


def split_module(
    module: nn.Module,
    balance: Sequence[int] | None = None,
    devices: Sequence[DeviceLike] | None = None,
) -> Stages:
    """Splits ``module`` into stages.

    Args:
        module: an ``nn.Sequential``.
        balance: layers per stage. Without it every child is one stage.
        devices: the device of each stage. With ``balance``, each partition
            is moved there; without it, each child is moved there (one device
            per child). If both are omitted the children stay where they are.

    Returns:
        The layers, partitions, stage devices and balance.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``; bad argument types.
        ValueError: a layer appears twice, layers on different devices share
            a parameter, a stage spans devices or sits on a device that does
            not exist, or balance/devices do not fit the module.
    """
    layers = _layers(module, balance is not None)
    if balance is None and devices is None:
        return _placed(layers)
    if balance is None:
        _check_one_device_per_layer(devices, len(layers))
    bal = _check_balance(balance, len(layers)) if balance is not None else [1] * len(layers)
    devs = stage_devices(devices, len(bal), "balance has")
    check_shared(layers, bal, devs)
    partitions = []
    start = 0
    for count, device in zip(bal, devs):
        group = layers[start : start + count]
        for _, layer in group:
            layer.to(device)
        partitions.append(_as_partition(group))
        start += count
    return Stages(layers, partitions, devs, bal)
