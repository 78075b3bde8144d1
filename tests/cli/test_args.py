"""The ``mpstream`` commands refuse bad options before measuring anything:
argument types, and ``--out`` / ``--cache`` paths they could not write."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from mpstream import cli
from mpstream.cli.argtypes import (
    device_here,
    device_name,
    devices_here,
    non_negative_float,
    positive_float,
)
from mpstream.cli.main import _config


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (positive_float, "0", "must be greater than 0"),
        (positive_float, "-1", "must be greater than 0"),
        (positive_float, "nan", "must be a finite number"),
        (positive_float, "fast", "expected a number"),
        (non_negative_float, "-0.5", "must not be negative"),
        (non_negative_float, "inf", "must be a finite number"),
        (device_name, "foo", "'foo' is not a device name"),
    ],
)
def test_bad_values_are_refused(parse: object, text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(text)  # type: ignore[operator]


def test_good_values_pass() -> None:
    assert positive_float("12.5") == 12.5
    assert non_negative_float("0") == 0.0
    assert device_name("cuda:5") == "cuda:5"  # a name; whether it exists is checked later


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["trace", "--link-gbps", "0"], "--link-gbps: must be greater than 0"),
        (["schedules", "--device", "foo"], "--device: 'foo' is not a device name"),
        (["schedules", "--copy-ms", "-1"], "--copy-ms: must not be negative"),
    ],
)
def test_bad_options_exit_2_at_once(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "tune", "trace", "schedules", "doctor"])
def test_an_out_that_cannot_be_a_folder_exits_2_before_measuring(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("")
    for out in (taken, taken / "below"):
        assert cli.main([command, "--out", str(out)]) == 2
        assert f"error: --out {out}: cannot create the folder" in capsys.readouterr().err


def test_tune_refuses_a_cache_that_is_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "new" / "out"
    args = ["tune", "--cache", str(tmp_path), "--out", str(out)]
    assert cli.main(args) == 2
    assert f"--cache {tmp_path}: is a folder" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # the --out it created is gone again
    assert cli.main([*args, "--no-cache", "--devices", "cpu"]) == 2  # --cache unused
    err = capsys.readouterr().err
    assert "two comma-separated devices" in err and "--cache" not in err


def test_tune_takes_no_option_it_would_ignore(capsys: pytest.CaptureFixture[str]) -> None:
    # tune times one mini-batch per step, over its --split-sizes.
    with pytest.raises(SystemExit) as info:
        cli.main(["tune", "--num-batches", "3"])
    assert info.value.code == 2
    assert "unrecognized arguments: --num-batches 3" in capsys.readouterr().err
    # No main split size: --split-size is read as (argparse's prefix of) --split-sizes.
    assert list(cli.parser().parse_args(["tune", "--split-size", "2"]).split_sizes) == [2]


@pytest.mark.parametrize(
    ("args", "main"),
    [
        (["--batch-size", "8"], 5),  # not the default 12: one micro-batch
        (["--quick", "--batch-size", "2"], 1),
        (["--quick", "--batch-size", "16"], 4),  # the default fits
        (["--batch-size", "8", "--split-sizes", "2,4"], 4),
        (["--batch-size", "8", "--split-size", "8"], 8),  # given: as given
    ],
)
def test_the_default_main_split_leaves_several_micro_batches(args: list[str], main: int) -> None:
    parsed = cli.parser().parse_args(["bench", *args])
    assert _config(parsed).split_size == main


def test_doctor_skips_accumulate() -> None:
    parsed = cli.parser().parse_args(["doctor", "--skip", "tutorial", "--skip", "races", "memory"])
    assert parsed.skip == ["tutorial", "races", "memory"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--uniform", "--device", "cpu", "--split-size", "4"],
            "--device, --split-size: --uniform uses unit costs and profiles no ResNet50; "
            "drop them or --uniform",
        ),
        (["--uniform", "--no-memory"], "--no-memory: --uniform uses unit costs"),
        (
            ["--stages", "3", "--balance", "tutorial"],
            "--balance tutorial: the tutorial's cut exists for 2 or 4 stages, not 3; "
            "use --balance time",
        ),
    ],
)
def test_schedules_refuses_options_it_would_ignore(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["schedules", *args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_devices_here_are_checked_against_this_machine() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert devices_here("cpu, cpu") == ["cpu", "cpu"]
    with pytest.raises(argparse.ArgumentTypeError, match=f"cuda:{count}: no such device here"):
        device_here(f"cuda:{count}")
    with pytest.raises(argparse.ArgumentTypeError, match="runs on cpu and cuda devices"):
        device_here("meta")
    with pytest.raises(argparse.ArgumentTypeError, match="expected comma-separated devices"):
        devices_here(",")
