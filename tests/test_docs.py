"""The documentation runs as written.

Every ```python block of README.md and docs/*.md runs: each file's blocks in
order, in one fresh namespace per file, on the CPU, with a temporary working
directory per file (files the blocks write land there). The files run in one
subprocess, which pays the imports (torch, torchvision) once and keeps their
global state (process groups, seeds, compiled graphs) away from the other
tests. A failure names the file, the block and the Markdown line, with the
traceback (each block is compiled with its own line numbers in the file).

Every relative link in those files, and in the stored reports under
docs/results, must point to a file that exists, and to a heading that
exists when it has an ``#anchor``.

Run files' blocks by hand: ``python tests/test_docs.py README.md docs/guide.md``
(temporary working directories; the exit status is 1 if a block failed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [p.relative_to(ROOT).as_posix() for p in DOCS]
# Stored reports (doctor summaries, results' READMEs): their links only.
REPORTS = sorted((ROOT / "docs" / "results").rglob("*.md"))
REPORT_IDS = [p.relative_to(ROOT).as_posix() for p in REPORTS]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+).*?\1")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")


def blocks(path: Path) -> list[tuple[int, int, str, str]]:
    """The fenced code blocks of a Markdown file: (opening line, closing line,
    language, code)."""
    found: list[tuple[int, int, str, str]] = []
    fence: str | None = None
    lang, start, body = "", 0, []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence, lang, start, body = match.group(1), match.group(2).lower(), number, []
        elif match and match.group(1).startswith(fence) and not match.group(2):
            found.append((start, number, lang, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{path.name}: the code block opened on line {start} is not closed"
    return found


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """The ```python blocks: (line of the first code line, code)."""
    return [(start + 1, code) for start, _, lang, code in blocks(path) if lang in ("python", "py")]


def prose(path: Path, *, code_spans: bool = False) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, without inline code unless ``code_spans``."""
    fenced = {n for start, end, _, _ in blocks(path) for n in range(start, end + 1)}
    return [
        (n, line if code_spans else INLINE_CODE.sub("", line))
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if n not in fenced
    ]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose(path, code_spans=True):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def run(path: Path) -> str | None:
    """Runs ``path``'s python blocks in order in one fresh namespace.

    Returns:
        None, or the failing block's number, line and traceback.
    """
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for i, (start, code) in enumerate(python_blocks(path), start=1):
        try:
            # Padded so that tracebacks give the line numbers of the Markdown file.
            exec(compile("\n" * (start - 1) + code, str(path), "exec"), namespace)
        except BaseException:
            return f"python block {i} (line {start}) failed:\n{traceback.format_exc()}"
    return None


def run_all(paths: list[Path], workdir: Path) -> dict[str, str | None]:
    """Runs each file's blocks with its own working directory under ``workdir``."""
    results: dict[str, str | None] = {}
    for path in paths:
        cwd = workdir / re.sub(r"\W", "_", path.relative_to(ROOT).as_posix())
        cwd.mkdir(parents=True, exist_ok=True)
        os.chdir(cwd)
        print(f"== {path.relative_to(ROOT)}", flush=True)
        results[str(path)] = run(path)
    return results


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each selected file's outcome: None (passed) or its error, from one subprocess."""
    selected = {
        item.callspec.params["path"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_python_blocks_run_in_order"
    }
    paths = [p for p in DOCS if p in selected and python_blocks(p)]
    workdir = tmp_path_factory.mktemp("docs")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MPLBACKEND"] = "Agg"
    env["XDG_CACHE_HOME"] = str(workdir / "cache")  # mpstream.tune's default cache
    # One intra-op thread: on a shared machine, threads that spin while waiting
    # for a busy core make tiny CPU ops hundreds of times slower.
    env["OMP_NUM_THREADS"] = "1"
    report = workdir / "outcomes.json"
    result = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            *("--report", str(report), "--workdir", str(workdir)),
            *map(str, paths),
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = json.loads(report.read_text()) if report.exists() else {}
    crashed = f"the docs runner exited with {result.returncode}:\n{result.stderr[-4000:]}"
    return {str(p): found.get(str(p), crashed) for p in paths}


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_python_blocks_run_in_order(path: Path, outcomes: dict) -> None:
    if not python_blocks(path):
        pytest.skip("no python blocks")
    error = outcomes[str(path)]
    if error is not None:
        pytest.fail(f"{path.relative_to(ROOT)}: {error}", pytrace=False)


@pytest.mark.parametrize("path", DOCS + REPORTS, ids=IDS + REPORT_IDS)
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for number, line in prose(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto:, ...
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"line {number}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"line {number}: {target} (no such heading)")
    if broken:
        pytest.fail(f"{path.relative_to(ROOT)}:\n" + "\n".join(broken), pytrace=False)


def test_the_readme_and_the_guides_are_checked() -> None:
    names = set(IDS)
    assert {"README.md", "docs/guide.md", "docs/ddp.md"} <= names


def architecture_names() -> set[str]:
    """The modules docs/architecture.md's tables name, as paths under mpstream/.

    A row's first cell names them in backticks: the first with its folder
    (``runtime/graphed/stages.py``), the others in the same folder by their
    file name alone (``state.py``).
    """
    names: set[str] = set()
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in re.findall(r"`([^`]+\.py)`", line.split(" | ")[0]):
            if "/" in name:
                folder = name.rpartition("/")[0]
            names.add(f"{folder}/{name}" if folder and "/" not in name else name)
    return names


def test_every_module_has_a_row_in_the_architecture() -> None:
    package = ROOT / "mpstream"
    modules = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "__init__.py" and "/_" not in f"/{p.relative_to(package)}"
    }
    missing = sorted(modules - architecture_names())
    assert not missing, f"docs/architecture.md names no row for: {', '.join(missing)}"


def main(argv: list[str]) -> int:
    """``[--report FILE] [--workdir DIR] FILE.md ...``: runs the files' blocks."""
    options: dict[str, Path] = {}
    while argv[:1] in (["--report"], ["--workdir"]):
        options[argv[0]], argv = Path(argv[1]).resolve(), argv[2:]
    paths = [Path(a).resolve() for a in argv]
    sys.path.insert(0, str(ROOT))  # this checkout's mpstream, however the script is started
    with tempfile.TemporaryDirectory(prefix="mpstream-docs-") as tmp:
        results = run_all(paths, options.get("--workdir", Path(tmp)))
    if "--report" in options:
        options["--report"].write_text(json.dumps(results))
    for name, error in results.items():
        if error is not None:
            print(f"{Path(name).relative_to(ROOT)}: {error}", file=sys.stderr)
    return 1 if any(e is not None for e in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
