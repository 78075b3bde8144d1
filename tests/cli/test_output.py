"""A command whose standard output's reader has gone (``mpstream ... | head``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import pytest

from mpstream import cli
from mpstream.cli.output import reader_may_leave


@contextlib.contextmanager
def reader_gone() -> Iterator[TextIO]:
    """Standard output a pipe whose reader has exited, written line by line
    (as ``python -u`` writes): the first line written raises BrokenPipeError.
    Set in the test's body: pytest puts its own capture back before each test."""
    read, write = os.pipe()
    os.close(read)
    with open(write, "w", buffering=1) as stream:
        saved, sys.stdout = sys.stdout, stream
        try:
            yield stream
        finally:
            sys.stdout = saved


def test_schedules_writes_its_json_when_the_reader_of_its_table_has_gone(
    tmp_path: Path,
) -> None:
    # It ended with a BrokenPipeError traceback at the table, before the JSON.
    args = ["schedules", "--uniform", "--stages", "2", "--micro-batches", "2", "--no-plots"]
    with reader_gone() as stream:
        assert cli.main([*args, "--out", str(tmp_path)]) == 0
        assert sys.stdout is stream  # put back; its descriptor now writes to the null device
        print("after the command", flush=True)
    doc = json.loads((tmp_path / "schedules.json").read_text())
    assert doc["stages"] == 2 and doc["schedules"]


def test_a_refusal_after_the_reader_has_gone_still_exits_2(tmp_path: Path) -> None:
    # `mpstream tune ... 2>&1 | head`: the header is printed, then the
    # balance refused; its one-line error on standard error, read by the
    # same departed reader, ended in a BrokenPipeError traceback.
    args = ["tune", "--batch-size", "4", "--image-size", "32", "--devices", "cpu,cpu"]
    args += ["--balances", "5:5", "--no-cache", "--no-progress", "--out", str(tmp_path / "o")]
    with reader_gone() as stream:
        saved, sys.stderr = sys.stderr, stream  # 2>&1
        try:
            assert cli.main(args) == 2
            assert sys.stderr is stream
            print("after the command", file=sys.stderr, flush=True)
        finally:
            sys.stderr = saved
    assert not (tmp_path / "o").exists()


def test_reader_may_leave_passes_output_through_and_keeps_other_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with reader_may_leave():
        print("a table")
    assert capsys.readouterr().out == "a table\n"
    with pytest.raises(ValueError, match="the command's own"), reader_may_leave():
        raise ValueError("the command's own")


def test_schedules_with_standard_output_closed_writes_its_json(tmp_path: Path) -> None:
    # Started with `>&-`, sys.stdout is None (print() writes nothing): the
    # wrapper wrote to None, an AttributeError before the JSON.
    args = ["schedules", "--uniform", "--stages", "2", "--micro-batches", "2", "--no-plots"]
    saved, sys.stdout = sys.stdout, None  # type: ignore[assignment]
    try:
        assert cli.main([*args, "--out", str(tmp_path)]) == 0
        assert sys.stdout is None
    finally:
        sys.stdout = saved
    assert json.loads((tmp_path / "schedules.json").read_text())["stages"] == 2
