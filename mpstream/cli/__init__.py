"""The ``mpstream`` command line (also ``python -m mpstream``).

:mod:`.main` builds the parser and runs the commands: ``bench``, ``trace``
and ``tune`` live in :mod:`.resnet` (``bench --model transformer`` in
:mod:`.transformer`), ``schedules`` in :mod:`.schedules`, ``doctor``'s
options in :mod:`.doctor` (its steps in :mod:`mpstream.doctor`);
:mod:`.extras` says what a command lacks of the optional packages and
:mod:`.argtypes` checks the arguments. The top of the stack: it may import
every package, and none imports it.
"""

from __future__ import annotations

from .main import main, parser

__all__ = ["main", "parser"]
