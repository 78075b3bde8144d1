"""``mpstream bench --model transformer``'s options
(:mod:`mpstream.cli.transformer`), read into the run without timing it."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpstream import cli


class Stop(Exception):
    """Raised by a stand-in where the test has seen what it needs."""


@pytest.mark.parametrize(
    ("args", "counts"),
    [
        ([], (2, 4)),  # the tiny preset's
        (["--sequences", "3"], (2,)),  # the preset's, up to the batch
        (["--sequences", "1"], (1,)),
        (["--sequences", "3", "--micro-batches", "3,1"], (3, 1)),
    ],
)
def test_micro_batch_counts_fit_the_sequences(
    args: list[str], counts: tuple[int, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mpstream.workloads import bench

    seen: list[tuple[int, ...]] = []

    def run(config: bench.Config, **_: object) -> None:
        seen.append(config.preset.micro_batches)
        raise Stop

    monkeypatch.setattr(bench, "run", run)
    base = ["bench", "--model", "transformer", "--preset", "tiny", "--devices", "cpu,cpu"]
    with pytest.raises(Stop):
        cli.main([*base, *args, "--no-progress", "--out", str(tmp_path / "o")])
    assert seen == [counts]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--micro-batches", "4,16"],
            "--micro-batches 16: more than the 8 sequences of a step (the 3b preset's; "
            "--sequences sets them)",
        ),
        (
            ["--sequences", "2", "--micro-batches", "4"],
            "--micro-batches 4: more than the 2 sequences of a step (--sequences sets them)",
        ),
    ],
)
def test_more_micro_batches_than_sequences_is_refused(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["bench", "--model", "transformer", "--preset", "3b", "--devices", "cpu,cpu"]
    assert cli.main([*base, *args, "--out", str(tmp_path / "o")]) == 2
    assert f"mpstream bench: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_transformer_names_all_its_options_and_every_known_peak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mpstream.cli.transformer import TRANSFORMER_ONLY
    from mpstream.workloads.bench import PEAKS

    out = str(tmp_path / "o")
    assert cli.main(["bench", "--model", "transformer", "--split-size", "3", "--out", out]) == 2
    refusal = capsys.readouterr().err
    assert all(f"--{name.replace('_', '-')}" in refusal for name in TRANSFORMER_ONLY), refusal
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    peak_help = capsys.readouterr().out.rsplit("--peak-tflops PEAK_TFLOPS", 1)[1]
    assert all(part.split()[0] in peak_help for part, _ in PEAKS), peak_help


def test_the_header_names_each_devices_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # It named the first device's model only: a CPU + GPU run read as a CPU one.
    import torch

    from mpstream.cli import transformer
    from mpstream.tutorial import machine
    from mpstream.workloads import bench

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(transformer, "detect_devices", lambda spec=None: (cpu, gpu))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")

    def keys_for(*_: object) -> None:
        raise Stop

    monkeypatch.setattr(bench, "keys_for", keys_for)
    with pytest.raises(Stop):
        cli.main(["bench", "--model", "transformer", "--preset", "tiny", "--out", str(tmp_path)])
    header = capsys.readouterr().out.splitlines()[0]
    assert f"devices cpu ({machine.device_name(cpu)}), cuda:0 (NVIDIA H100) | " in header
