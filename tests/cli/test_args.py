"""The ``mpstream`` commands refuse bad options before measuring anything:
argument types, and ``--out`` / ``--cache`` paths they could not write."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpstream import cli
from mpstream.cli.argtypes import (
    device_here,
    device_name,
    devices_here,
    int_list,
    non_negative_float,
    positive_float,
)
from mpstream.cli.resnet import _config


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
        (int_list, "4,8,4,2,8", "^4, 8 given more than once in '4,8,4,2,8': give each once$"),
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
        (["bench", "--repeat", "0"], "--repeat: must be at least 1, got 0"),
        # Repeats were merged unsaid (the transformer's micro-batch counts too).
        (
            ["bench", "--split-sizes", "4,8,4,2,8"],
            "--split-sizes: 4, 8 given more than once in '4,8,4,2,8': give each once",
        ),
        (
            ["bench", "--model", "transformer", "--micro-batches", "2,2"],
            "--micro-batches: 2 given more than once in '2,2': give each once",
        ),
        (["tune", "--split-sizes", "2, 2"], "--split-sizes: 2 given more than once in '2, 2'"),
        (["doctor", "--split-sizes", "16,16"], "--split-sizes: 16 given more than once"),
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
    # With --no-cache, --cache (or --refresh) would be ignored: refused before
    # the folder is looked at.
    for extra in (["--cache", str(tmp_path)], ["--refresh"], ["--cache", "c.json", "--refresh"]):
        assert cli.main(["tune", *extra, "--no-cache", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        given = " and ".join(a for a in extra if a.startswith("--"))
        assert f"--no-cache neither reads nor writes the cache, so {given} would be" in err
    assert not (tmp_path / "new").exists()


def test_tune_refuses_an_out_that_is_the_caches_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its tune.json would replace the cache's file, every stored result lost.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = tmp_path / "xdg" / "mpstream"
    mine = tmp_path / "mine"
    runs = [
        (["--out", str(folder)], folder),
        (["--no-cache", "--out", str(folder)], folder),  # the user's cache all the same
        (["--cache", str(mine / "c.json"), "--out", str(folder / ".." / "mpstream")], folder),
        (["--cache", str(mine / "tune.json"), "--out", str(mine)], mine),
    ]
    # Tiny, so that a run not refused ends soon.
    tiny = "--batch-size 4 --image-size 32 --num-classes 10 --split-sizes 2 --repeat 1"
    tiny += " --warmup 0 --no-progress --devices cpu,cpu"
    for args, cache_folder in runs:
        assert cli.main(["tune", *tiny.split(), *args]) == 2
        err = capsys.readouterr().err
        assert f"is the tuning cache's folder ({cache_folder}), whose tune.json" in err, err
        assert err.rstrip().endswith("pick another folder")
    assert not folder.exists() and not mine.exists()  # refused before any folder was made


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
        (["--quick", "--batch-size", "1"], 1),  # the split used, not the default 4
        (["--batch-size", "1"], 1),
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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--quick", "--image-size", "32", "--split-size", "1"],
            "--split-size 1 with --image-size 32x32: a micro-batch of one image",
        ),
        # 5 images in micro-batches of 2: the last holds one.
        (["--image-size", "32", "--batch-size", "5", "--split-sizes", "3,2"], "--split-sizes 2"),
        (["--image-size", "32", "--batch-size", "1"], "--batch-size 1 with --image-size 32x32"),
    ],
)
def test_a_lone_image_at_32x32_is_refused(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # BatchNorm would get one value per channel after ResNet50's 32x downsampling.
    assert cli.main(["bench", *args, "--devices", "cpu,cpu", "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_default_sweep_leaves_out_lone_images() -> None:
    config = _config(cli.parser().parse_args(["bench", "--image-size", "32", "--batch-size", "5"]))
    assert config.split_sizes == (3, 5) and config.split_size == 3  # not 1, 2 or 4: 5 % s == 1
    larger = cli.parser().parse_args(["bench", "--image-size", "33", "--batch-size", "5"])
    assert _config(larger).split_sizes == (1, 3, 5)  # 2x2 pixels at the end: any micro-batch


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "tiny"], "--preset: options of --model transformer; give it too"),
        (
            ["--micro-batches", "2", "--seq-len", "8"],
            "--micro-batches, --seq-len: options of --model transformer",
        ),
        (["--model", "transformer", "--no-sweep"], "--no-sweep: options of the tutorial's"),
        (  # refused first: the image size, refused later, keeps a regression from running
            ["--no-sweep", "--split-sizes", "2,4", "--image-size", "16"],
            "--split-sizes: the sizes the sweep times, but --no-sweep skips the sweep; drop one",
        ),
    ],
)
def test_bench_refuses_options_of_the_other_model(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", *args, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_doctor_refuses_bad_options_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["doctor", "--preset", "tiny", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "error: --preset sizes the transformer: give --model transformer too" in err
    assert not (tmp_path / "o").exists()


def test_schedules_counts_devices_with_num_devices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["schedules", "--help"])
    text = capsys.readouterr().out
    assert "--num-devices" in text
    assert "--devices" not in text  # the old spelling is hidden
    out = ["--uniform", "--stages", "2", "--no-plots", "--out", str(tmp_path / "o")]
    assert cli.main(["schedules", "--num-devices", "2", *out]) == 0
    captured = capsys.readouterr()
    assert "2 stages on 2 devices" in captured.out
    assert "deprecated" not in captured.err


def test_schedules_old_devices_spelling_still_counts_and_warns_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--uniform", "--stages", "2", "--no-plots", "--out", str(tmp_path / "o")]
    assert cli.main(["schedules", "--devices", "1", *out]) == 0
    captured = capsys.readouterr()
    assert "2 stages on 1 device," in captured.out  # not "1 devices"
    assert captured.err.splitlines() == [
        "mpstream schedules: warning: --devices is deprecated and goes in the next release; "
        "use --num-devices 1"
    ]
    assert cli.main(["schedules", "--devices", "1", "--num-devices", "1", *out]) == 2
    assert "give only --num-devices" in capsys.readouterr().err


def test_schedules_old_devices_spelling_given_names_points_to_num_devices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["schedules", "--devices", "cuda:0,cuda:1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "expected how many devices to simulate, got 'cuda:0,cuda:1'" in err
    assert "this count is --num-devices now (e.g. --num-devices 2)" in err
    assert "is --device (e.g. --device cuda:0)" in err


def test_schedules_blames_no_option_the_user_did_not_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--uniform", "--out", str(tmp_path / "o")]
    assert cli.main(["schedules", "--stages", "1", *out]) == 2
    assert (
        "--stages 1: fewer than the 2 devices simulated by default (a device needs a stage); "
        "give --num-devices 1, or more stages" in capsys.readouterr().err
    )
    assert cli.main(["schedules", "--stages", "1", "--num-devices", "2", *out]) == 2
    assert "--num-devices 2 exceeds --stages 1" in capsys.readouterr().err
    assert cli.main(["schedules", "--stages", "1", "--devices", "2", *out]) == 2
    assert "--devices 2 exceeds --stages 1" in capsys.readouterr().err


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from mpstream.tutorial.design import FULL, QUICK

    cli_main = importlib.import_module("mpstream.cli.main")
    # The help's numbers are the experiment's (written out: help loads no torchvision).
    assert (cli_main.REPEAT, cli_main.QUICK_REPEAT) == (FULL.repeat, QUICK.repeat)
    assert cli_main.WARMUP == FULL.warmup == QUICK.warmup
    assert (cli_main.BATCH, cli_main.QUICK_BATCH) == (FULL.batch_size, QUICK.batch_size)
    assert (cli_main.BATCHES, cli_main.QUICK_BATCHES) == (FULL.num_batches, QUICK.num_batches)
    assert (cli_main.IMAGE, cli_main.IMAGE) == (FULL.image_w, FULL.image_h)
    assert (cli_main.QUICK_IMAGE, cli_main.QUICK_IMAGE) == (QUICK.image_w, QUICK.image_h)
    assert cli_main.CLASSES == FULL.num_classes == QUICK.num_classes
    assert (cli_main.SWEEP, cli_main.QUICK_SWEEP) == (FULL.split_sizes, QUICK.split_sizes)

    def shown(command: str) -> str:
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        return " ".join(capsys.readouterr().out.split())

    bench, tune, trace = shown("bench"), shown("tune"), shown("trace")
    assert "timed runs per configuration (default: 10, 3 with --quick;" in bench
    assert "its preset's, tiny 5, 1b 6, 3b 6)" in bench
    assert "untimed runs before timing (default: 1;" in bench
    assert "timed runs per configuration (default: 3)" in tune
    for help_text in (bench, tune, trace):
        assert "images per mini-batch (default: 120, 16 with --quick)" in help_text
        assert "W or WxH (default: 128, 64 with --quick;" in help_text
        assert "classes of the one-hot labels (default: 1000)" in help_text
        assert "(default: 1,3,5,8,10,12,20,40,60, or 2,4,8,16 with --quick, up to" in help_text
    for help_text in (bench, trace):
        assert "mini-batches per train() call (default: 3, 2 with --quick)" in help_text
    assert "slower sizes in a row before stopping (default: 2)" in tune
    assert "split size of the traced run" in trace and "comparison" not in trace
    assert "(default: 10, 3 with --quick: the cost model's measured steps)" in trace
    # predict_scaling divides bytes by link_gbps * 1e9: gigabytes, not gigabits.
    assert "in GB/s (gigabytes per second; default: 50.0)" in trace


def test_the_doctor_s_models_and_steps_are_the_doctor_s() -> None:
    from mpstream import doctor
    from mpstream.cli import doctor as cli_doctor

    assert cli_doctor.ARCHS == doctor.ARCHS
    assert cli_doctor.SKIPPABLE == doctor.SKIPPABLE


def test_the_parser_loads_no_model_and_no_compiler() -> None:
    # Every command builds the whole parser first: torchvision's models and
    # torch._dynamo (which they import) took seconds of each command's start.
    code = (
        "import sys\n"
        "from mpstream.cli import parser\n"
        "parser()\n"
        "print([m for m in ('torchvision', 'torch._dynamo', 'matplotlib') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(("preset", "warned"), [("1b", True), ("tiny", False)])
def test_a_gpu_preset_on_the_cpu_says_what_it_costs_first(
    preset: str,
    warned: bool,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mpstream.workloads import bench

    class Stop(Exception):
        pass

    def run(*args: object, **kwargs: object) -> None:
        raise Stop  # the warning, if any, came before the run: the test ends here

    monkeypatch.setattr(bench, "run", run)
    args = ["bench", "--model", "transformer", "--preset", preset, "--devices", "cpu,cpu"]
    with pytest.raises(Stop):
        cli.main([*args, "--no-progress", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert ("the 1b preset is sized for GPUs" in err) is warned, err
    assert ("hours on a CPU (--preset tiny, or --quick, is the CPU's)" in err) is warned
