"""Shared pytest configuration: seeding and clean CUDA skips.

The property tests (``pipe/test_random_models.py``, ``pipe/test_random_sessions.py``,
``pipe/test_random_failures.py`` and their helpers ``random_models.py`` and
``random_sessions.py``) skip themselves, with a reason in the report, where
hypothesis is not installed (the GPU machine has none)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _young_heap() -> Iterator[None]:
    # A full gc.collect() (the benches' between groups of configurations,
    # the graph lifetime tests) scans every object alive, and late in the
    # suite that is every earlier test's leftovers too: a second a call.
    # Frozen, they are left out, and a collection scans what this test made.
    gc.freeze()
    yield
    # This test's cycles go now, while a collection scans only them: once
    # unfrozen and frozen again by the next test, no collection would.
    gc.collect()
    gc.unfreeze()
