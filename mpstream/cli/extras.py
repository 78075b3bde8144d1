"""The optional packages the commands use (``pyproject.toml``'s extras).

A command that cannot run without one says so before it starts, naming the
extra to install (:func:`require`); figures without matplotlib are skipped
with one warning, the results still written (:func:`figures`); a progress
bar without tqdm is not drawn (:func:`progress`).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["EXTRA", "MissingExtra", "installed", "require", "figures", "progress"]

#: The smallest extra of ``pyproject.toml`` that installs each package.
EXTRA = {"torchvision": "tutorial", "matplotlib": "bench", "tqdm": "bench"}


class MissingExtra(Exception):
    """A command needs a package this environment lacks."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    return importlib.util.find_spec(module) is not None


def require(command: str, modules: Sequence[str]) -> None:
    """Raises :class:`MissingExtra` naming what ``command`` lacks of
    ``modules`` and the extra that installs it.

    Raises:
        MissingExtra: one line: the command, the packages, ``pip install``.
    """
    lacking = [m for m in modules if not installed(m)]
    if not lacking:
        return
    # One extra for all: "bench" holds every package "tutorial" does.
    extra = "tutorial" if {EXTRA[m] for m in lacking} == {"tutorial"} else "bench"
    names = " and ".join([", ".join(lacking[:-1]), lacking[-1]] if len(lacking) > 1 else lacking)
    raise MissingExtra(
        f"mpstream {command} needs {names}, not installed here: pip install 'mpstream[{extra}]'"
    )


def figures(command: str, wanted: bool) -> bool:
    """Whether ``command`` draws its figures: ``wanted``, and matplotlib is
    installed; if it is wanted but missing, one warning on stderr says so."""
    if wanted and not installed("matplotlib"):
        print(
            f"mpstream {command}: warning: figures skipped: matplotlib is not installed "
            f"(pip install 'mpstream[{EXTRA['matplotlib']}]'); the results are still written",
            file=sys.stderr,
            flush=True,
        )
        return False
    return wanted


class _Silent:
    """What a progress bar offers the commands, drawing nothing."""

    def update(self, _: int = 1) -> None:
        pass

    def set_description(self, _: str | None = None) -> None:
        pass


@contextmanager
def progress(total: int, unit: str, enabled: bool) -> Iterator[Any]:
    """tqdm's bar if ``enabled`` and tqdm is installed, else a silent one.

    tqdm draws only when stderr is a terminal: in a log file its bar would
    be one long line.
    """
    if not (enabled and installed("tqdm")):
        yield _Silent()
        return
    from tqdm import tqdm

    with tqdm(total=total, unit=unit, disable=None) as bar:
        yield bar
