"""Every test that needs a CUDA device carries the ``cuda`` mark, read off the tests' source.

The GPU checks select their tests with ``-m cuda`` (``bash .ci/gpu cuda``, and
the lease's checks, which run nothing else): a test that skips itself
without a GPU but lacks the mark is skipped on every CPU machine and left
out of those checks, so it never runs. A test needs a CUDA device here when
it skips without one: a ``skipif`` (on the test or its class, through a
module-level name such as ``two_gpus = pytest.mark.skipif(...)``, or in
``pytestmark``) or an ``if ...: pytest.skip(...)`` opening its body, whose
condition holds on a CUDA build of torch with no GPU and not on one with
eight GPUs (a skip on a CPU-only build, ``torch.version.cuda is None``, needs
no device). The conditions are evaluated against a fake ``torch``, a test's
arguments standing for any value; one that mentions CUDA but cannot be
evaluated fails the test, so the scan never passes by not understanding.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

TESTS = Path(__file__).resolve().parent


def fake_torch(gpus: int) -> SimpleNamespace:
    """What the skip conditions may ask of a CUDA build of torch on a machine
    with ``gpus`` GPUs."""
    cuda = SimpleNamespace(is_available=lambda: gpus > 0, device_count=lambda: gpus)
    return SimpleNamespace(cuda=cuda, version=SimpleNamespace(cuda="12.8"))


@dataclass
class Module:
    """One test module's module-level names, marks and skips."""

    names: dict[str, ast.expr] = field(default_factory=dict)
    marks: list[ast.expr] = field(default_factory=list)  # pytestmark's items


def mark_items(value: ast.expr) -> list[ast.expr]:
    """The marks of ``pytestmark = ...`` (one mark, or a list or tuple of them)."""
    return list(value.elts) if isinstance(value, ast.List | ast.Tuple) else [value]


def read_module(tree: ast.Module) -> Module:
    module = Module()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            module.names[target.id] = value
            if target.id == "pytestmark":
                module.marks = mark_items(value)
    return module


def resolve(expr: ast.expr, module: Module) -> ast.expr:
    """A decorator given by a module-level name (``@two_gpus``) as its value."""
    seen: set[str] = set()
    while isinstance(expr, ast.Name) and expr.id in module.names and expr.id not in seen:
        seen.add(expr.id)
        expr = module.names[expr.id]
    return expr


def is_mark(expr: ast.expr, name: str) -> bool:
    """Whether ``expr`` is ``pytest.mark.<name>`` (or a call of it)."""
    if isinstance(expr, ast.Call):
        expr = expr.func
    return (
        isinstance(expr, ast.Attribute)
        and expr.attr == name
        and isinstance(expr.value, ast.Attribute)
        and expr.value.attr == "mark"
    )


def is_pytest_skip(node: ast.stmt) -> bool:
    call = node.value if isinstance(node, ast.Expr) else None
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "skip"
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "pytest"
    )


def mentions_cuda(expr: ast.expr, module: Module, seen: frozenset[str] = frozenset()) -> bool:
    """Whether ``expr``, or a module-level name it reads, mentions CUDA."""
    if "cuda" in ast.unparse(expr).lower():
        return True
    names = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)} - seen
    return any(
        mentions_cuda(module.names[n], module, seen | names) for n in names if n in module.names
    )


class AnyValue:
    """A test's argument in a skip condition: equal to any value it is
    compared with, true, and so are its attributes, so ``devices == 'two' and
    torch.cuda.device_count() < 2`` counts as skipping without CUDA (for that
    parameter)."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return True

    def __getattr__(self, name: str) -> AnyValue:
        return AnyValue()

    __hash__ = object.__hash__


def evaluate(
    expr: ast.expr, module: Module, gpus: int, args: frozenset[str] = frozenset()
) -> object:
    """``expr`` on a machine with ``gpus`` GPUs, its module-level names
    evaluated the same way (``ON_GPU = torch.cuda.is_available()``) and the
    test's arguments ``args`` standing for any value."""
    scope: dict[str, object] = {"torch": fake_torch(gpus), **{a: AnyValue() for a in args}}
    reads = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
    for name in sorted((reads - args) & module.names.keys()):
        scope[name] = evaluate(module.names[name], module, gpus)
    code = compile(ast.Expression(expr), "<skip condition>", "eval")
    return eval(code, {"__builtins__": {}}, scope)  # the tests' own source


def needs_cuda(
    condition: ast.expr, module: Module, where: str, args: frozenset[str] = frozenset()
) -> bool:
    """Whether a skip on ``condition`` skips without CUDA and runs on GPUs."""
    if not mentions_cuda(condition, module):
        return False
    try:
        without, with_gpus = (bool(evaluate(condition, module, g, args)) for g in (0, 8))
    except Exception as error:
        raise AssertionError(
            f"{where}: cannot tell whether `{ast.unparse(condition)}` needs CUDA "
            f"({type(error).__name__}: {error}); extend tests/test_marks.py"
        ) from error
    return without and not with_gpus


def skip_conditions(marks: list[ast.expr], module: Module) -> list[ast.expr]:
    """The conditions of the ``skipif`` marks among ``marks``."""
    found = []
    for mark in (resolve(m, module) for m in marks):
        if is_mark(mark, "skipif") and isinstance(mark, ast.Call) and mark.args:
            found.append(mark.args[0])
    return found


def unmarked_cuda_tests(source: str, path: str) -> tuple[list[str], list[str]]:
    """(tests that need CUDA, those of them without the ``cuda`` mark) in one module."""
    tree = ast.parse(source)
    module = read_module(tree)
    module_marked = any(is_mark(resolve(m, module), "cuda") for m in module.marks)
    module_needs = any(
        needs_cuda(c, module, f"{path}: pytestmark") for c in skip_conditions(module.marks, module)
    )
    needs: list[str] = []
    unmarked: list[str] = []

    def visit(fn: ast.FunctionDef | ast.AsyncFunctionDef, outer: list[ast.expr], name: str) -> None:
        where = f"{path}::{name}"
        decorators = [resolve(d, module) for d in [*outer, *fn.decorator_list]]
        conditions = skip_conditions(decorators, module)
        skips = any(needs_cuda(c, module, where) for c in conditions)
        args = frozenset(a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs])
        for statement in fn.body:  # `if ...: pytest.skip(...)` opening the body
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                continue  # the docstring
            if isinstance(statement, ast.If) and any(is_pytest_skip(s) for s in statement.body):
                skips = skips or needs_cuda(statement.test, module, where, args)
                continue
            break
        if module_needs or skips:
            needs.append(where)
            if not (module_marked or any(is_mark(d, "cuda") for d in decorators)):
                unmarked.append(where)

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name.startswith("test"):
                visit(node, [], node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    if item.name.startswith("test"):
                        visit(item, node.decorator_list, f"{node.name}::{item.name}")
    return needs, unmarked


def test_every_test_that_skips_without_cuda_has_the_cuda_mark() -> None:
    needs: list[str] = []
    unmarked: list[str] = []
    for path in sorted(TESTS.rglob("test_*.py")):
        where = str(path.relative_to(TESTS.parent))
        n, u = unmarked_cuda_tests(path.read_text(), where)
        needs += n
        unmarked += u
    assert unmarked == [], f"add @pytest.mark.cuda (or a module's pytestmark) to {unmarked}"
    # The scan sees them: a skipif on the test (a skipif through a
    # module-level name is the sample's, below).
    assert "tests/stages/test_placement.py::test_placement_moves_tensors_in_place" in needs


SAMPLE = '''
import pytest
import torch

ON_GPU = torch.cuda.is_available()
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
old = pytest.mark.skipif(sys.version_info < (3, 11), reason="not about CUDA")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_unmarked() -> None: ...


@pytest.mark.skipif(ON_GPU, reason="checks the CPU run")
def test_cpu_only() -> None: ...


@pytest.mark.cuda
@two_gpus
def test_marked() -> None: ...


@two_gpus
def test_unmarked_through_a_name() -> None: ...


@old
def test_not_about_cuda() -> None: ...


def test_skips_in_its_body() -> None:
    """A docstring first."""
    if not ON_GPU:
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("devices", ["one", "two"])
def test_skips_for_one_parameter(devices: str) -> None:
    if devices == "two" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


CUDA_BUILD = torch.version.cuda is not None


@pytest.mark.parametrize("p", [CALL])
def test_skips_on_a_cpu_build(p: object) -> None:
    if p.cuda_only and not CUDA_BUILD:
        pytest.skip("a CUDA build's call; this torch has none")


def test_skips_on_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only default")


class TestGroup:
    @two_gpus
    def test_in_a_class(self) -> None: ...


@pytest.mark.cuda
class TestMarked:
    @two_gpus
    def test_in_a_marked_class(self) -> None: ...
'''


def test_the_scan_finds_unmarked_cuda_tests_by_decorator_name_body_and_class() -> None:
    needs, unmarked = unmarked_cuda_tests(SAMPLE, "sample.py")
    assert unmarked == [
        "sample.py::test_unmarked",
        "sample.py::test_unmarked_through_a_name",
        "sample.py::test_skips_in_its_body",
        "sample.py::test_skips_for_one_parameter",
        "sample.py::TestGroup::test_in_a_class",
    ]
    assert set(needs) - set(unmarked) == {
        "sample.py::test_marked",
        "sample.py::TestMarked::test_in_a_marked_class",
    }


SKIPS_WITHOUT_CUDA = "@pytest.mark.skipif(not torch.cuda.is_available(), reason='')\n"


@pytest.mark.parametrize(
    ("pytestmark", "unmarked"),
    [
        ("pytest.mark.cuda", []),
        ("[pytest.mark.slow, pytest.mark.cuda]", []),
        ("pytest.mark.slow", ["m.py::test_b"]),
        (SKIPS_WITHOUT_CUDA[1:-1], ["m.py::test_a", "m.py::test_b"]),
    ],
)
def test_the_scan_reads_a_modules_pytestmark(pytestmark: str, unmarked: list[str]) -> None:
    source = (
        f"import pytest, torch\npytestmark = {pytestmark}\n\ndef test_a() -> None: ...\n\n"
        f"{SKIPS_WITHOUT_CUDA}def test_b() -> None: ...\n"
    )
    assert unmarked_cuda_tests(source, "m.py")[1] == unmarked


def test_a_condition_the_scan_cannot_evaluate_fails_it() -> None:
    source = (
        "import pytest, torch\n\n"
        "@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 0), reason='')\n"
        "def test_a() -> None: ...\n"
    )
    with pytest.raises(AssertionError, match="cannot tell whether .* needs CUDA"):
        unmarked_cuda_tests(source, "m.py")


def test_every_test_file_the_gpu_script_names_exists() -> None:
    # A file renamed or retired would otherwise fail only on the GPU
    # machine, where every minute is counted.
    script = (TESTS.parent / ".ci" / "gpu").read_text()
    named = sorted(set(re.findall(r"tests/[\w/]+\.py", script)))
    assert named, "the GPU script names its graph tests"
    assert [n for n in named if not (TESTS.parent / n).is_file()] == []
