"""The private torch calls mpstream makes, in one place.

Torch's private functions change without notice. Each one mpstream calls is
reached through a function here that says what it is for, and :data:`USED`
lists them with the arguments they took in the torch versions mpstream was
checked with (:data:`CHECKED`), so that ``tests/runtime/test_private.py``
fails on the torch that changes one, and :func:`missing` tells the doctor
which this torch lacks. A missing one raises :class:`PrivateApiError`
naming it and what depends on it, never an ``AttributeError`` from deep
inside a capture; one only saving host time (:func:`grad_mode_switch`,
:func:`autocast_check`) gives its public equivalent instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = [
    "CHECKED",
    "USED",
    "Private",
    "PrivateApiError",
    "missing",
    "lookup",
    "end_allocate_to_pool",
    "release_pool",
    "profiler_enabled",
    "will_engine_execute_node",
    "current_graph_task_id",
    "parse_to",
    "grad_mode_switch",
    "autocast_check",
]

#: The torch versions these calls were checked with (the test suite's).
CHECKED = "2.7 to 2.15"


class Private(NamedTuple):
    """One private torch call: where it lives, how many arguments it takes
    (None: varies), whether only a CUDA build has it, what needs it."""

    module: str
    name: str
    arity: int | None
    cuda_only: bool
    needed_for: str


USED = (
    Private("torch._C", "_cuda_endAllocateToPool", 2, True, "undoing a failed graph capture"),
    Private("torch._C", "_cuda_releasePool", 2, True, "undoing a failed graph capture"),
    Private("torch._C._autograd", "_profiler_enabled", 0, False, "profiler ranges per task"),
    Private(
        "torch._C",
        "_will_engine_execute_node",
        1,
        False,
        "replays the backward pass asks for; where a profiled stage's backward ends; "
        "whether a backward reaches DDP's reducer (distributed/pending.py)",
    ),
    Private(
        "torch._C",
        "_current_graph_task_id",
        0,
        False,
        "one replay, and one profiled span of a stage, per backward pass",
    ),
    Private("torch._C._nn", "_parse_to", None, False, "Pipe.to() arguments"),
    Private(
        "torch._C",
        "_set_grad_enabled",
        1,
        False,
        "a cheaper grad-mode switch around each replay (the public one otherwise)",
    ),
    Private(
        "torch._C",
        "_is_any_autocast_enabled",
        0,
        False,
        "a cheaper autocast check per replayed forward (the public one otherwise)",
    ),
)


class PrivateApiError(RuntimeError):
    """The installed torch lacks a private call mpstream needs."""


def lookup(p: Private) -> Any:
    """The call ``p`` in the installed torch (None: it has none)."""
    owner: Any = torch
    for part in p.module.split(".")[1:]:
        owner = getattr(owner, part, None)
    return getattr(owner, p.name, None)


# Asked in every replayed backward task of the user's loop: found once.
_graph_task_id: Callable[[], int] | None = lookup(USED[4])


def missing() -> list[Private]:
    """The calls of :data:`USED` this torch lacks (CUDA-only ones count only
    on a CUDA build)."""
    cuda = torch.version.cuda is not None
    return [p for p in USED if (cuda or not p.cuda_only) and lookup(p) is None]


def _require(p: Private) -> Any:
    fn = lookup(p)
    if fn is None:
        raise PrivateApiError(
            f"torch {torch.__version__} has no {p.module}.{p.name}, which mpstream uses for "
            f"{p.needed_for} (checked with torch {CHECKED}); use a torch in that range, or "
            f"report this torch version"
        )
    return fn


def _call(p: Private, *args: Any, **kwargs: Any) -> Any:
    return _require(p)(*args, **kwargs)


def end_allocate_to_pool(device: int, pool: Any) -> None:
    """Ends the caching allocator's routing of ``device``'s allocations to
    ``pool`` (``capture_begin`` started it; a failed capture leaves it on)."""
    _call(USED[0], device, pool)


def release_pool(device: int, pool: Any) -> None:
    """Gives back one use of ``pool`` (``capture_begin`` took one)."""
    _call(USED[1], device, pool)


def profiler_enabled() -> bool:
    """Whether torch's autograd profiler is on (then each task gets a range)."""
    return bool(_call(USED[2]))


def will_engine_execute_node(node: Any) -> bool:
    """Whether the running backward pass will execute ``node``; raises
    ``RuntimeError`` outside a backward pass."""
    return bool(_call(USED[3], node))


def current_graph_task_id() -> int:
    """The running backward pass's id (-1 outside one, or where this torch
    cannot tell)."""
    return -1 if _graph_task_id is None else int(_graph_task_id())


def parse_to(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """``Module.to``'s arguments parsed: (device, dtype, non_blocking, memory_format)."""
    device, dtype, non_blocking, memory_format = _call(USED[5], *args, **kwargs)
    return device, dtype, non_blocking, memory_format


def grad_mode_switch() -> Callable[[bool], object]:
    """A function that sets grad mode: torch's own switch, which makes no
    object per call (``torch.set_grad_enabled`` is a class whose instance
    is made and then dropped), else, on a torch without it, that class.

    Code run once per replayed task turns grad mode off with it inline, as
    ``torch.no_grad()`` would (``switch`` being this function)::

        on = torch.is_grad_enabled()
        if on:
            switch(False)
        try:
            ...
        finally:
            if on or torch.is_grad_enabled():  # as it was, as no_grad() leaves it
                switch(on)

    torch has no context manager for it written in C: ``no_grad()`` (or any
    Python one) costs the host an object or two Python calls per task, a
    helper running the body one; inside autograd (grad mode already off)
    this switches nothing."""
    fn = lookup(USED[6])
    return torch.set_grad_enabled if fn is None else fn  # type: ignore[no-any-return]


def autocast_check() -> Callable[[], bool]:
    """A function telling whether autocast is on for any device type:
    torch's own, one call, else, on a torch without it, one asking CUDA's
    and the CPU's (the devices whose autocast a graphed call's key reads)."""
    fn = lookup(USED[7])
    if fn is not None:
        return fn  # type: ignore[no-any-return]
    return lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
