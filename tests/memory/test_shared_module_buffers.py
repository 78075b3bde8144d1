"""A module the stages run whole (a layer of a Sequential stage, a leaf module
of a traced one), reached from two stages, whose forward writes its own
buffers (mpstream.memory.buffer_watch): its first call in a mode is watched
through its buffers' version counters, a write is refused there with the
buffers put back, and every later run in that mode before it starts. Buffers
only read, and writes in another mode only, run as the plain model."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from mpstream import Pipe
from tests.helpers import assert_same_grads


class _Ema(nn.Module):
    """Keeps an average of its inputs in training mode; adds its scale."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.ema.mul_(0.9).add_(x.detach().mean(0))
        return x * self.scale


class _Reads(_Ema):
    """Reads its buffers only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.ema


class _Block(nn.Module):
    """A layer and a module it is given (two blocks may share one)."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.lin, self.shared = nn.Linear(4, 4), shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.lin(x))


class _Twice(nn.Module):
    """``c`` called before and after the split point ``b``."""

    def __init__(self, c: nn.Module) -> None:
        super().__init__()
        self.a, self.c, self.b = nn.Linear(4, 4), c, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.c(self.a(x))))


def _sequential(shared: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(shared), _Block(shared))


def _pipe(model: nn.Module) -> Pipe:
    """The model split by a Sequential's balance, or ``c`` a leaf of an fx trace."""
    if isinstance(model, nn.Sequential):
        return Pipe(model, chunks=2, balance=[1, 1], devices=["cpu", "cpu"])
    return Pipe(model, chunks=2, split_points=["b"], devices=["cpu", "cpu"], tracer="fx",
                leaf_modules=["c"])  # fmt: skip


@pytest.mark.parametrize("kind", ["sequential", "fx leaf"])
def test_a_module_two_stages_run_writing_its_buffer_is_refused(kind: str) -> None:
    torch.manual_seed(0)
    model = _sequential(_Ema()) if kind == "sequential" else _Twice(_Ema())
    pipe = _pipe(model)
    name = "0.shared" if kind == "sequential" else "c"
    said = rf"the buffer '{name}\.ema' of '{name}' \(_Ema\) is written by its forward, "
    said += "which stages 0 and 1 run"
    before = copy.deepcopy(pipe.state_dict())
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    with pytest.raises(ValueError, match=said):
        pipe.train_step(x, y, nn.MSELoss())  # seen at the first call, put back
    with pytest.raises(ValueError, match=said):
        pipe(x)  # refused before it runs
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(value, before[key], msg=key)
    assert all(p.grad is None for p in pipe.parameters())
    # In eval mode it writes nothing: it runs, as the plain model.
    pipe.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))


@pytest.mark.parametrize("kind", ["sequential", "fx leaf"])
def test_a_module_two_stages_run_reading_its_buffers_trains_as_the_plain_model(kind: str) -> None:
    model = _sequential(_Reads()) if kind == "sequential" else _Twice(_Reads())
    plain = copy.deepcopy(model)
    pipe = _pipe(model)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    for _ in range(2):  # watched at the first run, then not
        loss = pipe.train_step(x, y, nn.MSELoss())
        expected = nn.MSELoss()(plain(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected)
        assert_same_grads(pipe, plain)
        for p in [*pipe.parameters(), *plain.parameters()]:
            p.grad = None


@pytest.mark.parametrize("module", [_Reads, _Ema])
def test_a_model_built_under_inference_mode_runs_under_it(module: type[nn.Module]) -> None:
    # Its buffers are inference tensors, which keep no version counter: the
    # watch compares their values instead (it raised RuntimeError at the
    # first call). Only read, it runs as the plain model; written, refused.
    with torch.inference_mode():
        model = _sequential(module()).eval()
        pipe = _pipe(model)
        x = torch.randn(8, 4)
        if module is _Reads:
            torch.testing.assert_close(pipe(x), model(x))
            return
        model.train()
        pipe.train()
        before = model[0].shared.ema.clone()
        with pytest.raises(ValueError, match=r"the buffer '0\.shared\.ema' of '0\.shared'"):
            pipe(x)
        torch.testing.assert_close(model[0].shared.ema, before)


@pytest.mark.parametrize("call", ["pipe(x)", "train_step"])
def test_a_run_that_never_reaches_a_watched_module_leaves_no_hook_on_it(call: str) -> None:
    # Stage 0's layer refuses the input before the module's first call: the
    # watch's hooks (local functions) stayed on the user's module, which
    # then could not be pickled (torch.save(model) neither).
    model = _sequential(_Reads())
    pipe = _pipe(model)
    bad = torch.randn(8, 5)
    with pytest.raises(RuntimeError):
        if call == "pipe(x)":
            pipe(bad)
        else:
            pipe.train_step(bad, torch.randn(8, 4), nn.MSELoss())
    shared = model[0].shared
    assert not shared._forward_pre_hooks and not shared._forward_hooks
    again = pickle.loads(pickle.dumps(pipe))
    x = torch.randn(8, 4)
    torch.testing.assert_close(again(x), model(x))
    torch.testing.assert_close(pipe(x), model(x))


def test_the_watch_follows_the_shared_module_s_own_mode_not_the_pipe_s() -> None:
    # Frozen with .eval() while the pipe trains, its first call writes
    # nothing; put back in training mode, it writes: watched again there.
    model = _sequential(_Ema())
    pipe = _pipe(model)
    shared = model[0].shared
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    shared.eval()
    pipe.train_step(x, y, nn.MSELoss())  # its eval-mode call reads only
    ema = shared.ema.clone()
    shared.train()
    with pytest.raises(ValueError, match=r"'0\.shared\.ema' of '0\.shared' \(_Ema\) is written"):
        pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(shared.ema, ema)  # put back
    with pytest.raises(ValueError, match="is written by its forward"):
        pipe(x)  # refused before it runs, while the module trains
    shared.eval()  # its forward skips the write: the pipe trains again
    pipe.train_step(x, y, nn.MSELoss())
