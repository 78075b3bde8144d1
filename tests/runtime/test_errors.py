"""Errors that say where: an exception raised inside a stage reaches the
caller unchanged (same object, type and message) with a note naming the
stage, its layers and device, the micro-batch and the task."""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import mpstream.runtime.copy
import mpstream.runtime.training
from mpstream import Pipe
from mpstream.runtime import scheduler
from mpstream.runtime.errors import (
    annotate_task,
    dtype_hint,
    layers_label,
    stage_labels,
    task_note,
)
from mpstream.schedules.schedule import Kind, Task

notes_supported = pytest.mark.skipif(sys.version_info < (3, 11), reason="notes need 3.11")


class Raise(nn.Module):
    """Raises ``error`` on the ``at``-th call."""

    def __init__(self, error: BaseException, at: int) -> None:
        super().__init__()
        self.error, self.at, self.calls = error, at, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return x


def pipe_with(error: BaseException, at: int, **kwargs: object) -> Pipe:
    layers = OrderedDict(
        [
            ("embed", nn.Linear(4, 4)),
            ("act", nn.Tanh()),
            ("bad", Raise(error, at)),
            ("head", nn.Linear(4, 2)),
        ]
    )
    return Pipe(nn.Sequential(layers), chunks=4, balance=[2, 1, 1], devices=["cpu"] * 3, **kwargs)  # type: ignore[arg-type]


@notes_supported
@pytest.mark.parametrize("path", ["forward", "train_step"])
def test_stage_error_is_the_same_object_with_a_note(path: str) -> None:
    error = ValueError("bad shape")
    pipe = pipe_with(error, at=3)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with pytest.raises(ValueError) as info:
        pipe(x) if path == "forward" else pipe.train_step(x, y, nn.MSELoss())
    assert info.value is error and str(error) == "bad shape"
    assert info.value.__notes__ == [
        "mpstream: raised in the forward task of stage 1 of 3 (layer 'bad' on cpu), "
        "micro-batch 2 (of 4)"
    ]
    # Nothing is left half-done: the next call works.
    assert pipe(x).shape == (8, 2)


@notes_supported
def test_a_shape_error_names_the_stage_and_its_layers() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)], nn.Linear(3, 2))
    pipe = Pipe(model, chunks=2, balance=[2, 2, 2], devices=["cpu"] * 3)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        pipe(torch.randn(4, 4))
    assert info.value.__notes__ == [
        "mpstream: raised in the forward task of stage 2 of 3 (layers '4', '5' on cpu), "
        "micro-batch 0 (of 2)"
    ]


@notes_supported
def test_loss_fn_errors_are_named() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), chunks=2)

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(out, target)  # targets of the wrong shape

    with pytest.raises(RuntimeError, match="multi-target not supported") as info:
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 1), loss_fn)
    (note,) = info.value.__notes__
    assert note.startswith(
        "mpstream: raised by loss_fn on micro-batch 0 (of 2), in the forward "
        "task of stage 1 of 2 (layer '1' on cpu)"
    )


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: Tensor) -> Tensor:
        raise ArithmeticError("backward failed")


class BadGrad(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return FailingBackward.apply(x)


@notes_supported
@pytest.mark.parametrize(("schedule", "first"), [("gpipe", 2), ("1f1b", 0)])
def test_backward_task_errors_are_named(schedule: str, first: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), BadGrad(), nn.Linear(4, 2))
    pipe = Pipe(model, chunks=3, balance=[2, 1], devices=["cpu"] * 2, schedule=schedule)
    with pytest.raises(ArithmeticError, match="backward failed") as info:
        pipe.train_step(torch.randn(6, 4), torch.randn(6, 2), nn.MSELoss())
    assert info.value.__notes__ == [
        "mpstream: raised in the backward task of stage 0 of 2 (layers '0', '1' on cpu), "
        f"micro-batch {first} (of 3)"  # the first backward of stage 0 in the schedule
    ]


@notes_supported
@pytest.mark.parametrize(
    ("path", "at", "expected"),
    [
        (
            "forward",
            2,
            "the copy of micro-batch 1 (of 2) from stage 0 of 2 (layer '0' on cpu) to stage 1",
        ),
        (
            "train_step",
            3,
            "the copy of micro-batch 1 (of 2)'s gradient from stage 1 back to stage 0 "
            "of 2 (layer '0' on cpu)",
        ),
    ],
)
def test_copy_errors_are_named(
    monkeypatch: pytest.MonkeyPatch, path: str, at: int, expected: str
) -> None:
    calls = 0
    real = mpstream.runtime.copy.send

    def failing(*args: object, **kwargs: object) -> Tensor:
        nonlocal calls
        calls += 1
        if calls == at:
            raise OSError("copy failed")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    # Every copy, either way, goes through copy.send (training's gradient
    # copies through the name it imported).
    monkeypatch.setattr(mpstream.runtime.copy, "send", failing)
    monkeypatch.setattr(mpstream.runtime.training, "send", failing)
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), chunks=2, force_copies=True)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    with pytest.raises(OSError, match="copy failed") as info:
        pipe(x) if path == "forward" else pipe.train_step(x, y, nn.MSELoss())
    assert info.value.__notes__ == [f"mpstream: raised in {expected}"]


def test_interrupts_get_no_note() -> None:
    pipe = pipe_with(KeyboardInterrupt(), at=1)
    with pytest.raises(KeyboardInterrupt) as info:
        pipe(torch.randn(8, 4))
    assert not hasattr(info.value, "__notes__")


def test_notes_for_every_task_kind() -> None:
    labels = stage_labels(["a", "b", "c"], [2, 1], [torch.device("cpu")] * 2)
    assert labels == ["stage 0 of 2 (layers 'a', 'b' on cpu)", "stage 1 of 2 (layer 'c' on cpu)"]
    assert layers_label([str(i) for i in range(9)]) == "layers '0' .. '8' (9)"

    def note(kind: Kind, stage: int) -> str:
        return task_note(Task(0, kind, stage, 1, ()), 3, labels)

    assert note(Kind.COPY, -1) == (
        "mpstream: raised in the transfer of micro-batch 1 (of 3)'s input to stage 0 of 2 "
        "(layers 'a', 'b' on cpu)"
    )
    assert note(Kind.TARGET, 1) == (
        "mpstream: raised in the transfer of micro-batch 1 (of 3)'s target to stage 1 of 2 "
        "(layer 'c' on cpu)"
    )
    assert note(Kind.WEIGHT, 1) == (
        "mpstream: raised in the weight task of stage 1 of 2 (layer 'c' on cpu), "
        "micro-batch 1 (of 3)"
    )


@pytest.mark.parametrize(
    ("value", "got"),
    [
        ("images.png", "got str: 'images.png'"),
        ([1.0, 2.0, 3.0], "got list of float: [1.0, 2.0, 3.0]"),
        ([[0.5, 1.5], [2.5, 3.5]], "got list of list: [[0.5, 1.5], [2.5, 3.5]]"),
    ],
)
@pytest.mark.parametrize("path", ["forward", "train_step"])
def test_an_input_without_a_tensor_is_named(value: object, got: str, path: str) -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2)
    target = torch.zeros(2, 2)
    with pytest.raises(TypeError, match="Pipe input holds no tensor") as info:
        pipe(value) if path == "forward" else pipe.train_step(value, target, nn.MSELoss())
    assert got in str(info.value) and "torch.as_tensor" in str(info.value)


@notes_supported
@pytest.mark.parametrize("layer", ["linear", "conv", "norm"])
def test_a_dtype_mismatch_says_the_stage_s_dtype_and_what_to_do(layer: str) -> None:
    first = {
        "linear": nn.Linear(4, 4),
        "conv": nn.Sequential(nn.Unflatten(1, (1, 2, 2)), nn.Conv2d(1, 1, 1), nn.Flatten()),
        "norm": nn.LayerNorm(4),
    }[layer]
    pipe = Pipe(nn.Sequential(nn.Tanh(), first, nn.Linear(4, 2)), chunks=2, balance=[1, 2],
                devices=["cpu", "cpu"])  # fmt: skip
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError) as info:
        pipe(x)
    where, hint = info.value.__notes__
    assert where.startswith("mpstream: raised in the forward task of stage 1 of 2")
    assert hint == (
        "mpstream: a dtype mismatch in stage 1, which has parameters of dtype float32: give "
        "the pipe input of the model's dtype (x.to(torch.float32)), convert the model before "
        "wrapping it (model.to(dtype)), or run the step under torch.autocast to mix precisions"
    )
    assert pipe(x.float()).dtype == torch.float32  # the next call works


def test_the_dtype_hint_is_only_for_dtypes() -> None:
    task = Task(0, Kind.FORWARD, 0, 0, ())
    f32 = {torch.float32}
    device = RuntimeError(
        "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the same"
    )
    assert dtype_hint(device, task, f32) is None  # one dtype on two devices
    dtype = RuntimeError(
        "Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) should be "
        "the same"
    )
    assert "dtype mismatch in stage 0" in (dtype_hint(dtype, task, f32) or "")
    assert "dtype mismatch" in (
        dtype_hint(RuntimeError("expected scalar type Float but found Half"), task, f32) or ""
    )
    assert dtype_hint(RuntimeError("shapes cannot be multiplied"), task, f32) is None
    assert "which has no parameters" in (dtype_hint(RuntimeError("same dtype"), task, set()) or "")


@notes_supported
def test_annotate_task_notes_a_task_s_errors_and_hints_only_for_a_stage() -> None:
    labels, stages = ["stage 0 of 1"], [nn.Linear(2, 2).double()]
    mismatch = "expected scalar type Double but found Float"

    def notes(exc: BaseException, task: Task | None) -> list[str]:
        annotate_task(exc, task, 2, labels, stages)
        return getattr(exc, "__notes__", [])

    forward, transfer = Task(0, Kind.FORWARD, 0, 1, ()), Task(1, Kind.COPY, -1, 1, (), peer=0)
    where, hint = notes(RuntimeError(mismatch), forward)
    assert where == "mpstream: raised in the forward task of stage 0 of 1, micro-batch 1 (of 2)"
    assert hint.startswith("mpstream: a dtype mismatch in stage 0") and "dtype float64" in hint
    # The input's transfer is no stage's: no dtype hint.
    assert notes(RuntimeError(mismatch), transfer) == [
        "mpstream: raised in the transfer of micro-batch 1 (of 2)'s input to stage 0 of 1"
    ]
    assert notes(RuntimeError(mismatch), None) == []  # no task ran
    assert notes(KeyboardInterrupt(), forward) == []  # not the task's fault


class _FailingAbort:
    """The C++ scheduler, except that ending a failed run meets a device
    error (after doing its cleanup), as a sticky CUDA error would."""

    def __init__(self, native: Any) -> None:
        self._native = native

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)

    def abort(self) -> None:
        self._native.abort()
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")


@notes_supported
@pytest.mark.parametrize("path", ["forward", "train_step"])
def test_a_device_error_ending_a_failed_run_is_said_then_checked_on_the_next_call(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    error = ValueError("bad shape")
    pipe = pipe_with(error, at=5)  # in the second call: 4 micro-batches each
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    pipe(x)  # builds the runtime
    sched = pipe._rt().worker.sched
    sched.native = _FailingAbort(sched.native)
    with pytest.raises(ValueError) as info:
        pipe(x) if path == "forward" else pipe.train_step(x, y, nn.MSELoss())
    assert info.value is error  # the cause stays what is raised ...
    said = "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert f"mpstream: ending the failed run raised too: {said}" in info.value.__notes__
    # ... and the next call checks the devices: still failing, it says so.
    monkeypatch.setattr(scheduler, "device_failure", lambda d: "cuda:0 still fails (same)")
    with pytest.raises(
        RuntimeError, match=f"ending it raised {said}; cuda:0 still fails .* sticky"
    ):
        pipe(x)
    # Working again (an error that was not sticky): forgotten, the call runs.
    monkeypatch.setattr(scheduler, "device_failure", lambda d: None)
    assert pipe(x).shape == (8, 2) and sched.device_error is None


class Checked(nn.Module):
    """Checks its input's width as torchvision's ViT checks the image size."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        torch._assert(x.shape[1] == 4, f"expected 4 features, got {x.shape[1]}")
        return self.b(self.a(x))


@notes_supported
def test_a_traced_check_s_message_built_while_tracing_is_explained() -> None:
    pipe = Pipe(Checked(), chunks=2, split_points=["b"], devices=["cpu"] * 2, tracer="fx")
    with pytest.raises(AssertionError, match=r"got Proxy\(getitem_1\)") as info:
        pipe(torch.randn(4, 5))
    assert info.value.__notes__[1] == (
        "mpstream: torch.fx built this message when it traced the forward, so "
        "'Proxy(getitem_1)' stands where this call's value would be; the check ran on this "
        "call's values (the plain model, called on the same input, shows them)"
    )
    assert pipe(torch.randn(4, 4)).shape == (4, 4)
