"""Training flags make kinds of call of a module split by torch.fx: code
reading ``self.training`` follows the pipe's mode and flags set on blocks,
leaves' flags do not make a kind, a pipe starts in its module's mode, and a
mode change the code ignores keeps the split and its runtime."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mpstream import Pipe
from tests.stages.test_traced import Fallback, Masked, fx_split, pipe_of


class ModeAware(nn.Module):
    """Code that reads its own training flag (fixed by a trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.training:
            h = h * 3.0
        return self.b(F.dropout(h, 0.5, self.training))


def test_code_reading_the_training_flag_follows_the_pipes_mode() -> None:
    model = ModeAware().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe.eval()
    model.eval()
    torch.testing.assert_close(pipe(x), model(x))  # no dropout, no factor 3
    pipe.train()
    model.train()
    torch.manual_seed(0)
    out = pipe(x)
    # Dropout zeroes about half of the hidden values: not the eval output.
    assert not torch.allclose(out, model.eval()(x))
    assert "traced for: eval: every argument given" in str(pipe.split_report())
    pipe.eval()
    torch.testing.assert_close(pipe(x), model(x))
    assert len(fx_split(pipe).traces) == 2


def test_a_mode_change_the_code_ignores_reuses_the_split_and_its_runtime() -> None:
    model = Masked()
    pipe = pipe_of(model, chunks=2)
    x, s = torch.randn(4, 4), torch.randn(4, 4)
    pipe(x, s)
    runtime = pipe.__dict__["_runtime"]
    graph = pipe.graph
    pipe.eval()
    pipe(x, s)
    split = fx_split(pipe)
    assert len(split.traces) == 1 and len(split.kinds) == 3  # (), (extra) in each mode
    assert pipe.graph is graph and pipe.__dict__["_runtime"] is runtime


def test_flags_set_on_submodules_survive_a_switch_of_kind() -> None:
    model = Fallback().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    m = torch.randn(4, 4, dtype=torch.float64)
    pipe.train()
    pipe.norm.eval()  # frozen statistics while training the rest
    model.train()
    model.norm.eval()
    for args in [(x, m), (x,), (x, m)]:
        torch.testing.assert_close(pipe(*args), model(*args))
        assert not pipe.norm.training
    torch.testing.assert_close(pipe.norm.running_mean, model.norm.running_mean)


def test_a_module_passed_in_eval_mode_runs_in_eval_mode() -> None:
    model = ModeAware().double().eval()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(6, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), model(x))
    assert [t.described for t in fx_split(pipe).traces] == ["eval: every argument given"]


def test_leaf_flags_do_not_make_a_kind() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    pipe = Pipe(model, split_points=["2"], devices=["cpu"] * 2, tracer="fx", chunks=2)
    split = fx_split(pipe)
    assert split.watched == [model]  # the Sequential's code; its layers are leaves
    pipe(torch.randn(4, 4))
    model[1].eval()
    pipe(torch.randn(4, 4))
    assert len(split.kinds) == 1


class Scale(nn.Module):
    """Scales by 3 in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) * (3.0 if self.training else 1.0)


class Blocks(nn.Module):
    """Blocks in a ModuleList, which fx calls a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Scale(), Scale()])
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_flags_of_blocks_in_a_module_list_make_kinds() -> None:
    model = Blocks().double()
    pipe = Pipe(copy.deepcopy(model), split_points=["blocks.1"], devices=["cpu"] * 2, chunks=2)
    assert {type(m).__name__ for m in fx_split(pipe).watched} == {"Blocks", "ModuleList", "Scale"}
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe.eval()
    model.eval()
    pipe.blocks[1].train()
    model.blocks[1].train()
    torch.testing.assert_close(pipe(x), model(x))
    pipe.blocks[1].eval()
    model.blocks[1].eval()
    torch.testing.assert_close(pipe(x), model(x))
    assert len(fx_split(pipe).traces) == 3  # training (built), one block in it, eval


def test_a_pipe_starts_in_its_modules_mode() -> None:
    model = ModeAware().double().eval()
    pipe = pipe_of(model)
    assert not pipe.training
    x = torch.randn(4, 4, dtype=torch.float64)
    exported = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, tracer="export",
        sample=(x,), chunks=2,
    )  # fmt: skip
    assert not exported.training
    torch.testing.assert_close(exported(x), model(x))
    assert exported.split_report().exports[0].startswith("eval")


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_the_modules_own_flags_decide_its_mode(tracer: str) -> None:
    model = ModeAware().double().eval()
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, tracer=tracer,
        sample=(x,), chunks=2,
    )  # fmt: skip
    torch.testing.assert_close(pipe(x), model(x))
    root = pipe.__dict__["_root"]
    root.training = True  # set on the module, not through the pipe
    model.training = True
    torch.manual_seed(0)
    out = pipe(x)
    # Dropout draws differ from the model's; the training branch (x3) shows.
    assert out.abs().mean() > 1.5 * model.eval()(x).abs().mean()
    pipe.eval()
    torch.testing.assert_close(pipe(x), model(x))
