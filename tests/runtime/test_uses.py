"""Every tensor a task reads on another stream than its allocating one is
marked for that stream first (emulated on the CPU, see tests/runtime/uses.py),
in forward runs and training steps of every built-in schedule, and where a
replayed stage (emulated graphs) neighbours an eager one; and the check
fails when a mark goes missing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime import boundary, forward, training
from mpstream.runtime import copy as copies
from mpstream.runtime.graphed import Emulated, GraphWarning
from mpstream.runtime.graphed.call import GraphedCall
from tests.runtime.uses import checking_uses


class Skip(nn.Module):
    """Four stages; stage 3 also reads stage 0's output (a skip hop)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(6, 6) for _ in range(3))
        self.d = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        return self.d(torch.tanh(self.c(torch.tanh(self.b(h)))) + h)


def chain() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def pipe_of(
    schedule: str, skip: bool = False, force: bool = True, checkpoint: str = "never"
) -> Pipe:
    torch.manual_seed(0)
    if skip:
        return Pipe(
            Skip().double(),
            split_points=["b", "c", "d"],
            sample=torch.randn(2, 6, dtype=torch.float64),
            chunks=4,
            force_copies=force,
            schedule=schedule,
        )
    if schedule in {"interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"}:
        model = nn.Sequential(*list(chain())[:4], nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
        balance, virtual = [2, 2, 2, 1], {"virtual_stages": 2}
    else:
        model, balance, virtual = chain(), [2, 3], {}
    return Pipe(
        model.double(),
        balance=balance,
        chunks=4,
        force_copies=force,
        schedule=schedule,
        checkpoint=checkpoint,
        **virtual,
    )


def batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(
        8, 2, generator=g, dtype=torch.float64
    )


@pytest.mark.parametrize("force", [True, False], ids=["copies", "shared"])
@pytest.mark.parametrize("skip", [False, True], ids=["chain", "skip"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1", "interleaved_zb"])
def test_every_cross_stream_read_is_marked(schedule: str, skip: bool, force: bool) -> None:
    """With copies between the stages (as across devices), and with stages
    reading each other's outputs in place (one device)."""
    if skip and schedule == "interleaved_zb":
        pytest.skip("interleaved_zb places two stages per rank; the skip pipe has one")
    pipe = pipe_of(schedule, skip, force)
    x, y = batch()
    ref = copy.deepcopy(pipe)
    with checking_uses(pipe.scheduler) as uses:
        with torch.no_grad():
            out = pipe(x)
        loss = pipe.train_step(x, y, nn.MSELoss())
    assert uses.missing == []
    assert uses.reads > 0
    torch.testing.assert_close(out, ref(x))
    torch.testing.assert_close(loss, ref.train_step(x, y, nn.MSELoss()))


@pytest.mark.parametrize("force", [True, False], ids=["copies", "shared"])
@pytest.mark.parametrize(
    ("schedule", "checkpoint"),
    [("zbv", "never"), ("dualpipev", "never"), ("1f1b", "always"), ("zb_h1", "always")],
)
def test_every_cross_stream_read_is_marked_in_v_and_checkpointed_runs(
    schedule: str, checkpoint: str, force: bool
) -> None:
    """The V schedules (the first and the last stage share a rank: the loss
    and the first stage's backward on one device) and checkpointed
    micro-batches (the recompute reads the stage's saved inputs in its
    backward task)."""
    pipe = pipe_of(schedule, force=force, checkpoint=checkpoint)
    x, y = batch()
    ref = copy.deepcopy(pipe)
    with checking_uses(pipe.scheduler) as uses:
        loss = pipe.train_step(x, y, nn.MSELoss())
    assert uses.missing == []
    assert uses.reads > 0
    torch.testing.assert_close(loss, ref.train_step(x, y, nn.MSELoss()))
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize(
    ("target", "name", "run", "force"),
    [
        (copies, "record_stream", "forward", True),  # a copy's marks
        (copies, "record_stream", "step", True),
        (boundary, "record_stream", "step", True),  # a gradient's mark for its producer
        (boundary, "record_stream", "step", False),
        (forward, "protect", "forward", False),  # a stage's inputs read in place
        (training, "protect", "step", False),
    ],
)
def test_a_missing_mark_is_found(
    target: object, name: str, run: str, force: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe = pipe_of("1f1b", skip=True, force=force)
    x, y = batch()
    with checking_uses(pipe.scheduler) as uses:
        # Planted after the check put its own logging in place.
        monkeypatch.setattr(target, name, lambda *args, **kwargs: None)
        if run == "forward":
            with torch.no_grad():
                pipe(x)
        else:
            pipe.train_step(x, y, nn.MSELoss())
    assert uses.missing, "the check missed a dropped record_stream"


class _Refusing(Emulated):
    """Emulated graphs for every stage but one, whose capture fails: that
    stage runs eagerly between replayed ones."""

    def __init__(self) -> None:
        super().__init__()
        self.eager: nn.Module | None = None

    def capture(self, call: GraphedCall, fn: object) -> None:
        if fn is self.eager:
            raise RuntimeError("no graph for this stage")
        super().capture(call, fn)  # type: ignore[arg-type]


def _mixed(schedule: str, force: bool, eager: int) -> Pipe:
    """The skip pipe, stage ``eager`` eager and the others replayed, its
    graphs captured (outside any check: a slot's buffers need no mark)."""
    torch.manual_seed(0)
    backend = _Refusing()
    pipe = Pipe(
        Skip().double(),
        split_points=["b", "c", "d"],
        sample=torch.randn(2, 6, dtype=torch.float64),
        chunks=4,
        force_copies=force,
        schedule=schedule,
        graphs=backend,
    )
    backend.eager = pipe.partitions[eager]
    x, y = batch()
    with pytest.warns(GraphWarning, match="runs eagerly"):
        pipe.train_step(x, y, nn.MSELoss())
    assert [s.graphed for s in pipe.graph_report().stages] == [s != eager for s in range(4)]
    return pipe


@pytest.mark.parametrize("eager", [0, 1, 3])
@pytest.mark.parametrize("force", [True, False], ids=["copies", "shared"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_every_cross_stream_read_is_marked_beside_replayed_stages(
    schedule: str, force: bool, eager: int
) -> None:
    """The thinned replay path (runtime/replayed.py): a replayed stage's
    outputs, its input gradients (pushed into a producer's buffer, or
    cloned and routed), an eager stage's gradients reaching a replayed
    producer, the loss over a replayed last stage's outputs."""
    pipe = _mixed(schedule, force, eager)
    torch.manual_seed(0)
    model = Skip().double()  # the pipe's, before it was split
    x, y = batch()
    pipe.zero_grad()
    with checking_uses(pipe.scheduler) as uses:
        loss = pipe.train_step(x, y, nn.MSELoss())
        with torch.no_grad():
            out = pipe(x)
    assert uses.missing == []
    assert uses.reads > 0
    expected = nn.MSELoss()(model(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(out, model(x).detach())
    for (name, a), b in zip(pipe.named_parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize(
    ("target", "name", "force", "eager"),
    [
        (boundary, "record_stream", False, 0),  # an eager stage's gradient for a replayed one
        (boundary, "record_stream", False, 1),  # a replayed stage's for an eager one
        (copies, "record_stream", True, 1),
        (training, "protect", False, 0),  # a replayed stage reading an eager one's output
    ],
)
def test_a_missing_mark_beside_replayed_stages_is_found(
    target: object, name: str, force: bool, eager: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe = _mixed("1f1b", force, eager)
    x, y = batch()
    with checking_uses(pipe.scheduler) as uses:
        monkeypatch.setattr(target, name, lambda *args, **kwargs: None)
        pipe.train_step(x, y, nn.MSELoss())
    assert uses.missing, "the check missed a dropped record_stream"
