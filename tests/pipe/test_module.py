"""mpstream.pipe.module: a Pipe's Sequential-like surface (indexing, state_dict
keys, dtype conversion, fixed placement, copies and pickling, train/eval),
and what it does when its layers or tensors are replaced after construction,
or a module holding it is moved."""

from __future__ import annotations

import copy
import io
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from mpstream import Pipe
from tests.helpers import mlp, staged


def test_sequential_like_access() -> None:
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)]
    pipe = Pipe(nn.Sequential(*layers), balance=[2, 1], devices=["cpu", "cpu"], chunks=4)
    assert len(pipe) == 3
    assert list(pipe) == layers
    assert pipe[0] is layers[0] and pipe[-1] is layers[2]
    assert list(pipe[1:]) == layers[1:]
    assert pipe.devices == [torch.device("cpu")] * 2
    assert pipe.balance == [2, 1]
    assert isinstance(pipe.partitions, nn.ModuleList)
    assert all(isinstance(p, nn.Sequential) for p in pipe.partitions)
    assert [list(p) for p in pipe.partitions] == [layers[:2], layers[2:]]
    assert pipe.chunks == 4 and pipe.split_size is None
    pipe.split_size = 3
    assert pipe.split_size == 3 and pipe.chunks is None
    pipe.chunks = 2
    assert pipe.chunks == 2 and pipe.split_size is None
    assert "chunks=2" in repr(pipe)


@pytest.mark.parametrize("style", ["children", "balance"])
def test_state_dict_keys_are_the_wrapped_sequential_keys(style: str) -> None:
    model = nn.Sequential(
        OrderedDict([("embed", nn.Linear(3, 4)), ("act", nn.ReLU()), ("head", nn.Linear(4, 2))])
    )
    plain = copy.deepcopy(model)
    if style == "children":
        pipe = Pipe(model)
    else:
        pipe = Pipe(model, balance=[2, 1], devices=["cpu", "cpu"])
    assert list(pipe.state_dict()) == list(plain.state_dict())
    other = Pipe(copy.deepcopy(plain), balance=[1, 2], devices=["cpu", "cpu"])
    for p in plain.parameters():
        p.data.add_(1.0)
    pipe.load_state_dict(plain.state_dict())
    other.load_state_dict(pipe.state_dict())
    for a, b in zip(other.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b)


def test_placement_is_fixed_but_dtype_converts() -> None:
    pipe = Pipe(staged(mlp([2, 2, 2], dtype=torch.float32), [2, 2]), chunks=2)
    for move in (
        lambda: pipe.cuda(),
        lambda: pipe.to("meta"),
        lambda: pipe.to(torch.device("meta"), torch.float64),
        lambda: pipe.to(torch.ones(1, dtype=torch.float64, device="meta")),
    ):
        with pytest.raises(TypeError, match="stage devices are fixed when it is built"):
            move()
    # To where every stage already is: no move (generic model.to(device) code).
    assert pipe.cpu() is pipe and pipe.to("cpu") is pipe
    assert pipe.to(torch.float64) is pipe
    assert all(p.dtype == torch.float64 for p in pipe.parameters())
    assert all(p.dtype == torch.float64 for part in pipe.partitions for p in part.parameters())
    out = pipe(torch.randn(4, 2, dtype=torch.float64))
    assert out.dtype == torch.float64
    pipe.half()
    assert all(p.dtype == torch.float16 for p in pipe.parameters())
    assert pipe(torch.randn(4, 2, dtype=torch.float16)).dtype == torch.float16
    pipe.to(dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in pipe.parameters())


def test_deepcopy_and_save_rebuild_the_runtime() -> None:
    model = mlp([3, 4, 2])
    pipe = Pipe(staged(model, [2, 2]), chunks=2)
    x = torch.randn(4, 3, dtype=torch.float64)
    expected = pipe(x)
    twin = copy.deepcopy(pipe)
    torch.testing.assert_close(twin(x), expected)
    assert twin.scheduler is not pipe.scheduler
    assert twin.partitions[0][0] is twin[0], "partitions must hold the copied layers"
    assert twin.partitions[0] is not pipe.partitions[0]
    buf = io.BytesIO()
    torch.save(pipe, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), expected)


def test_train_and_eval_reach_every_layer() -> None:
    pipe = Pipe(nn.Sequential(nn.Dropout(0.5), nn.Linear(2, 2)), chunks=2)
    pipe.eval()
    assert not any(m.training for m in pipe.modules())
    assert not any(m.training for part in pipe.partitions for m in part.modules())
    pipe.train()
    assert all(m.training for part in pipe.partitions for m in part.modules())


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
        self.encoder = nn.Linear(8, 16).double()
        self.decoder = nn.Linear(16, 4).double()
        self.register_buffer("shift", torch.zeros(16, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.encoder(x) * self.scale + self.shift)  # type: ignore[no-any-return]


def traced(model: nn.Module) -> Pipe:
    return Pipe(copy.deepcopy(model), chunks=2, split_points=["decoder"], devices=["cpu"] * 2)


def test_a_replaced_root_tensor_is_what_the_stages_read() -> None:
    model = Scaled()
    pipe = traced(model)
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe.scale = nn.Parameter(torch.tensor(3.0, dtype=torch.float64))
    model.scale = nn.Parameter(torch.tensor(3.0, dtype=torch.float64))
    torch.testing.assert_close(pipe(x), model(x))
    pipe(x).sum().backward()
    model(x).sum().backward()
    torch.testing.assert_close(pipe.scale.grad, model.scale.grad)
    pipe.register_parameter("scale", nn.Parameter(torch.tensor(0.5, dtype=torch.float64)))
    with pytest.raises(TypeError, match="'scale' is a tensor the stages read"):
        pipe.register_parameter("scale", None)
    model.scale = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
    torch.testing.assert_close(pipe(x), model(x))
    pipe.shift = torch.ones(16, dtype=torch.float64)
    model.shift = torch.ones(16, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), model(x))
    pipe.register_buffer("shift", torch.full((16,), 2.0, dtype=torch.float64))
    model.shift = torch.full((16,), 2.0, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), model(x))
    # A parameter inside a layer: the stages hold the layer, so they see it.
    pipe.decoder.weight = nn.Parameter(torch.zeros(4, 16, dtype=torch.float64))
    model.decoder.weight = nn.Parameter(torch.zeros(4, 16, dtype=torch.float64))
    torch.testing.assert_close(pipe(x), model(x))


class ReadsLayerWeight(nn.Module):
    """Reads a layer's tensors itself: torch.fx gives the stage ``b.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16).double()
        self.b = nn.Linear(16, 4).double()
        self.c = nn.Linear(4, 4).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.c(F.linear(self.a(x).relu(), self.b.weight, self.b.bias))  # type: ignore[no-any-return]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_parameter_replaced_inside_a_layer_is_what_the_stages_read(tracer: str) -> None:
    # A stage holds each tensor it reads outside a called layer (every
    # tensor, exported): the layer's new parameter must reach it.
    model = ReadsLayerWeight()
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), chunks=2, split_points=["c"], devices=["cpu"] * 2,
                tracer=tracer, sample=(x,))  # fmt: skip
    pipe(x)  # bound once before the replacement
    for m in (pipe, model):
        m.get_submodule("b").weight = nn.Parameter(
            torch.linspace(-1, 1, 64, dtype=torch.float64).view(4, 16)
        )
        m.get_submodule("c").bias = nn.Parameter(torch.ones(4, dtype=torch.float64))
    out, expected = pipe(x), model(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for name in ("b.weight", "c.bias"):
        grad = pipe.get_parameter(name).grad
        assert grad is not None, name
        torch.testing.assert_close(grad, model.get_parameter(name).grad)


def test_a_tensor_replaced_by_something_else_or_elsewhere_is_refused() -> None:
    pipe = traced(Scaled())
    with pytest.raises(TypeError, match="'scale' is a tensor the stages read"):
        pipe.scale = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match="'scale' sits on cpu"):
        pipe.scale = nn.Parameter(torch.tensor(1.0, device="meta"))
    with pytest.raises(TypeError, match="'shift' is a buffer the stages read"):
        pipe.shift = nn.Parameter(torch.zeros(16, dtype=torch.float64))
    for name in ("shift", "scale", "decoder"):
        with pytest.raises(TypeError, match=f"the Pipe's stages read '{name}'"):
            delattr(pipe, name)
    pipe(torch.randn(2, 8, dtype=torch.float64))  # unchanged, still runs


def test_a_copied_pipe_reads_its_replaced_tensors() -> None:
    # GraphModule's deepcopy keeps only listed attributes: the stages' map
    # of the module's tensors must survive it.
    model = Scaled()
    pipe = copy.deepcopy(traced(model))
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe.scale = nn.Parameter(torch.tensor(5.0, dtype=torch.float64))
    model.scale = nn.Parameter(torch.tensor(5.0, dtype=torch.float64))
    torch.testing.assert_close(pipe(x), model(x))
    fresh = Scaled()
    pipe.load_state_dict(fresh.state_dict(), assign=True)
    torch.testing.assert_close(pipe(x), fresh(x))


def test_a_replaced_layer_is_refused() -> None:
    pipe = traced(Scaled())
    with pytest.raises(TypeError, match="run the layer 'decoder' they hold"):
        pipe.decoder = nn.Linear(16, 4)
    seq = Pipe(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), chunks=2, balance=[1, 1],
               devices=["cpu"] * 2)  # fmt: skip
    with pytest.raises(TypeError, match="run the layer '1' they hold"):
        setattr(seq, "1", nn.Linear(16, 4))
    with pytest.raises(TypeError, match="run the layer '0' they hold"):
        seq.add_module("0", nn.Linear(8, 16))
    # nn.Sequential's spellings (Python's "does not support item assignment" said nothing).
    with pytest.raises(TypeError, match="run the layer '1' they hold"):
        seq[-1] = nn.Linear(16, 4)
    with pytest.raises(TypeError, match="none can be deleted"):
        del seq[0]
    seq.extra = nn.Linear(2, 2)  # a new attribute is the user's own
    assert seq(torch.randn(4, 8)).shape == (4, 4)


def test_a_layer_or_tensor_added_after_construction_is_the_users_own() -> None:
    # No stage runs it: replacing or deleting it is no replacement of theirs.
    pipe = traced(Scaled())
    pipe.probe = nn.Linear(2, 2)
    pipe.probe = nn.Linear(2, 3)
    pipe.temperature = nn.Parameter(torch.tensor(1.0))
    pipe.temperature = nn.Parameter(torch.tensor(2.0, device="meta"))
    pipe.register_buffer("seen", torch.zeros(1))
    pipe.seen = None  # (refused for a buffer the stages read)
    del pipe.probe, pipe.temperature, pipe.seen
    assert "probe" not in pipe._modules and "temperature" not in pipe._parameters
    with pytest.raises(TypeError, match="run the layer 'decoder' they hold"):
        pipe.decoder = nn.Linear(16, 4)  # the module's own stay checked
    with pytest.raises(TypeError, match="it cannot be deleted"):
        del pipe.scale
    x = torch.randn(4, 8, dtype=torch.float64)
    copied = pickle.loads(pickle.dumps(pipe))
    copied.extra = nn.Linear(2, 2)
    copied.extra = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="'shift' is a tensor the stages read"):
        copied.shift = None
    torch.testing.assert_close(copied(x), pipe(x))
    state = pipe.__getstate__()
    state["_sealed"] = True  # as pickled while it was a flag
    old = Pipe.__new__(Pipe)
    old.__setstate__(state)
    with pytest.raises(TypeError, match="run the layer 'decoder' they hold"):
        old.decoder = nn.Linear(16, 4)


def test_a_tensor_added_to_the_pipe_stays_off_the_wrapped_module() -> None:
    model = Scaled()
    pipe = Pipe(model, chunks=2, split_points=["decoder"], devices=["cpu"] * 2)
    pipe.temperature = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    pipe.register_buffer("seen", torch.zeros(1, dtype=torch.float64))
    pipe.float()  # puts the converted tensors back into the module
    pipe.scale = nn.Parameter(torch.tensor(3.0))  # and a replaced one
    assert list(model.state_dict()) == list(Scaled().state_dict())
    assert model.scale is pipe.scale and model.shift is pipe.shift
    assert pipe.temperature.dtype == torch.float32


def test_moving_a_module_that_holds_a_pipe_is_refused() -> None:
    holder = nn.Module()
    holder.head = nn.Linear(2, 2)  # before the Pipe: moved before it refuses
    holder.pipe = traced(Scaled())
    with pytest.raises(TypeError, match="would move the stages on cpu to meta"):
        holder.to("meta")
    assert holder.head.weight.device.type == "meta"
    holder.head.to_empty(device="cpu")
    with pytest.raises(TypeError, match="would move the stages on cpu to meta"):
        holder.to_empty(device="meta")
    assert all(p.device.type == "cpu" for p in holder.pipe.parameters())
    holder.head.to_empty(device="cpu")
    holder.to(torch.float32)  # dtype conversions reach the stages
    assert holder.pipe(torch.randn(2, 8)).dtype == torch.float32
    holder.to("cpu")  # where the stages already are


class Raise(nn.Module):
    """Raises at its second forward once armed (after micro-batch 0's
    backward, in 1F1B)."""

    armed = False
    calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.armed and self.calls == 2:
            raise ValueError("stage failed")
        return x


@pytest.mark.parametrize("overwrite", [False, True], ids=["in place", "new parameters"])
def test_a_failed_step_after_a_dtype_conversion_puts_the_converted_state_back(
    overwrite: bool,
) -> None:
    # The conversion replaces the buffers (and with the flag the parameters)
    # by new tensors: the step's snapshot must save those, not the old ones.
    fail = Raise()
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4), fail)
    pipe = Pipe(model, chunks=2, balance=[2, 2], devices=["cpu"] * 2, schedule="1f1b")
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe.train_step(x, y, nn.MSELoss())  # the snapshot's lists are found here
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    try:
        pipe.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    x, y = x.double(), y.double()
    pipe.train_step(x, y, nn.MSELoss())
    state = copy.deepcopy(pipe.state_dict())
    grads = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
    assert len(grads) == 6
    fail.armed, fail.calls = True, 0
    with pytest.raises(ValueError, match="stage failed"):
        pipe.train_step(x, y, nn.MSELoss())
    for (name, now), before in zip(pipe.state_dict().items(), state.values()):
        torch.testing.assert_close(now, before, rtol=0, atol=0, msg=name)
    torch.testing.assert_close([p.grad for p in pipe.parameters()], grads, rtol=0, atol=0)
