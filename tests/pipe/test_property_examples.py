"""``MPSTREAM_PROPERTY_EXAMPLES=N`` runs each hypothesis property test
longer, on examples drawn at random (docs/architecture.md)."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

pytest.importorskip("hypothesis", reason="a property test: needs hypothesis (the dev extra)")

# Each property test module and its test.
PROPERTY_TESTS = {
    "tests.pipe.test_random_models": "test_pipe_equals_the_plain_model",
    "tests.pipe.test_random_sessions": "test_a_session_of_calls_equals_the_plain_model",
    "tests.pipe.test_random_failures": "test_a_failure_anywhere_leaves_nothing_half_done",
}


def _settings(module: ModuleType, name: str) -> tuple[int, bool]:
    given = getattr(module, name)._hypothesis_internal_use_settings
    return given.max_examples, given.derandomize


@pytest.mark.parametrize("name", list(PROPERTY_TESTS))
def test_the_variable_sets_every_property_tests_examples(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # test_random_failures kept its 20 fixed examples whatever it said.
    module = importlib.import_module(name)
    try:
        monkeypatch.setenv("MPSTREAM_PROPERTY_EXAMPLES", "7")
        assert _settings(importlib.reload(module), PROPERTY_TESTS[name]) == (7, False)
        monkeypatch.delenv("MPSTREAM_PROPERTY_EXAMPLES")
        examples, fixed = _settings(importlib.reload(module), PROPERTY_TESTS[name])
        assert examples > 7 and fixed
    finally:
        monkeypatch.delenv("MPSTREAM_PROPERTY_EXAMPLES", raising=False)
        importlib.reload(module)
