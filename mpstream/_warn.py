"""Warnings located at the user's own line.

A warning mpstream gives is most use at the line of the user's code that
led to it (``pipe(x)``, ``loss.backward()``, ``pipe.train_step(...)``,
``step(x, y)`` of a :class:`~mpstream.CapturedStep`,
``mpstream.distributed.train_step(...)``): there its message names the
place to change, and a ``warnings`` filter for the user's module matches
it. How many frames lie between that line and the ``warnings.warn`` call
differs per entry point (decorators, ``nn.Module.__call__``, autograd's
engine, one public call wrapping another), so a fixed ``stacklevel`` points
into mpstream from some of them; :func:`warn` finds the frame instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

__all__ = ["warn"]

# Frames that are never the user's: mpstream's, torch's (Module.__call__,
# Tensor.backward and autograd lie between a user's call and a pipe's
# code), contextlib's (a ``with`` block's exit runs mpstream code from
# there) and frozen modules' (runpy's, for ``python -m mpstream``).
_NOT_THE_USERS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.abspath(contextlib.__file__),
    "<frozen ",
)
# ``python -m mpstream``'s entry stands where the ``mpstream`` script's
# does (a file outside mpstream, so the user's): the command the user ran.
_COMMAND = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")


def _theirs(filename: str) -> bool:
    """Whether a frame of ``filename`` is never the user's."""
    return filename.startswith(_NOT_THE_USERS) and filename != _COMMAND


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` located at the nearest calling
    frame outside mpstream and torch: the user's line, whatever the entry
    point; under ``python -m mpstream``, its entry's line, as the
    ``mpstream`` script's. Where no frame is the user's (a hook on a
    thread of autograd's engine, whose caller waits on another thread),
    the line that called this.

    Args:
        message: the warning's text.
        category: its class.
    """
    # Frames walked, not warnings.warn(skip_file_prefixes=...): that exists
    # from Python 3.12 only, and mpstream supports 3.10.
    frame = sys._getframe(1)
    level = 2  # warn's caller; each frame further out, one more
    while _theirs(frame.f_code.co_filename):
        if frame.f_back is None:  # nothing but mpstream's and torch's frames
            level = 2
            break
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
