"""Argument types of the ``mpstream`` commands: numbers, size lists, image
sizes, device names; and :class:`UsageError`, a bad option found after
parsing (a combination a command refuses)."""

from __future__ import annotations

import argparse
import math

import torch

__all__ = [
    "UsageError",
    "positive_int",
    "non_negative_int",
    "positive_float",
    "non_negative_float",
    "int_list",
    "image_size",
    "device_name",
    "device_here",
    "devices_here",
]


class UsageError(ValueError):
    """A bad option that parsing alone cannot see: ``mpstream CMD: error:
    ...``, exit status 2, like argparse's own. Any other error of a run is
    not the user's options and keeps its traceback."""


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0."""
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _real(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _real(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _real(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def device_name(text: str) -> str:
    """A name ``torch.device`` accepts (``cpu``, ``cuda:1``); whether the
    device exists is checked where it is used."""
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device name (e.g. cpu, cuda, cuda:1)"
        ) from None
    return text


def device_here(text: str) -> str:
    """A device name (see :func:`device_name`) of a device this machine has."""
    name = device_name(text.strip())
    device = torch.device(name)
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{name}: mpstream runs on cpu and cuda devices")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        have = ", ".join(["cpu", *(f"cuda:{i}" for i in range(count))])
        raise argparse.ArgumentTypeError(f"{name}: no such device here (there are: {have})")
    return name


def devices_here(text: str) -> list[str]:
    """Comma-separated device names, each of a device this machine has."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated devices, e.g. cuda:0,cuda:1")
    return [device_here(p) for p in parts]


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive sizes, each given once, e.g. ``1,3,12``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated sizes, e.g. 1,3,12")
    values = tuple(positive_int(p) for p in parts)
    # Each value is one configuration to run: a repeat would be run twice, or
    # dropped unsaid.
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(str, repeated))} given more than once in {text!r}: give each once"
        )
    return values


def image_size(text: str) -> tuple[int, int]:
    """``W`` (square) or ``WxH``."""
    parts = text.lower().split("x")
    if len(parts) == 1:
        side = positive_int(parts[0])
        return side, side
    if len(parts) == 2:
        return positive_int(parts[0]), positive_int(parts[1])
    raise argparse.ArgumentTypeError(f"expected W or WxH, got {text!r}")
