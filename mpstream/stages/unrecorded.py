"""What a forward does to Python state that ``torch.fx`` runs instead of recording.

fx records operations, not the state they run in: a change of the grad or
autocast mode (a ``with torch.no_grad():`` block in forward) or of a buffer
or plain tensor attribute (``self.steps += 1``) would happen once, while
tracing, and be missing from the stages. The
:class:`~mpstream.stages.fx_tracer.Tracer` refuses the first as it is
recorded (:func:`check_modes`, :class:`ModeChange`);
:mod:`~mpstream.stages.fx` refuses the second (:class:`BufferChange`), seen
on the copies :func:`~mpstream.stages.stand_ins.stand_ins` puts in their
place. Both say what to do.
"""

from __future__ import annotations

import torch

__all__ = ["Unrecorded", "ModeChange", "BufferChange", "current_modes", "check_modes"]


class Unrecorded(TypeError):
    """A forward does what fx runs while tracing instead of recording."""


class ModeChange(Unrecorded):
    """A forward changes the grad or autocast mode."""


class BufferChange(Unrecorded):
    """A forward changes one of the module's buffers or plain tensor attributes."""


_MODE_NAMES = (
    "the grad mode",
    "inference mode",
    "autocast on cpu",
    "autocast on cuda",
    "the cpu autocast dtype",
    "the cuda autocast dtype",
)


def current_modes() -> tuple[object, ...]:
    """The global modes that change what an operation computes, in the
    order of :data:`_MODE_NAMES`."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cpu"),
        torch.get_autocast_dtype("cuda"),
    )


def check_modes(then: tuple[object, ...]) -> None:
    """Refuses an operation recorded in other modes than ``then`` (the
    trace's, from :func:`current_modes`): fx would not record the change,
    so the stages would run the operation in the caller's mode.

    Raises:
        ModeChange: naming the modes changed and what changes them.
    """
    modes = current_modes()
    if modes != then:
        changed = ", ".join(what for what, now, was in zip(_MODE_NAMES, modes, then) if now != was)
        raise ModeChange(
            f"forward changes {changed} (torch.no_grad(), torch.autocast(), ...), which "
            f"torch.fx does not record: the stages would run those operations in the "
            f"caller's mode"
        )
