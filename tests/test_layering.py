"""The house rules on imports: core modules never import the tools, and the
figures module (drawn by several tools) imports no other mpstream module, so
no import circle runs through it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mpstream"
CORE = [
    "pipe", "worker", "training", "values", "graph", "trace", "schedule", "scheduler", "copy",
    "transfer", "partition", "microbatch", "plan", "boundary", "checkpoint", "batchnorm",
    "errors", "compiling", "orders", "split_backward", "balance", "memory", "marks", "build",
    "inputs", "snapshot", "capture", "capture_state", "graphed", "pipe_module",
]
TOOLS = {
    "timeline", "figures", "bench", "cli", "analysis", "profiling", "tuning", "cost_model",
    "scaling", "compare", "doctor", "diagnosis", "report", "environment", "checks", "overlap",
    "probes", "sanitizer", "soak", "experiment", "attribution", "modelcheck", "cli_schedules",
    "argtypes",
}


def mpstream_imports(module: str) -> set[str]:
    """The mpstream modules ``module`` imports, at any level (TYPE_CHECKING too)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpstream."):
            found.add((node.module or "").split(".")[1])
    return found


@pytest.mark.parametrize("module", CORE)
def test_core_modules_do_not_import_tools(module: str) -> None:
    assert not mpstream_imports(module) & TOOLS


def test_figures_imports_no_mpstream_module() -> None:
    assert mpstream_imports("figures") == set()
