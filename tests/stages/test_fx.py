"""Any module, traced and split: outputs and every gradient equal the unsplit
module's for chains, skips and fan-outs, every schedule and checkpoint mode;
state_dict keys are the module's (refusals: test_fx_errors.py)."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import mpstream
from mpstream import NoChunk, Pipe, PlanError, record_plan, verify_plan
from mpstream.runtime.plan import Plan
from mpstream.stages.fx import trace
from tests.helpers import assert_same_grads
from tests.models import Decoder, Fan, UNet

MODES = ["never", "except_last", "always"]


def check(
    model: nn.Module,
    make: Any,
    inputs: tuple[Any, ...],
    target: Tensor,
    **kw: Any,
) -> Pipe:
    """pipe(*inputs) forward + backward, then train_step, against ``model``."""
    ref = copy.deepcopy(model)
    pipe = make(model, **kw)
    out = pipe(*inputs)
    expected = ref(*inputs)
    torch.testing.assert_close(out, expected)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    assert_same_grads(pipe, ref)
    pipe.zero_grad()
    ref.zero_grad()
    loss = pipe.train_step(inputs if len(inputs) > 1 else inputs[0], target, nn.MSELoss())
    expected_loss = nn.MSELoss()(ref(*inputs), target)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss.detach())
    assert_same_grads(pipe, ref)
    return pipe


def fan_pipe(model: nn.Module, **kw: Any) -> Pipe:
    return Pipe(model, split_points=["a", "b", "c"], devices=["cpu"] * 4, **kw)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("split_size", [2, 3, 7])
def test_a_value_read_by_three_later_stages(
    schedule: str, checkpoint: str, split_size: int
) -> None:
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe = check(
        Fan().double(), fan_pipe, (x, 2.0), torch.randn(6, 3, dtype=torch.float64),
        split_size=split_size, schedule=schedule, checkpoint=checkpoint,
    )  # fmt: skip
    reads = pipe.graph.reads()
    assert [0 in r for r in reads] == [False, True, True, True]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_forced_copies_carry_skips_once_per_receiving_stage(schedule: str, checkpoint: str) -> None:
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe = check(
        Fan().double(), fan_pipe, (x,), torch.randn(6, 3, dtype=torch.float64),
        chunks=3, schedule=schedule, checkpoint=checkpoint, force_copies=True,
    )  # fmt: skip
    sched = pipe.schedule_for(3, torch.device("cpu"), training_step=True)
    copies = {(t.stage, t.peer) for t in sched.tasks if t.kind.label == "copy"}
    # Stage 0's output goes to stages 1, 2 and 3 directly, not through 1 and 2.
    assert copies == {(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_unet_skips_cross_three_stages(schedule: str, checkpoint: str) -> None:
    def make(model: nn.Module, **kw: Any) -> Pipe:
        return Pipe(model, split_points=["down2", "mid", "up2", "up1"], devices=["cpu"] * 5, **kw)

    x = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    pipe = check(
        UNet().double(), make, (x,), torch.randn(5, 1, 8, 8, dtype=torch.float64),
        split_size=2, schedule=schedule, checkpoint=checkpoint,
    )  # fmt: skip
    # down1's output (stage 0) goes straight to the stage that concatenates
    # it for up1 (stage 3), past stages 1 and 2.
    reads = pipe.graph.reads()
    assert 0 in reads[3] and 0 not in reads[2] and 1 in reads[2]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_gpt_decoder_in_four_stages(schedule: str, checkpoint: str) -> None:
    def make(model: nn.Module, **kw: Any) -> Pipe:
        return Pipe(
            model, split_points=["blocks.1", "blocks.2", "blocks.3"], devices=["cpu"] * 4, **kw
        )

    ids = torch.randint(0, 11, (5, 6))
    check(
        Decoder().double(), make, (ids,), torch.randn(5, 6, 11, dtype=torch.float64),
        chunks=2, schedule=schedule, checkpoint=checkpoint,
    )  # fmt: skip


def test_torchvision_resnet50_split_at_layer3() -> None:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet50(num_classes=5).double().eval()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)

    def make(m: nn.Module, **kw: Any) -> Pipe:
        return Pipe(m, split_points=["layer3"], devices=["cpu", "cpu"], **kw).eval()

    pipe = check(model, make, (x,), torch.randn(2, 5, dtype=torch.float64), chunks=2)
    assert list(pipe.state_dict()) == list(model.state_dict())


def test_stages_keep_no_string_annotations() -> None:
    # tests/models.py uses postponed annotations, so fx sees "Tensor" as a
    # string; torch 2.11 then fails to pickle the stage (torch.save(pipe)).
    for stage in trace(Decoder(), ["blocks.2"]).partitions:
        assert [n.name for n in stage.graph.nodes if isinstance(n.type, str)] == []


def test_state_dict_round_trips_with_the_unsplit_module() -> None:
    model = Decoder()
    pipe = Pipe(copy.deepcopy(model), split_points=["blocks.2"], devices=["cpu", "cpu"])
    assert list(pipe.state_dict()) == list(model.state_dict())
    other = Decoder()
    pipe.load_state_dict(other.state_dict())
    ids = torch.randint(0, 11, (4, 5))
    torch.testing.assert_close(pipe(ids), other(ids))
    model.load_state_dict(pipe.state_dict())
    torch.testing.assert_close(model(ids), other(ids))
    # Root-level tensors too, replaced rather than copied into.
    fresh = Decoder()
    pipe.load_state_dict(fresh.state_dict(), assign=True)
    torch.testing.assert_close(pipe(ids), fresh(ids))
    pipe.double()
    torch.testing.assert_close(pipe(ids), fresh.double()(ids))
    buf = io.BytesIO()
    torch.save(pipe, buf)
    buf.seek(0)
    torch.testing.assert_close(torch.load(buf, weights_only=False)(ids), fresh(ids))


def test_keyword_arguments_defaults_and_plain_values() -> None:
    model = Fan().double()
    pipe = fan_pipe(copy.deepcopy(model), chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), model(x))
    torch.testing.assert_close(pipe(x, scale=3.0), model(x, 3.0))
    torch.testing.assert_close(pipe(scale=0.5, x=x), model(x, 0.5))
    with pytest.raises(TypeError, match=r"Fan.forward\(x.*too many positional"):
        pipe(x, 1.0, 2.0)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, int]:
        h = self.a(x) * mask
        return self.b(h) * mask, 7


def test_nochunk_inputs_reach_every_micro_batch_whole() -> None:
    model = Masked().double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, split_size=2)
    x, mask = torch.randn(5, 4, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    out, seven = pipe(x, NoChunk(mask))
    torch.testing.assert_close(out, model(x, mask)[0])
    assert seven == [7, 7, 7]  # a plain output, one per micro-batch


def test_plan_of_a_graph_with_skips_is_verified() -> None:
    # Stage 2 reads only stage 0 (a skip past stage 1); stage 3 reads 0 and 2.
    reads = [(-1,), (0,), (0,), (0, 2)]
    devices = ["cuda:0", "cuda:1", "cuda:2", "cuda:2"]
    for schedule in ("gpipe", "1f1b"):
        plan = record_plan(schedule, 4, 3, devices, reads=reads, backward=True)
        verify_plan(plan)
    runs = [op for op in plan.ops if op.op == "run" and op.kind == "copy"]
    # Stage 0's output goes to cuda:2 once, shared by stages 2 and 3.
    assert sorted({(op.stage, op.peer) for op in runs}) == [(0, 1), (0, 2)]
    recorded: dict[int, tuple[str, int, int]] = {}
    skip_waits = []
    for i, op in enumerate(plan.ops):
        if op.op == "record":
            recorded[op.event] = (op.kind, op.stage, op.peer)
        elif op.op == "wait" and op.kind == "forward" and recorded[op.event] == ("copy", 0, 2):
            skip_waits.append(i)
    # Stage 2's forward, once per micro-batch; stage 3's wait on stage 2
    # implies the copy, so it waits on nothing more.
    assert len(skip_waits) == 3
    for i in skip_waits:
        broken = Plan(plan.ops[:i] + plan.ops[i + 1 :], plan.slot_names, plan.slot_devices, 4,
                      plan.reads)  # fmt: skip
        match = r"forward\(stage=2, micro=\d\) is not ordered after copy"
        with pytest.raises(PlanError, match=match):
            verify_plan(broken)


def test_profile_and_cost_model_see_stage_graphs() -> None:
    pipe = fan_pipe(Fan(), chunks=2, force_copies=True)
    with mpstream.profile(pipe) as prof:
        pipe(torch.randn(4, 4)).sum().backward()
    hops = {(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)}
    assert {(s.stage, s.peer) for s in prof.spans if s.kind == "copy"} == hops
    assert {(s.stage, s.peer) for s in prof.spans if s.kind == "copy_grad"} == hops
    costs = mpstream.simulate_fit(prof)
    assert set(costs.hops) == hops
    # One device per stage: stage 3 also gets the input (its `scale`).
    sim = mpstream.simulate(costs.stage_times, costs.hops, 2, reads=pipe.graph.reads())
    simulated = {(s.stage, s.peer) for s in sim.timeline.spans if s.kind == "copy"}
    assert simulated == hops | {(-1, 3)}


@pytest.mark.parametrize("how", ["time", "size"])
def test_balance_picks_split_points_of_a_traced_module(how: str) -> None:
    from mpstream.stages.fx import call_units

    model = Decoder(depth=4)
    assert call_units(model) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
    ids = torch.randint(0, 11, (4, 6))
    pipe = Pipe(copy.deepcopy(model), balance=how, sample=ids, devices=["cpu"] * 3, chunks=2)
    points = pipe.split_points
    assert len(points) == 2 and all(p in call_units(model) for p in points)
    torch.testing.assert_close(pipe(ids), model(ids))
    with pytest.raises(ValueError, match="needs devices= .* and sample="):
        Pipe(Decoder(), balance=how, devices=["cpu"] * 2)


class Unread(nn.Module):
    """Stage 0's values feed nothing: its BatchNorm still counts the batches."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        self.norm(self.a(x))
        return self.b(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_a_stage_whose_values_nothing_reads_still_runs(schedule: str) -> None:
    model = Unread().double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=1, split_points=["b"], devices=["cpu"] * 2, schedule=schedule)
    x = torch.randn(4, 2, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), ref(x))
    torch.testing.assert_close(model.norm.running_mean, ref.norm.running_mean)
    pipe(x).sum().backward()
    ref(x).sum().backward()
    assert model.a.weight.grad is None and ref.a.weight.grad is None
    torch.testing.assert_close(model.b.weight.grad, ref.b.weight.grad)


class Containers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> dict[str, Any]:
        y = self.a(x)
        z = self.b(y)
        return {"out": [z, y], "pair": (z, 1)}


def test_a_traced_pipe_returns_the_module_s_own_containers() -> None:
    # torch.fx holds a graph's output in immutable lists and dicts.
    pipe = Pipe(Containers().double(), chunks=2, split_points=["b"], devices=["cpu"] * 2)
    out = pipe(torch.randn(4, 3, dtype=torch.float64))
    assert type(out) is dict and type(out["out"]) is list and type(out["pair"]) is tuple
    out["out"].append(None)  # a user may change what they got
    assert out["pair"][1] == [1, 1]  # plain values are gathered per micro-batch


def test_deferred_batch_norm_in_a_traced_module_runs_whole() -> None:
    model = Unread().double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b"], devices=["cpu"] * 2, deferred_batch_norm=True)
    x = torch.randn(8, 2, dtype=torch.float64)
    pipe(x)
    ref(x)  # whole-batch statistics, as deferred BatchNorm keeps them
    torch.testing.assert_close(pipe.norm.running_mean, ref.norm.running_mean)
    torch.testing.assert_close(pipe.norm.running_var, ref.norm.running_var)
    with pytest.raises(ValueError, match="deferred_batch_norm=True: .* torch.export"):
        Pipe(Unread().double(), chunks=2, split_points=["b"], devices=["cpu"] * 2,
             deferred_batch_norm=True, tracer="export", sample=x[:4])  # fmt: skip


class InPlaceSkip(nn.Module):
    """``act`` changes ``g`` in place; the skip then adds the changed ``g``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        g = self.a(x)
        return self.c(self.b(self.act(g))) + g  # type: ignore[no-any-return]


def test_an_in_place_change_another_stage_would_miss_is_refused() -> None:
    with pytest.raises(ValueError, match="'act' in stage 1 changes 'a' in place, which stage 2"):
        Pipe(InPlaceSkip(), chunks=2, split_points=["act", "c"], devices=["cpu"] * 3)
    # Changed in the stage that makes it: every later stage gets it changed.
    model = InPlaceSkip().double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    check(model, Pipe, (x,), y, chunks=2, split_points=["c"], devices=["cpu"] * 2, schedule="1f1b")


class AugmentedView(nn.Module):
    """``h *= 2`` changes ``h`` in place, so the view ``v`` taken before it
    too; before ``c`` (in stage 0 split at ``b``) or after (in stage 1 split
    at ``c``)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(2, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        v = h[:, :2]
        if self.where == "stage 0":
            h *= 2
        g = self.c(x)
        if self.where == "stage 1":
            h *= 2
        return self.b(v) + g  # type: ignore[no-any-return]


def test_an_augmented_assignment_changes_views_as_in_the_module() -> None:
    # fx's own proxy would trace ``h *= 2`` as ``h = h * 2``: ``v`` unchanged.
    model = AugmentedView("stage 0").double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    check(model, Pipe, (x,), y, chunks=2, split_points=["b"], devices=["cpu"] * 2)
    # In a later stage than ``v``, which reaches stage 2 unchanged: refused.
    with pytest.raises(ValueError, match="'imul' in stage 1 changes 'a' in place, which stage 2"):
        Pipe(AugmentedView("stage 1"), chunks=2, split_points=["c", "b"], devices=["cpu"] * 3)


class _Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor, *, mask: Tensor) -> Tensor:
        return self.b(self.a(x) * mask)


class _Batch(nn.Module):
    """Takes one dict (whose keys name no parameter of forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return self.b(self.a(batch["x"]) * batch["mask"])


@pytest.mark.parametrize("model_type", [_Keyword, _Batch])
def test_train_step_takes_keyword_arguments_or_a_dict_input(model_type: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = model_type().double()
    x, m = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2)
    batch = {"x": x, "mask": m}
    loss = pipe.train_step(batch, y, nn.functional.mse_loss)
    if model_type is _Keyword:
        expected = nn.functional.mse_loss(model(x, mask=m), y)
    else:
        expected = nn.functional.mse_loss(model(batch), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, model)
