"""The ``mpstream`` command line (also ``python -m mpstream``).

:mod:`.main` builds the parser and runs ``bench``, ``trace`` and ``tune``;
``schedules`` lives in :mod:`.schedules`, ``doctor``'s options in
:mod:`.doctor` (its steps in :mod:`mpstream.doctor`); :mod:`.argtypes` checks
the arguments. The top of the
stack: it may import every package, and none imports it.
"""

from __future__ import annotations

from .main import main, parser

__all__ = ["main", "parser"]
