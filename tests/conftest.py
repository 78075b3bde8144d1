"""Shared pytest configuration: seeding, clean CUDA skips, and the property
tests left out where hypothesis is not installed (the GPU machine has none)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("hypothesis") is None:
    collect_ignore = [
        "random_models.py",
        "pipe/test_random_models.py",
        "pipe/test_random_failures.py",
    ]


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
