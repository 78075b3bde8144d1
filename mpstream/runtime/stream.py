"""Stream helpers that treat CPU and CUDA alike.

CUDA stages get real streams; a CPU stage gets the :data:`CPU_STREAM`
placeholder, on which work simply runs on the host in issue order. Every
stream decision in mpstream goes through these helpers, so the same code path
runs (and is tested) on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = [
    "CPUStream",
    "CPU_STREAM",
    "AnyStream",
    "new_stream",
    "current_stream",
    "is_cuda",
    "stream_id",
    "record_stream",
    "synchronize",
    "device_type_code",
    "capturing",
    "explicit_device",
    "as_device",
]


class CPUStream:
    """Placeholder stream for CPU devices: host work needs no ordering."""

    device = torch.device("cpu")

    def __repr__(self) -> str:
        return "CPUStream()"


CPU_STREAM = CPUStream()

AnyStream = torch.cuda.Stream | CPUStream

# c10::DeviceType values of the device types mpstream schedules.
_DEVICE_TYPE_CODES = {"cpu": 0, "cuda": 1}


def device_type_code(device: torch.device) -> int:
    """Returns c10's integer code for ``device.type``.

    Raises:
        ValueError: the device type is not one mpstream schedules.
    """
    try:
        return _DEVICE_TYPE_CODES[device.type]
    except KeyError:
        raise ValueError(
            f"mpstream runs stages on 'cuda' and 'cpu' devices; got {device}"
        ) from None


def new_stream(device: torch.device, priority: int = 0) -> AnyStream:
    """A fresh stream on ``device`` (the placeholder on CPU).

    Args:
        device: where the stream runs.
        priority: CUDA stream priority; lower is higher, 0 the default.
    """
    if device.type == "cuda":
        return torch.cuda.Stream(device=device, priority=priority)  # type: ignore[no-untyped-call]
    device_type_code(device)
    return CPU_STREAM


def current_stream(device: torch.device) -> AnyStream:
    """The calling thread's current stream on ``device``."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return CPU_STREAM


def is_cuda(stream: AnyStream) -> bool:
    """Whether ``stream`` is a real CUDA stream."""
    return not isinstance(stream, CPUStream)


def stream_id(stream: AnyStream) -> int | None:
    """The id the C++ scheduler uses for ``stream``; None for the placeholder."""
    if isinstance(stream, CPUStream):
        return None
    return int(stream.stream_id)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Blocks the host until all work queued on ``devices`` has finished."""
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def record_stream(tensor: torch.Tensor, stream: AnyStream) -> None:
    """Tells the caching allocator that ``stream`` uses ``tensor``.

    Without it, memory freed by the allocating stream could be handed out
    again while ``stream`` still reads it. Skipped for a stream of another
    device: the allocator would accept it, but mpstream's only cross-device
    use (a peer copy, which PyTorch issues on the source device's stream) is
    already ordered before the destination's later frees by the copy's
    events.
    """
    if isinstance(stream, CPUStream) or not tensor.is_cuda:
        return
    if tensor.device.index != stream.device.index:
        return
    tensor.record_stream(stream)


def capturing(devices: Iterable[torch.device]) -> bool:
    """Whether a CUDA graph is being captured on the current stream.

    Never initialises CUDA: without a CUDA context nothing can be capturing.

    Args:
        devices: the devices work is about to run on; without a CUDA device
            among them the answer is False.

    Returns:
        True while ``torch.cuda.graph`` (or ``CUDAGraph.capture_begin``)
        captures the current stream.
    """
    return (
        any(d.type == "cuda" for d in devices)
        and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        and torch.cuda.is_current_stream_capturing()
    )


def explicit_device(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` means the current CUDA device, and
    streams and events belong to one device."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def as_device(d: str | int | torch.device, what: str) -> torch.device:
    """``d`` as a device, or a ValueError naming ``what`` (the argument)."""
    try:
        return torch.device(d)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"{what} is {d!r}, not a device ({str(exc).splitlines()[0]}); give a "
            f"torch.device or a string such as 'cuda:0' or 'cpu'"
        ) from None
