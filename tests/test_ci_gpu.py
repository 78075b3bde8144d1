"""``.ci/gpu lease``'s time accounting, run with a stub Python (no torch, no GPU).

The device tool kills a call at 600 s: a lease part still running then is
never tarred into ``$OUT``, so whatever it measured is lost. The lease caps
``LEASE_DEADLINE`` below that limit.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None,
    reason="needs bash and coreutils' timeout",
)

# Stands for the Python of every step: `import mpstream` succeeds, pytest,
# the doctor and the bench "pass" at once; each call's arguments are logged.
STUB = '#!/bin/sh\necho "$*" >> "$(dirname "$0")/calls.log"\nexit 0\n'


def lease(tmp_path: Path, call: str, deadline: str) -> tuple[int, str, list[str]]:
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": str(stub),
        "OUT": str(out),
        "LEASE_DEADLINE": deadline,
        "LEASE_TMP": str(tmp_path / "lease"),
        "BUILD_STAMP": str(tmp_path / "csrc.sha256"),  # never the tree's own
        "MPSTREAM_COMMIT": "test",
    }
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu"), "lease", call],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = (out / "lease.log").read_text()
    return done.returncode, log, sorted(p.name for p in out.iterdir())


def test_a_deadline_over_a_calls_limit_is_capped(tmp_path: Path) -> None:
    code, log, files = lease(tmp_path, "2", "900.5")
    assert code == 0, log
    assert "LEASE_DEADLINE 900s is over a call's 600 s: 580s" in log
    limits = [int(s) for s in re.findall(r"== part \S+ \(limit (\d+)s\)", log)]
    assert limits == [120, 110, 150, 100]  # each part's own: none was cut
    assert len(files) <= 8, files  # what comes back from $OUT
    parts = ("tests", "device-bound", "transformer-bench", "transformer-model")
    assert {f"{p}.tar.gz" for p in parts} <= set(files)


def test_a_deadline_within_the_limit_is_kept(tmp_path: Path) -> None:
    code, log, files = lease(tmp_path, "1", "330")
    assert code == 0, log
    assert "over a call's" not in log
    assert files == ["build.log", "env.txt", "graph-tests.tar.gz", "lease.log", "profile.tar.gz"]


def test_the_extension_is_built_once_per_source(tmp_path: Path) -> None:
    # A warm machine keeps the build between calls: the second call must not
    # rebuild, but a changed csrc/ must (an unchanged interface version
    # would import the old build).
    def builds() -> int:
        log = tmp_path / "calls.log"
        return log.read_text().count("pip install") if log.exists() else 0

    lease(tmp_path, "1", "100")
    assert builds() == 1
    lease(tmp_path, "1", "100")
    assert builds() == 1
    (tmp_path / "csrc.sha256").write_text("the sources of an older build\n")
    lease(tmp_path, "1", "100")
    assert builds() == 2
