"""The CUDA-only tests' references into mpstream still resolve, checked on the CPU by AST.

Tests that need a GPU (tests/cuda/, ``*_cuda.py``, and every test marked ``cuda``,
the mark tests/test_marks.py makes each test that skips without CUDA carry) run
only on a lent GPU machine, so a name a refactor moved fails there first, with
an AttributeError (``monkeypatch.setattr(copy, "move", ...)`` after ``move`` went).
Without running them, each such module's ``monkeypatch.setattr``/``delattr`` and
``unittest.mock.patch``/``patch.object`` targets, its imports from mpstream and
tests (function-local ones included, which collection does not run), its
attribute chains on those modules (``graphed.stages.StageGraphs``; what a call
returns is not followed) and a module and name a helper is given as two strings
(``spy(monkeypatch, "mpstream.runtime.copy", "send")``) must resolve. A target
given through a name the module does not import (a test's local) is skipped and
counted; none resolved fails the test, so it cannot pass by understanding nothing.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parent
OURS = ("mpstream", "tests")  # imported to check; other modules only if already imported
UNKNOWN, MISSING = object(), object()  # not known statically; reported missing
Scope = ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
PATCHES = {"patch", "mock.patch", "unittest.mock.patch"}


def member(obj: object, name: str) -> object:
    """``obj.name``, a submodule not imported yet included, or MISSING."""
    if hasattr(obj, name):
        return getattr(obj, name)
    if isinstance(obj, ModuleType):
        try:
            return importlib.import_module(f"{obj.__name__}.{name}")
        except ModuleNotFoundError:
            pass
    return MISSING


def known(obj: object) -> bool:
    """Whether ``obj`` was resolved (by identity: a tensor's ``==`` is elementwise)."""
    return obj is not UNKNOWN and obj is not MISSING


def text(node: ast.expr | None) -> str | None:
    """The string ``node`` is a literal of, if it is one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def ours(obj: object) -> bool:
    """Whether ``obj`` is a module of mpstream or of the tests."""
    return isinstance(obj, ModuleType) and obj.__name__.partition(".")[0] in OURS


def local_nodes(scope: Scope) -> Iterator[ast.AST]:
    """The nodes of ``scope`` outside the functions and classes it defines
    (their decorators and defaults are evaluated in ``scope``, so read here)."""
    todo: list[ast.AST] = [scope.body] if isinstance(scope, ast.Lambda) else list(scope.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, Scope):
            todo += getattr(node, "decorator_list", [])
            if not isinstance(node, ast.ClassDef | ast.Module):
                todo += [*node.args.defaults, *(d for d in node.args.kw_defaults if d)]
        elif isinstance(node, ast.AnnAssign):  # annotations are not evaluated here
            todo += [node.target, *([node.value] if node.value else [])]
        else:
            todo += ast.iter_child_nodes(node)


class Checker:
    """The problems of one module's source, and how many targets were resolved."""

    def __init__(self, source: str, where: str, package: str) -> None:
        self.where, self.package = where, package
        self.found: set[tuple[int, str]] = set()  # (line, problem)
        self.resolved = self.unresolved = 0
        self.visit(ast.parse(source), [])

    def report(self, node: ast.AST, owner: object, name: str) -> object:
        """Records that ``owner`` has no ``name`` at ``node``'s line; returns MISSING."""
        line = getattr(node, "lineno", 0)
        owner = getattr(owner, "__name__", type(owner).__name__)
        self.found.add((line, f"{self.where}:{line}: {owner} has no {name!r}"))
        return MISSING

    @property
    def problems(self) -> list[str]:
        """Each problem as ``file:line: owner has no 'name'``, by line."""
        return [problem for _, problem in sorted(self.found)]

    def load(self, node: ast.AST, dotted: str) -> object:
        """The object ``a.b.c`` names, each missing step reported."""
        first, *rest = dotted.split(".")
        if first not in OURS and first not in sys.modules:
            return UNKNOWN
        obj: object = importlib.import_module(first)
        for name in rest:
            found = member(obj, name)
            if found is MISSING:
                return self.report(node, obj, name)
            obj = found
        return obj

    def imported(self, node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, object]]:
        """The names an import binds and their objects."""
        if isinstance(node, ast.Import):
            for alias in node.names:
                obj = self.load(node, alias.name)
                top = alias.name.split(".")[0]
                yield (alias.asname, obj) if alias.asname else (top, self.load(node, top))
            return
        parts = self.package.split(".")
        base = parts[: len(parts) - node.level + 1] if node.level else []
        module = self.load(node, ".".join([*base, *([node.module] if node.module else [])]))
        for alias in node.names:
            obj = member(module, alias.name) if known(module) else UNKNOWN
            if obj is MISSING and ours(module):
                self.report(node, module, alias.name)
            yield alias.asname or alias.name, UNKNOWN if obj is MISSING else obj

    def visit(self, scope: Scope, outer: list[dict[str, object]]) -> None:
        """Checks ``scope`` and the scopes it defines; ``outer`` binds the enclosing
        scopes' names (an import's object, or UNKNOWN for any other binding)."""
        nodes = list(local_nodes(scope))
        imports: dict[str, object] = {}
        bound = (
            set()
            if isinstance(scope, ast.Module | ast.ClassDef)
            else {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)}
        )
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name, obj in self.imported(node):
                    imports[name] = obj if imports.get(name, obj) is obj else UNKNOWN
            elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                bound.add(node.id)
            elif isinstance(node, Scope) and not isinstance(node, ast.Lambda | ast.Module):
                bound.add(node.name)
        env = [*outer, {**imports, **dict.fromkeys(bound - imports.keys(), UNKNOWN)}]
        for name in bound & imports.keys():  # imported and bound some other way too
            env[-1][name] = UNKNOWN
        inner = {id(n.value) for n in nodes if isinstance(n, ast.Attribute)}
        for node in nodes:
            if isinstance(node, ast.Attribute) and id(node) not in inner:
                self.resolve(node, env, strict=False)  # a plain chain on our modules
            elif isinstance(node, ast.Call):
                self.target(node, env)
                self.named(node)
            elif isinstance(node, Scope) and node is not scope:
                self.visit(node, env)

    def resolve(self, expr: ast.expr, env: list[dict[str, object]], strict: bool) -> object:
        """What ``expr`` names: through any object if ``strict``, else our modules only."""
        if isinstance(expr, ast.Name):
            return next((s[expr.id] for s in reversed(env) if expr.id in s), UNKNOWN)
        if not isinstance(expr, ast.Attribute):
            return UNKNOWN
        base = self.resolve(expr.value, env, strict)
        if not known(base) or not (strict or ours(base)):
            return MISSING if base is MISSING else UNKNOWN
        found = member(base, expr.attr)
        return self.report(expr, base, expr.attr) if found is MISSING else found

    def target(self, call: ast.Call, env: list[dict[str, object]]) -> None:
        """Checks what a ``monkeypatch.setattr``/``delattr`` or mock ``patch`` replaces."""
        func, args = ast.unparse(call.func), call.args
        flags = {k.arg: k.value.value for k in call.keywords if isinstance(k.value, ast.Constant)}
        if func in {"monkeypatch.setattr", "monkeypatch.delattr"}:
            if not flags.get("raising", True):
                return  # may add a name
            dotted = len(args) == (2 if func.endswith("setattr") else 1)
        elif func in PATCHES | {f"{p}.object" for p in PATCHES}:
            if flags.get("create"):
                return
            dotted = func in PATCHES
        else:
            return
        first, name = text(args[0]) if args else None, text(args[1]) if args[1:] else None
        if dotted and first is not None:
            found = self.load(call, first)
        elif name is not None:
            owner = self.resolve(args[0], env, strict=True)
            found = member(owner, name) if known(owner) else owner
            if found is MISSING and owner is not MISSING:
                self.report(call, owner, name)
        else:
            found = UNKNOWN
        self.unresolved += found is UNKNOWN
        self.resolved += found is not UNKNOWN

    def named(self, call: ast.Call) -> None:
        """Checks a module and a name given a helper as two strings, as in
        ``spy(monkeypatch, "mpstream.runtime.copy", "send")``."""
        values = [text(a) for a in call.args]
        for module, name in zip(values, values[1:]):
            if module is None or not re.fullmatch(r"mpstream(\.\w+)*", module):
                continue
            found = self.load(call, module)
            if isinstance(found, ModuleType) and name is not None and name.isidentifier():
                self.resolved += 1
                if member(found, name) is MISSING:
                    self.report(call, found, name)


def cuda_only(path: Path, source: str) -> bool:
    """Whether a module under tests/ holds tests that run only with a GPU."""
    in_cuda = path.parent == TESTS / "cuda" or path.stem.endswith("_cuda")
    return in_cuda or re.search(r"\bmark\.cuda\b", source) is not None


def test_what_the_cuda_only_tests_patch_import_and_read_exists() -> None:
    checked: list[str] = []
    problems: list[str] = []
    resolved = unresolved = 0
    for path in sorted(TESTS.rglob("*.py")):
        source = path.read_text()
        if path == Path(__file__).resolve() or not cuda_only(path, source):
            continue
        where = str(path.relative_to(TESTS.parent))
        package = ".".join(path.relative_to(TESTS.parent).parent.parts)
        checker = Checker(source, where, package)
        checked.append(where)
        problems += checker.problems
        resolved, unresolved = resolved + checker.resolved, unresolved + checker.unresolved
    assert problems == [], "stale names in CUDA-only tests:\n" + "\n".join(problems)
    assert {"tests/cuda/test_correctness.py", "tests/capture/test_step_cuda.py"} <= set(checked)
    assert resolved > 0, f"no patch target resolved ({unresolved} could not be)"


STALE = """
from unittest import mock

import pytest
from mpstream.pipe import pipe as pipe_py
from mpstream.runtime import graphed


@pytest.mark.cuda
def test_stale(monkeypatch, pipe) -> None:
    from mpstream.runtime import copy
    from mpstream.runtime.copy import to_device, move

    monkeypatch.setattr(copy, "move", to_device)
    monkeypatch.setattr(pipe_py, "Snapshot", None)
    monkeypatch.setattr("mpstream.runtime.copy.move", None)
    monkeypatch.setattr(pipe, "Snapshot", None)  # a test's argument: skipped
    monkeypatch.setattr(copy, "gone", None, raising=False)
    graphed.stages.StageGraphs(pipe).gone
    graphed.stages.gone()
    spy(monkeypatch, "mpstream.runtime.copy", "move")
    with mock.patch.object(copy, "move"):
        mock.patch("mpstream.runtime.copy.move")
"""


def test_the_check_names_a_stale_patch_import_and_chain_by_line() -> None:
    checker = Checker(STALE, "t.py", "tests")
    assert list(checker.problems) == [
        "t.py:12: mpstream.runtime.copy has no 'move'",  # a function-local import
        "t.py:14: mpstream.runtime.copy has no 'move'",
        "t.py:15: mpstream.pipe.pipe has no 'Snapshot'",
        "t.py:16: mpstream.runtime.copy has no 'move'",
        "t.py:20: mpstream.runtime.graphed.stages has no 'gone'",
        "t.py:21: mpstream.runtime.copy has no 'move'",
        "t.py:22: mpstream.runtime.copy has no 'move'",
        "t.py:23: mpstream.runtime.copy has no 'move'",
    ]
    assert (checker.resolved, checker.unresolved) == (6, 1)
