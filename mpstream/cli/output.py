"""Standard output and error whose reader may leave: ``mpstream schedules | head``.

A command's tables go to standard output, its results to files in
``--out``. When the program reading the tables exits first (``head``,
``less`` quit early), the next write raises ``BrokenPipeError``: where it
is raised (an unbuffered stream, ``python -u`` or ``PYTHONUNBUFFERED``, or
more output than the buffer holds) the command ended with a traceback
before writing its files. Standard error too, read by the same program
under ``2>&1``: a warning, or a refusal's one-line error, written after
the reader left raised it as well. :func:`reader_may_leave` sends what
either stream gets after that to the null device instead, so the run ends
as it would have, its files written.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["reader_may_leave"]


class _Tolerant:
    """Forwards to ``stream``; once its reader has gone, points its file
    descriptor at the null device and writes there."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self._stream = stream
        self._name = name

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._silence()
            return self._stream.write(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._silence()
            self._stream.flush()

    def _silence(self) -> None:
        """The stream's descriptor now writes to the null device: what it
        still buffers, and the interpreter's last flush at exit, succeed."""
        try:
            fd = self._stream.fileno()
        except (OSError, io.UnsupportedOperation):
            raise BrokenPipeError(f"the reader of {self._name} has gone") from None
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """Within the block, ``print`` keeps working after the reader of
    standard output or standard error has gone (what it gets then is
    dropped); each stream is flushed at the end of the block and put back.
    A closed stream (None, where ``print`` writes nothing) is left as it
    is."""
    with _tolerant("stdout", "standard output"), _tolerant("stderr", "standard error"):
        yield


@contextlib.contextmanager
def _tolerant(attribute: str, name: str) -> Iterator[None]:
    """``sys.<attribute>`` wrapped in a :class:`_Tolerant` within the block."""
    stream = getattr(sys, attribute)
    if stream is None:
        # Started with the stream closed (``>&-``): print() writes nothing
        # then, and a wrapper would write to None.
        yield
        return
    tolerant = _Tolerant(stream, name)
    setattr(sys, attribute, tolerant)
    try:
        yield
    finally:
        setattr(sys, attribute, stream)
        # A stream with no descriptor to silence keeps its error, not the block's.
        with contextlib.suppress(BrokenPipeError):
            tolerant.flush()
