"""torch's own reports kept off stderr while mpstream tries an export.

When ``torch.export`` fails (a model neither tracer follows, after the
torch.fx fallback), torch logs warnings from ``symbolic_shapes`` and prints
the partial graph it traced, twice: some thirty lines above mpstream's own
three-line error, which already says why and what to do. During mpstream's
export, :func:`quiet_export` raises torch's export loggers to ERROR and
holds back what is written to ``sys.stderr``; after, each logger gets its
own level back and the held text is written out, less the graph dumps of a
failure. Nothing is changed when the user asked for torch's logs
(``TORCH_LOGS`` set, or one of those loggers, or a parent, set below
WARNING).
"""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr

__all__ = ["quiet_export", "EXPORT_LOGGERS"]

# The loggers that report, at WARNING, what an export could not do.
EXPORT_LOGGERS = (
    "torch.fx.experimental.symbolic_shapes",
    "torch._dynamo",
    "torch.export",
    "torch._export",
)


@contextmanager
def _raised_loggers() -> Iterator[None]:
    """Each of :data:`EXPORT_LOGGERS` at ERROR, unless the user made it (or
    a parent) more verbose than WARNING; its own level restored after."""
    saved: list[tuple[logging.Logger, int]] = []
    for name in EXPORT_LOGGERS:
        logger = logging.getLogger(name)
        if logging.WARNING <= logger.getEffectiveLevel() < logging.ERROR:
            saved.append((logger, logger.level))
            logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
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

    Anything else written to ``sys.stderr`` meanwhile (the module's own
    prints, torch's errors) is held and written out as the body ends, so
    nothing else is lost.
    """
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    held = io.StringIO()
    try:
        with _raised_loggers(), redirect_stderr(held):
            yield
    except BaseException as exc:
        text = held.getvalue()
        for graph in _graph_dumps(exc):
            text = text.replace(graph + "\n", "")  # print(graph, file=sys.stderr)
        sys.stderr.write(text)
        raise
    sys.stderr.write(held.getvalue())
