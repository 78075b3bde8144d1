"""What graphs bake in: a stage's tensors and modules, noticed when they
change (cheaply: no walk over the stage per run); a call's key, strides
included; plain arguments' values, bounded."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated, GraphWarning, StageGraphs
from mpstream.runtime.graphed import keys as keys_module
from mpstream.runtime.graphed.keys import MAX_VALUES, Baked, autocast_key, generation, signature
from tests.helpers import assert_same_grads
from tests.models import Fan
from tests.runtime.graphed.pairs import pair


def test_what_a_capture_baked_in_notices_what_a_replay_could_not() -> None:
    layer = nn.Linear(2, 2)
    baked = Baked(layer)
    with torch.no_grad():
        layer.weight.add_(1)  # in place: the graphs read it
    assert not baked.changed()
    layer.weight.data = layer.weight.data.clone()  # a new storage
    assert baked.changed()
    baked = Baked(layer)
    with torch.no_grad():
        layer.weight.t_()  # the same memory, laid out anew
    assert baked.changed()
    baked = Baked(layer)
    layer.bias.requires_grad_(False)
    assert baked.changed()
    baked = Baked(layer)
    layer.weight = nn.Parameter(layer.weight.detach())  # the same memory, a new parameter
    assert baked.changed()
    baked = Baked(layer)
    nn.Linear(2, 2)  # a module registering its own: nothing of this stage's
    assert not baked.changed()
    layer.extra = nn.Linear(2, 2)  # a module registered in the stage
    assert baked.changed()
    baked = Baked(layer)
    layer.register_buffer("scale", torch.ones(2))  # a buffer too
    assert baked.changed()
    baked = Baked(layer)
    layer.to(torch.float64)  # moved (parameters and buffers alike)
    assert baked.changed()


def test_the_watch_names_the_tensors_frozen_since_and_only_those() -> None:
    # What a backward task reads (StageState.check_frozen): the positions of
    # tensors that required grad when watched and no longer do.
    layer = nn.Linear(2, 2)
    baked = Baked(layer)
    assert list(baked.watch.frozen()) == []
    layer.weight.data = layer.weight.data.clone()  # moved: not a freeze
    assert list(baked.watch.frozen()) == []
    layer.bias.requires_grad_(False)
    assert [baked.tensors[i] is layer.bias for i in baked.watch.frozen()] == [True]
    layer.bias.requires_grad_(True)
    assert list(baked.watch.frozen()) == []


def test_a_run_walks_no_module_unless_something_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]).double()
    _, graphed = pair(model, chunks=2, balance=[2, 2])
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    graphed.train_step(x, y, nn.MSELoss())  # captures (each way of calling: its own graphs)
    nn.functional.mse_loss(graphed(x), y).backward()
    walked: list[nn.Module] = []
    real = nn.Module.named_modules  # what modules() and parameters() walk

    def spy(self: nn.Module, *args: object, **kwargs: object) -> object:
        walked.append(self)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(nn.Module, "named_modules", spy)
    before = generation()
    loss = nn.MSELoss()
    graphed.train_step(x, y, loss)
    nn.functional.mse_loss(graphed(x), y).backward()
    assert [m for m in walked if m is not loss] == [] and generation() == before


class Gate(nn.Module):
    """A module of the user's own: its forward may read its flag."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * (2.0 if self.training else 0.5)


def test_a_run_reads_the_flags_of_modules_that_may_read_them_only() -> None:
    linear, drop, norm, gate = nn.Linear(2, 2), nn.Dropout(), nn.BatchNorm1d(2), Gate()
    hooked = nn.Linear(2, 2)
    hooked.register_forward_hook(lambda m, i, o: o * 2 if m.training else o)
    baked = Baked(nn.Sequential(linear, nn.ReLU(), drop, norm, gate, hooked))
    flags = baked.modes()
    # Dropout, BatchNorm, the user's module and the hooked Linear; not the
    # container, the plain Linear layers or ReLU: a transformer's thousands
    # of them are not read at each run.
    assert len(flags) == 4
    linear.eval()
    assert baked.modes() == flags
    for module in (drop, norm, gate, hooked):
        module.eval()
        assert baked.modes() != flags, type(module).__name__
        module.train()
        assert baked.modes() == flags


def test_one_submodule_switched_to_eval_replays_graphs_of_its_own_mode() -> None:
    model = nn.Sequential(
        nn.Linear(6, 6), Gate(), nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 6), Gate())
    ).double()
    eager, graphed = pair(model, chunks=2, balance=[2, 2])
    x = torch.randn(4, 6, dtype=torch.float64)

    def gates(pipe: Pipe) -> list[nn.Module]:
        return [m for m in pipe.modules() if isinstance(m, Gate)]

    for switched in (None, 1, 0, None):  # the nested one, then the first one
        for pipe in (eager, graphed):
            pipe.train()
            if switched is not None:
                gates(pipe)[switched].eval()
        for _ in range(2):  # a capture, then a replay
            torch.testing.assert_close(graphed(x), eager(x))
    # Captures are per micro-batch slot (2). The first stage: one per mode of
    # its gate; the second: one per mode of its own gate, and again for the
    # first stage's new call (its key names its producer's call).
    assert [s.captures for s in graphed.graph_report().stages] == [4, 6]


def test_the_key_holds_strides_not_storage_offsets() -> None:
    x = torch.randn(4, 6)
    assert signature((x,)) == signature((torch.randn(4, 6),))
    assert signature((x[1:3],)) == signature((x[2:4],))  # offsets: copied into the buffers
    assert signature((x.t().contiguous().t(),)) != signature((x,))  # strides: another layout
    assert signature((x,), [True]) != signature((x,), [False])


def test_an_input_of_another_layout_gets_graphs_of_its_own() -> None:
    eager, graphed = pair(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4)).double(),
                          chunks=1, balance=[2, 1])  # fmt: skip
    x = torch.randn(6, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), eager(x))
        before = graphed.graph_report().stages[0].captures
        strided = x.t().contiguous().t()  # equal values, column-major
        torch.testing.assert_close(graphed(strided), eager(strided))
    assert graphed.graph_report().stages[0].captures == before + 1


def test_a_plain_argument_taking_many_values_is_bounded_with_one_warning() -> None:
    eager, graphed = pair(
        Fan().double(), split_points=["a", "b", "c"], devices=["cpu"] * 4, balance=None, chunks=2
    )  # fmt: skip
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    scales = [1.0 + i / 10 for i in range(MAX_VALUES + 4)]
    with pytest.warns(
        GraphWarning, match=r"argument \d+ \(a float\) took more than 8 values.*tensor"
    ):
        for scale in scales:
            for pipe in (eager, graphed):
                pipe.zero_grad()
                nn.functional.mse_loss(pipe(x, scale), y).backward()
            assert_same_grads(graphed, eager)
    report = graphed.graph_report()
    assert all(s.graphed for s in report.stages)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphWarning)
        nn.functional.mse_loss(graphed(x, scales[0]), y).backward()  # a known value replays


def test_a_module_built_elsewhere_keeps_the_stages_graphs_and_gradient_buffers() -> None:
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]).double()
    _, graphed = pair(model, chunks=2, balance=[2, 2])
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    graphed.train_step(x, y, nn.MSELoss())
    grads = [p.grad for p in graphed.parameters()]
    nn.Linear(3, 3)  # a metric, another model: registers its own parameters
    graphed.train_step(x, y, nn.MSELoss())
    assert all(p.grad is g for p, g in zip(graphed.parameters(), grads))
    assert [s.recaptures for s in graphed.graph_report().stages] == [0, 0]


def test_the_autocast_key_asks_no_device_while_autocast_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Read at every replayed forward: one call to torch says autocast is
    # off everywhere; asking CUDA's and the CPU's by name cost four times that.
    asked: list[str] = []
    real = torch.is_autocast_enabled

    def counted(device: str) -> bool:
        asked.append(device)
        return real(device)

    monkeypatch.setattr(torch, "is_autocast_enabled", counted)
    assert autocast_key() == ()
    assert asked == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_key() == (("cpu", torch.bfloat16),)


def _variants() -> list[tuple[tuple[Any, ...], list[bool] | None]]:
    """Arguments (fresh tensors each time) that no two calls may share
    graphs for, with the gradients a step needs (None: as autograd sees)."""
    x = torch.randn(4, 6)
    return [
        ((x,), None),
        ((x,), [True]),  # a step needs its gradient
        ((x.double(),), None),  # dtype
        ((torch.randn(5, 6),), None),  # shape
        ((x.t().contiguous().t(),), None),  # strides
        ((torch.randn(4, 6, device="meta"),), None),  # device
        ((x, x), None),  # how many
        ((x, 1), None),  # plain values: their type and value
        ((x, 1.0), None),
        ((x, True), None),
        ((x, 2), None),
        ((x, None), None),
        (([x],), None),  # structure
        (((x,),), None),
        (({"a": x},), None),
    ]


def test_distinct_signatures_are_distinct_keys_and_equal_ones_equal() -> None:
    keys = [signature(args, needs) for args, needs in _variants()]
    assert len(set(keys)) == len(keys)
    assert [signature(args, needs) for args, needs in _variants()] == keys
    x = torch.randn(4, 6)
    # Whether it needs a gradient, as autograd sees it or as a step says.
    assert signature((x,), [False]) == signature((x,))
    assert signature((x.requires_grad_(),)) == signature((x,), [True])
    assert signature([x]) == signature((x,))  # a list of arguments is their sequence


def test_a_flat_sequence_of_tensors_is_keyed_without_walking_a_pytree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The key of every replayed forward: its common case costs no pytree walk.
    walked: list[object] = []
    real = keys_module.leaves

    def spy(value: object) -> tuple[list[Any], Any]:
        walked.append(value)
        return real(value)

    monkeypatch.setattr(keys_module, "leaves", spy)
    x = torch.randn(4, 6)
    assert signature((x, x.t()), [True, False]) != signature((x, x.t()), [False, False])
    assert signature([x]) is not None and walked == []
    assert signature((x, 2)) is not None and len(walked) == 1  # a plain value: walked


class Takes(nn.Module):
    """A stage taking any tensors (any dtype, shape or layout) and plain values."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, *args: Any) -> torch.Tensor:
        first = next(t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))
        out: torch.Tensor = first * self.w.to(first.dtype)
        return out


def _graphs(stage: nn.Module) -> StageGraphs:
    """One stage's graphs (emulated), begun for a forward run of one micro-batch."""
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2)), devices=["cpu"], chunks=1, graphs=Emulated())
    with torch.no_grad():
        pipe(torch.randn(1, 2))
    graphs = StageGraphs([stage], [torch.device("cpu")], backend=Emulated())
    graphs.begin(next(iter(pipe._rt().schedules.values())), step=False)
    return graphs


def test_calls_of_distinct_signatures_never_share_graphs() -> None:
    stage = Takes()
    graphs = _graphs(stage)

    def on_cpu(args: tuple[Any, ...]) -> bool:
        return all(t.device.type == "cpu" for t in pytree.tree_leaves(args) if torch.is_tensor(t))

    variants = [v for v in _variants() if on_cpu(v[0])]  # the others: the key only
    seen: set[int] = set()
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            found = [graphs.find(0, 0, stage, args, False, needs) for args, needs in variants]
            assert all(c is not None for c in found) and len(set(map(id, found))) == len(found)
            again = [graphs.find(0, 0, stage, args, False, needs) for args, needs in variants]
            assert [id(c) for c in again] == [id(c) for c in found]
            assert not {id(c) for c in found} & seen  # grad mode is part of the key
            seen = {id(c) for c in found}  # the stage keeps them: no id is reused


class Hashed:
    """A plain argument that counts how often it is hashed."""

    count = 0

    def __hash__(self) -> int:
        Hashed.count += 1
        return 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Hashed)


def test_a_replayed_call_hashes_its_key_once() -> None:
    # Hashing a key (dtypes, shapes, strides, devices, ...) is a large part
    # of a replay's host work: not again to look up, reorder and mark it.
    stage = Takes()
    graphs = _graphs(stage)
    args = (torch.randn(4, 6), Hashed())
    first = graphs.find(0, 0, stage, args, False)
    Hashed.count = 0
    assert graphs.find(0, 0, stage, args, False) is first
    # Once to check it can be a key, once for the call's key: its stage's
    # bound on plain values (Scalars) admitted them when it was captured.
    assert Hashed.count == 2
