"""mpstream.distributed in one process (a one-rank gloo group): what wrapping
a pipe in DDP and ``train_step`` refuse, placement checks, graphed stages
handing every gradient to the reducer, tied weights and a grad scaler."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import mpstream
from mpstream import Pipe
from mpstream import distributed as mpdist
from tests.ddp_group import BALANCE, SPLIT, batches, initial_model, one_process_group


@pytest.fixture
def group() -> Iterator[None]:
    with one_process_group():
        yield


def small_pipe(**kwargs: Any) -> Pipe:
    return Pipe(
        initial_model(), split_size=SPLIT, balance=BALANCE, devices=["cpu", "cpu"], **kwargs
    )


def test_wrap_needs_a_pipe() -> None:
    with pytest.raises(TypeError, match="mpstream.Pipe, got Sequential"):
        mpdist.wrap(initial_model())  # type: ignore[arg-type]


def test_wrap_needs_an_initialised_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        mpdist.wrap(small_pipe())


@pytest.mark.parametrize("name", ["device_ids", "output_device"])
def test_wrap_rejects_device_placement(group: None, name: str) -> None:
    with pytest.raises(ValueError, match=f"{name}=.*leave {name}=None"):
        mpdist.wrap(small_pipe(), **{name: [0] if name == "device_ids" else 0})


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("mixed_precision", "forward hooks"),
        ("delay_all_reduce_named_params", "once per micro-batch"),
        ("param_to_hook_all_reduce", "once per micro-batch"),
    ],
)
def test_wrap_rejects_what_cannot_work_with_a_pipeline(group: None, name: str, why: str) -> None:
    pipe = small_pipe()
    with pytest.raises(ValueError, match=f"{name} is not supported .*{why}"):
        mpdist.wrap(pipe, **{name: object()})


def test_wrap_refuses_a_pipe_split_at_its_first_call_before_it(group: None) -> None:
    from tests.stages.test_export import Shaped

    # DDP would bucket the parameters before the split places them.
    pipe = Pipe(Shaped(), split_points=["head"], devices=["cpu", "cpu"])
    with pytest.raises(RuntimeError, match=r"wrap needs .* not split yet.*Call the pipe once"):
        mpdist.wrap(pipe)
    pipe(torch.randn(4, 4))
    assert isinstance(mpdist.wrap(pipe), DistributedDataParallel)


@pytest.mark.parametrize(
    ("devices", "config", "message"),
    [
        (["cpu", "cuda:0"], "cpu:gloo,cuda:nccl", "several device types"),
        (["cpu", "cpu"], "cuda:nccl", r"backend \(cuda:nccl\) has no collectives for cpu"),
        (["cpu", "cpu"], "nccl", "use gloo for CPU stages"),
        (["cuda:0", "cuda:1"], "cpu:gloo", "no collectives for cuda"),
    ],
)
def test_check_placement_rejects(devices: list[str], config: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mpdist.check_placement([torch.device(d) for d in devices], config)


@pytest.mark.parametrize(
    ("devices", "config"),
    [
        (["cpu", "cpu"], "cpu:gloo"),
        (["cpu", "cpu"], "gloo"),
        (["cuda:0", "cuda:1"], "cpu:gloo,cuda:nccl"),
        (["cuda:0", "cuda:0"], "nccl"),
        (["cuda:0"], "some_custom_backend"),
    ],
)
def test_check_placement_accepts(devices: list[str], config: str) -> None:
    mpdist.check_placement([torch.device(d) for d in devices], config)
    mpdist.check_placement(devices, config)  # names, as Pipe(devices=...) takes them


def test_check_placement_names_a_bad_device() -> None:
    with pytest.raises(ValueError, match=r"devices\[1\] is 'gpu', not a device"):
        mpdist.check_placement(["cuda:0", "gpu"], "nccl")


def test_one_process_train_step_equals_the_pipes(group: None) -> None:
    pipe = small_pipe(schedule="1f1b", checkpoint="always")
    ref = copy.deepcopy(pipe)
    ddp = mpdist.wrap(pipe)
    assert isinstance(ddp, DistributedDataParallel) and ddp.module is pipe
    x, y = batches(1)[0]
    loss = mpdist.train_step(ddp, x, y, nn.MSELoss())
    torch.testing.assert_close(loss, ref.train_step(x, y, nn.MSELoss()))
    for a, b in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_a_batch_is_one_argument_and_a_spread_one_is_refused_with_what_to_do(
    group: None,
) -> None:
    from tests.pipe.test_train_step_errors import Gated

    model = Gated()
    ref = Pipe(copy.deepcopy(model), split_size=4, split_points=["b"], devices=["cpu", "cpu"])
    ddp = mpdist.wrap(Pipe(model, split_size=4, split_points=["b"], devices=["cpu", "cpu"]))
    x = torch.randn(8, 4, dtype=torch.float64)
    batch = {"x": x, "gate": torch.rand_like(x)}
    y = torch.randn(8, 2, dtype=torch.float64)
    with pytest.raises(
        TypeError,
        match=r"distributed.train_step got keyword argument\(s\) 'x', 'gate', .* one dict",
    ):
        mpdist.train_step(ddp, **batch)  # type: ignore[arg-type]
    loss = mpdist.train_step(ddp, batch, y, nn.MSELoss())  # a traced module's keyword inputs
    torch.testing.assert_close(loss, ref.train_step(batch, y, nn.MSELoss()))
    for a, b in zip(ddp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_train_step_without_loss_fn_trains_on_the_modules_own_loss(group: None) -> None:
    from tests.stages.test_export import Shaped

    torch.manual_seed(0)
    model = Shaped().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    batch = {"x": x, "target": y}
    options: dict[str, Any] = {"chunks": 2, "split_points": ["head"], "devices": ["cpu"] * 2}
    ref = Pipe(copy.deepcopy(model), sample=batch, **options)
    ddp = mpdist.wrap(Pipe(model, sample=batch, **options))
    loss = mpdist.train_step(ddp, batch)  # as pipe.train_step(batch)
    torch.testing.assert_close(loss, ref.train_step(batch))
    for a, b in zip(ddp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_graphed_stages_under_ddp_train_through_train_step(group: None) -> None:
    # Graphed stages add their gradients inside the graphs, past the
    # AccumulateGrad hooks DDP's reducer counts on: ddp(x) with gradients is
    # refused with what to do, and mpdist.train_step reduces their buffers.
    from mpstream.runtime.graphed import Emulated

    eager, graphed = small_pipe(), small_pipe(graphs=Emulated())
    graphed.load_state_dict(eager.state_dict())
    wrapped = [mpdist.wrap(pipe) for pipe in (eager, graphed)]
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"mpstream.distributed.train_step\(ddp, inputs"):
        nn.functional.mse_loss(wrapped[1](x), y).backward()
    with torch.no_grad():
        torch.testing.assert_close(wrapped[1](x), wrapped[0](x))  # inference is fine
    for i in range(3):
        for ddp in wrapped:
            if i != 1:  # the second step accumulates onto the first's
                ddp.zero_grad()
            mpdist.train_step(ddp, x, y, nn.MSELoss())
        for a, b in zip(graphed.parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
    stores = [s for s in graphed._grad_stores() if s is not None]
    assert stores and all(p.grad is v for s in stores for p, v in s.owned())


def test_graphed_stages_under_a_plain_ddp_are_refused_with_what_to_do(group: None) -> None:
    from mpstream.runtime.graphed import Emulated

    graphed = small_pipe(graphs=Emulated())
    ddp = DistributedDataParallel(graphed, device_ids=None)
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="reducer hooks cannot see them"):
        nn.functional.mse_loss(ddp(x), y).backward()
    mpdist.train_step(ddp, x, y, nn.MSELoss())  # the way that works


def test_one_process_train_step_with_tied_weights_and_a_grad_scaler(group: None) -> None:
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5)).double()
    model[2].weight = model[0].weight  # tied, on one device: reduced once
    pipe = Pipe(model, split_size=SPLIT, balance=[2, 1], devices=["cpu", "cpu"])
    ref = copy.deepcopy(pipe)
    scalers = [torch.amp.GradScaler("cpu", init_scale=8.0) for _ in range(2)]
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    loss = mpdist.train_step(mpdist.wrap(pipe), x, y, nn.MSELoss(), scaler=scalers[0])
    torch.testing.assert_close(loss, ref.train_step(x, y, nn.MSELoss(), scaler=scalers[1]))
    for a, b in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_the_wrapped_pipes_own_train_step_is_refused_with_what_to_do(group: None) -> None:
    pipe = small_pipe()
    ddp = mpdist.wrap(pipe)
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"never averaged.*distributed.train_step\(ddp, "):
        pipe.train_step(x, y, nn.MSELoss())  # each process would keep its own gradients
    assert all(p.grad is None for p in pipe.parameters())
    copy.deepcopy(pipe).train_step(x, y, nn.MSELoss())  # a copy is not wrapped
    with ddp.no_sync():
        mpdist.train_step(ddp, x, y, nn.MSELoss())  # accumulates locally
    mpdist.train_step(ddp, x, y, nn.MSELoss())
    del ddp
    pipe.train_step(x, y, nn.MSELoss())  # no wrapper now: the pipe trains alone
    # Wrapped without wrap(): refused once mpdist.train_step has checked it.
    ddp = DistributedDataParallel(pipe, device_ids=None)
    mpdist.train_step(ddp, x, y, nn.MSELoss())
    with pytest.raises(RuntimeError, match="never averaged"):
        ddp.module.train_step(x, y, nn.MSELoss())
    # Wrapped twice: refused while either wrapper lives.
    second = mpdist.wrap(pipe)
    del second
    with pytest.raises(RuntimeError, match="never averaged"):
        pipe.train_step(x, y, nn.MSELoss())


def test_schedule_auto_measures_a_wrapped_pipe_by_its_own_steps(group: None) -> None:
    from mpstream.schedules import Auto

    pipe = small_pipe(schedule=Auto(cache=None))  # no costs: measured at the first step
    ref = copy.deepcopy(pipe)
    x, y = batches(1)[0]
    loss = mpdist.train_step(mpdist.wrap(pipe), x, y, nn.MSELoss())
    torch.testing.assert_close(loss, ref.train_step(x, y, nn.MSELoss()))


def test_tune_times_a_wrapped_pipe_by_its_own_steps(group: None) -> None:
    # Timing only: the gradients tune's steps make are dropped, so the
    # refusal of the wrapped pipe's own train_step does not apply.
    pipe = small_pipe()
    ddp = mpdist.wrap(pipe)
    x, y = batches(1)[0]
    result = mpstream.tune(
        pipe, x, nn.MSELoss(), [2], target=y, repeat=1, warmup=0, cache=None, progress=False
    )
    assert result.best is not None
    assert all(p.grad is None for p in pipe.parameters())
    del ddp


def test_train_step_needs_ddp_around_a_pipe(group: None) -> None:
    x, y = batches(1)[0]
    with pytest.raises(TypeError, match="DistributedDataParallel module, got Pipe"):
        mpdist.train_step(small_pipe(), x, y, nn.MSELoss())  # type: ignore[arg-type]
    plain = DistributedDataParallel(initial_model())
    with pytest.raises(TypeError, match="around an mpstream.Pipe, got one around Sequential"):
        mpdist.train_step(plain, x, y, nn.MSELoss())


def test_train_step_refuses_to_ignore_a_comm_hook(group: None) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = mpdist.wrap(small_pipe())
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="communication hook .* would be ignored"):
        mpdist.train_step(ddp, x, y, nn.MSELoss())


def test_sync_gradients_rejects_sparse_gradients(group: None) -> None:
    pipe = Pipe(nn.Sequential(nn.Embedding(4, 3, sparse=True), nn.Linear(3, 2)))
    ddp = DistributedDataParallel(pipe)
    pipe[0](torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="gradient of 0.weight is sparse"):
        mpdist.sync_gradients(ddp)


def test_map_location_pairs_stage_devices() -> None:
    assert mpdist.map_location(["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]) == {
        "cuda:0": "cuda:2",
        "cuda:1": "cuda:3",
    }
    assert mpdist.map_location(["cuda:0", "cuda:0"], ["cuda:1", "cuda:1"]) == {"cuda:0": "cuda:1"}
    assert mpdist.map_location(["cpu", "cpu"], [torch.device("cpu")] * 2) == {"cpu": "cpu"}
    with pytest.raises(ValueError, match="has 2 stages and this one 3"):
        mpdist.map_location(["cpu", "cpu"], ["cpu"] * 3)
    with pytest.raises(ValueError, match="cuda:0 maps to both cuda:2 and cuda:3"):
        mpdist.map_location(["cuda:0", "cuda:0"], ["cuda:2", "cuda:3"])
    # torch.load looks up the saved location, 'cuda:0': a 'cuda' key never
    # matched, and every process loaded onto the saving process's devices.
    with pytest.raises(ValueError, match=r"saved_devices\[1\] is 'cuda', .*index.*pipe.devices"):
        mpdist.map_location(["cuda:0", "cuda"], ["cuda:2", "cuda:3"])
    with pytest.raises(ValueError, match=r"devices\[0\] is 'gpu', not a device"):
        mpdist.map_location(["cuda:0"], ["gpu"])
    with pytest.raises(ValueError, match=r"devices\[0\] is 'cuda', a device without an index"):
        mpdist.map_location(["cuda:0"], [torch.device("cuda")])


class _WithUnused(nn.Module):
    """A layer with a parameter its forward never uses: no gradient reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3).double()
        self.unused = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)


def test_a_gradient_set_by_hand_on_a_graphed_stage_is_reduced_not_dropped(group: None) -> None:
    from mpstream.runtime.graphed import Emulated

    def pipe(**kwargs: Any) -> Pipe:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8).double(), nn.Tanh(), nn.Linear(8, 6).double(),
                              nn.Tanh(), _WithUnused())  # fmt: skip
        return Pipe(model, split_size=SPLIT, balance=[2, 3], devices=["cpu", "cpu"], **kwargs)

    eager, graphed = pipe(), pipe(graphs=Emulated())
    x, y = batches(1)[0]
    x, y = x[:, :5], y[:, :3]
    for i in range(3):  # capture, then replays
        for p in (eager, graphed):
            p.zero_grad(set_to_none=True)
            p[4].unused.grad = torch.full((4,), float(i + 1), dtype=torch.float64)
            mpdist.train_step(mpdist.wrap(p), x, y, nn.MSELoss())
        torch.testing.assert_close(graphed[4].unused.grad, eager[4].unused.grad)
        for a, b in zip(graphed.parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad)


def test_the_reduced_parameters_follow_requires_grad_without_a_registration(group: None) -> None:
    # Gradual unfreezing registers no module: the units must still notice.
    pipe = small_pipe()
    ddp = mpdist.wrap(pipe)
    x, y = batches(1)[0]
    mpdist.train_step(ddp, x, y, nn.MSELoss())
    before = mpdist.StageReducer(ddp).units()
    first = next(pipe.partitions[0].parameters())
    first.requires_grad_(False)
    after = mpdist.StageReducer(ddp).units()
    assert any(p is first for p in before.params[0])
    assert not any(p is first for p in after.params[0])
    assert after.order == before.order == [1, 0, -1]


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True])
def test_train_step_on_one_gpu_over_nccl_equals_the_models_gradients(graphs: bool) -> None:
    # Each stage's all-reduce is issued on the stage's stream inside its last
    # backward task, and waited for on the caller's: a one-rank NCCL group.
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = initial_model().cuda()
        ref = copy.deepcopy(model)
        pipe = Pipe(
            model, split_size=SPLIT, balance=BALANCE, devices=["cuda:0", "cuda:0"],
            schedule="zb_h1", graphs=graphs,
        )  # fmt: skip
        ddp = mpdist.wrap(pipe)
        x, y = (t.cuda() for t in batches(1)[0])
        for _ in range(3):  # graphs captured in the first
            pipe.zero_grad()
            loss = mpdist.train_step(ddp, x, y, nn.MSELoss())
        ref.zero_grad()
        expected = nn.MSELoss()(ref(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        for p, q in zip(pipe.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    finally:
        dist.destroy_process_group()
