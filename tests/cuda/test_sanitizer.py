"""The event ordering is race-free under PyTorch's CUDA sanitizer (CSAN), on
one GPU and across two.

Marked ``cuda``: skipped cleanly without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.cuda.helpers import (
    two_gpus,
)

pytestmark = pytest.mark.cuda


SANITIZED = textwrap.dedent(
    """
    import torch
    from torch import nn
    import mpstream
    from mpstream import Pipe
    from mpstream.doctor.sanitizer import csan_workarounds
    from mpstream.tutorial import StreamPipelineResNet50

    def run():
        torch.manual_seed(0)
        devices = {devices}
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in devices])
        pipe = Pipe(model, split_size=3, balance=[1] * len(devices), devices=devices)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            pipe(torch.randn(10, 64, device=devices[0])).pow(2).mean().backward()
            opt.step()
        net = StreamPipelineResNet50(devices[0], devices[-1], split_size=4, num_classes=10)
        net(torch.randn(8, 3, 64, 64, device=devices[0])).sum().backward()
        for schedule, checkpoint in (("gpipe", "never"), ("1f1b", "except_last"),
                                     ("zb_h1", "never"), ("interleaved_1f1b", "except_last")):
            virtual = len(devices) if len(set(devices)) == 1 else None
            for force in (False, True):
                stepper = Pipe(nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
                                               for _ in devices]),
                               split_size=4, balance=[1] * len(devices), devices=devices,
                               schedule=schedule, checkpoint=checkpoint, deferred_batch_norm=True,
                               force_copies=force,
                               virtual_stages=virtual if schedule == "interleaved_1f1b" else None)
                for _ in range(2):
                    stepper.train_step(torch.randn(12, 64).pin_memory(), torch.randn(12, 64),
                                       nn.MSELoss())
                x = torch.randn(12, 64, requires_grad=True)  # pageable, needs its gradient
                stepper(x).sum().backward()
                assert x.grad is not None
        mixed = Pipe(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), split_size=3,
                     balance=[1, 1], devices=["cpu", devices[-1]])
        mixed(torch.randn(10, 64, requires_grad=True)).sum().backward()
        mixed.train_step(torch.randn(10, 64), torch.randn(10, 64), nn.MSELoss())
        with mpstream.profile(pipe) as prof:
            pipe(torch.randn(10, 64, device=devices[0])).sum().backward()
        assert prof.spans
        torch.cuda.synchronize()

    with csan_workarounds():  # see its docstring: two CSAN flaws, not races
        run()
    print("sanitized run finished")
    """
)


def sanitized(devices: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    return subprocess.run(
        [sys.executable, "-c", SANITIZED.format(devices=devices)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cuda:0"] * 3])
def test_cuda_sanitizer_reports_no_race_on_one_gpu(devices: list[str]) -> None:
    result = sanitized(devices)
    assert "CSAN detected" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "sanitized run finished" in result.stdout


@two_gpus
def test_cuda_sanitizer_reports_no_race_across_gpus() -> None:
    result = sanitized(["cuda:0", "cuda:1"])
    assert "CSAN detected" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stderr[-4000:]
