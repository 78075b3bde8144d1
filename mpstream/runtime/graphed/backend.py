"""What captures and replays a stage call's graphs: the :class:`Backend`
protocol (:mod:`.backends` implements it with CUDA graphs, :mod:`.emulated`
for tests), and the mark on an exception the stage's own code raised while a
backend ran it eagerly (:func:`raised_eagerly`), which a failed capture's
fallback must not swallow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Backend", "raised_eagerly", "was_raised_eagerly"]


#: Set on an exception the stage's own code raised while a backend ran it
#: eagerly before capturing (its warm-up): the stage's error, not a capture's.
_EAGER = "_mpstream_raised_eagerly"


def raised_eagerly(exc: BaseException) -> None:
    """Marks ``exc`` as raised by the stage's code run eagerly (a backend's
    warm-up, before any capture began): the caller's error to see, where a
    failed capture would make the stage run eagerly instead."""
    setattr(exc, _EAGER, True)


def was_raised_eagerly(exc: BaseException) -> bool:
    """Whether :func:`raised_eagerly` marked ``exc``."""
    return bool(getattr(exc, _EAGER, False))


class Backend(Protocol):
    """Captures and replays the graphs of one :class:`~.call.GraphedCall`.

    An exception the stage's code raises while :meth:`capture` runs it
    eagerly (before capturing) is marked with :func:`raised_eagerly`: it
    reaches the caller, and the stage's next call captures again.

    ``call`` is typed ``Any`` here: :mod:`.call` imports this module, and
    imports go one way (tests/test_layering.py); a backend types it as the
    ``GraphedCall`` it is.
    """

    #: Whether a replay runs the stage's Python (then its side effects,
    #: such as deferred BatchNorm's counting, happen by themselves).
    runs_python: bool

    def capture(self, call: Any, fn: Callable[..., Any]) -> None:
        """Fills ``call``'s static buffers and arms its replays."""

    def replay(self, call: Any, name: str) -> None:
        """Replays one pass: ``forward``, ``backward`` (all of it, or B where
        the call is split) or ``weight`` (W)."""
