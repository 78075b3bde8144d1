"""The house rules on imports, read off the package's folders.

mpstream's folders are its layers. Each top-level package (or module) of
``mpstream/`` sits in one tier below; it may import only what lies in lower
tiers, so the core (the first tiers) never imports a tool, and nothing runs
in a circle. A tool imports a core package only through what that package
exports (``from mpstream.runtime import synchronize``, a name in
``mpstream.runtime.__all__``), never one of its modules, so the core's
modules can move without breaking a tool. ``figures`` (drawn by several
tools) imports no other mpstream module. The rules read every module under
each folder: a new module is checked without editing anything here, and a
new folder (with or without ``__init__.py``) fails until it is given a
tier. A name imported from the facade (``from mpstream import profile``)
counts as an import of the folder it comes from; ``import mpstream`` as
one of everything.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mpstream"

# Bottom-up. The core: the extension and version, schedules and memory
# policies, the runtime, cutting modules into stages, the Pipe, and what
# builds on a Pipe. Then the tools, each on those below it.
CORE = [
    {"_ext", "_version", "_warn", "_words"},
    {"schedules", "memory"},
    {"runtime"},
    {"stages"},
    {"pipe"},
    {"capture", "distributed"},
]
TOOLS = [{"observe"}, {"tutorial"}, {"workloads"}, {"doctor"}, {"cli"}, {"__main__"}]
TIER = {unit: i for i, tier in enumerate(CORE + TOOLS) for unit in tier}
# ``import mpstream``: the facade, above everything (it imports every unit).
FACADE = "mpstream (the facade)"
TIER[FACADE] = len(CORE + TOOLS)
CORE_UNITS = set().union(*CORE)


def units() -> list[str]:
    """The top-level packages and modules of mpstream (the facade aside);
    a folder of modules without ``__init__.py`` too."""
    found = [
        p.name
        for p in PACKAGE.iterdir()
        if p.is_dir() and p.name != "__pycache__" and any(p.rglob("*.py"))
    ]
    found += [p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"]
    return sorted(found)


def modules(unit: str) -> list[Path]:
    path = PACKAGE / unit
    return sorted(path.rglob("*.py")) if path.is_dir() else [PACKAGE / f"{unit}.py"]


def dotted(path: Path) -> list[str]:
    """A file's package, as parts (``mpstream/runtime/worker.py``: mpstream, runtime)."""
    parts = ["mpstream", *path.relative_to(PACKAGE).parts]
    return parts[:-1]


def imports(path: Path) -> list[tuple[list[str], list[str]]]:
    """Every mpstream import of a module, at any level (TYPE_CHECKING and
    function-local ones too): the absolute module imported from, and the names."""
    found: list[tuple[list[str], list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = dotted(path)[: len(dotted(path)) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            if target[0] == "mpstream":
                found.append((target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mpstream":
                    found.append((alias.name.split("."), []))
    return found


def uses(target: list[str], names: list[str]) -> list[tuple[str, list[str], list[str]]]:
    """What an import reaches: (unit, module path inside it, names imported from it)."""
    if len(target) > 1:
        return [(target[1], target[2:], names)]
    if not names or "*" in names:  # import mpstream, from mpstream import *
        return [(FACADE, [], [])]
    # from mpstream import runtime (a unit), or profile (a name the facade
    # re-exports: the unit it comes from).
    return [(name if name in TIER else _origin(name), [], []) for name in names]


def _origin(name: str) -> str:
    """The unit a name of the facade comes from (the facade if unknown)."""
    module = getattr(getattr(importlib.import_module("mpstream"), name, None), "__module__", "")
    parts = (module or "").split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "mpstream" else FACADE


def exported(unit: str) -> set[str]:
    """What a package exports: its ``__all__``."""
    return set(getattr(importlib.import_module(f"mpstream.{unit}"), "__all__", ()))


def test_every_folder_has_a_tier() -> None:
    missing = [u for u in units() if u not in TIER]
    assert not missing, f"give these a tier in tests/test_layering.py: {missing}"


@pytest.mark.parametrize("unit", units())
def test_imports_point_down(unit: str) -> None:
    wrong = []
    for path in modules(unit):
        for target, names in imports(path):
            for used, _, _ in uses(target, names):
                if used != unit and TIER.get(used, -1) >= TIER[unit]:
                    wrong.append(f"{path.relative_to(PACKAGE)} imports mpstream.{used}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("unit", sorted(set().union(*TOOLS)))
def test_tools_use_the_core_through_its_exports(unit: str) -> None:
    wrong = []
    for path in modules(unit):
        for target, names in imports(path):
            for used, inside, what in uses(target, names):
                if used not in CORE_UNITS or not (PACKAGE / used).is_dir():
                    continue  # a tool, or a core module with no inside (_ext, distributed)
                hidden = set(what) - exported(used)
                if inside or hidden:
                    reached = ".".join(["mpstream", used, *inside])
                    wrong.append(f"{path.relative_to(PACKAGE)}: {reached} {sorted(hidden)}")
    assert not wrong, "import these from the package, and export them there:\n" + "\n".join(wrong)


@pytest.mark.parametrize("unit", [u for u in units() if (PACKAGE / u).is_dir()])
def test_packages_say_what_they_hold_and_export_it(unit: str) -> None:
    init = ast.parse((PACKAGE / unit / "__init__.py").read_text())
    assert ast.get_docstring(init), f"mpstream/{unit}/__init__.py needs a docstring"
    package = importlib.import_module(f"mpstream.{unit}")
    names = exported(unit)
    assert names, f"mpstream.{unit} exports nothing (__all__)"
    assert all(hasattr(package, n) for n in names)


def test_an_import_of_the_facade_counts_as_what_it_reaches() -> None:
    assert uses(["mpstream"], ["profile"]) == [("observe", [], [])]
    assert uses(["mpstream"], ["runtime"]) == [("runtime", [], [])]
    assert uses(["mpstream"], []) == [(FACADE, [], [])]


def test_figures_imports_no_mpstream_module() -> None:
    assert imports(PACKAGE / "observe" / "figures.py") == []


def _module_imports() -> dict[str, set[str]]:
    """Module -> the mpstream modules it imports (type-checking imports too:
    a circle only the type checker follows still ties two modules in one)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + [node.module] if node.module else base)
                if not node.level:
                    module = node.module or ""
                for alias in node.names:
                    target = f"{module}.{alias.name}"
                    found.add(target if target in names else module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {
            t for t in found if t in names and t != name and not t.startswith(name + ".")
        }
    return graph


def test_no_module_imports_itself_in_a_circle() -> None:
    graph = _module_imports()
    circles = []
    for start in graph:  # depth-first from each module: small graph, plain search
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start and len(path) > 1:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in path and nxt > start:  # each circle once, from its smallest
                    stack.append((nxt, [*path, nxt]))
    assert not circles, "import circles:\n" + "\n".join(circles)
