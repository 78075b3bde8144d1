"""``mpstream.Pipe``: the ``nn.Module`` a user wraps a model in.

:mod:`.pipe` holds :class:`Pipe` (its construction and a training step, end
to end), :mod:`.call` a call (``pipe(x)``, the split chosen for the call's
kind), :mod:`.config` its configuration and the runtime it builds on first
use, :mod:`.module` its ``nn.Module`` side (adopted layers, ``state_dict``,
placement), :mod:`.inputs` how a call's arguments become micro-batches,
:mod:`.snapshot` what a failed step puts back, :mod:`.compiling`
``torch.compile`` of stages, :mod:`.auto` when ``schedule='auto'`` chooses
and the hook the tools install to choose.

May import every core package below it (:mod:`mpstream.stages`,
:mod:`mpstream.runtime`, :mod:`mpstream.memory`, :mod:`mpstream.schedules`);
never a tool.
"""

from __future__ import annotations

from .auto import AutoRequest, Chooser, install_chooser
from .call import SingleMicroBatchWarning, warned_as_before
from .inputs import micro_sizes
from .pipe import Pipe

__all__ = [
    "Pipe",
    "AutoRequest",
    "Chooser",
    "install_chooser",
    "micro_sizes",
    "SingleMicroBatchWarning",
    "warned_as_before",
]
