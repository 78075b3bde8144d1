"""The extension load check names both torch versions and the rebuild command."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from mpstream import _ext


def test_loads_and_matches_installed_torch() -> None:
    ext = _ext.load()
    assert ext.torch_version() == torch.__version__


def test_missing_extension_says_how_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> types.ModuleType:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(_ext.ExtensionError) as info:
        _ext.load()
    text = str(info.value)
    assert "not built" in text
    assert f"installed torch: {torch.__version__}" in text
    assert _ext.REBUILD_COMMAND in text


def test_unloadable_extension_names_the_stamped_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> types.ModuleType:
        raise ImportError("undefined symbol: _ZN3c104impl8GPUTrace")

    monkeypatch.setattr(importlib, "import_module", broken)
    monkeypatch.setattr(_ext, "_stamped_version", lambda: "2.0.0+cu118")
    with pytest.raises(_ext.ExtensionError) as info:
        _ext.load()
    text = str(info.value)
    assert "undefined symbol" in text
    assert "built for torch: 2.0.0+cu118" in text
    assert f"installed torch: {torch.__version__}" in text
    assert _ext.REBUILD_COMMAND in text


def test_version_mismatch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.SimpleNamespace(torch_version=lambda: "1.13.1")
    monkeypatch.setattr(importlib, "import_module", lambda name: fake)
    with pytest.raises(_ext.ExtensionError) as info:
        _ext.load()
    text = str(info.value)
    assert "different torch" in text
    assert "built for torch: 1.13.1" in text
    assert f"installed torch: {torch.__version__}" in text


def test_an_extension_built_from_older_sources_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Built before timings() carried host issue times: no interface_version.
    fake = types.SimpleNamespace(torch_version=lambda: torch.__version__)
    monkeypatch.setattr(importlib, "import_module", lambda name: fake)
    with pytest.raises(_ext.ExtensionError) as info:
        _ext.load()
    text = str(info.value)
    assert (
        f"built from other sources (interface 1, this package needs {_ext.INTERFACE_VERSION})"
        in text
    )
    assert _ext.REBUILD_COMMAND in text


def test_other_import_errors_are_not_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    def other(name: str) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'numpy'", name="numpy")

    monkeypatch.setattr(importlib, "import_module", other)
    with pytest.raises(ModuleNotFoundError, match="numpy"):
        _ext.load()


def test_a_torch_older_than_the_tested_floor_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    with pytest.raises(ImportError, match=r"needs torch >= 2\.7; torch 2\.6\.0\+cu124") as info:
        _ext.load()
    assert _ext.REBUILD_COMMAND in str(info.value)
    for version in ("2.7.0", "2.7.0a0+79aa17489c.nv25.04", "2.11.0+cu130", "10.0.0"):
        monkeypatch.setattr(torch, "__version__", version)
        monkeypatch.setattr(
            importlib,
            "import_module",
            lambda name, v=version: types.SimpleNamespace(
                torch_version=lambda: v, interface_version=_ext.INTERFACE_VERSION
            ),
        )
        _ext.load()
