"""The tutorial's models, its training loops and its experiment.

"Single-Machine Model Parallel Best Practices" as code: :mod:`.models` holds
its ResNet50 (and IDRIS's ResNet-101) single-device, model-parallel and
pipelined models and mpstream's drop-in (:class:`StreamPipelineResNet50`);
:mod:`.loops` the tutorial's ``train`` loop (and IDRIS's, from a
``DataLoader``); :mod:`.graphed` the same pipeline with each step
replayed as a CUDA graph; :mod:`.bench` times them all (``mpstream bench``:
:mod:`.design` says what is measured and recorded, :mod:`.report` prints and
saves a run) on the devices :mod:`.machine` picks, which also says what a
result records of the machine and the code; :mod:`.analysis` studies the
split with the profiler and the cost model.

A tool package: it builds on the core and on :mod:`mpstream.observe` through
what they export; the core never imports it. The
models need torchvision (the ``tutorial`` extra), loaded on first use:
:mod:`.machine` and :mod:`.rounds` import without it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .graphed import *  # noqa: F403
    from .loops import *  # noqa: F403
    from .models import *  # noqa: F403

# The models subclass torchvision's ResNet: they load on first use, so that
# machine and rounds (which the transformer workload and the command line
# use) import without torchvision, an optional extra.
_LAZY = ("models", "loops", "graphed")


def __getattr__(name: str) -> Any:
    # ``from . import machine`` asks for the submodule as an attribute first:
    # answered no, the import loads it without the models.
    submodule = name not in _LAZY and Path(__file__).with_name(f"{name}.py").exists()
    if submodule or (name.startswith("__") and name != "__all__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    loaded = [importlib.import_module(f".{m}", __name__) for m in _LAZY]
    if name == "__all__":
        return [n for module in loaded for n in module.__all__]
    for module in loaded:
        if name in module.__all__:
            return getattr(module, name)
    if name in _LAZY:
        return loaded[_LAZY.index(name)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
