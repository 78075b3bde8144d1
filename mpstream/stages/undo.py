"""A module's tensors put back as they were when building its pipe fails.

Building a pipe places the module's parameters and buffers on the stage
devices before all of it is checked (a schedule the stages cannot run is
found once they are placed): :func:`undone_on_error` keeps what the module
held, so a failed build leaves the caller's model as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

__all__ = ["undone_on_error"]


@contextmanager
def undone_on_error(module: nn.Module) -> Iterator[None]:
    """``module``'s parameters and buffers put back as they were if the
    block raises: a pipe that fails to build (a schedule its stages cannot
    run, found once they are placed) leaves the caller's model where it
    was, not spread over the stage devices.

    A move replaces a buffer and, in place, a parameter's data and its
    ``.grad``'s; the originals are kept until the block ends, as the model
    held them before.

    Args:
        module: the module the pipe is built over.

    Yields:
        Nothing: the block runs, and what it raises is raised again once
        the tensors are put back.
    """
    kept: list[tuple[dict[str, Any], str, Tensor, Tensor | None]] = [
        (store, name, t, t.data if store is mod._parameters else None)
        for mod in module.modules()
        for store in (mod._parameters, mod._buffers)
        for name, t in store.items()
        if t is not None
    ]
    grads = [
        (t, t.grad, t.grad.data)
        for _, _, t, data in kept
        if data is not None and t.grad is not None
    ]
    try:
        yield
    except BaseException:
        for store, name, t, data in kept:
            store[name] = t
            if data is not None and t.data.data_ptr() != data.data_ptr():
                t.data = data
        for t, grad, data in grads:  # after the data: a .grad matches its parameter
            if grad.data.data_ptr() != data.data_ptr():
                grad.data = data
            if t.grad is not grad:
                t.grad = grad
        raise
