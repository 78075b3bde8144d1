"""What :func:`~mpstream.observe.tuning.tune` finds: each configuration's
measured step times, the best one and the whole curve, as JSON for the
cache (:mod:`.tune_cache`) and as a figure.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._warn import warn

__all__ = ["TunePoint", "TuneResult", "from_cache"]

# How a figure's axis names each kind of step tune times (the key's mode).
_TIMED = {
    "forward": "forward time",
    "backward": "forward + backward time",
    "train_step": "train_step time",
}


@dataclass
class TunePoint:
    """One configuration and its measured step times (seconds)."""

    split_size: int
    balance: list[int] | None
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def to_json(self) -> dict[str, Any]:
        return {
            "split_size": self.split_size,
            "balance": self.balance,
            "times_s": self.times,
            "median_s": self.median,
        }


@dataclass
class TuneResult:
    """The best configuration and the curve it was picked from.

    Attributes:
        best: the fastest configuration (by median).
        curve: every configuration timed, in the order timed.
        stopped_early: whether a sweep stopped before its last split size
            (its times had risen for ``patience`` sizes).
        cached: whether it came from the cache.
        key: what it was measured for (the cache's key).
    """

    best: TunePoint
    curve: list[TunePoint]
    stopped_early: bool
    cached: bool
    key: dict[str, Any]

    @property
    def split_size(self) -> int:
        return self.best.split_size

    @property
    def balance(self) -> list[int] | None:
        return self.best.balance

    def stops(self) -> str:
        """Where and why the sweeps that stopped early stopped, as the curve
        and the key's candidates (:meth:`to_json`) have it.

        Returns:
            One line, e.g. ``stopped early after split size 12, leaving 16
            untried: the 2 sizes timed after its fastest, 8, were slower``, a
            part per balance that stopped (``; `` between them); ``''`` where
            every sweep ran to its end.
        """
        candidates = [int(s) for s in self.key.get("split_sizes", ())]
        sweeps: dict[str, list[TunePoint]] = {}
        for p in self.curve:
            sweeps.setdefault(repr(p.balance), []).append(p)
        parts = []
        for points in sweeps.values():
            last = points[-1].split_size
            untried = [s for s in candidates if s > last]
            if not untried:
                continue
            fastest = min(points, key=lambda p: p.median)
            after = len(points) - points.index(fastest) - 1
            where = "" if fastest.balance is None else f"with balance {fastest.balance} "
            timed = "the size timed" if after == 1 else f"the {after} sizes timed"
            parts.append(
                f"{where}after split size {last}, leaving {', '.join(map(str, untried))} "
                f"untried: {timed} after its fastest, {fastest.split_size}, "
                f"{'was' if after == 1 else 'were'} slower"
            )
        return f"stopped early {'; '.join(parts)}" if parts else ""

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "best": self.best.to_json(),
            "curve": [p.to_json() for p in self.curve],
            "stopped_early": self.stopped_early,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any], key: dict[str, Any]) -> TuneResult:
        def point(d: dict[str, Any]) -> TunePoint:
            return TunePoint(int(d["split_size"]), d["balance"], [float(t) for t in d["times_s"]])

        return cls(
            point(doc["best"]),
            [point(d) for d in doc["curve"]],
            bool(doc["stopped_early"]),
            True,
            key,
        )

    def plot(self, path: str | Path, *, title: str = "") -> Path:
        """The split-size tradeoff: median step time per split size, a curve per balance."""
        from .figures import split_curves

        curves: dict[str, tuple[list[int], list[float], list[tuple[float, float]]]] = {}
        for p in self.curve:
            label = "split sizes" if p.balance is None else f"balance {p.balance}"
            sizes, medians, bounds = curves.setdefault(label, ([], [], []))
            sizes.append(p.split_size)
            medians.append(p.median)
            bounds.append((min(p.times), max(p.times)))
        heading = title or f"best: split size {self.split_size}" + (
            f", balance {self.balance}" if self.balance else ""
        )
        counts = {len(p.times) for p in self.curve}
        calls = f"{counts.pop()} calls" if len(counts) == 1 else "each point's calls"
        spread = f"median; bars: fastest to slowest of {calls}"
        # What a step of the sweep ran, not the bench's ResNet50 the figure
        # module names by default.
        timed = _TIMED.get(self.key.get("mode", ""), "step time")
        model = str(self.key.get("model", "")).rpartition(".")[2]
        return split_curves(curves, Path(path), heading, model, spread=spread, timed=timed)


def from_cache(
    entries: dict[str, Any], key_text: str, key: dict[str, Any], path: Path
) -> TuneResult | None:
    """The cached result for ``key``, if the cache holds a readable one.

    Args:
        entries: the cache file's entries (:func:`~.tune_cache.load`).
        key_text: ``key`` as the cache spells it.
        key: what the result was measured for (its candidates included).
        path: the cache file, for the warning a malformed entry gives.

    Returns:
        The result (``cached`` True), or None where the cache has none for
        ``key`` or only a malformed one (warned about).
    """
    if key_text not in entries:
        return None
    try:
        result = TuneResult.from_json(entries[key_text], key)
        if any(not p.times or p.split_size not in key["split_sizes"] for p in result.curve):
            raise ValueError("a point with no times, or a split size not among the candidates")
        if result.best not in result.curve:
            raise ValueError("a best point that is not on the curve")
    except (KeyError, TypeError, ValueError) as exc:
        warn(f"ignoring a malformed entry of the tuning cache {path}: {exc!r}")
        return None
    return result
