"""The tutorial's models, its training loops and its experiment.

"Single-Machine Model Parallel Best Practices" as code: :mod:`.models` holds
its ResNet50 (and IDRIS's ResNet-101) single-device, model-parallel and
pipelined models, mpstream's drop-in (:class:`StreamPipelineResNet50`) and the
tutorial's ``train`` loop; :mod:`.graphed` the same pipeline with each step
replayed as a CUDA graph; :mod:`.bench` times them all (``mpstream bench``:
:mod:`.design` says what is measured and recorded, :mod:`.report` prints and
saves a run) on the devices :mod:`.machine` picks, which also says what a
result records of the machine and the code; :mod:`.analysis` studies the
split with the profiler and the cost model.

A tool package: it builds on the core and on :mod:`mpstream.observe` through
what they export; the core never imports it.
"""

from __future__ import annotations

from . import graphed, models
from .graphed import *  # noqa: F403
from .models import *  # noqa: F403

__all__ = [*models.__all__, *graphed.__all__]
