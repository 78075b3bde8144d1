"""Which devices and groups of stages a step can be captured in, a graph per segment of each.

The graphs of different groups replay side by side (:mod:`.edges`), ordered
only where data crosses. What two groups touch without that order must be
safe to touch concurrently, and two things are not:

- a parameter or buffer in stages of two groups (tied weights): both
  groups' backward graphs accumulate into one gradient at the same time,
  and an update can be lost (the eager pipe orders them on the
  accumulation's stream);
- random numbers (dropout): before torch 2.13, every graph on a device that
  draws them reads the generator's seed and offset from one pair of device
  scalars, which each such graph's replay refills on its own stream, so two
  groups drawing side by side race on them and draw other masks. Each
  device has its own generator: groups on two GPUs may both draw.

:func:`check_groups` refuses both from the modules: shared tensors, and
dropout layers (``nn.Dropout`` and its kin, ``nn.MultiheadAttention`` with
dropout) in training mode in two groups. Random numbers drawn by other code
(``F.dropout``, ``torch.rand`` in a stage) do not show in the modules;
:func:`drawing` watches a real step for them, and :func:`check_drawing`
refuses what it saw.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

__all__ = ["capture_devices", "check_drawing", "check_groups", "drawing"]

# One graph cannot span devices: PyTorch's graph memory pools are per device
# and multi-device replays fault (pytorch/pytorch#153025, open in 2026).
_MULTI_DEVICE = "PyTorch cannot replay one CUDA graph across devices (pytorch/pytorch#153025)"


def capture_devices(
    devices: Sequence[torch.device], groups: Sequence[int] | None
) -> list[torch.device]:
    """The GPUs a step on stages on ``devices`` is captured on.

    Args:
        devices: each stage's device.
        groups: the group labels a step is captured in, if any.

    Returns:
        The distinct CUDA devices, in stage order (empty: every stage on
        CPUs, where the step runs eagerly).

    Raises:
        ValueError: stages on both CPUs and GPUs, or on several GPUs without
            ``groups`` or with the ``cudaMallocAsync`` allocator.
    """
    distinct = list(dict.fromkeys(devices))
    cuda = [d for d in distinct if d.type == "cuda"]
    if cuda and len(cuda) < len(distinct):
        raise ValueError(
            f"CapturedStep needs every stage on CUDA devices or every stage on CPUs: "
            f"stages are on {', '.join(map(str, distinct))}; move the CPU stages to a GPU "
            f"or run the pipe eagerly."
        )
    if len(cuda) > 1 and groups is None:
        raise ValueError(
            f"CapturedStep: stages are on {', '.join(map(str, cuda))}, and {_MULTI_DEVICE}; "
            f"pass groups= (a label per stage, at least one group per device) to capture "
            f"each device's work as graphs of its own."
        )
    if len(cuda) > 1 and torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        # Its graph allocations are untested for reads from another GPU.
        raise ValueError(
            "CapturedStep across GPUs reads one GPU's graph memory from another, which is "
            "untested with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync; use the native "
            "allocator (the default)"
        )
    return cuda


def check_groups(
    stages: Sequence[nn.Module], groups: Sequence[int], devices: Sequence[torch.device]
) -> None:
    """Refuses groups a step cannot be captured in, seen from the modules.

    Args:
        stages: the pipe's stage modules.
        groups: a group label per stage.
        devices: each stage's device.

    Raises:
        ValueError: not one label per stage; a parameter or buffer in stages
            of two groups; or dropout layers in training mode in two groups.
    """
    if len(groups) != len(stages):
        raise ValueError(f"groups needs one label per stage ({len(stages)}), got {len(groups)}")
    owner: dict[int, tuple[str, int]] = {}
    for i, (stage, group) in enumerate(zip(stages, groups)):
        named = [*stage.named_parameters(), *stage.named_buffers()]
        for name, t in named:
            first, s = owner.setdefault(id(t), (name, i))
            if groups[s] != group:
                raise ValueError(
                    f"'{first}' of stage {s} (group {groups[s]}) is shared with '{name}' of "
                    f"stage {i} (group {group}): the two groups' graphs would update it side by "
                    f"side; put the stages sharing it in one group"
                )
    drawing: dict[int, int] = {}
    for i, (stage, group) in enumerate(zip(stages, groups)):
        if any(_draws(m) for m in stage.modules()):
            drawing.setdefault(group, i)
    check_drawing(set(drawing.values()), groups, devices, "dropout")


def _draws(module: nn.Module) -> bool:
    if not module.training:
        return False
    if isinstance(module, _DropoutNd):
        return module.p > 0
    return isinstance(module, nn.MultiheadAttention) and module.dropout > 0


def check_drawing(
    stages: set[int],
    groups: Sequence[int],
    devices: Sequence[torch.device],
    what: str = "random numbers",
) -> None:
    """Refuses random numbers drawn by stages of two groups on one device.

    Args:
        stages: the stages that draw them.
        groups: a group label per stage.
        devices: each stage's device (each has a generator of its own).
        what: how the message names what they draw.

    Raises:
        ValueError: naming one stage of each of two groups.
    """
    first: dict[torch.device, dict[int, int]] = {}
    for s in sorted(stages):
        first.setdefault(devices[s], {}).setdefault(groups[s], s)
    for on_device in first.values():
        if len(on_device) < 2:
            continue
        (g1, s1), (g2, s2) = list(on_device.items())[:2]
        raise ValueError(
            f"{what} in stage {s1} (group {g1}) and stage {s2} (group {g2}): the two groups' "
            f"graphs would draw random numbers side by side from one generator offset, which "
            f"PyTorch's graph replays share; put the stages that draw them in one group, or "
            f"capture one graph (groups=None)"
        )


@contextmanager
def drawing(stages: Sequence[nn.Module], devices: Sequence[torch.device]) -> Iterator[set[int]]:
    """Watches what runs inside for stages whose forward draws random numbers.

    One host thread issues every stage's forward in turn, so the generator
    of a stage's device moving between the start and the end of its forward
    is that stage's doing (a checkpointed forward's recomputation counts
    too).

    Args:
        stages: the pipe's stage modules.
        devices: each stage's device.

    Yields:
        The indices of the stages seen drawing, filled as they run.
    """
    seen: set[int] = set()
    handles = []
    for i, (stage, device) in enumerate(zip(stages, devices)):
        at: list[Any] = []

        def before(
            _m: nn.Module, _a: Any, device: torch.device = device, at: list[Any] = at
        ) -> None:
            at.append(_position(device))

        def after(
            _m: nn.Module, _a: Any, _o: Any, i: int = i, device: torch.device = device,
            at: list[Any] = at,
        ) -> None:  # fmt: skip
            if at and not _same(at.pop(), _position(device)):
                seen.add(i)

        handles.append(stage.register_forward_pre_hook(before))
        handles.append(stage.register_forward_hook(after))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _position(device: torch.device) -> Any:
    """Where ``device``'s default generator stands."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return torch.cuda.default_generators[index].get_offset()
    return torch.default_generator.get_state()


def _same(a: Any, b: Any) -> bool:
    return bool(torch.equal(a, b)) if isinstance(a, torch.Tensor) else bool(a == b)
