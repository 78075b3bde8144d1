"""What an optimizer stepped in a captured step must allow: settings a
replay would not see are refused, what the optimizer does not read is not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpstream import CapturedStep, Pipe
from mpstream.capture.optimizer import check_optimizer, check_state
from tests.capture.steps import data, setup
from tests.helpers import mlp

GPU = torch.device("cuda:0")  # named only: nothing runs on it


def test_a_scheduler_built_after_capture_is_no_changed_setting() -> None:
    # Its initial_lr is bookkeeping of the scheduler's, which AdamW never reads.
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(6, 5, generator=g).double(), torch.randn(6, 4, generator=g).double())
        for _ in range(3)
    ]
    model = mlp([5, 8, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], split_size=3)
    opt = torch.optim.AdamW(pipe.parameters(), lr=torch.tensor(0.1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    step = CapturedStep(pipe, *batches[0], nn.MSELoss(), optimizer=opt)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 4)
    ref_schedule = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, 4)
    for x, y in batches:
        loss = step(x, y)
        ref_opt.zero_grad()
        expected = nn.MSELoss()(ref(x), y)
        expected.backward()
        ref_opt.step()
        schedule.step()
        ref_schedule.step()
        torch.testing.assert_close(loss, expected.detach())
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


def test_on_cuda_a_tensor_setting_in_host_memory_is_refused() -> None:
    # Adam's kernels take a 0-dim tensor in host memory as a number read at
    # launch: every replay would keep the learning rate of capture.
    params = list(mlp([5, 4]).to("meta").parameters())  # stand for parameters on a GPU
    adam = torch.optim.Adam(params, lr=torch.tensor(0.1), capturable=False, foreach=False)
    adam.param_groups[0]["capturable"] = True  # as on CUDA parameters
    with pytest.raises(ValueError, match=r"group 0 of Adam holds 'lr' as a tensor in host memory"):
        check_optimizer(adam, [torch.device("cuda:0")])
    check_optimizer(adam, [])  # on the CPU every step reads it


def test_a_frozen_parameter_needs_no_state_before_capture() -> None:
    # No step ever makes a state for a parameter without a gradient, so the
    # eager step the refusal asks for cannot satisfy it for a frozen one.
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(6, 5, generator=g).double(), torch.randn(6, 4, generator=g).double())
        for _ in range(3)
    ]
    model = mlp([5, 8, 4])
    next(model.parameters()).requires_grad_(False)
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], split_size=3)
    opt, ref_opt = torch.optim.NAdam(pipe.parameters()), torch.optim.NAdam(ref.parameters())
    for o, module in ((opt, pipe), (ref_opt, ref)):  # the eager step the refusal asks for
        nn.MSELoss()(module(batches[0][0]), batches[0][1]).backward()
        o.step()
    step = CapturedStep(pipe, *batches[0], nn.MSELoss(), optimizer=opt)
    for x, y in batches[1:]:
        loss = step(x, y)
        ref_opt.zero_grad()
        expected = nn.MSELoss()(ref(x), y)
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, expected.detach())
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


def test_optimizers_whose_first_state_is_not_zero_need_an_eager_step_first() -> None:
    pipe, _, _, _ = setup("cpu", "sgd", split_size=3)
    x, y = data("cpu", 1)
    for make in (
        lambda ps: torch.optim.NAdam(ps),
        lambda ps: torch.optim.Rprop(ps),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
    ):
        opt = make(list(pipe.parameters()))
        with pytest.raises(ValueError, match="Take one eager step first"):
            CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt)
        pipe.train_step(x, y, nn.MSELoss())
        opt.step()
        CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt)  # state exists: restored exactly
    meta = list(mlp([5, 4]).to("meta").parameters())  # stands for parameters on the GPU
    check_optimizer(torch.optim.SGD(meta, lr=0.1, momentum=0.9), [GPU])


def test_on_cuda_parameters_in_host_memory_are_refused() -> None:
    # A captured step would update them once, at capture, never at a replay.
    meta = list(mlp([5, 4]).to("meta").parameters())
    host = nn.Parameter(torch.zeros(()))
    sgd = torch.optim.SGD([{"params": meta}, {"params": [host]}], lr=0.1)
    with pytest.raises(ValueError, match="parameter 0 of param group 1 of SGD is on cpu"):
        check_optimizer(sgd, [GPU])
    check_optimizer(sgd, [])  # on the CPU every step runs eagerly


def test_on_cuda_a_tensor_setting_needs_an_optimizer_that_reads_it_on_the_device() -> None:
    params = list(mlp([5, 4]).to("meta").parameters())
    sgd = torch.optim.SGD(params, lr=torch.tensor(0.1))
    with pytest.raises(ValueError, match=r"param group 0 of SGD holds 'lr' as a tensor"):
        check_optimizer(sgd, [GPU])
    check_optimizer(sgd, [])  # eager steps read it every time
    adam = torch.optim.Adam(params, lr=torch.tensor(0.1), foreach=False)
    adam.param_groups[0]["capturable"] = True  # as on CUDA parameters
    adam.param_groups[0]["lr"] = torch.tensor(0.1, device="meta")  # on theirs too
    check_optimizer(adam, [GPU])
    # A group spanning devices would copy its tensor setting between GPUs.
    spanning = [nn.Parameter(torch.ones(2, device="meta")), nn.Parameter(torch.ones(2))]
    adam = torch.optim.Adam(spanning, lr=torch.tensor(0.1), foreach=False)
    adam.param_groups[0]["capturable"] = True
    with pytest.raises(ValueError, match="copy the setting between GPUs"):
        check_optimizer(adam, [GPU, torch.device("cuda:1")])


def test_optimizer_state_in_host_memory_beside_parameters_on_a_device_is_refused() -> None:
    # Adagrad keeps its step count on the host and computes its learning
    # rate's decay from it there: a replay would keep the captured value.
    p = nn.Parameter(torch.ones(3, device="meta"))
    adagrad = torch.optim.Adagrad([p], lr=0.1, lr_decay=0.01)
    adagrad.state[p] = {"step": torch.tensor(1.0), "sum": torch.zeros(3, device="meta")}
    with pytest.raises(ValueError, match=r"Adagrad keeps its state 'step' of a parameter on meta"):
        check_state(adagrad)
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    sgd.state[p] = {"momentum_buffer": torch.zeros(3, device="meta")}
    check_state(sgd)
    undecayed = torch.optim.Adagrad([p], lr=0.1)  # the count then changes nothing replayed
    undecayed.state[p] = {"step": torch.tensor(1.0), "sum": torch.zeros(3, device="meta")}
    check_state(undecayed)
    q = nn.Parameter(torch.ones(3))  # on the CPU, where the step runs eagerly
    adagrad = torch.optim.Adagrad([q], lr=0.1)
    adagrad.state[q] = {"step": torch.tensor(1.0), "sum": torch.zeros(3)}
    check_state(adagrad)


@pytest.mark.cuda
def test_an_optimizer_stepping_on_the_host_is_refused_before_capture() -> None:
    pipe, _, _, _ = setup("cuda:0", "sgd", split_size=3)
    opt = torch.optim.Adagrad(pipe.parameters(), lr=0.01, lr_decay=0.01)
    before = [p.detach().clone() for p in pipe.parameters()]
    x, y = data("cuda:0", 0)
    with pytest.raises(ValueError, match="Adagrad keeps its state 'step'"):
        CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt)
    assert all(float(s["step"]) == 0 for s in opt.state.values())  # warm-up's steps undone
    for p, b in zip(pipe.parameters(), before):
        torch.testing.assert_close(p.detach(), b)


def test_a_tensor_learning_rate_is_changed_in_place_not_replaced() -> None:
    pipe, _, ref, _ = setup("cpu", "sgd", split_size=3)
    lr = torch.tensor(0.1)
    opt = torch.optim.SGD(pipe.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data("cpu", 0)
    step = CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt)
    for value in (0.1, 0.05):
        lr.fill_(value)
        ref_opt.param_groups[0]["lr"] = value
        step(x, y)
        ref_opt.zero_grad()
        nn.MSELoss()(ref(x), y).backward()
        ref_opt.step()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())
    opt.param_groups[0]["lr"] = torch.tensor(0.01)
    with pytest.raises(ValueError, match="'lr' changed from tensor"):
        step(x, y)


def test_a_changed_optimizer_setting_is_refused() -> None:
    pipe, opt, _, _ = setup("cpu", "sgd", split_size=3)
    x, y = data("cpu", 0)
    step = CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt)
    opt.param_groups[0]["lr"] = 0.05
    with pytest.raises(ValueError, match=r"param group 0's 'lr' changed from 0.1 to 0.05"):
        step(x, y)
    opt.param_groups[0]["lr"] = 0.1
    step(x, y)
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(ValueError, match="2 param groups, 1 at capture"):
        step(x, y)
