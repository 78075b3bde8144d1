"""Stage devices across processes: which a process group can reduce on, and
how a checkpoint saved on one process's devices loads onto another's.

:func:`check_placement` refuses, before a step runs, stages a backend has no
collectives for (or stages on several device types, which DDP cannot hold);
:func:`map_location` is ``torch.load``'s ``map_location`` from the saving
process's stage devices to this one's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._words import count_of
from ..runtime.stream import as_device
from ..stages.sequential import DeviceLike

__all__ = ["check_placement", "map_location"]

# Which device types a process-group backend can run collectives on, for
# groups whose backend config is a bare name rather than "cpu:gloo,cuda:nccl".
_BACKEND_DEVICES = {"gloo": {"cpu", "cuda"}, "nccl": {"cuda"}}


def check_placement(devices: Sequence[DeviceLike], backend_config: str) -> None:
    """Checks that a process group can reduce gradients of stages on ``devices``.

    Args:
        devices: the stage devices of one process's pipeline.
        backend_config: ``torch.distributed.get_backend_config(group)``, e.g.
            ``'cpu:gloo,cuda:nccl'`` or ``'nccl'``.

    Raises:
        ValueError: the stages sit on several device types (DDP holds one
            device type per module), the backend has no collectives for
            their device type, or an entry of ``devices`` is not a device.
    """
    # Names too ('cuda:0'), as Pipe(devices=...) and map_location take them.
    types = sorted({as_device(d, f"devices[{i}]").type for i, d in enumerate(devices)})
    if len(types) > 1:
        listed = ", ".join(str(d) for d in devices)
        raise ValueError(
            f"the pipeline's stages are on several device types ({listed}); "
            f"DistributedDataParallel needs all of one process's stages on one type "
            f"(all CUDA, or all CPU)"
        )
    supported = _supported_device_types(backend_config)
    if supported is not None and types[0] not in supported:
        hint = " (use gloo for CPU stages)" if types[0] == "cpu" else ""
        raise ValueError(
            f"the process group's backend ({backend_config}) has no collectives for "
            f"{types[0]} tensors, where the pipeline's stages are{hint}"
        )


def _supported_device_types(config: str) -> set[str] | None:
    """Device types a backend config covers; None when it is not recognised."""
    if ":" in config:
        return {part.split(":", 1)[0].strip() for part in config.split(",") if ":" in part}
    return _BACKEND_DEVICES.get(config.strip().lower())


def map_location(
    saved_devices: Sequence[DeviceLike], devices: Sequence[DeviceLike]
) -> dict[str, str]:
    """``torch.load``'s ``map_location`` from the saving process's stages to ours.

    A checkpoint saved by rank 0 holds tensors on rank 0's stage devices
    (``cuda:0``, ``cuda:1``, ...); another process loads stage ``s``'s tensors
    straight onto its own stage ``s`` device instead of rank 0's.

    Args:
        saved_devices: the stage devices of the process that saved.
        devices: this process's stage devices (``pipe.devices``).

    Returns:
        ``{'cuda:0': 'cuda:2', ...}``; on CPU ``{'cpu': 'cpu'}``.

    Raises:
        ValueError: the pipelines have different numbers of stages, an
            entry is not a device, a device has no index (``'cuda'``: a
            checkpoint names ``'cuda:0'``), or one saved device would have
            to go to two different devices.
    """
    if len(saved_devices) != len(devices):
        raise ValueError(
            f"the checkpoint's pipeline has {count_of(len(saved_devices), 'stage')} and this one "
            f"{len(devices)}; map_location pairs stages one to one"
        )
    mapping: dict[str, str] = {}
    for stage, (src, dst) in enumerate(zip(saved_devices, devices)):
        key, value = (
            str(_indexed(src, "saved_devices", stage)),
            str(_indexed(dst, "devices", stage)),
        )
        if mapping.setdefault(key, value) != value:
            raise ValueError(
                f"stage {stage}: saved device {key} maps to both {mapping[key]} and {value}; "
                f"the two pipelines share devices between stages differently"
            )
    return mapping


def _indexed(device: DeviceLike, what: str, stage: int) -> torch.device:
    """``device``, refused without an index where its type has them: torch.load
    looks a dict ``map_location`` up by the saved location, ``'cuda:0'``, never
    ``'cuda'``, so every tensor would stay on the saving process's devices."""
    d = as_device(device, f"{what}[{stage}]")
    if d.index is None and d.type != "cpu":
        raise ValueError(
            f"{what}[{stage}] is {str(d)!r}, a device without an index: checkpoints name "
            f"devices with one ('{d.type}:0'); give each stage's device as pipe.devices lists it"
        )
    return d
