"""Module hooks a pipe's stages would not run are refused, naming the module
and what to do; those the stages do run (a Sequential's layers, torch.fx's
leaves) behave as in the plain model, registered before or after the pipe
is built and removed again, eager and with emulated graphed stages; so do
eager-mode quantization-aware training's observer hooks."""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated

Hook = Callable[[nn.Module], RemovableHandle]

DOUBLING: Hook = lambda m: m.register_forward_hook(lambda _m, _i, out: out * 2)  # noqa: E731
HOOKS: dict[str, Hook] = {
    "forward hook": DOUBLING,
    "forward pre-hook": lambda m: m.register_forward_pre_hook(lambda _m, args: (args[0] * 3,)),
    "backward hook": lambda m: m.register_full_backward_hook(lambda _m, gi, _go: (gi[0] * 5,)),
}


class Block(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width_in, width_out)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(3, 4), Block(4, 4), Block(4, 2)])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def traced(model: nn.Module, tracer: str = "fx", graphs: bool = False, **kw: Any) -> Pipe:
    if tracer == "export":
        kw["sample"] = (torch.randn(2, 3, dtype=torch.float64),)
    return Pipe(
        model,
        chunks=2,
        devices=["cpu", "cpu"],
        split_points=["blocks.1"],
        tracer=tracer,
        graphs=Emulated() if graphs else False,
        **kw,
    )


def sequential() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def assert_as_plain(pipe: nn.Module, plain: nn.Module) -> None:
    """A user-loop call and a train_step equal the plain model on the same
    micro-batches: output, loss and every gradient."""
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    for step in (False, True):
        pipe.zero_grad()
        plain.zero_grad()
        expected = torch.cat([plain(part) for part in x.chunk(2)])
        loss = nn.functional.mse_loss(expected, y)
        loss.backward()  # type: ignore[no-untyped-call]
        if step:
            torch.testing.assert_close(pipe.train_step(x, y, nn.functional.mse_loss), loss.detach())
        else:
            out = pipe(x)
            torch.testing.assert_close(out, expected)
            nn.functional.mse_loss(out, y).backward()  # type: ignore[no-untyped-call]
        for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kind", HOOKS)
def test_a_hook_on_a_module_fx_traces_through_is_refused_at_construction(kind: str) -> None:
    model = Net().double()
    HOOKS[kind](model.blocks[1])
    with pytest.raises(TypeError, match=rf"module 'blocks.1' has a {kind}.*leaf_modules="):
        traced(model)
    # Nothing was moved or traced: the model still runs as it did.
    assert model(torch.randn(2, 3, dtype=torch.float64)).shape == (2, 2)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_hook_added_after_the_split_is_refused_at_each_call_until_removed(graphs: bool) -> None:
    model = Net().double()
    plain = copy.deepcopy(model)
    pipe = traced(model, graphs=graphs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a graphed stage's eager first calls
        assert_as_plain(pipe, plain)
        handle = DOUBLING(pipe.blocks[1])
        x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        message = "module 'blocks.1' has a forward hook (register_forward_hook)"
        with pytest.raises(TypeError, match=re.escape(message)):
            pipe(x)
        with pytest.raises(TypeError, match=re.escape(message)):
            pipe.train_step(x, y, nn.functional.mse_loss)
        handle.remove()
        assert_as_plain(pipe, plain)  # the refusal left nothing behind


@pytest.mark.parametrize("graphs", [False, True])
def test_a_hooked_module_named_a_leaf_runs_its_hooks_at_every_call(graphs: bool) -> None:
    model = Net().double()
    plain = copy.deepcopy(model)
    handles = [DOUBLING(m.blocks[1]) for m in (model, plain)]
    pipe = traced(model, graphs=graphs, leaf_modules=["blocks.1"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_as_plain(pipe, plain)
        for handle in handles:
            handle.remove()
        assert_as_plain(pipe, plain)  # removed: gone from the stages too
        handles = [HOOKS["backward hook"](m.blocks[1]) for m in (pipe, plain)]
        assert_as_plain(pipe, plain)


def test_a_hook_on_any_module_torch_export_splits_is_refused() -> None:
    model = Net().double()
    HOOKS["forward pre-hook"](model.blocks[0].lin)
    with pytest.raises(TypeError, match=r"'blocks.0.lin' has a forward pre-hook.*tracer='fx'"):
        traced(model, "export")
    model = Net().double()
    plain = copy.deepcopy(model)
    pipe = traced(model, "export")
    handle = HOOKS["backward hook"](pipe.blocks[2].lin)
    with pytest.raises(TypeError, match="module 'blocks.2.lin' has a backward hook"):
        pipe(torch.randn(4, 3, dtype=torch.float64))
    handle.remove()
    assert_as_plain(pipe, plain)


@pytest.mark.parametrize("how", ["sequential", "fx"])
def test_the_module_s_own_hook_is_refused_saying_to_register_it_on_the_pipe(how: str) -> None:
    model = sequential() if how == "sequential" else Net().double()
    handle = DOUBLING(model)
    message = f"the {type(model).__name__} given to Pipe has a forward hook"
    build: Callable[[], Pipe] = (
        (lambda: Pipe(model, chunks=2, balance=[2, 1], devices=["cpu", "cpu"]))
        if how == "sequential"
        else lambda: traced(model)
    )
    with pytest.raises(TypeError, match=f"{re.escape(message)}.*register it on the Pipe"):
        build()
    handle.remove()
    pipe = build()
    if how == "fx":  # the traced module is the pipe's still: its hooks are checked at calls
        handle = DOUBLING(model)
        with pytest.raises(TypeError, match=re.escape(message)):
            pipe(torch.randn(4, 3, dtype=torch.float64))
        handle.remove()
    plain = copy.deepcopy(model)
    DOUBLING(pipe)  # on the pipe, pipe(x) runs it
    DOUBLING(plain)
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), torch.cat([plain(part) for part in x.chunk(2)]))


@pytest.mark.parametrize("kind", HOOKS)
@pytest.mark.parametrize("graphs", [False, True])
def test_hooks_on_layers_a_stage_calls_whole_run_as_in_the_plain_model(
    kind: str, graphs: bool
) -> None:
    model = sequential()
    plain = copy.deepcopy(model)
    pipe = Pipe(
        model,
        chunks=2,
        balance=[2, 1],
        devices=["cpu", "cpu"],
        graphs=Emulated() if graphs else False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_as_plain(pipe, plain)
        handles = [HOOKS[kind](m[2]) for m in (pipe, plain)]
        assert_as_plain(pipe, plain)
        for handle in handles:
            handle.remove()
        assert_as_plain(pipe, plain)


def test_the_module_s_own_state_dict_hook_is_refused_saying_to_register_it_on_the_pipe() -> None:
    model = sequential()
    loaded: list[object] = []
    handle = model.register_load_state_dict_post_hook(lambda module, _: loaded.append(module))
    message = "the Sequential given to Pipe has a load_state_dict hook"
    with pytest.raises(TypeError, match=f"{message}.*pipe.register_load_state_dict_post_hook"):
        Pipe(model, chunks=2, balance=[2, 1], devices=["cpu", "cpu"])
    handle.remove()
    pipe = Pipe(model, chunks=2, balance=[2, 1], devices=["cpu", "cpu"])
    pipe.register_load_state_dict_post_hook(lambda module, _: loaded.append(module))
    pipe.load_state_dict(sequential().state_dict())
    assert loaded == [pipe]


def test_a_hook_on_a_container_no_code_calls_never_runs_as_in_the_plain_model() -> None:
    model = Net().double()
    plain = copy.deepcopy(model)
    for m in (model, plain):
        DOUBLING(m.blocks)  # a ModuleList is iterated, never called
    assert_as_plain(traced(model), plain)


class _Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.LazyLinear(4, dtype=torch.float64)
        self.b = nn.Sequential(nn.ReLU(), nn.LazyLinear(2, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


def test_a_lazy_module_torch_export_would_split_is_refused_until_sized() -> None:
    # Its sizing hook was refused as a user's hook (before that, export
    # failed blaming data-dependent control flow).
    with pytest.raises(TypeError, match=r"'a' \(LazyLinear\) has parameters not yet sized"):
        Pipe(_Lazy(), chunks=2, split_points=["b"], devices=["cpu"] * 2, tracer="export")
    torch.manual_seed(0)
    model = _Lazy()
    x = torch.randn(4, 3, dtype=torch.float64)
    model(x)  # sizes them; the hooks go
    pipe = Pipe(copy.deepcopy(model), chunks=2, split_points=["b"], devices=["cpu"] * 2,
                tracer="export")  # fmt: skip
    torch.testing.assert_close(pipe(x), model(x))
    # torch.fx calls torch's layers whole: their hook sizes them at the first call.
    fx_pipe = Pipe(_Lazy(), chunks=2, split_points=["b"], devices=["cpu"] * 2, tracer="fx")
    fx_pipe(x)
    fx_pipe.load_state_dict(model.state_dict())
    torch.testing.assert_close(fx_pipe(x), model(x))


class Quantized(nn.Module):
    """Eager-mode quantization-aware training's model: stubs and layers
    that torch.ao.quantization.prepare_qat gives observer hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: Tensor) -> Tensor:
        return self.dequant(self.b(torch.relu(self.a(self.quant(x)))))


def prepared() -> nn.Module:
    torch.manual_seed(0)
    model = Quantized()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")  # type: ignore[assignment]
    return torch.ao.quantization.prepare_qat(model)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.ao.quantization's own
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_quantization_aware_training_s_observer_hooks_run_as_in_the_plain_model(
    tracer: str,
) -> None:
    # Their hooks call the modules' observers, code the trace holds and runs
    # at every call: they were refused as a user's hooks.
    model, plain = prepared(), prepared()
    sample = (torch.randn(4, 4),) if tracer == "export" else None
    pipe = Pipe(
        model, chunks=2, split_points=["b"], devices=["cpu", "cpu"], tracer=tracer, sample=sample
    )
    for step in range(3):
        if step == 2:  # observers frozen, as training does towards its end
            for m in (model, plain):
                m.apply(torch.ao.quantization.disable_observer)
        x = torch.randn(4, 4) * (step + 1)
        out = pipe(x)
        expected = torch.cat([plain(part) for part in x.chunk(2)])
        torch.testing.assert_close(out, expected)
        pipe.zero_grad()
        plain.zero_grad()
        out.pow(2).sum().backward()  # type: ignore[no-untyped-call]
        expected.pow(2).sum().backward()  # type: ignore[no-untyped-call]
        for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    torch.testing.assert_close(dict(pipe.state_dict()), dict(plain.state_dict()))


class Spare(Net):
    """Net holding submodules its forward never calls (the plain model runs
    none of their hooks), and an ``nn.Identity`` that adds no operation."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = Block(4, 4)
        self.same = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(self.same(x))


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("kind", HOOKS)
def test_a_hook_on_a_module_the_forward_never_calls_is_left_alone(tracer: str, kind: str) -> None:
    # It was refused as one on a module the trace follows.
    model = Spare().double()
    plain = copy.deepcopy(model)
    for m in (model, plain):
        HOOKS[kind](m.spare)
        HOOKS[kind](m.spare.lin)
    pipe = traced(model, tracer)
    assert_as_plain(pipe, plain)
    handles = [HOOKS[kind](m.spare) for m in (pipe, plain)]  # added after the split
    assert_as_plain(pipe, plain)
    for handle in handles:
        handle.remove()
    # One on a module the forward calls is refused still, the Identity too
    # (the graph holds no operation of its own).
    where = "blocks.1" if tracer == "fx" else "same"
    handle = HOOKS[kind](pipe.get_submodule(where))
    with pytest.raises(TypeError, match=f"module '{where}' has a {kind}"):
        pipe(torch.randn(4, 3, dtype=torch.float64))
    handle.remove()
    assert_as_plain(pipe, plain)


def test_a_hook_met_by_a_new_kind_s_trace_is_refused_and_not_kept_for_that_kind() -> None:
    model = Net().double()
    plain = copy.deepcopy(model)
    pipe = traced(model)  # traced in training
    handle = DOUBLING(pipe.blocks[1])
    pipe.eval()  # a kind not traced yet: its trace enters blocks.1
    with pytest.raises(TypeError, match="module 'blocks.1' has a forward hook"):
        pipe(torch.randn(4, 3, dtype=torch.float64))
    handle.remove()
    plain.eval()
    assert_as_plain(pipe, plain)
