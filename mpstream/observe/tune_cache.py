"""The tuning cache: a plain JSON file of :func:`~mpstream.observe.tuning.tune`
results, keyed by what changes a step's time.

A key holds the model (type, parameter count, a hash of its repr, the
dtypes of its tensors, what of it trains, its mode and its Pipes' settings),
the step timed (with its loss function and the target's shapes), the
devices, the batch's shapes, the torch version and the candidates.
A result is merged into the file as it is when written (another run's
results written meanwhile stay), atomically; a file that cannot be read or
written is warned about, never fatal. Runs storing at once take turns on an
advisory lock, the sidecar file ``tune.json.lock`` beside it (POSIX; on
Windows, unlocked: two runs storing at the same moment may keep only one's
result).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.utils import _pytree as pytree

from .._warn import warn
from ..pipe import Pipe
from ..runtime import Value
from .profiling import pipes_in

__all__ = ["default_cache", "model_key", "loss_key", "batch_shape", "load", "store"]


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/mpstream/tune.json`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpstream" / "tune.json"


# A Pipe's settings that change its step time but not its repr.
SETTINGS = ("checkpoint", "schedule", "virtual_stages", "force_copies", "graphed")


def model_key(model: nn.Module) -> dict[str, Any]:
    arch = hashlib.sha1(_architecture(model).encode()).hexdigest()[:16]
    # A module's repr names neither: model.half() or frozen layers change the
    # step's time but not the repr, and an integer batch (token ids) keeps
    # the batch's key too.
    dtypes = sorted({str(t.dtype) for t in (*model.parameters(), *model.buffers())})
    # A lazy module's parameters have no size until its first call: counted
    # apart (the key of a model never lazy is unchanged).
    params = [p for p in model.parameters() if not is_lazy(p)]
    lazy = sum(is_lazy(t) for t in (*model.parameters(), *model.buffers()))
    trainable = sum(p.numel() for p in params if p.requires_grad)
    # Which layers are frozen changes the backward as much as how many: a
    # frozen first layer needs no input gradient, a frozen last one does.
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    settings: dict[str, str] = {"training": repr(model.training)}
    if isinstance(model, Pipe):
        settings.update(_settings(model))
    # A model wrapping pipes (tune's "any model with a settable split_size")
    # shows none of their settings in its repr either.
    inner = [_settings(p) for p in pipes_in(model) if p is not model]
    if inner:
        settings["pipes"] = repr(inner)
    return {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "parameters": sum(p.numel() for p in params),
        "architecture": arch,
        "dtypes": dtypes,
        "trainable": trainable,
        "settings": settings,
        **({"uninitialized": lazy} if lazy else {}),
        **({"frozen": hashlib.sha1(repr(frozen).encode()).hexdigest()[:16]} if frozen else {}),
    }


def _settings(pipe: Pipe) -> dict[str, str]:
    out = {n: repr(getattr(pipe, n)) for n in SETTINGS}
    out["compile"] = repr(pipe.__dict__["_compile"])
    backend = pipe.__dict__["_graphed"]
    if backend is not None and backend is not True:
        # Another graph backend replays differently (the emulated one runs
        # the stage's Python), but pipe.graphed says True for any: named by
        # its class, as its repr holds an address (True's key is unchanged).
        out["graphed"] = f"{type(backend).__module__}.{type(backend).__qualname__}"
    return out


def _architecture(model: nn.Module) -> str:
    text = repr(model)
    points = model.split_points if isinstance(model, Pipe) else None
    if points is not None:
        # A pipe cut at split points shows its balance, which a torch.export
        # split learns only at its first call: the points, the same before
        # and after it, stand in for it (the first occurrence is the pipe's
        # own line, above its layers).
        balance = model.__dict__["_balance"]
        cut = f"balance={balance}" if balance is not None else "split at the first call"
        text = text.replace(cut, f"split_points={points}", 1)
    return text


def loss_key(loss_fn: Callable[..., Any] | None, target: Any) -> dict[str, Any]:
    """What of a timed step's loss changes its time: the function (a
    module's repr, else its qualified name) and the target's shapes."""
    if loss_fn is None:
        return {}
    leaves = [t for t in pytree.tree_leaves(target) if isinstance(t, Tensor)]
    return {
        "loss": _function(loss_fn),
        "target": batch_shape(tuple(leaves)) if leaves else type(target).__name__,
    }


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _function(fn: Callable[..., Any]) -> str:
    """A loss function's name: a module's repr; a partial's function and
    arguments; a function's qualified name, with its line where several
    share the name (lambdas, local functions)."""
    if isinstance(fn, nn.Module):
        return repr(fn)
    if isinstance(fn, functools.partial):
        # Without addresses (a default repr's), which change every run;
        # long arguments by a hash of their text.
        bound = _ADDRESS.sub("", repr((fn.args, fn.keywords)))
        if len(bound) > 200:
            bound = hashlib.sha1(bound.encode()).hexdigest()[:16]
        return f"partial({_function(fn.func)}, {bound})"
    qualname = getattr(fn, "__qualname__", type(fn).__qualname__)
    name = f"{getattr(fn, '__module__', '')}.{qualname}"
    code = getattr(fn, "__code__", None)
    if code is not None and "<" in qualname:  # <lambda>, <locals>
        name += f":{code.co_firstlineno}"
    return name


def batch_shape(value: Value) -> list[list[Any]]:
    tensors = (value,) if isinstance(value, Tensor) else value
    return [[list(t.shape), str(t.dtype), str(t.device)] for t in tensors]


def load(path: Path, *, quiet: bool = False) -> dict[str, Any]:
    """The cache's entries; an unreadable file holds none (and is warned
    about unless ``quiet``)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        if not quiet:
            warn(
                f"ignoring unreadable tuning cache {path}: {exc}; the next result stored "
                f"replaces the file (move it away to keep it)"
            )
        return {}
    return doc if isinstance(doc, dict) else {}


def store(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Adds one result to the cache as the file holds it now, atomically; a
    cache it cannot write is warned about, and the result is returned all
    the same."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Read and replaced under one lock: another run's store between the
        # read and the replace would otherwise be lost.
        with _locked(path):
            entries = load(path, quiet=True)  # read at the start, and warned about then
            entries[key] = entry
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tune-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1)
            os.replace(tmp, path)
            tmp = None
    except OSError as exc:
        warn(f"could not write the tuning cache {path}: {exc}")
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Holds an exclusive advisory lock on ``path``'s sidecar ``.lock``
    file. Without one (Windows has no flock; a file system may refuse
    locks) it locks nothing, as before locks: a cache is never fatal. The
    lock file stays: removing it would let a run lock a file another run
    has just unlinked."""
    fd = None
    if sys.platform != "win32":
        import fcntl

        try:
            fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock
