"""What an optimizer stepped inside a CUDA graph must allow.

A captured step replays the optimizer's kernels with the values they had
at capture: whatever the optimizer computes on the host (a step count in
host memory, a setting read as a Python number) is frozen there, and the
state its first step creates is made by warm-up and must be put back.
These checks refuse, before capture or at a call, an optimizer whose
replayed step would differ from its eager one, naming why.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Optimizer",
    "check_optimizer",
    "check_settings",
    "check_state",
    "hyperparameters",
    "same_plain",
    "state_tensors",
]

Optimizer = torch.optim.Optimizer

# Optimizers whose state, as their first step creates it, is all zeros (step
# counts, moments, accumulators), so zeroing what warm-up created gives the
# first step exactly. Others (NAdam's mu_product starts at 1, ASGD's eta and
# Rprop's step sizes at lr) need their state made by an eager step first.
_ZERO_STATE: tuple[type[Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RAdam,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
)


def hyperparameters(optimizer: Optimizer | None) -> list[dict[str, Any]]:
    """Each param group's settings: plain values (which a graph keeps) and the
    tensors themselves (a replay reads the captured ones).

    Only the optimizer's own settings (the keys of its ``defaults``, which
    every group gets): what else a group holds is no input of its step,
    such as the ``initial_lr`` an LR scheduler built after capture adds.
    """
    if optimizer is None:
        return []
    kept = (int, float, bool, tuple, str, type(None), Tensor)
    own = optimizer.defaults.keys()
    return [
        {k: v for k, v in g.items() if k in own and k != "params" and isinstance(v, kept)}
        for g in optimizer.param_groups
    ]


def state_tensors(optimizer: Optimizer | None) -> Iterator[tuple[Any, str, Tensor]]:
    """(parameter, key, tensor) for every tensor of the optimizer's state."""
    if optimizer is None:
        return
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                yield param, key, value


def _zero_state(optimizer: Optimizer) -> bool:
    if type(optimizer) is torch.optim.SGD:
        # The momentum buffer starts as the first gradient: a zeroed buffer
        # gives the same step only without dampening.
        return all(g["momentum"] == 0 or g["dampening"] == 0 for g in optimizer.param_groups)
    return type(optimizer) in _ZERO_STATE


def check_optimizer(optimizer: Optimizer | None, devices: Sequence[torch.device]) -> None:
    """Refuses an optimizer whose captured step would differ from its eager one.

    Args:
        optimizer: the optimizer stepped in the graph, if any.
        devices: the GPUs the step is captured on (none: the CPU).

    Raises:
        ValueError: some parameter that requires a gradient has no state yet
            and the optimizer's first state is not all zeros; or, on CUDA, a
            parameter is on the CPU, or a param group holds a tensor setting
            that the optimizer reads as a Python number, that sits in host
            memory (read as a number at launch), or that it would copy to
            another GPU inside a capture (a group whose parameters span GPUs).
    """
    if optimizer is None:
        return
    name = type(optimizer).__name__
    # A frozen parameter gets no gradient, so no step (warm-up's or the
    # user's eager one) ever creates its state: nothing for warm-up to change.
    fresh = [
        p
        for g in optimizer.param_groups
        for p in g["params"]
        if p.requires_grad and not optimizer.state.get(p)
    ]
    if fresh and not _zero_state(optimizer):
        raise ValueError(
            f"CapturedStep: {name} creates state on its first step that is not all zeros, "
            f"and {len(fresh)} parameter(s) have none yet; warm-up before capture would "
            f"change it. Take one eager step first (pipe.train_step, then "
            f"optimizer.step()): existing state is put back exactly."
        )
    if not devices:
        return  # eager steps read tensor settings at every step
    for i, group in enumerate(optimizer.param_groups):
        on_device = group.get("capturable", False) or group.get("fused", False)
        tensors = [k for k, v in group.items() if isinstance(v, Tensor) and k != "params"]
        spans = list(dict.fromkeys(p.device for p in group["params"]))
        if tensors and len(spans) > 1:
            raise ValueError(
                f"CapturedStep: param group {i} of {name} holds {', '.join(map(repr, tensors))} "
                f"as a tensor and parameters on {', '.join(map(str, spans))}: its step would "
                f"copy the setting between GPUs, which a capture per device cannot hold. Use "
                f"a param group per device (each with its own tensor), or a plain number."
            )
        if tensors and not on_device:
            raise ValueError(
                f"CapturedStep: param group {i} of {name} holds {', '.join(map(repr, tensors))} "
                f"as a tensor, which this optimizer reads as a Python number at capture: a "
                f"graph would keep that number. Use {name}(..., capturable=True) where it "
                f"has that option, or a plain number (a change then raises)."
            )
        host = [j for j, p in enumerate(group["params"]) if p.device.type == "cpu"]
        if host:
            raise ValueError(
                f"CapturedStep: parameter {host[0]} of param group {i} of {name} is on "
                f"{group['params'][host[0]].device}; a step captured on the GPU would update "
                f"it once, at capture, and never at a replay. Move it to a GPU, or step it "
                f"with an optimizer of its own outside the captured step."
            )
        # A 0-dim tensor in host memory goes to CUDA kernels as a number
        # read at launch (Adam's lr, capturable or fused): a graph keeps it.
        held = [k for k in tensors if k in optimizer.defaults and group[k].device.type == "cpu"]
        if held and group["params"]:
            raise ValueError(
                f"CapturedStep: param group {i} of {name} holds {held[0]!r} as a tensor in "
                f"host memory, which the optimizer's kernels read as a number at capture: "
                f"every replay would keep that value. Create it on the parameters' device "
                f"(torch.tensor(..., device={str(group['params'][0].device)!r}))."
            )


def check_state(optimizer: Optimizer | None) -> None:
    """Refuses, before capture on CUDA, optimizer state in host memory beside
    parameters on a GPU: the optimizer computes on the host from it (Adagrad's
    step count, for its learning-rate decay), so a graph would keep what the
    host computed at capture and never advance it.

    Adagrad without learning-rate decay is let through: its host-side step
    count then changes nothing a replay computes (only the count itself
    stays as captured).

    Raises:
        ValueError: naming the optimizer, the state and the parameter.
    """
    undecayed = isinstance(optimizer, torch.optim.Adagrad) and all(
        g.get("lr_decay", 0) == 0 for g in optimizer.param_groups
    )
    for param, key, value in state_tensors(optimizer):
        if undecayed and key == "step":
            continue
        if value.device.type == "cpu" and param.device.type != "cpu":
            name = type(optimizer).__name__
            raise ValueError(
                f"CapturedStep: {name} keeps its state {key!r} of a parameter on "
                f"{param.device} ({tuple(param.shape)}) in host memory and computes from it "
                f"on the host, which a replay cannot repeat: every replay would take the "
                f"captured step's values. Use {name}(..., capturable=True) where it has that "
                f"option, or an optimizer whose state lives on the GPU (SGD, "
                f"Adam/AdamW(capturable=True))."
            )


def same_plain(a: Any, b: Any) -> bool:
    """Equality for plain values, with NaN equal to itself; tensors by identity
    (a replay reads the captured tensor, whatever its value)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # values whose == is not a bool
        return a is b


def check_settings(settings: list[dict[str, Any]], optimizer: Optimizer | None) -> None:
    """Refuses a plain optimizer setting changed since ``settings`` were
    taken (:func:`hyperparameters`), which a replay would not see.

    Raises:
        ValueError: naming the param group and the setting.
    """
    now = hyperparameters(optimizer)
    for g, (before, after) in enumerate(zip(settings, now)):
        for key in sorted(before.keys() | after.keys()):
            a, b = before.get(key), after.get(key)
            if not same_plain(a, b):
                raise ValueError(
                    f"CapturedStep: optimizer param group {g}'s {key!r} changed from "
                    f"{a!r} to {b!r} since capture; the captured step uses {a!r}. "
                    f"Capture a new step, or give {key!r} as a tensor changed in place "
                    f"(tensor.fill_), where the optimizer supports that under capture "
                    f"(Adam, AdamW: capturable=True)."
                )
    if len(now) != len(settings):
        raise ValueError(
            f"CapturedStep: the optimizer has {len(now)} param groups, "
            f"{len(settings)} at capture; capture a new step"
        )
