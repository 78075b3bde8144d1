"""The batch as one argument: a clear error for a batch spread into keywords.

``pipe(**batch)`` calls a traced module with its keyword arguments, so
``pipe.train_step(**batch)`` is a natural slip; Python's own answer ("got an
unexpected keyword argument 'input_ids'") says nothing of what to do. The
training steps take the batch as one argument (a dict of keyword inputs for
a traced module, a tuple of positional ones) and keep their exact
signatures, so a static checker still catches a misspelt option; the
decorator here only rewords the refusal of keywords they do not take: as
a spread batch where the batch argument (``inputs``) is missing, else as a
misspelt option, with the closest one it takes (none close: as a model
input that belongs in the batch).
"""

from __future__ import annotations

import difflib
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
        A decorator for a function whose batch parameter is ``inputs``. A
        call with keywords the function does not take raises ``TypeError``
        naming them: with ``usage`` where ``inputs`` is missing (the batch
        spread), else with the closest keyword it takes (an option
        misspelt), or, none being close, the keywords it takes and
        ``usage`` (a model input beside the batch). Any other call goes
        through unchanged.
    """

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        signature = inspect.signature(fn)
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        known = {p.name for p in signature.parameters.values() if p.kind in named}

        @functools.wraps(fn)
        def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if kwargs and not known.issuperset(kwargs):
                unknown = [k for k in kwargs if k not in known]
                raise TypeError(_refusal(call, usage, signature, args, kwargs, unknown, known))
            return fn(*args, **kwargs)

        return checked

    return decorate


def _refusal(
    call: str,
    usage: str,
    signature: inspect.Signature,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    unknown: list[str],
    known: set[str],
) -> str:
    """The message for keywords ``unknown`` the step does not take."""
    listed = ", ".join(repr(k) for k in unknown)
    given = {k: v for k, v in kwargs.items() if k in known}
    try:
        batch = "inputs" in signature.bind_partial(*args, **given).arguments
    except TypeError:  # too many positional arguments: not a spread batch
        batch = True
    if not batch:
        return (
            f"{call} got keyword argument(s) {listed}, which it does not take: it takes "
            f"the batch as one argument, not spread into keywords. Pass a traced module's "
            f"keyword inputs as one dict (not **batch), or its positional inputs as a "
            f"tuple: {usage}"
        )
    # The batch is there: an option misspelt, as Python would say, with a hint.
    hints = [difflib.get_close_matches(k, sorted(known), n=1) for k in unknown]
    near = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k, m in zip(unknown, hints) if m)
    if near:
        return f"{call} got keyword argument(s) {listed}, which it does not take ({near})"
    # Like no option: more likely a model input passed beside the batch.
    return (
        f"{call} got keyword argument(s) {listed}, which it does not take; it takes "
        f"{', '.join(sorted(known - {'self'}))}. A model input goes into the batch: a "
        f"traced module's keyword inputs as one dict, its positional ones as a tuple: {usage}"
    )
