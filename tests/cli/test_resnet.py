"""The ResNet experiment's commands (:mod:`mpstream.cli.resnet`): what
they hand the experiment, checked without timing it."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpstream import cli


class Stop(Exception):
    """Raised by a stand-in where the test has seen what it needs."""


def test_tune_leaves_lone_images_out_of_its_default_ladder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mpstream.observe import tuning

    seen: list[object] = []

    def tune(target: object, sample: object, loss_fn: object, sizes: object, **_: object) -> None:
        seen.append(sizes)
        raise Stop

    monkeypatch.setattr(tuning, "tune", tune)
    args = ["tune", "--image-size", "32", "--batch-size", "16", "--devices", "cpu,cpu"]
    with pytest.raises(Stop):
        cli.main([*args, "--no-cache", "--out", str(tmp_path)])
    # 1 is one image, and 3 and 5 leave one over (16 % s == 1): BatchNorm
    # cannot train on one pixel per channel.
    assert seen == [(2, 4, 6, 8, 10, 12, 16)]


def test_split_sizes_are_swept_in_increasing_order() -> None:
    from mpstream.cli.resnet import _config

    parsed = cli.parser().parse_args(["bench", "--quick", "--split-sizes", "8,2,4"])
    # As given, the figure's curve ran 8 -> 2 -> 4 (a size given twice is refused).
    assert _config(parsed).split_sizes == (2, 4, 8)


def test_the_bench_header_names_each_devices_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # It named the first device's model only: a CPU + GPU run read as a CPU one.
    import torch

    from mpstream.cli import resnet
    from mpstream.tutorial import bench, machine

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(resnet, "detect_devices", lambda spec=None: (cpu, gpu))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")

    def calls(*_: object) -> None:
        raise Stop

    monkeypatch.setattr(bench, "calls", calls)
    with pytest.raises(Stop):
        cli.main(["bench", "--quick", "--no-plots", "--out", str(tmp_path)])
    header = capsys.readouterr().out.splitlines()[0]
    assert f"devices cpu ({machine.device_name(cpu)}), cuda:0 (NVIDIA H100) | quick" in header


def test_tune_says_where_and_why_a_sweep_stopped_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # tune.json said "stopped_early": true; the printed output said nothing of it.
    import json

    from mpstream.observe import tuning
    from mpstream.observe.tune_result import TunePoint, TuneResult

    def tune(target: object, sample: object, loss_fn: object, sizes: object, **_: object) -> object:
        curve = [TunePoint(s, None, [t]) for s, t in ((2, 0.3), (4, 0.2), (8, 0.4), (16, 0.5))]
        return TuneResult(curve[1], curve, True, False, {"split_sizes": [2, 4, 8, 16, 32]})

    monkeypatch.setattr(tuning, "tune", tune)
    args = ["tune", "--quick", "--image-size", "32", "--batch-size", "32", "--devices", "cpu"]
    assert cli.main([*args, "--no-cache", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[lines.index("best: split size 4, 0.2000 s") + 1] == (
        "stopped early after split size 16, leaving 32 untried: the 2 sizes timed after its "
        "fastest, 4, were slower"
    )
    assert json.loads((tmp_path / "tune.json").read_text())["stopped_early"] is True


def test_a_balance_given_twice_is_refused() -> None:
    from mpstream.cli.argtypes import UsageError
    from mpstream.cli.resnet import _balances

    # tune timed it once, unsaid.
    with pytest.raises(UsageError, match="^--balances: 9:14, time given more than once: give"):
        _balances("9:14,time,tutorial,9:14,time")
