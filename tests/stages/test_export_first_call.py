"""A module split by torch.export without ``sample=``: the first call is the
example. Before it the pipe owns the module's parameters (an optimizer made
then trains them), converts dtypes, loads state and prints; what needs the
stages says to call the pipe once; after it the pipe equals the unsplit
module (outputs, loss, every gradient, optimizer steps) as one built with
``sample=`` does. A first call that fails leaves the pipe unsplit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import mpstream
from mpstream import Pipe
from mpstream.stages.points import SplitPointError
from tests.helpers import assert_same_grads
from tests.models import Fan
from tests.stages.test_export import Shaped, data

NOT_SPLIT = r"not split yet.*Call the pipe once \(or pass sample="


def shaped() -> tuple[nn.Module, nn.Module]:
    """A float64 module torch.fx cannot trace, and its unsplit reference."""
    torch.manual_seed(0)
    model = Shaped().double()
    return model, copy.deepcopy(model)


def lazy(model: nn.Module, **kwargs: str) -> Pipe:
    """A pipe over ``model`` in 3 stages, without ``sample=``."""
    return Pipe(model, chunks=3, split_points=["blocks.1", "head"], devices=["cpu"] * 3,
                **kwargs)  # type: ignore[arg-type]  # fmt: skip


def check_own_loss_step(pipe: Pipe, ref: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """A train_step on the module's own loss equals the unsplit module's,
    loss and every gradient."""
    loss = pipe.train_step({"x": x, "target": y})
    expected = ref(x, target=y)["loss"]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)


def test_the_first_call_splits_and_equals_the_unsplit_module() -> None:
    model, ref = shaped()
    pipe = lazy(model)
    assert list(pipe.state_dict()) == list(ref.state_dict())
    assert "split at the first call" in repr(pipe)
    report = pipe.split_report()
    assert report.tracer == "torch.export" and "torch.fx could not trace it" in report.reason
    assert report.exports == () and "exported for: nothing yet" in str(report)
    for what in ("graph", "balance", "partitions"):
        with pytest.raises(RuntimeError, match=rf"pipe\.{what} .*{NOT_SPLIT}"):
            getattr(pipe, what)
    with pytest.raises(RuntimeError, match=rf"pipe\.schedule_for\(\) .*{NOT_SPLIT}"):
        pipe.schedule_for(2, torch.device("cpu"))

    x, y = data()
    out = pipe(x, target=y, scale=0.5)
    expected = ref(x, target=y, scale=0.5)
    torch.testing.assert_close(out["logits"], expected["logits"])
    torch.testing.assert_close(out["loss"], expected["loss"])
    out["loss"].backward()
    expected["loss"].backward()
    assert_same_grads(pipe, ref)
    assert len(pipe.split_report().exports) == 1
    assert pipe.graph.reads()[0] == (-1,) and len(pipe.partitions) == 3
    assert len(pipe.balance) == 3 and "balance=[" in repr(pipe)
    # Parameters the stages read are the pipe's own, not copies.
    owned = {id(p) for p in pipe.parameters()}
    assert all(id(p) in owned for part in pipe.partitions for p in part.parameters())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_train_step_as_the_first_call_splits_and_trains_equal(schedule: str) -> None:
    model, ref = shaped()
    pipe = lazy(model, schedule=schedule, checkpoint="except_last")
    x, y = data()
    check_own_loss_step(pipe, ref, x, y)


def test_a_first_call_under_inference_mode_trains_later() -> None:
    model, ref = shaped()
    pipe = lazy(model)
    x, y = data()
    with torch.inference_mode():  # a validation pass first: the tensors stay trainable
        torch.testing.assert_close(pipe(x)["logits"], ref(x)["logits"])
    check_own_loss_step(pipe, ref, x, y)


def test_train_step_with_a_loss_fn_as_the_first_call() -> None:
    torch.manual_seed(0)
    model = Fan().double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=4, split_points=["a", "b", "c"], devices=["cpu"] * 4,
                tracer="export", schedule="1f1b")  # fmt: skip
    x = torch.randn(6, 4, dtype=torch.float64)
    target = torch.randn(6, 3, dtype=torch.float64)
    loss = pipe.train_step(x, target, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)
    assert [0 in r for r in pipe.graph.reads()] == [False, True, True, True]


def test_an_optimizer_made_before_the_first_call_trains_as_the_unsplit_model() -> None:
    model, ref = shaped()
    # "cpu:0" is not "cpu": the split moves stage 1's tensors (in place) as
    # it would to another GPU.
    pipe = Pipe(model, chunks=3, split_points=["blocks.1"], devices=["cpu", "cpu:0"])
    params = list(pipe.parameters())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    expected_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = data()
    for _ in range(3):
        for net, opt in ((pipe, optimizer), (ref, expected_optimizer)):
            opt.zero_grad()
            net(x, target=y)["loss"].backward()
            opt.step()
    assert [p for p in pipe.parameters()] == params  # the same tensors
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)


@pytest.mark.cuda
def test_the_first_call_places_the_stages_on_their_gpus_from_host_inputs() -> None:
    model, ref = shaped()
    devices = ["cuda:0", f"cuda:{torch.cuda.device_count() - 1}"]
    pipe = Pipe(model, chunks=3, split_points=["blocks.1"], devices=devices)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    expected_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    assert all(p.device.type == "cpu" for p in pipe.parameters())  # until the split
    x, y = data()  # on the host
    for _ in range(2):
        for net, opt in ((pipe, optimizer), (ref, expected_optimizer)):
            opt.zero_grad()
            net(x, target=y)["loss"].backward()
            opt.step()
    assert pipe.embed.weight.device == torch.device(devices[0])
    assert pipe.head.weight.device == torch.device(devices[1])
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, msg=name)


def test_a_failing_first_call_leaves_the_pipe_unsplit_and_usable() -> None:
    model, ref = shaped()
    pipe = lazy(model)
    x, y = data()
    with pytest.raises(TypeError, match="(?s)could not export Shaped.*wrong shape or dtype"):
        pipe(torch.randn(7, 5, dtype=torch.float64))  # 5 features, not 4
    with pytest.raises(TypeError, match="unexpected keyword argument 'mask'"):
        pipe(x, mask=y)
    with pytest.raises(TypeError, match="holds no tensor"):
        pipe.train_step({"x": 1.0})
    assert pipe.split_report().exports == ()
    with pytest.raises(RuntimeError, match=NOT_SPLIT):
        pipe.graph.reads()
    out = pipe(x, target=y)
    expected = ref(x, target=y)
    torch.testing.assert_close(out["loss"], expected["loss"])
    out["loss"].backward()
    expected["loss"].backward()
    assert_same_grads(pipe, ref)
    assert len(pipe.split_report().exports) == 1


def test_a_bad_order_is_checked_at_the_split_and_the_pipe_stays_usable() -> None:
    model, ref = shaped()
    bad = ["F1m0", "F0m0", "B1m0", "B0m0"]  # stage 1 before the stage it reads
    pipe = Pipe(model, split_points=["head"], devices=["cpu"] * 2, schedule=bad)
    x, y = data()
    with pytest.raises(ValueError):
        pipe.train_step({"x": x, "target": y})
    pipe.schedule = "1f1b"
    check_own_loss_step(pipe, ref, x, y)


def test_state_dtype_and_mode_set_before_the_first_call_hold_after_it() -> None:
    torch.manual_seed(0)
    model, other = Shaped(), Shaped()
    pipe = lazy(model)
    pipe.load_state_dict(other.state_dict())
    pipe.to(torch.float64)
    pipe.eval()
    twin = copy.deepcopy(pipe)  # unsplit copies split on their own
    ref = other.double().eval()
    x, y = data()
    for net in (pipe, twin):
        torch.testing.assert_close(net(x, target=y)["logits"], ref(x, target=y)["logits"])
    assert pipe.split_report().exports[0].startswith("eval, float64")
    assert twin.partitions[0] is not pipe.partitions[0]


def test_profile_and_the_scheduler_serve_a_pipe_not_split_yet() -> None:
    model, _ = shaped()
    pipe = lazy(model)
    x, y = data()
    with pytest.raises(TypeError, match="could not export"), mpstream.profile(pipe):
        pipe(torch.randn(7, 5, dtype=torch.float64))  # the block's own error, not profile's
    with mpstream.profile(pipe) as prof:
        pipe(x, target=y)["loss"].backward()
    assert {s.stage for s in prof.spans} >= {0, 1, 2}


def test_what_needs_a_sample_before_any_call_still_asks_for_one() -> None:
    # balance='time' profiles the module at construction.
    with pytest.raises(ValueError, match="needs devices= .* and sample=.*before any call"):
        Pipe(Shaped(), balance="time", devices=["cpu"] * 2)
    with pytest.raises(SplitPointError, match="'blocks.7' names no submodule of Shaped.*'head'"):
        Pipe(Shaped(), split_points=["blocks.7"], devices=["cpu"] * 2)


class _Doubled(nn.Module):
    """A module that needs its keyword arguments (and fx cannot trace them)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor, **extra: Tensor) -> Tensor:
        h = self.a(x)
        if "shift" in extra:
            h = h + extra["shift"]
        return self.b(h)  # type: ignore[no-any-return]


def test_keyword_arguments_of_the_first_call_are_the_example() -> None:
    torch.manual_seed(0)
    model = _Doubled().double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b"], devices=["cpu"] * 2)
    x, shift = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe(x, shift=shift), ref(x, shift=shift))
    torch.testing.assert_close(pipe(x), ref(x))  # another kind, exported when it comes
    assert len(pipe.split_report().exports) == 2
