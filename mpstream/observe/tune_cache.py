"""The tuning cache: a plain JSON file of :func:`~mpstream.observe.tuning.tune`
results, keyed by what changes a step's time.

A key holds the model (type, parameter count, a hash of its repr, its mode
and a Pipe's settings), the step timed, the devices, the batch's shapes,
the torch version and the candidates. The file is written atomically; one
that cannot be read or written is warned about, never fatal.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ..pipe import Pipe
from ..runtime import Value

__all__ = ["default_cache", "model_key", "batch_shape", "load", "store"]


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/mpstream/tune.json`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpstream" / "tune.json"


# A Pipe's settings that change its step time but not its repr.
SETTINGS = ("checkpoint", "schedule", "virtual_stages", "force_copies", "graphed")


def model_key(model: nn.Module) -> dict[str, Any]:
    arch = hashlib.sha1(repr(model).encode()).hexdigest()[:16]
    settings: dict[str, str] = {"training": repr(model.training)}
    if isinstance(model, Pipe):
        settings.update({n: repr(getattr(model, n)) for n in SETTINGS})
        settings["compile"] = repr(model.__dict__["_compile"])
    return {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "architecture": arch,
        "settings": settings,
    }


def batch_shape(value: Value) -> list[list[Any]]:
    tensors = (value,) if isinstance(value, Tensor) else value
    return [[list(t.shape), str(t.dtype), str(t.device)] for t in tensors]


def load(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"ignoring unreadable tuning cache {path}: {exc}", stacklevel=3)
        return {}
    return doc if isinstance(doc, dict) else {}


def store(path: Path, entries: dict[str, Any]) -> None:
    """Writes the cache atomically; a cache it cannot write is warned about,
    and the result is returned all the same."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tune-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        warnings.warn(f"could not write the tuning cache {path}: {exc}", stacklevel=3)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
