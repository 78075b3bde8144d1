"""Loads ``mpstream._C`` and checks it was built for the installed torch.

First the installed torch must be one mpstream supports (:data:`MIN_TORCH`).
A C++ extension compiled against one torch may load against another and
fail later with an unrelated symbol error, or not load at all. This module
turns both cases into one message: which torch it was built for, which torch
is installed, and the command that rebuilds it.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["ExtensionError", "load", "MIN_TORCH", "REBUILD_COMMAND", "INTERFACE_VERSION"]

REBUILD_COMMAND = "pip install --no-build-isolation --no-deps -e ."

# The oldest torch the whole test suite passed on. 2.7 added GradientEdge
# roots to torch.autograd.backward, which the zero-bubble weight pass uses;
# on 2.4 that and torch.compile of stages fail.
MIN_TORCH = "2.7"


# What mpstream's Python expects of the bindings (csrc/bindings.cpp's
# interface_version): an extension built from older sources loads but
# returns the wrong shapes.
INTERFACE_VERSION = 12


def _release(version: str) -> tuple[int, ...]:
    """Major and minor of a version string: a pre-release or vendor build of
    2.7 (``2.7.0a0+git…``, ``2.7.0a0+….nv25.04``) counts as 2.7."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(match[1]), int(match[2])) if match else (0, 0)


class ExtensionError(ImportError):
    """mpstream's C++ extension is missing or was built for another torch."""


def _stamped_version() -> str | None:
    stamp = Path(__file__).with_name("_build.json")
    try:
        return str(json.loads(stamp.read_text())["torch"])
    except (OSError, ValueError, KeyError):
        return None


def _message(problem: str, built_for: str | None) -> str:
    built = built_for if built_for is not None else "unknown (no build stamp)"
    return (
        f"{problem}\n"
        f"  built for torch: {built}\n"
        f"  installed torch: {torch.__version__}\n"
        f"Rebuild it against the installed torch from the mpstream checkout:\n"
        f"  {REBUILD_COMMAND}\n"
        f"(or: python setup.py build_ext --inplace)"
    )


def load() -> ModuleType:
    """Imports ``mpstream._C`` and verifies its torch version.

    Returns:
        The extension module.

    Raises:
        ExtensionError: the extension is missing, fails to load, was
            compiled against a torch other than the one installed, or from
            older sources than this Python package.
        ImportError: the installed torch is older than :data:`MIN_TORCH`.
    """
    if _release(torch.__version__) < _release(MIN_TORCH):
        raise ImportError(
            f"mpstream needs torch >= {MIN_TORCH}; torch {torch.__version__} is installed. "
            f"Upgrade it (pip install 'torch>={MIN_TORCH}'), then rebuild mpstream._C "
            f"({REBUILD_COMMAND})."
        )
    try:
        ext = importlib.import_module("mpstream._C")
    except ModuleNotFoundError as exc:
        if exc.name != "mpstream._C":
            raise
        raise ExtensionError(
            _message("mpstream's C++ extension mpstream._C is not built.", _stamped_version())
        ) from exc
    except ImportError as exc:
        raise ExtensionError(
            _message(f"mpstream._C failed to load: {exc}", _stamped_version())
        ) from exc
    built_for = str(ext.torch_version())
    if built_for != torch.__version__:
        raise ExtensionError(
            _message("mpstream._C was built against a different torch.", built_for)
        )
    interface = getattr(ext, "interface_version", 1)
    if interface != INTERFACE_VERSION:
        raise ExtensionError(
            _message(
                f"mpstream._C was built from other sources (interface {interface}, this "
                f"package needs {INTERFACE_VERSION}).",
                built_for,
            )
        )
    return ext
