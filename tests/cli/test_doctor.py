"""``mpstream doctor``'s options (:mod:`mpstream.cli.doctor`): bad ones
are refused before any step runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpstream import cli


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # 5 images in micro-batches of 4 (the quick default): the last holds one.
        (["--batch-size", "5"], "--batch-size 5 (default split sizes: 4; give --split-sizes) with"),
        (["--batch-size", "5", "--split-sizes", "3,2"], "--split-sizes 2 with"),
        (["--batch-size", "1", "--split-sizes", "1"], "--batch-size 1 with"),
    ],
)
def test_a_lone_image_at_32x32_is_refused_before_running(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--quick", "--devices", "cpu", "--out", str(tmp_path / "o")]
    assert cli.main(["doctor", "--image-size", "32", *args, *out]) == 2
    err = capsys.readouterr().err
    assert message + " --image-size 32x32: a micro-batch of one image" in err
    assert not (tmp_path / "o").exists()
