"""pytest configuration shared by the unit tests (``tests/``) and the
benchmark suite (``benchmarks/``): CPU threads under pytest-xdist."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist (`make test`) each worker takes its share of the
    # cores: torch's default of one thread per core in every worker
    # oversubscribes the machine and slows the whole suite down.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
