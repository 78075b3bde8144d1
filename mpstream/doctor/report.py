"""The doctor's report: a console table, ``summary.md``, ``report.json`` and one archive.

The report folder holds at most :data:`MAX_FILES` files and no folders:
the summary, the JSON, the step-7 timeline, the overlap Gantt (GPU), the
tutorial's three figures, and ``doctor-raw.tar.gz`` with everything else
(Chrome traces, the experiment's JSON, sanitizer logs, tracebacks, the
console log).
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .diagnosis import FAIL, PASS, SKIP, StepResult, jsonable

__all__ = [
    "MAX_FILES",
    "ARCHIVE",
    "ARTIFACTS",
    "status_of",
    "table",
    "markdown",
    "top_files",
    "write",
]

MAX_FILES = 8
ARCHIVE = "doctor-raw.tar.gz"
FIGURES = (
    "timeline.png",
    "overlap.png",
    "mp_vs_rn.png",
    "mp_vs_rn_vs_pp.png",
    "split_size_tradeoff.png",
    # --model transformer's
    "transformer_throughput.png",
    "transformer_memory.png",
    "transformer_memory_schedules.png",
    "transformer_timeline.png",
)
RESULTS = ("transformer.json",)  # the transformer bench's, step 6
# Every top-level file a doctor run may write (stale ones are removed first).
ARTIFACTS = ("summary.md", "report.json", *FIGURES, *RESULTS, ARCHIVE)


def status_of(results: Sequence[StepResult]) -> str:
    """The run's status: FAIL if any step failed, SKIP if none ran (nothing
    was checked), else PASS."""
    if any(r.status == FAIL for r in results):
        return FAIL
    return SKIP if all(r.status == SKIP for r in results) else PASS


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def table(results: Sequence[StepResult], width: int = 100) -> str:
    """The summary table printed last: one row per step."""
    head = f"{'#':>2}  {'step':<20} {'status':<6} {'time':>8}  key figure / reason"
    lines = [head, "-" * len(head)]
    for i, r in enumerate(results, 1):
        text = r.figure if r.status == PASS or not r.reason else f"{r.reason}"
        lines.append(
            f"{i:>2}  {r.title:<20} {r.status:<6} {r.seconds:>7.1f}s  {_clip(text, width - 43)}"
        )
    lines.append(f"overall: {status_of(results)}")
    return "\n".join(lines)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _provenance(env: dict[str, Any]) -> str:
    gpus = env.get("gpus") or []
    if gpus:
        names = ", ".join(sorted({g["name"] for g in gpus}))
        device = f"{len(gpus)} x {names} ({gpus[0]['memory_gib']} GiB), driver {env.get('driver')}"
    else:
        device = f"no GPU: {env.get('cpu')}"
    commit = (env.get("git_commit") or "unknown")[:12]
    return (
        f"**Device:** {device}  \n"
        f"**Software:** torch {env.get('torch')} (CUDA {env.get('cuda') or '-'}, cuDNN "
        f"{env.get('cudnn') or '-'}), Python {env.get('python')}, mpstream {env.get('mpstream')} "
        f"at commit `{commit}`  \n"
        f"**Host:** {env.get('host')}, {env.get('platform')}  "
    )


def markdown(results: Sequence[StepResult], meta: dict[str, Any], files: Sequence[str]) -> str:
    """``summary.md``: provenance, the table of every step, each step's checks, the figures."""
    lines = [
        f"# mpstream doctor: {status_of(results)}" + (" so far" if meta.get("partial") else ""),
        "",
        _provenance(meta["environment"]),
        f"**Run:** `{meta['command']}` on {' | '.join(meta['devices'])}, {meta['sizes']} sizes, "
        f"{meta['created']}, {meta['total_seconds']:.0f} s in all",
        "",
    ]
    if meta.get("partial"):
        lines += [f"**Partial:** {meta['partial']}", ""]
    lines += [
        "| # | step | status | key figure | reason | time |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(results, 1):
        lines.append(
            f"| {i} | {r.title} | **{r.status}** | {_cell(r.figure)} | {_cell(r.reason)} "
            f"| {r.seconds:.1f} s |"
        )
    for i, r in enumerate(results, 1):
        lines += ["", f"## {i}. {r.title}: {r.status}"]
        if r.reason:
            lines += ["", _cell(r.reason)]
        if r.checks:
            lines += ["", "| check | status | detail |", "| --- | --- | --- |"]
            lines += [f"| {_cell(c.name)} | {c.status} | {_cell(c.detail)} |" for c in r.checks]
    shown = [f for f in FIGURES if f in files]
    if shown:
        lines += ["", "## Figures", ""]
        lines += [f"![{Path(f).stem}]({f})" for f in shown]
    lines += [
        "",
        "## Files",
        "",
        "`report.json` holds every measurement; "
        f"`{ARCHIVE}` holds: {', '.join(meta['archived']) or 'nothing'}.",
        "",
    ]
    return "\n".join(lines)


def top_files(out: Path) -> list[str]:
    """The report's top-level files, given the figures the steps left in ``out``."""
    left = (f for f in (*FIGURES, *RESULTS) if (out / f).exists())
    return ["summary.md", "report.json", *left, ARCHIVE]


def write(
    out: Path,
    scratch: Path,
    results: Sequence[StepResult],
    meta: dict[str, Any],
) -> list[Path]:
    """Writes the report into ``out`` and archives ``scratch``'s files.

    Returns:
        The top-level files of the report (at most :data:`MAX_FILES`).
    """
    archived = sorted(p.name for p in scratch.iterdir() if p.is_file())
    # Each file is written beside its place and renamed into it: a run killed
    # mid-write (a time limit's SIGTERM) keeps the last whole report.
    with _replacing(out / ARCHIVE) as part:
        with tarfile.open(part, "w:gz") as tar:
            for name in archived:
                tar.add(scratch / name, arcname=name)
    meta = {**meta, "archived": archived}
    files = top_files(out)
    doc = {
        **meta,
        "status": status_of(results),
        "files": files,
        "steps": [r.to_json() for r in results],
    }
    with _replacing(out / "report.json") as part:
        part.write_text(json.dumps(jsonable(doc), indent=2) + "\n")
    with _replacing(out / "summary.md") as part:
        part.write_text(markdown(results, meta, files))
    return [out / f for f in files]


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A path to write ``path``'s new content to; renamed over ``path``
    once written (removed if writing failed)."""
    part = path.with_name(f".{path.name}.part")
    try:
        yield part
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
