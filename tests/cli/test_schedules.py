"""``mpstream schedules`` (:mod:`mpstream.cli.schedules`): options it
refuses before profiling anything."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mpstream import cli
from mpstream.cli.resnet import RESNET50_LAYERS


def test_more_stages_than_resnet50_has_blocks_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mpstream.tutorial.models import resnet50_layers

    assert len(resnet50_layers()) == RESNET50_LAYERS
    out = ["--out", str(tmp_path / "o")]
    assert cli.main(["schedules", "--stages", "24", "--device", "cpu", *out]) == 2
    assert (
        "error: --stages 24: ResNet50 has 23 blocks, a stage needs one; give at most 23 "
        "stages, or --uniform" in capsys.readouterr().err
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("device", "message"),
    [("cuda:99", "cuda:99: no such device here (there are: cpu"), ("meta", "meta: mpstream runs")],
)
def test_a_device_this_machine_lacks_is_refused_at_once(
    device: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["schedules", "--device", device, "--no-memory"])
    assert info.value.code == 2
    assert f"error: argument --device: {message}" in capsys.readouterr().err


def test_uniform_help_names_the_options_it_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    from mpstream.cli.schedules import PROFILE_OPTIONS

    with pytest.raises(SystemExit):
        cli.main(["schedules", "--help"])
    text = capsys.readouterr().out
    assert "the options below up to --no-memory do not apply" in " ".join(text.split())
    options = re.findall(r"^  (--[a-z-]+)", text, flags=re.M)
    below = options[options.index("--uniform") + 1 : options.index("--no-memory") + 1]
    assert below == [f"--{o.replace('_', '-')}" for o in PROFILE_OPTIONS]  # not --copy-ms


def test_the_modelled_copy_time_is_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["schedules", "--uniform", "--stages", "2", "--copy-ms", "0.5", "--no-plots"]
    assert cli.main([*args, "--out", str(tmp_path)]) == 0
    assert "2 stages on 2 devices, 8 micro-batches, each copy 0.5 ms; unit costs" in (
        capsys.readouterr().out
    )
