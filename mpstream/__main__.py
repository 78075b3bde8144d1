"""``python -m mpstream``: the same commands as the ``mpstream`` script."""

from __future__ import annotations

import sys

from .cli.main import main

sys.exit(main())
