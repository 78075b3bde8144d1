"""torch's own reports kept off stderr while mpstream tries an export.

When ``torch.export`` fails (a model neither tracer follows, after the
torch.fx fallback), torch logs warnings from ``symbolic_shapes`` and prints
the partial graph it traced, twice: some thirty lines above mpstream's own
three-line error, which already says why and what to do. During mpstream's
export, :func:`quiet_export` raises torch's export loggers to ERROR and
holds back what the exporting thread writes to ``sys.stderr``; after, each
logger gets its own level back and the held text is written out, less the
graph dumps of a failure. Other threads' writes (a progress bar, a
training loop's prints) pass straight through meanwhile, and exports run
by several threads at once each hold their own text, the loggers raised
until the last one ends. Nothing is changed when the user asked for
torch's logs (``TORCH_LOGS`` set, or one of those loggers, or a parent,
set below WARNING).
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO, cast

__all__ = ["quiet_export", "EXPORT_LOGGERS"]

# The loggers that report, at WARNING, what an export could not do.
EXPORT_LOGGERS = (
    "torch.fx.experimental.symbolic_shapes",
    "torch._dynamo",
    "torch.export",
    "torch._export",
)


def _raise_loggers() -> list[tuple[logging.Logger, int]]:
    """Sets each of :data:`EXPORT_LOGGERS` to ERROR, unless the user made it
    (or a parent) more verbose than WARNING; returns the levels to restore."""
    saved: list[tuple[logging.Logger, int]] = []
    for name in EXPORT_LOGGERS:
        logger = logging.getLogger(name)
        if logging.WARNING <= logger.getEffectiveLevel() < logging.ERROR:
            saved.append((logger, logger.level))
            logger.setLevel(logging.ERROR)
    return saved


class _PerThread:
    """``sys.stderr`` while exports run: what an exporting thread writes
    goes to its innermost export's buffer, what any other thread writes to
    the stream that was there before."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.held: dict[int, list[io.StringIO]] = {}

    def write(self, text: str) -> int:
        buffers = self.held.get(threading.get_ident())
        return (buffers[-1] if buffers else self.stream).write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty, ...
        return getattr(self.stream, name)


_lock = threading.Lock()
# The exports running: sys.stderr's stand-in and the loggers' levels to
# restore when the last one ends.
_active: tuple[_PerThread, list[tuple[logging.Logger, int]]] | None = None


def _hold(buffer: io.StringIO) -> None:
    """The calling thread's stderr into ``buffer`` until :func:`_release`."""
    global _active
    with _lock:
        if _active is None:
            _active = (_PerThread(sys.stderr), _raise_loggers())
            sys.stderr = cast(TextIO, _active[0])
        _active[0].held.setdefault(threading.get_ident(), []).append(buffer)


def _release() -> None:
    """Ends the calling thread's innermost hold; after the last one,
    ``sys.stderr`` and the loggers' levels are put back."""
    global _active
    with _lock:
        assert _active is not None
        proxy, saved = _active
        me = threading.get_ident()
        proxy.held[me].pop()
        if not proxy.held[me]:
            del proxy.held[me]
        if proxy.held:
            return
        _active = None
        if sys.stderr is cast(TextIO, proxy):  # else whoever replaced it since keeps theirs
            sys.stderr = proxy.stream
        for logger, level in saved:
            logger.setLevel(level)


def _graph_dumps(exc: BaseException) -> list[str]:
    """The partial graphs torch attached to a failure (and to the errors it
    was raised from), which ``torch.export`` prints to stderr."""
    dumps: list[str] = []
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        graph = getattr(e, "partial_fx_graph", None)
        if isinstance(graph, str):
            dumps.append(graph)
        todo += [e.__cause__, e.__context__]
    return dumps


@contextmanager
def quiet_export() -> Iterator[None]:
    """The body (one ``torch.export`` call) with torch's export warnings and
    failure dumps kept off stderr; see the module's docstring.

    Anything else the calling thread writes to ``sys.stderr`` meanwhile
    (the module's own prints, torch's errors) is held and written out as
    the body ends, so nothing else is lost; other threads' writes are not
    held.
    """
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    held = io.StringIO()
    _hold(held)
    try:
        yield
    except BaseException as exc:
        _release()
        text = held.getvalue()
        for graph in _graph_dumps(exc):
            text = text.replace(graph + "\n", "")  # print(graph, file=sys.stderr)
        sys.stderr.write(text)
        raise
    _release()
    sys.stderr.write(held.getvalue())
