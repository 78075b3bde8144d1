"""Every schedule trains: loss and gradients equal the whole-batch step for
every schedule x checkpoint mode x shape, on MLPs and ResNet50's layers;
deferred BatchNorm, profiling, recorded plans and failure recovery work with
each; measured activation memory per stage follows the schedules' bounds."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe, profile, verify_plan
from mpstream.memory import StageSavedBytes
from mpstream.observe.compare import live_activations
from mpstream.runtime import training
from mpstream.runtime.microbatch import scatter
from mpstream.runtime.plan import Plan
from mpstream.runtime.scheduler import EventScheduler
from mpstream.runtime.worker import Worker
from mpstream.schedules.schedule import Schedule
from tests.helpers import assert_same_grads, mlp, virtual_for

BATCH = 10
MODES = ["never", "except_last", "always"]
# One hand-written order per stage count: 1F1B's shape with split backwards
# whose weight passes trail by one micro-batch on the first stage.
NAMES = [
    "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "looped_bfs", "interleaved_zb", "zbv",
    "dualpipev", "custom",
]  # fmt: skip
# Those whose orders split backwards into B and W (DualPipe-V some of them).
SPLITS = ("zb_h1", "interleaved_zb", "zbv", "dualpipev", "custom")
# (stages, virtual stages, split size): one micro-batch; fewer micro-batches
# than stages; micro-batches not dividing the batch; one rank of two and
# of three stages; ten micro-batches (DualPipe-V's main phase, m >= 2p).
# A V holds two stages per rank (its virtual stages are 2 whatever the
# shape says) and needs an even number of stages.
SHAPES = [(2, 1, BATCH), (4, 2, 4), (4, 1, 3), (3, 3, 7), (2, 2, 3), (4, 2, 1)]
CASES = [
    (name, shape)
    for name in NAMES
    for shape in SHAPES
    if (name not in ("zbv", "dualpipev") or shape[0] % 2 == 0)
    and (shape[2] > 1 or name not in ("gpipe", "1f1b", "zb_h1", "custom"))
]


def custom_order(stages: int, micros: int) -> list[str]:
    """zb_h1's order, with the first stage's weight passes moved to the end."""
    order = str(Schedule("zb_h1", stages, micros, [False] * stages)).split()
    tail = [a for a in order if a.startswith("W0m")]
    return [a for a in order if not a.startswith("W0m")] + tail


def make_pipe(
    model: nn.Module, name: str, stages: int, virtual: int, micros: int, **kw: object
) -> Pipe:
    schedule: object = custom_order(stages, micros) if name == "custom" else name
    return Pipe(
        model,
        devices=["cpu"] * stages,
        schedule=schedule,  # type: ignore[arg-type]
        virtual_stages=virtual_for(name, stages, stages // virtual),
        **kw,  # type: ignore[arg-type]
    )


def reference(model: nn.Module, x: Tensor, y: Tensor, loss_fn: Callable[..., Tensor]) -> Tensor:
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize(("name", "shape"), CASES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_gradients_equal_the_whole_batch(
    name: str, checkpoint: str, shape: tuple[int, int, int]
) -> None:
    stages, virtual, split_size = shape
    model = mlp([5, 8, 7, 6, 4])
    ref = copy.deepcopy(model)
    balance = {2: [4, 4], 3: [2, 3, 3], 4: [2, 2, 2, 2]}[stages]
    micros = -(-BATCH // split_size)
    pipe = make_pipe(
        model, name, stages, virtual, micros, split_size=split_size, balance=balance,
        checkpoint=checkpoint,
    )  # fmt: skip
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, reference(ref, x, y, nn.MSELoss()))
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize(
    ("name", "checkpoint"),
    [
        ("interleaved_1f1b", "always"),
        ("zb_h1", "never"),
        ("custom", "except_last"),
        ("zbv", "except_last"),
        ("dualpipev", "never"),
    ],  # fmt: skip
)
def test_resnet50_layers(name: str, checkpoint: str) -> None:
    """The tutorial's ResNet50 blocks up to layer2's first (the stem,
    layer1, a strided block with a downsample), in four stages."""
    from torchvision.models import resnet50

    from mpstream.tutorial import resnet50_layers

    torch.manual_seed(0)
    model = nn.Sequential(*list(resnet50_layers(resnet50(num_classes=10)))[:8]).double()
    ref = copy.deepcopy(model)
    pipe = make_pipe(model, name, 4, 2, 3, chunks=3, balance=[3, 1, 2, 2], checkpoint=checkpoint)
    x = torch.randn(6, 3, 32, 32, dtype=torch.float64)
    y = torch.randn(6, 512, 4, 4, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.MSELoss())
    # BatchNorm normalises each micro-batch on its own: the reference runs
    # the same micro-batches.
    out = torch.cat([ref(part) for part in x.split(2)])
    expected = sum(nn.MSELoss()(o, t) / 3 for o, t in zip(out.split(2), y.split(2)))
    expected.backward()  # type: ignore[union-attr]
    torch.testing.assert_close(loss, expected.detach())  # type: ignore[union-attr]
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("name", NAMES)
def test_deferred_batch_norm_updates_statistics_once(name: str) -> None:
    # One BatchNorm, whose input does not depend on the split: its statistics
    # then equal the whole batch's.
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh()
    ).double()
    ref = copy.deepcopy(model)
    pipe = make_pipe(model, name, 2, 2, 4, split_size=3, balance=[3, 2], deferred_batch_norm=True)
    x = torch.randn(12, 4, dtype=torch.float64)
    pipe.train_step(x, torch.randn(12, 6, dtype=torch.float64), nn.MSELoss())
    ref(x)
    for (key, a), b in zip(pipe.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, msg=key)


@pytest.mark.parametrize("name", NAMES)
def test_profile_and_plan_of_every_schedule(name: str) -> None:
    pipe = make_pipe(mlp([6, 8, 4]), name, 2, 2, 3, chunks=3, balance=[2, 2])
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with profile(pipe) as prof:
        pipe.train_step(x, y, nn.MSELoss())
    kinds = sorted((s.kind, s.stage, s.micro) for s in prof.spans)
    split = pipe.schedule_for(3, x.device, training_step=True).split
    expected = [(k, s, m) for k in ("forward", "backward") for s in range(2) for m in range(3)]
    expected += [("weight", s, m) for s, m in split]
    assert kinds == sorted(expected)
    assert bool(split) == (name in SPLITS)
    costs = __import__("mpstream").simulate_fit(prof)
    assert len(costs.weight_times) == (2 if split else 0)
    # The run's stream operations, recorded and checked.
    sched = pipe.scheduler
    sched.recording = True
    pipe.train_step(x, y, nn.MSELoss())
    verify_plan(Plan(sched.plan(), sched.slot_names, sched.slot_devices, 2))


@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("gpipe", "1f1b", "custom")])
def test_plans_with_copies_between_stages(name: str) -> None:
    model = mlp([4, 5, 6, 5, 3])
    ref = copy.deepcopy(model)
    parts = [model[0:2], model[2:4], model[4:6], model[6:8]]
    sched = EventScheduler([torch.device("cpu")] * 4)
    worker = Worker(parts, sched)
    x, y = torch.randn(BATCH, 4, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
    micro, targets = scatter(x, None, 3), scatter(y, None, 3)
    schedule = Schedule(
        name, 4, len(micro), [True] * 4, backward=True, copy_target=True, virtual_stages=2
    )
    sched.recording = True
    weights = [len(m) / BATCH for m in micro]  # type: ignore[arg-type]
    loss = training.run(worker, [(b,) for b in micro], targets, schedule, nn.MSELoss(), weights)
    verify_plan(Plan(sched.plan(), sched.slot_names, sched.slot_devices, 4))
    torch.testing.assert_close(loss, reference(ref, x, y, nn.MSELoss()))
    assert_same_grads(model, ref)


class Fails(torch.autograd.Function):
    """Identity on a parameter: its backward runs in the weight pass only."""

    armed = False

    @staticmethod
    def forward(ctx: object, w: Tensor) -> Tensor:  # type: ignore[override]
        return w.clone()

    @staticmethod
    def backward(ctx: object, g: Tensor) -> Tensor:  # type: ignore[override]
        if Fails.armed:
            raise KeyError("weight pass failed")
        return g


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return x * Fails.apply(self.w)  # type: ignore[no-any-return]


def test_a_failed_weight_pass_restores_gradients() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Scaled(), nn.Linear(4, 2)).double()
    pipe = Pipe(model, split_size=4, balance=[1, 2], devices=["cpu", "cpu"], schedule="zb_h1")
    x, y = torch.randn(BATCH, 4, dtype=torch.float64), torch.randn(BATCH, 2, dtype=torch.float64)
    pipe.train_step(x, y, nn.MSELoss())
    before = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    Fails.armed = True
    try:
        with pytest.raises(KeyError, match="weight pass failed"):
            pipe.train_step(x, y, nn.MSELoss())
    finally:
        Fails.armed = False
    for p, g in zip(pipe.parameters(), before):
        torch.testing.assert_close(p.grad, g)
    assert not pipe.scheduler.native.running
    pipe.train_step(x, y, nn.MSELoss())
    for p, g in zip(pipe.parameters(), before):
        torch.testing.assert_close(p.grad, 2 * g)


def test_measured_activation_memory_per_stage() -> None:
    """Bytes autograd saved, per stage, against the schedules' counts.

    Equal stages save the same bytes per micro-batch; a stage's peak is then
    that unit times the micro-batches it holds: ``min(p - s, m)`` until B for
    1F1B and ZB-H1 (until W, ZB-H1's stages hold up to ``min(p, m)``), all of
    them for GPipe, Megatron's in-flight count for interleaved 1F1B. (Stage
    0 saves views of the one input batch, a storage counted once: it is
    checked against GPipe only.)
    """
    stages, micros, width = 4, 8, 64
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)])
    x, y = torch.randn(micros * 4, width), torch.randn(micros * 4, width)
    peaks = {}
    for name in NAMES[:-1]:
        pipe = make_pipe(copy.deepcopy(model), name, stages, 2, micros, chunks=micros)
        with StageSavedBytes(pipe.partitions) as tracker:
            pipe.train_step(x, y, nn.MSELoss())
        assert tracker.current_bytes == [0] * stages, "activations outlived the step"
        peaks[name] = tracker.peak_bytes
        sched = pipe.schedule_for(micros, x.device, training_step=True)
        live, held = live_activations(sched)
        unit = peaks["gpipe"][1] / micros
        for s in range(1, stages):
            # Between B and W a micro-batch keeps what W reads, less what
            # only the nodes above the stage's last weight read.
            assert live[s] * unit <= peaks[name][s] <= held[s] * unit, (name, s, peaks[name])
            if not sched.split:
                assert peaks[name][s] == held[s] * unit
        assert peaks[name][0] <= peaks["gpipe"][0]
        if name in ("1f1b", "zb_h1"):
            assert live == [min(stages - s, micros) for s in range(stages)]
    assert peaks["gpipe"][1:] == [peaks["gpipe"][1]] * (stages - 1)
    assert sum(peaks["1f1b"]) < 0.6 * sum(peaks["gpipe"])
    assert sum(peaks["zb_h1"]) < sum(peaks["gpipe"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_checkpointed_stages_are_charged_their_saved_inputs(schedule: str) -> None:
    # A checkpoint keeps its stage's input (before the stage's hooks run),
    # and its recomputation stops part-way: each stage holds its own input.
    model = nn.Sequential(nn.Linear(100, 3), nn.Linear(3, 1))
    pipe = Pipe(model, chunks=2, balance=[1, 1], devices=["cpu"] * 2, schedule=schedule,
                checkpoint="always")  # fmt: skip
    x, y = torch.randn(4, 100), torch.randn(4, 1)
    with StageSavedBytes(pipe.partitions) as tracker:
        pipe.train_step(x, y, nn.MSELoss())
    in_flight = 2 if schedule == "gpipe" else 1  # stage 1's micro-batches held at once
    assert tracker.peak_bytes == [2 * 2 * 100 * 4, in_flight * 2 * 3 * 4]
    assert tracker.current_bytes == [0, 0] and tracker._running is None


def test_saved_bytes_ignore_checkpoints_of_other_pipes() -> None:
    # A tracked stage that runs another, checkpointed pipe inside, and a
    # pipe checkpointing on another thread: neither moves the attribution.
    inner = Pipe(nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100)), chunks=1,
                 checkpoint="always")  # fmt: skip

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(100, 100)

        def forward(self, x: Tensor) -> Tensor:
            return inner(self.a(x))

    outer = Pipe(nn.Sequential(Outer(), nn.Linear(100, 1)), chunks=1, balance=[1, 1],
                 devices=["cpu"] * 2)  # fmt: skip
    x = torch.randn(4, 100)
    with StageSavedBytes(outer.partitions) as tracker:
        outer.train_step(x, torch.randn(4, 1), nn.MSELoss())
    assert tracker.peak_bytes[0] > 0 and tracker.peak_bytes[1] == 4 * 100 * 4
