"""The batch as one argument: a clear error for a batch spread into keywords.

``pipe(**batch)`` calls a traced module with its keyword arguments, so
``pipe.train_step(**batch)`` is a natural slip; Python's own answer ("got an
unexpected keyword argument 'input_ids'") says nothing of what to do. The
training steps take the batch as one argument (a dict of keyword inputs for
a traced module, a tuple of positional ones) and keep their exact
signatures, so a static checker still catches a misspelt option; the
decorator here only rewords the refusal of keywords they do not take.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["batch_argument"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def batch_argument(call: str, usage: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorates a step taking the batch as one argument, signature unchanged.

    Args:
        call: how the user calls it (``pipe.train_step``).
        usage: the right call, shown in the error
            (``pipe.train_step(batch, target, loss_fn)``).

    Returns:
        A decorator. A call with keywords the function does not take raises
        ``TypeError`` naming them and showing ``usage``; any other call
        goes through unchanged.
    """

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        known = {p.name for p in inspect.signature(fn).parameters.values() if p.kind in named}

        @functools.wraps(fn)
        def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if kwargs and not known.issuperset(kwargs):
                unknown = ", ".join(repr(k) for k in kwargs if k not in known)
                raise TypeError(
                    f"{call} got keyword argument(s) {unknown}, which it does not take: it "
                    f"takes the batch as one argument, not spread into keywords. Pass a "
                    f"traced module's keyword inputs as one dict (not **batch), or its "
                    f"positional inputs as a tuple: {usage}"
                )
            return fn(*args, **kwargs)

        return checked

    return decorate
