"""One call of a Pipe at a time.

A call (``pipe(x)``, ``train_step``) sets up state the whole run shares:
the split of the call's kind, deferred BatchNorm's accumulation, the
failure snapshot of gradients and statistics. A second call while one runs
(from another thread, or from inside the run: a stage's forward calling its
own pipe) would change that state under the first call and, failing, put
back what its own failure path saves: the first call's statistics were
lost silently. :class:`Running` refuses such a call before it touches
anything.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Concatenate, ParamSpec, TypeVar

__all__ = ["Running", "held", "running_of"]

S = TypeVar("S")
P = ParamSpec("P")
R = TypeVar("R")

# Makes a claim's check-and-set atomic across threads (held for a few lines).
_claims = threading.Lock()


class Running:
    """Which thread runs a call of one pipe now, if any."""

    def __init__(self) -> None:
        self.owner: int | None = None
        self.nested = False  # the running call allows calls from its own thread

    @contextmanager
    def call(self, what: str) -> Iterator[None]:
        """Holds the pipe for one call named ``what`` (``'pipe(x)'``, ``'train_step'``).

        Raises:
            RuntimeError: another call of the pipe is running, naming where
                it runs and what to do.
        """
        me = threading.get_ident()
        with _claims:
            owner = self.owner
            if owner is not None and not (owner == me and self.nested):
                raise RuntimeError(_refusal(what, owner == me))
            saved = (owner, self.nested)
            self.owner, self.nested = me, False
        try:
            yield
        finally:
            with _claims:
                self.owner, self.nested = saved

    @contextmanager
    def nesting(self) -> Iterator[None]:
        """Lets the running call's own thread call the pipe inside the block
        (``schedule='auto'`` measures steps of the pipe before its own)."""
        self.nested = True
        try:
            yield
        finally:
            self.nested = False


def _refusal(what: str, same_thread: bool) -> str:
    if same_thread:
        return (
            f"{what} was called while a call of the same Pipe runs in this thread (a stage's "
            f"forward, a hook or loss_fn calling its own pipe?): a Pipe runs one call at a "
            f"time; call it again once the running call has returned"
        )
    return (
        f"{what} was called from another thread while a call of this Pipe runs: a Pipe "
        f"runs one call at a time; serialise the threads' calls (a threading.Lock), or give "
        f"each thread a Pipe of its own"
    )


def running_of(pipe: object) -> Running:
    """Who runs a call of ``pipe`` now (made on first use: a pipe copied or
    unpickled gets its own)."""
    state = vars(pipe)
    busy = state.get("_busy")
    if busy is None:
        # setdefault: of two threads making one at once, both keep the first.
        busy = state.setdefault("_busy", Running())
    return busy  # type: ignore[no-any-return]


def held(
    what: str,
) -> Callable[[Callable[Concatenate[S, P], R]], Callable[Concatenate[S, P], R]]:
    """Decorates a pipe method that runs a call named ``what``: the pipe is
    held for the whole method (:meth:`Running.call`)."""

    def wrap(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
        @functools.wraps(method)
        def run(pipe: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            with running_of(pipe).call(what):
                return method(pipe, *args, **kwargs)

        return run

    return wrap
