"""What an optimizer stepped in a captured step must allow: settings a
replay would not see are refused, what the optimizer does not read is not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpstream import CapturedStep, Pipe
from mpstream.capture.optimizer import check_optimizer
from tests.helpers import mlp


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
