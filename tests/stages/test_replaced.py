"""A submodule replaced after a torch.fx trace (:mod:`mpstream.stages.replaced`)
is refused at every call, naming it, where the stages would silently go on
running the old one; the same change on a module torch.export split is run
as the plain model runs it. A ``forward`` set on a module instance before
the trace runs; set, replaced or deleted after it, it is refused (either
tracer) until put back."""

from __future__ import annotations

import copy
import re
import types
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x))


class Scaled(nn.Module):
    """A block without layers: the trace holds its code and reads its tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(3) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(), Scaled()])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def pipe_of(model: nn.Module, tracer: str, graphs: bool = False) -> Pipe:
    sample = (torch.randn(2, 3, dtype=torch.float64),) if tracer == "export" else None
    return Pipe(
        model,
        chunks=2,
        devices=["cpu", "cpu"],
        split_points=["blocks.1"],
        tracer=tracer,
        sample=sample,
        graphs=Emulated() if graphs else False,
    )


def linear(model: nn.Module) -> None:
    model.get_submodule("blocks.1").lin = nn.Linear(3, 3).double()


def block(model: nn.Module) -> None:
    model.get_submodule("blocks")[1] = Block().double()


def scaled(model: nn.Module) -> None:
    model.get_submodule("blocks")[2] = Scaled().double()


CHANGES: dict[str, tuple[Callable[[nn.Module], None], str]] = {
    "a layer": (linear, "the Linear stage 1 calls (traced as 'blocks_1_lin') was replaced"),
    "a block of layers": (block, "the Linear stage 1 calls (traced as 'blocks_1_lin') was"),
    "a block the trace holds": (scaled, "a Scaled whose code the trace holds was replaced"),
}


def as_plain(pipe: Pipe, plain: nn.Module) -> None:
    x = torch.randn(4, 3, dtype=torch.float64)
    out, expected = pipe(x), torch.cat([plain(part) for part in x.chunk(2)])
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    got = dict(pipe.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("graphs", [False, True])
def test_a_submodule_replaced_after_a_torch_fx_trace_is_refused(change: str, graphs: bool) -> None:
    replace, message = CHANGES[change]
    pipe = pipe_of(Net().double(), "fx", graphs)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a graphed stage's eager first calls
        pipe(x)
        replace(pipe)
        for _ in range(2):  # at every call, not once
            with pytest.raises(TypeError, match=f"{re.escape(message)}.*build a new Pipe"):
                pipe(x)
            with pytest.raises(TypeError, match=re.escape(message)):
                pipe.train_step(x, y, nn.functional.mse_loss)


@pytest.mark.parametrize("change", CHANGES)
def test_torch_export_splits_the_module_again_with_the_new_submodule(change: str) -> None:
    model = Net().double()
    pipe = pipe_of(model, "export")
    pipe(torch.randn(4, 3, dtype=torch.float64))
    torch.manual_seed(1)
    CHANGES[change][0](pipe)
    plain = copy.deepcopy(model)
    as_plain(pipe, plain)


def doubled(self: nn.Module, x: Tensor) -> Tensor:
    return type(self).forward(self, x) * 2  # type: ignore[no-any-return]


def patch(module: nn.Module) -> None:
    module.forward = types.MethodType(doubled, module)  # type: ignore[method-assign]


@pytest.mark.parametrize(("tracer", "name"), [("fx", "blocks.1"), ("export", "blocks.1.lin")])
def test_a_forward_set_on_an_instance_after_the_trace_is_refused(tracer: str, name: str) -> None:
    model = Net().double()
    plain = copy.deepcopy(model)
    pipe = pipe_of(model, tracer)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    pipe(x)
    patch(pipe.get_submodule(name))
    message = f"the forward of module '{name}' was set on the instance after torch.{tracer}"
    for _ in range(2):  # at every call, not once
        with pytest.raises(TypeError, match=re.escape(message)):
            pipe(x)
        with pytest.raises(TypeError, match=re.escape(message)):
            pipe.train_step(x, y, nn.functional.mse_loss)
    del pipe.get_submodule(name).forward  # put back: the calls run again
    as_plain(pipe, plain)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_forward_set_before_the_trace_runs_and_removing_it_is_refused(tracer: str) -> None:
    model = Net().double()
    plain = copy.deepcopy(model)
    for m in (model, plain):
        patch(m.get_submodule("blocks.1"))
    pipe = pipe_of(model, tracer)
    as_plain(pipe, plain)
    copied = copy.deepcopy(pipe)  # a copy takes its module's forwards as they are
    as_plain(copied, copy.deepcopy(plain))
    del pipe.get_submodule("blocks.1").forward
    with pytest.raises(TypeError, match="the forward of module 'blocks.1' was deleted"):
        pipe(torch.randn(4, 3, dtype=torch.float64))
