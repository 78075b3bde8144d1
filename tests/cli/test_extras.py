"""Without the optional extras the commands still parse, say what to install
before they start, and skip only the figures and progress bars."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpstream.cli import extras


def test_require_names_what_is_missing_and_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "installed", lambda m: m == "tqdm")
    extras.require("schedules", ())  # nothing needed: nothing said
    with pytest.raises(extras.MissingExtra, match=r"needs torchvision, not .*mpstream\[tutorial\]"):
        extras.require("bench", ("torchvision",))
    message = "mpstream doctor needs torchvision and matplotlib, not installed here: pip install"
    with pytest.raises(extras.MissingExtra, match=rf"^{message} 'mpstream\[bench\]'$"):
        extras.require("doctor", ("torchvision", "matplotlib", "tqdm"))


def test_figures_without_matplotlib_warn_once_and_are_skipped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(extras, "installed", lambda m: m != "matplotlib")
    assert extras.figures("tune", False) is False
    assert capsys.readouterr().err == ""  # not wanted: nothing to say
    assert extras.figures("tune", True) is False
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "mpstream tune: warning: figures skipped: matplotlib is not installed "
        "(pip install 'mpstream[bench]'); the results are still written"
    ]


def test_progress_without_tqdm_draws_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "installed", lambda m: m != "tqdm")
    with extras.progress(3, "step", True) as bar:
        bar.update(1)
        bar.set_description("stage")


# The reviewer's environment: mpstream installed without extras.
HIDDEN = textwrap.dedent(
    """
    import sys

    class Hide:
        def __init__(self, inner):
            self.inner = inner

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torchvision", "tqdm", "matplotlib"):
                return None
            return self.inner.find_spec(name, path, target)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
    import mpstream.workloads  # the transformer needs none of them
    from mpstream import cli

    out = sys.argv[1]
    try:
        cli.main(["--help"])
    except SystemExit as exc:
        print("=", "help", exc.code)
    print("=", "uniform", cli.main(["schedules", "--uniform", "--out", out]))
    for command in ("bench", "tune", "trace", "schedules", "doctor"):
        print("=", command, cli.main([command, "--out", out + "-" + command]))
    """
)


def test_the_commands_without_the_extras(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", HIDDEN, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    codes = dict(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("= "))
    assert codes == {
        "help": "0", "uniform": "0", "bench": "1", "tune": "1", "trace": "1", "schedules": "1",
        "doctor": "1",
    }  # fmt: skip
    assert (out / "schedules.json").exists() and not (out / "schedules.png").exists()
    err = done.stderr.splitlines()
    assert "mpstream schedules: warning: figures skipped: matplotlib is not installed" in err[0]
    assert err[1:] == [
        "mpstream bench needs torchvision, not installed here: pip install 'mpstream[tutorial]'",
        "mpstream tune needs torchvision, not installed here: pip install 'mpstream[tutorial]'",
        "mpstream trace needs torchvision, not installed here: pip install 'mpstream[tutorial]'",
        "mpstream schedules needs torchvision, not installed here: "
        "pip install 'mpstream[tutorial]'",
        "mpstream doctor needs torchvision, matplotlib and tqdm, not installed here: "
        "pip install 'mpstream[bench]'",
    ]
    assert not list(tmp_path.glob("out-*"))  # refused before any --out was made
