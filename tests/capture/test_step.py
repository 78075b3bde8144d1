"""CapturedStep: steps equal a plain model's training, forward and optimizer,
on the CPU (eager) and on one GPU (a replayed CUDA graph); what a replay
cannot see is refused with a clear error; capture leaves nothing changed."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from mpstream import CapturedStep, Pipe
from mpstream.capture.state import Kept, Saved, Trained
from mpstream.runtime.graphed import Emulated
from mpstream.runtime.stream import capturing
from tests.capture.steps import (
    BATCH,
    OPTIMIZERS,
    check_steps,
    data,
    setup,
)
from tests.helpers import mlp


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("split_size", [3, 5])
def test_steps_on_the_cpu_equal_plain_training(
    optimizer: str, schedule: str, checkpoint: str, split_size: int
) -> None:
    step = check_steps(
        "cpu", optimizer, split_size=split_size, schedule=schedule, checkpoint=checkpoint
    )
    assert not step.captured and step.reserved_bytes == 0


def test_static_bytes_are_the_storages_of_the_buffers_each_call_trains_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipe, opt, _, _ = setup("cpu", "sgd", split_size=3)
    wide, y = torch.randn(BATCH, 9, dtype=torch.float64), data("cpu", 0)[1]
    step = CapturedStep(pipe, wide[:, :5], y, nn.MSELoss(), optimizer=opt)
    read: list[Tensor] = []
    train = pipe._train_step

    def recorded(inputs: Tensor, target: Tensor, *args: object) -> Tensor:
        read.extend([inputs, target])
        return train(inputs, target, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(pipe, "_train_step", recorded)
    for i in range(2):
        step(*data("cpu", i + 1))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in read}
    # The same two buffers every call, copies of the batch's shape (not of the
    # wider tensor the example was a view of); the parameters, gradients and
    # momentum an eager step holds too are not counted.
    assert len(storages) == 2
    assert step.static_bytes == sum(storages.values()) == BATCH * (5 + 4) * 8


def test_without_zero_grad_gradients_accumulate_across_calls() -> None:
    pipe, _, ref, _ = setup("cpu", "sgd", split_size=3)
    x, y = data("cpu", 1)
    step = CapturedStep(pipe, x, y, nn.MSELoss(), zero_grad=False)
    step(x, y)
    step(x, y)
    (2 * nn.MSELoss()(ref(x), y)).backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_warm_up_is_undone_so_the_first_call_is_a_first_step() -> None:
    """What capture relies on, checked on the CPU: after warm-up steps and
    :class:`Saved`'s restore, a step equals a fresh model's first step
    (optimizer state created by warm-up is zeroed in place) and the random
    number generator is where it was."""
    for name in OPTIMIZERS:
        pipe, opt, ref, ref_opt = setup("cpu", name, split_size=3)
        x, y = data("cpu", 1)
        saved = Saved(Trained(pipe, None, opt), [])
        draw = torch.rand(3, generator=torch.Generator().set_state(torch.get_rng_state()))
        for _ in range(3):
            pipe.zero_grad(set_to_none=False)
            pipe.train_step(x, y, nn.MSELoss())
            opt.step()
            torch.rand(5)  # warm-up draws (dropout, say)
        state = [id(v) for s in opt.state.values() for v in s.values()]
        grads = [p.grad for p in pipe.parameters()]
        saved.restore(captured=True)
        assert state == [id(v) for s in opt.state.values() for v in s.values()], "in place"
        assert all(p.grad is g for p, g in zip(pipe.parameters(), grads)), "in place"
        torch.testing.assert_close(torch.rand(3), draw)
        for p, q in zip(pipe.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach())
        pipe.zero_grad(set_to_none=False)
        pipe.train_step(x, y, nn.MSELoss())
        opt.step()
        nn.MSELoss()(ref(x), y).backward()
        ref_opt.step()
        for p, q in zip(pipe.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), msg=name)


def test_a_failed_capture_gives_every_gradient_tensor_back() -> None:
    pipe, opt, _, _ = setup("cpu", "sgd", split_size=3)
    x, y = data("cpu", 1)
    saved = Saved(Trained(pipe, None, opt), [])
    pipe.train_step(x, y, nn.MSELoss())
    opt.step()
    saved.restore(captured=False)
    assert all(p.grad is None for p in pipe.parameters()) and not opt.state
    pipe.train_step(x, y, nn.MSELoss())
    grads = [p.grad for p in pipe.parameters()]
    values = [g.clone() for g in grads if g is not None]
    saved = Saved(Trained(pipe, None, opt), [])
    pipe.zero_grad()  # set_to_none: warm-up would make new gradient tensors
    pipe.train_step(x, y, nn.MSELoss())
    saved.restore(captured=False)
    assert all(p.grad is g for p, g in zip(pipe.parameters(), grads))
    for p, v in zip(pipe.parameters(), values):
        torch.testing.assert_close(p.grad, v)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.cuda)])
def test_replaced_gradients_state_or_parameters_are_refused(device: str) -> None:
    pipe, opt, _, _ = setup(device, "sgd", split_size=3)
    x, y = data(device, 0)
    step = CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt, zero_grad=False)
    # The graph's pool holds its activations (bytes the bench reports).
    assert (step.reserved_bytes > 0) == (device != "cpu")
    opt.zero_grad(set_to_none=False)
    step(x, y)
    step(x, y)
    opt.zero_grad()  # set_to_none=True
    with pytest.raises(ValueError, match=r"gradient of .* was replaced"):
        step(x, y)
    step = CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt)
    step(x, y)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a checkpoint file
    with pytest.raises(ValueError, match="optimizer's state 'momentum_buffer' was replaced"):
        step(x, y)
    step = CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt)
    step(x, y)
    pipe.float()
    with pytest.raises(ValueError, match="moved since capture"):
        step(x, y)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.cuda)])
def test_replaced_tensors_modules_or_requires_grad_are_refused(device: str) -> None:
    def block(p: Pipe) -> nn.Sequential:
        layer = p[0]
        assert isinstance(layer, nn.Sequential)
        return layer

    changes: list[tuple[Callable[[Pipe], object], str]] = [
        (
            lambda p: p.load_state_dict(copy.deepcopy(p.state_dict()), assign=True),
            r"0.0.weight was replaced by another tensor",
        ),
        (
            lambda p: setattr(block(p)[0], "bias", nn.Parameter(block(p)[0].bias.detach())),
            "0.0.bias",
        ),
        (lambda p: block(p)[0].weight.requires_grad_(False), "requires_grad of 0.0.weight changed"),
        (lambda p: block(p).__setitem__(1, nn.ReLU()), "submodule 0.1 was replaced"),
        (lambda p: _in_place(p[1].weight.t_), "laid out anew in place"),
    ]
    for change, message in changes:
        model = nn.Sequential(nn.Sequential(nn.Linear(5, 8), nn.Tanh()), nn.Linear(8, 4))
        pipe = Pipe(model.double().to(device), balance=[1, 1], devices=[device] * 2, split_size=3)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        x, y = data(device, 0)
        step = CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt)
        step(x, y)
        step(x, y)
        change(pipe)
        with pytest.raises(ValueError, match=message):
            step(x, y)


def _in_place(change: Callable[[], object]) -> None:
    with torch.no_grad():
        change()


class ScaledMSE(nn.Module):
    """A loss with a learnable scale: a parameter outside the pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.log_s = nn.Parameter(torch.zeros((), dtype=torch.float64))

    def forward(self, out: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(out, target) * torch.exp(-self.log_s) + self.log_s


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("held", ["loss module", "elsewhere"])
def test_parameters_the_optimizer_steps_outside_the_pipe_train_as_eagerly(
    graphs: bool, held: str
) -> None:
    pipe, _, ref, _ = setup("cpu", "sgd", split_size=3, graphs=Emulated() if graphs else False)
    loss, ref_loss = ScaledMSE(), ScaledMSE()
    opt = torch.optim.SGD([*pipe.parameters(), loss.log_s], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([*ref.parameters(), ref_loss.log_s], lr=0.1, momentum=0.9)
    # Held by the loss module the step calls, or only by the optimizer.
    loss_fn = loss if held == "loss module" else (lambda o, t: loss(o, t))
    step = CapturedStep(pipe, *data("cpu", 0), loss_fn, optimizer=opt)
    assert float(loss.log_s.detach()) == 0.0 and loss.log_s.grad is None  # nothing ran yet
    for i in range(3):
        x, y = data("cpu", i + 1)
        got = step(x, y)
        ref_opt.zero_grad()
        expected = ref_loss(ref(x), y)
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(got, expected.detach())
    torch.testing.assert_close(loss.log_s.grad, ref_loss.log_s.grad)  # zeroed every step
    torch.testing.assert_close(loss.log_s.detach(), ref_loss.log_s.detach())
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


@pytest.mark.parametrize("zero_grad", [False, True])
def test_a_failed_call_puts_back_the_gradients_of_parameters_outside_the_pipe(
    zero_grad: bool,
) -> None:
    # train_step puts back the pipe's and a loss module's gradients; a loss
    # scale only the optimizer holds must not keep a failed step's partial sum.
    pipe, _, _, _ = setup("cpu", "sgd", split_size=3, schedule="1f1b")
    loss = ScaledMSE()
    opt = torch.optim.SGD([*pipe.parameters(), loss.log_s], lr=0.1)
    fail = [False]

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        if fail[0] and out.shape[0] == 1:  # the last micro-batch, after backwards ran
            raise KeyError("loss failed")
        scaled: Tensor = loss(out, target)
        return scaled

    x, y = data("cpu", 0)
    step = CapturedStep(pipe, x, y, loss_fn, optimizer=opt, zero_grad=zero_grad)
    step(x, y)
    grad = loss.log_s.grad
    assert grad is not None
    before = torch.zeros_like(grad) if zero_grad else grad.clone()
    fail[0] = True
    with pytest.raises(KeyError, match="loss failed"):
        step(x, y)
    assert loss.log_s.grad is grad  # the tensor a replay writes into
    torch.testing.assert_close(grad, before, rtol=0, atol=0)


def test_batches_of_another_shape_dtype_or_structure_are_refused() -> None:
    pipe, opt, _, _ = setup("cpu", "sgd", split_size=3)
    x, y = data("cpu", 0)
    step = CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt)
    before = [p.detach().clone() for p in pipe.parameters()]
    with pytest.raises(
        ValueError, match=r"inputs leaf 0 has shape \(9, 5\).*captured for \(10, 5\)"
    ):
        step(x[:9], y)
    with pytest.raises(ValueError, match=r"target leaf 0 .*dtype torch.float32"):
        step(x, y.float())
    with pytest.raises(ValueError, match="target have another structure"):
        step(x, (y, y))
    for p, b in zip(pipe.parameters(), before):  # nothing ran
        torch.testing.assert_close(p.detach(), b)
    step(x, y)  # and the next call works


def test_a_changed_plain_value_in_the_batch_is_refused() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(5, 6).double(), nn.Linear(6, 4).double()

        def forward(self, x: Tensor, scale: float) -> Tensor:
            out: Tensor = self.b(self.a(x) * scale)
            return out

    traced = Pipe(Scaled(), split_size=3, split_points=["b"], devices=["cpu", "cpu"])
    x, y = data("cpu", 0)
    step = CapturedStep(traced, (x, 2.0), y, nn.MSELoss())
    step((x, 2.0), y)
    with pytest.raises(ValueError, match=r"inputs leaf 1 is 3.0; the step was captured with 2.0"):
        step((x, 3.0), y)


def test_bad_arguments_are_named() -> None:
    x, y = data("cpu", 0)
    with pytest.raises(TypeError, match="needs an mpstream.Pipe, got Sequential"):
        CapturedStep(mlp([5, 4]), x, y, nn.MSELoss())  # type: ignore[arg-type]
    pipe, _, _, _ = setup("cpu", "sgd", split_size=3)
    with pytest.raises(ValueError, match="warmup"):
        CapturedStep(pipe, x, y, nn.MSELoss(), warmup=0)
    with pytest.raises(ValueError, match="reduction must be one of 'mean', 'sum'; got 'avg'"):
        CapturedStep(pipe, x, y, nn.MSELoss(), reduction="avg")
    with pytest.raises(TypeError, match="loss_fn must be callable, got str"):
        CapturedStep(pipe, x, y, "mse")  # type: ignore[arg-type]
    params = list(pipe.parameters())  # the optimizer's parameters, not an optimizer
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer .* got list"):
        CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=params)  # type: ignore[arg-type]
    copied = torch.optim.SGD(copy.deepcopy(pipe).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizer \\(SGD\\) steps none of the pipe's"):
        CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=copied)
    step = CapturedStep(pipe, x, y, nn.MSELoss())
    with pytest.raises(RuntimeError, match="no CUDA graph"):
        _ = step.pool


def test_outside_a_capture_nothing_is_capturing() -> None:
    # Without a CUDA context nothing can capture; asking must not create one.
    before = torch.cuda.is_initialized()
    assert not capturing([torch.device("cpu")])
    assert not capturing([torch.device("cuda:0")])
    assert torch.cuda.is_initialized() == before


def test_a_call_walks_the_modules_only_when_something_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipe, opt, _, _ = setup("cpu", "sgd", split_size=3)
    step = CapturedStep(pipe, *data("cpu", 0), nn.MSELoss(), optimizer=opt)
    step(*data("cpu", 1))  # the CPU's checks start here
    walks: list[int] = []
    walk = Kept._walk
    monkeypatch.setattr(Kept, "_walk", lambda self: (walks.append(1), walk(self))[1])
    step(*data("cpu", 2))
    assert walks == []  # nothing registered, no tensor moved: one C++ pass
    nn.Linear(3, 3)  # registered elsewhere: walked once, found to be none of the step's
    step(*data("cpu", 3))
    step(*data("cpu", 4))
    assert walks == [1]
    with torch.no_grad():
        next(pipe.parameters()).data = torch.zeros(8, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="moved since capture"):
        step(*data("cpu", 5))


def test_a_batch_spread_into_keywords_is_refused_with_what_to_do() -> None:
    pipe, _, _, _ = setup("cpu", "sgd", split_size=3)
    x, y = data("cpu", 0)
    spread = {"x": x, "y": y}
    with pytest.raises(TypeError, match=r"CapturedStep got keyword argument\(s\) 'x', 'y'"):
        CapturedStep(pipe, loss_fn=nn.MSELoss(), **spread)  # type: ignore[arg-type]
    step = CapturedStep(pipe, x, y, nn.MSELoss())
    with pytest.raises(TypeError, match=r"'x', 'y', which it does not take.*step\(inputs, target"):
        step(**spread)
    step(inputs=x, target=y)  # its own keywords still bind
