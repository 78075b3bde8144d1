"""The tuning cache's file: runs storing into it at once lose no result."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest

from mpstream.observe import tune_cache

PROCESSES, ENTRIES = 4, 3


def _store_slowly(path: Path, who: int, start: Any) -> None:
    """Stores ENTRIES results, pausing between reading the file and
    replacing it: without a lock, every other process's stores in that
    pause would be overwritten."""
    read = tune_cache.load

    def slow(path: Path, *, quiet: bool = False) -> dict[str, Any]:
        entries = read(path, quiet=quiet)
        time.sleep(0.03)
        return entries

    tune_cache.load = slow  # this child's copy only
    start.wait()
    for i in range(ENTRIES):
        tune_cache.store(path, f"{who}-{i}", {"who": who})


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs fork (POSIX)"
)
def test_processes_storing_at_once_lose_no_entry(tmp_path: Path) -> None:
    path = tmp_path / "tune.json"
    # Forked: a child needs no fresh interpreter importing torch.
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    children = [
        ctx.Process(target=_store_slowly, args=(path, who, start)) for who in range(PROCESSES)
    ]
    for child in children:
        child.start()
    start.set()  # all at once
    for child in children:
        child.join(timeout=30)
    assert [c.exitcode for c in children] == [0] * PROCESSES
    expected = {f"{who}-{i}" for who in range(PROCESSES) for i in range(ENTRIES)}
    assert set(json.loads(path.read_text())) == expected
