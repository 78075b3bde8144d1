"""A write the caller makes mid-run (``Pipe.zero_grad(set_to_none=False)``)
is ordered between the stage streams' work queued before and after it:
the stream waits it issues, recorded with stand-in streams on the CPU (the
GPU race itself: tests/cuda/test_streams.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.pipe import pipe as pipe_module
from mpstream.runtime import ordered_writes
from mpstream.runtime.ordered_writes import ordered_write
from mpstream.runtime.stream import CPU_STREAM
from tests.helpers import mlp


class Recorded:
    """A stand-in CUDA stream that logs the waits issued on it."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def wait_stream(self, other: Recorded) -> None:
        self.log.append(f"{self.name} waits {other.name}")


def fake(
    monkeypatch: pytest.MonkeyPatch, running: bool, captured: frozenset[str] = frozenset()
) -> tuple[SimpleNamespace, list[str]]:
    """A scheduler of four stages (two on cuda:0, one on cuda:1, one on the
    CPU) and the log of the waits; the current stream on cuda:0 is stage
    1's (a loss_fn runs in the last stage's task), on cuda:1 the caller's;
    a CUDA graph captures the streams named in ``captured``."""
    log: list[str] = []
    s0, s1, s2 = (Recorded(f"stage{s}", log) for s in range(3))
    caller = Recorded("caller1", log)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    current = {cuda0: s1, cuda1: caller}
    monkeypatch.setattr(ordered_writes, "current_stream", current.__getitem__)
    monkeypatch.setattr(ordered_writes, "_capturing", lambda st: st.name in captured)
    sched = SimpleNamespace(
        devices=[cuda0, cuda0, cuda1, torch.device("cpu")],
        compute_streams=[s0, s1, s2, CPU_STREAM],
        native=SimpleNamespace(running=running),
    )
    return sched, log


def test_a_write_mid_run_waits_for_the_stage_streams_and_they_wait_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sched, log = fake(monkeypatch, running=True)
    with ordered_write(sched):  # type: ignore[arg-type]
        log.append("write")
    assert log == [
        "stage1 waits stage0",
        "caller1 waits stage2",
        "write",
        "stage0 waits stage1",
        "stage2 waits caller1",
    ]


def test_a_write_that_fails_is_still_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    sched, log = fake(monkeypatch, running=True)
    with pytest.raises(RuntimeError, match="boom"), ordered_write(sched):  # type: ignore[arg-type]
        raise RuntimeError("boom")
    assert log[-2:] == ["stage0 waits stage1", "stage2 waits caller1"]


def test_outside_a_run_and_a_backward_pass_nothing_is_issued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sched, log = fake(monkeypatch, running=False)
    with ordered_write(sched):  # type: ignore[arg-type]
        pass
    with ordered_write(None):
        pass
    assert log == []


def test_a_write_from_a_hook_in_a_backward_pass_is_ordered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sched, log = fake(monkeypatch, running=False)

    def hook(g: Tensor) -> None:
        with ordered_write(sched):  # type: ignore[arg-type]
            log.append("write")

    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    assert log.index("write") == 2 and len(log) == 5


def test_under_capture_only_streams_of_the_capture_are_ordered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # cuda:0's streams are captured, cuda:1's caller stream is not, its stage's is.
    sched, log = fake(monkeypatch, running=True, captured=frozenset({"stage0", "stage1", "stage2"}))
    with ordered_write(sched):  # type: ignore[arg-type]
        log.append("write")
    assert log == ["stage1 waits stage0", "write", "stage0 waits stage1"]


@pytest.mark.parametrize("set_to_none", [False, True])
def test_pipe_zero_grad_in_a_loss_fn_zeroes_inside_an_ordered_write(
    monkeypatch: pytest.MonkeyPatch, set_to_none: bool
) -> None:
    pipe = Pipe(mlp([4, 6, 6, 2]), balance=[2, 4], devices=["cpu", "cpu"], chunks=2)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    pipe.train_step(x, y, nn.functional.mse_loss)  # every .grad set
    seen: list[tuple[bool, bool]] = []
    real = pipe_module.ordered_write

    def spy(sched: object) -> object:
        # The pipe's scheduler, mid-run; no gradient zeroed yet.
        assert sched is pipe.scheduler
        grads = [p.grad for p in pipe.parameters()]
        seen.append((pipe.scheduler.native.running, all(g is not None and g.any() for g in grads)))
        return real(sched)  # type: ignore[arg-type]

    monkeypatch.setattr(pipe_module, "ordered_write", spy)
    calls = [0]

    def loss(out: Tensor, target: Tensor) -> Tensor:
        calls[0] += 1
        if calls[0] == 2:
            pipe.zero_grad(set_to_none=set_to_none)
        return nn.functional.mse_loss(out, target)

    pipe.train_step(x, y, loss)
    # Set to None, .grad is let go of on the host: no kernel to order.
    assert seen == ([] if set_to_none else [(True, True)])
