"""A training step's cuts between stages: a value needs a gradient in the
stage reading it only where it needs one in the plain model, so a step with
every parameter frozen is refused as ``loss.backward()`` refuses it, and a
stage after frozen ones computes no input gradient.

The graphed stages' side of it: tests/runtime/test_replayed.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.schedules import SCHEDULES
from tests.helpers import fits, mlp, virtual_for

BATCH = 6
BALANCE = {1: [8], 2: [4, 4], 3: [2, 3, 3]}
# Every schedule over 1 to 3 stages sharing the CPU (a V needs an even count).
SHAPES = [(n, k) for n in SCHEDULES for k in (1, 2, 3) if fits(n, k)]


class SeesItsInput(nn.Module):
    """Identity that notes whether its input requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(x.requires_grad)
        return x


def data() -> tuple[Tensor, Tensor]:
    return torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)


def pipe_of(model: nn.Module, schedule: str, stages: int, **kwargs: object) -> Pipe:
    kwargs.setdefault("balance", BALANCE[stages])
    return Pipe(
        model,
        chunks=2,
        devices=["cpu"] * stages,
        schedule=schedule,
        virtual_stages=virtual_for(schedule, stages),
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("schedule", "stages"), SHAPES)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_every_parameter_frozen_is_refused_as_the_plain_backward_is(
    schedule: str, stages: int, checkpoint: str
) -> None:
    model = mlp([5, 8, 7, 6, 4]).requires_grad_(False)
    x, y = data()
    with pytest.raises(RuntimeError, match="does not require grad"):
        nn.MSELoss()(model(x), y).backward()
    pipe = pipe_of(model, schedule, stages, checkpoint=checkpoint)
    # Before: with two stages or more, the second stage's input required
    # grad whatever it stood for, and the step returned a loss, computing
    # no gradient.
    with pytest.raises(RuntimeError, match="loss_fn returned a loss that does not require grad"):
        pipe.train_step(x, y, nn.MSELoss())
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize(("schedule", "stages"), [s for s in SHAPES if s[1] > 1])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_stages_after_frozen_ones_read_values_that_need_no_gradient(
    schedule: str, stages: int, checkpoint: str
) -> None:
    # The first stage frozen: what it hands on needs no gradient in the
    # plain model, so none in the pipe (no input gradient computed for it);
    # the later stages' parameters get theirs.
    torch.manual_seed(0)
    probes = [SeesItsInput() for _ in range(stages - 1)]
    layers: list[nn.Module] = [nn.Linear(5, 6), nn.Tanh()]
    for probe in probes:
        layers += [probe, nn.Linear(6, 6), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(6, 4)).double()
    model[0].requires_grad_(False)
    ref = copy.deepcopy(model)
    x, y = data()
    want = nn.MSELoss()(ref(x), y)
    want.backward()
    balance = [2] + [3] * (stages - 1)
    balance[-1] += 1
    pipe = pipe_of(model, schedule, stages, balance=balance, checkpoint=checkpoint)
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, want.detach())
    plain = [m.seen for m in ref.modules() if isinstance(m, SeesItsInput)]
    assert plain[0] == [False] and all(plain[1:])  # stage 1 trains: it hands on a gradient
    for probe, seen in zip(probes, plain):
        assert set(probe.seen) == set(seen)
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_loss_reading_a_trainable_tensor_trains_it_with_every_parameter_frozen(
    stages: int,
) -> None:
    # Not refused by looking at the parameters: the loss needs a gradient.
    model = mlp([5, 8, 7, 6, 4]).requires_grad_(False)
    scale = torch.ones(4, dtype=torch.float64, requires_grad=True)
    mine = scale.detach().clone().requires_grad_()
    x, y = data()

    def loss_fn(out: Tensor, target: Tensor, w: Tensor = scale) -> Tensor:
        return nn.functional.mse_loss(out * w, target)

    want = loss_fn(model(x), y, mine)
    want.backward()
    loss = pipe_of(model, "1f1b", stages).train_step(x, y, loss_fn)
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(scale.grad, mine.grad)
