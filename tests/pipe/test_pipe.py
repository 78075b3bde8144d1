"""mpstream.Pipe on CPU: transparency against the plain model (micro-batch
sizes, tuples and plain values, BatchNorm, forced copies, complex values)
(its nn.Module surface: test_module.py; errors: test_pipe_errors.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import NoChunk, Pipe
from tests.helpers import assert_same_grads, mlp, reference_on_micro_batches, staged

BATCH = 12
SPLITS = [1, 3, 7, BATCH, 20]  # 7 does not divide 12; 20 exceeds it


def check_transparent(model: nn.Module, pipe: Pipe, x: Tensor) -> None:
    x_pipe = x.clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    out = pipe(x_pipe)
    ref = model(x_ref)
    torch.testing.assert_close(out, ref)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    (ref * torch.arange(ref.numel(), dtype=ref.dtype).view_as(ref)).sum().backward()
    torch.testing.assert_close(x_pipe.grad, x_ref.grad)
    assert_same_grads(pipe, model)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("split_size", SPLITS)
def test_split_sizes_match_single_device(stages: int, split_size: int) -> None:
    model = mlp([5, 8, 7, 6, 4])  # 8 layers
    ref = copy.deepcopy(model)
    balance = {2: [4, 4], 3: [3, 3, 2], 4: [2, 2, 2, 2]}[stages]
    pipe = Pipe(model, split_size=split_size, balance=balance, devices=["cpu"] * stages)
    check_transparent(ref, pipe, torch.randn(BATCH, 5, dtype=torch.float64))


@pytest.mark.parametrize("chunks", [1, 2, 5, 12, 30])
def test_chunks_match_single_device(chunks: int) -> None:
    model = mlp([5, 8, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(staged(model, [2, 2]), chunks=chunks)
    check_transparent(ref, pipe, torch.randn(BATCH, 5, dtype=torch.float64))


def test_micro_batches_reach_stages_in_order_with_the_right_sizes() -> None:
    seen: list[tuple[int, int]] = []

    class Spy(nn.Module):
        def __init__(self, stage: int) -> None:
            super().__init__()
            self.stage = stage

        def forward(self, x: Tensor) -> Tensor:
            seen.append((self.stage, x.size(0)))
            return x + 1

    pipe = Pipe(nn.Sequential(Spy(0), Spy(1)), split_size=5)
    out = pipe(torch.zeros(12, 1))
    torch.testing.assert_close(out, torch.full((12, 1), 2.0))
    assert seen == [(0, 5), (0, 5), (1, 5), (0, 2), (1, 5), (1, 2)]


class TupleStage(nn.Module):
    """Takes (x, y), returns (x', y') with both transformed."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).double()
        self.b = nn.Linear(3, 3).double()

    def forward(self, xy: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = xy
        return torch.tanh(self.a(x)), self.b(y) * x[:, :3]


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 2).double()

    def forward(self, xy: tuple[Tensor, Tensor]) -> Tensor:
        return self.lin(torch.cat(xy, dim=1))


@pytest.mark.parametrize("split_size", [1, 5, 12])
@pytest.mark.parametrize("as_list", [False, True])
def test_tuple_inputs_and_outputs(split_size: int, as_list: bool) -> None:
    model = nn.Sequential(TupleStage(), TupleStage(), Merge())
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=split_size)
    x = torch.randn(BATCH, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(BATCH, 3, dtype=torch.float64, requires_grad=True)
    out = pipe([x, y] if as_list else (x, y))
    xr, yr = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    expected = ref((xr, yr))
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(y.grad, yr.grad)
    assert_same_grads(pipe, ref)


def test_tuple_output_is_gathered_per_element() -> None:
    pipe = Pipe(nn.Sequential(TupleStage(), TupleStage()), split_size=5)
    x, y = torch.randn(BATCH, 4, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
    out = pipe((x, y))
    assert isinstance(out, tuple) and [o.shape[0] for o in out] == [BATCH, BATCH]


def batchnorm_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 3),
    ).double()


@pytest.mark.parametrize("split_size", [3, 5, 12])
def test_batchnorm_train_mode_matches_per_micro_batch_reference(split_size: int) -> None:
    model = batchnorm_model()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=split_size, balance=[3, 3], devices=["cpu", "cpu"])
    x = torch.randn(BATCH, 6, dtype=torch.float64)
    out = pipe(x)
    (out**2).sum().backward()
    expected = reference_on_micro_batches(ref, x, split_size, lambda o: (o**2).sum())
    torch.testing.assert_close(out, expected)
    assert_same_grads(pipe, ref)
    for name, buf in pipe.named_buffers():
        torch.testing.assert_close(buf, dict(ref.named_buffers())[name], msg=name)


def test_batchnorm_eval_mode_matches_whole_batch() -> None:
    model = batchnorm_model()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    ref = copy.deepcopy(model).eval()
    pipe = Pipe(model, split_size=5, balance=[3, 3], devices=["cpu", "cpu"]).eval()
    check_transparent(ref, pipe, torch.randn(BATCH, 6, dtype=torch.float64))


def test_no_grad_forward() -> None:
    model = mlp([4, 4, 4])
    pipe = Pipe(staged(copy.deepcopy(model), [2, 2]), chunks=3)
    with torch.no_grad():
        out = pipe(torch.randn(6, 4, dtype=torch.float64))
    assert not out.requires_grad


def test_optimizer_step_matches() -> None:
    model = mlp([4, 6, 2])
    ref = copy.deepcopy(model)
    pipe = Pipe(staged(model, [2, 2]), split_size=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(7, 4, dtype=torch.float64)
        for o, m in ((opt, pipe), (opt_ref, ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for a, b in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("split_size", [3, 7])
def test_forced_copies_are_transparent_and_really_copy(stages: int, split_size: int) -> None:
    model = mlp([5, 8, 7, 6, 4])
    ref = copy.deepcopy(model)
    balance = {2: [4, 4], 3: [3, 3, 2]}[stages]
    pipe = Pipe(
        model, split_size=split_size, balance=balance, devices=["cpu"] * stages, force_copies=True
    )
    sched = pipe.scheduler
    sched.recording = True
    check_transparent(ref, pipe, torch.randn(BATCH, 5, dtype=torch.float64))
    runs = {(op.kind, op.stage) for op in sched.plan() if op.op == "run"}
    assert {("copy", s) for s in range(stages - 1)} <= runs
    assert {("copy_grad", s) for s in range(stages - 1)} <= runs
    # Each boundary hands the next stage a copy, not the producer's tensor.
    seen: list[int] = []
    first = pipe.partitions[1]
    first.register_forward_pre_hook(lambda m, args: seen.append(args[0].data_ptr()))
    produced: list[int] = []
    pipe.partitions[0].register_forward_hook(lambda m, a, out: produced.append(out.data_ptr()))
    pipe(torch.randn(BATCH, 5, dtype=torch.float64))
    # Pairwise, per micro-batch: both are alive then (the allocator may
    # reuse a freed micro-batch's memory for a later one).
    assert len(produced) == len(seen) > 0
    assert all(p != q for p, q in zip(produced, seen))


class Attend(nn.Module):
    """Takes two arguments and returns a tuple with a plain value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, int]:
        return self.lin(x) * mask, mask, 3


class UseAll(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: Tensor, mask: Tensor, n: int) -> Tensor:
        return self.lin(x * mask) * n


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_several_inputs_spread_tuples_and_plain_values(schedule: str) -> None:
    model = nn.Sequential(Attend(), UseAll()).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=2, balance=[1, 1], devices=["cpu"] * 2, schedule=schedule)
    x, mask = torch.randn(5, 4, dtype=torch.float64), torch.rand(5, 4, dtype=torch.float64)
    # What nn.Sequential cannot do: two inputs, and a tuple spread over three.
    expected = ref[1](*ref[0](x, mask))
    torch.testing.assert_close(pipe(x, mask), expected)
    y = torch.randn(5, 2, dtype=torch.float64)
    loss = pipe.train_step((x, mask), y, nn.MSELoss())
    want = nn.MSELoss()(expected, y)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    assert_same_grads(pipe, ref)
    out = pipe(x, NoChunk(torch.ones(4, dtype=torch.float64)))
    assert out.shape == (5, 2)


class _Fft(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.fft.fft(x)


class _Abs(nn.Module):
    def forward(self, z: Tensor) -> Tensor:
        return z.abs()


@pytest.mark.parametrize("force_copies", [False, True])
@pytest.mark.parametrize("how", ["backward", "train_step", "profiled"])
def test_complex_values_between_stages_carry_their_gradients(force_copies: bool, how: str) -> None:
    import mpstream

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Fft(), _Abs(), nn.Linear(4, 1)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), chunks=2, balance=[2, 2], force_copies=force_copies)
    if how == "train_step":
        pipe.train_step(x, y, nn.functional.mse_loss)
    elif how == "profiled":
        with mpstream.profile(pipe):
            nn.functional.mse_loss(pipe(x), y).backward()
    else:
        nn.functional.mse_loss(pipe(x), y).backward()
    nn.functional.mse_loss(model(x), y).backward()
    assert_same_grads(pipe, model)


class _WithConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.lin(x), torch.ones_like(x)


class _Pass(nn.Module):
    def forward(self, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        return h, c


@pytest.mark.parametrize("force_copies", [False, True])
def test_a_constant_output_needs_no_gradient_after_a_copy(force_copies: bool) -> None:
    pipe = Pipe(nn.Sequential(_WithConstant(), _Pass()), chunks=2, force_copies=force_copies)
    h, c = pipe(torch.randn(6, 4))
    assert h.requires_grad and not c.requires_grad


@pytest.mark.parametrize("balance", [[2, 1], [1, 2]])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_first_layer_changing_the_input_in_place_is_named(
    schedule: str, balance: list[int]
) -> None:
    # Micro-batches are views of one batch tensor: one changed in place
    # invalidates what autograd saved of another (the whole batch is fine).
    # With balance [1, 2] the next stage saved the changed view: its
    # backward finds it.
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Linear(4, 2)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), chunks=3, balance=balance, schedule=schedule)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        pipe.train_step(x.clone(), y, nn.functional.mse_loss)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "changed the pipeline's input in place" in notes and "out-of-place" in notes
    assert all(p.grad is None for p in pipe.parameters())  # put back
    with torch.no_grad():  # nothing saved: it runs
        torch.testing.assert_close(pipe(x.clone()), model(x.clone()))


def test_an_in_place_error_of_a_stages_own_tensors_is_not_blamed_on_the_input() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 2)).double()
    model[1].register_forward_hook(lambda m, a, out: out.mul_(1))  # sigmoid saved its output
    pipe = Pipe(model, chunks=2, balance=[2, 1])
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        pipe.train_step(x, y, nn.functional.mse_loss)
    assert "input in place" not in "\n".join(getattr(raised.value, "__notes__", []))


def test_force_copies_set_after_the_first_call_copies() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), chunks=2)
    x = torch.randn(4, 4)
    pipe(x)  # the runtime is built without copies
    pipe.force_copies = True
    produced: list[int] = []
    seen: list[int] = []
    pipe.partitions[0].register_forward_hook(lambda m, a, out: produced.append(out.data_ptr()))
    pipe.partitions[1].register_forward_pre_hook(lambda m, a: seen.append(a[0].data_ptr()))
    pipe(x)
    pipe.train_step(x, torch.zeros(4, 2), nn.functional.mse_loss)
    assert len(seen) == 4 and all(p != q for p, q in zip(produced, seen))


def test_a_pipe_starts_in_its_modules_mode() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)).eval()
    pipe = Pipe(model, chunks=2, balance=[2, 1], checkpoint="always")
    assert not pipe.training and not any(p.training for p in pipe.partitions)
    x = torch.randn(4, 4)
    torch.testing.assert_close(pipe(x), model(x))  # eval: no dropout, no checkpoint
    pipe.train()
    assert pipe.training and pipe[1].training


@pytest.mark.parametrize("split_size", [3, 5])  # 5 does not divide the batch
def test_what_the_docs_promise_of_results(split_size: int) -> None:
    """README and guide: the forward is bit-identical to the plain model on
    the same micro-batches; after backward and training, results agree to
    float rounding, which assert_close's float32 defaults accept."""
    torch.manual_seed(0)
    model = mlp([32, 64, 64, 10], dtype=torch.float32)
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=split_size, balance=[3, 3], devices=["cpu", "cpu"])
    x, y = torch.randn(16, 32), torch.randn(16, 10)
    with torch.no_grad():
        assert torch.equal(pipe(x), torch.cat([ref(part) for part in x.split(split_size)]))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        for m, o in ((pipe, opt), (ref, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    torch.testing.assert_close(list(pipe.parameters()), list(ref.parameters()))


def test_setting_virtual_stages_makes_auto_choose_again() -> None:
    from mpstream.schedules import Auto

    model = mlp([5, 8, 7, 6, 4])
    ref = copy.deepcopy(model)
    auto = Auto(costs=[(1.0, 1.0, 1.0)] * 4, cache=None)  # given costs: nothing is profiled
    pipe = Pipe(model, chunks=4, balance=[2, 2, 2, 2], devices=["cpu"] * 4, schedule=auto)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe.train_step(x, y, nn.MSELoss())
    # One device: the schedules of several stages per rank wait for virtual_stages.
    assert {c.schedule for c in pipe.schedule_report().candidates} == {"gpipe", "1f1b", "zb_h1"}
    pipe.virtual_stages = 2  # what the report's excluded rows ask for
    assert pipe.virtual_stages == 2
    with pytest.raises(RuntimeError, match="chooses at the first train_step"):
        pipe.schedule_report()
    pipe.zero_grad()
    pipe.train_step(x, y, nn.MSELoss())
    assert {"interleaved_1f1b", "zbv"} <= {c.schedule for c in pipe.schedule_report().candidates}
    nn.MSELoss()(ref(x), y).backward()
    assert_same_grads(pipe, ref)
    # A pipe pickled while virtual_stages was a plain attribute still loads.
    state = pipe.__getstate__()
    state["virtual_stages"] = state.pop("_virtual_stages")
    old = Pipe.__new__(Pipe)
    old.__setstate__(state)
    assert old.virtual_stages == 2
