"""A count and its noun in the messages and figures mpstream writes:
``1 step``, ``2 steps``, never ``1 steps``."""

from __future__ import annotations

__all__ = ["count_of"]


def count_of(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun that goes with it.

    Args:
        n: the count.
        one: the noun for one (``"step"``).
        many: the noun for any other count; default ``one`` + ``"s"``
            (give it where that is wrong: ``"micro-batches"``).

    Returns:
        ``"1 step"``, ``"0 steps"``, ``"3 micro-batches"``.
    """
    return f"{n} {one if n == 1 else (many if many is not None else one + 's')}"
