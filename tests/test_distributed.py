"""mpstream.distributed: pipelines under DistributedDataParallel.

Two processes with two CPU stages each train over gloo (tests/ddp_group.py);
after each step their parameters must equal a single process's on the whole
batch, for the DDP forward/backward path and for
``mpstream.distributed.train_step``, with every schedule (a user-given order
too) and checkpoint mode. The example script's run under ``torchrun`` is in
tests/test_examples.py.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from mpstream import Pipe
from mpstream import distributed as mpdist
from mpstream.runtime.graphed import Emulated
from mpstream.schedules import Auto
from tests.ddp_buffers import run_buffers
from tests.ddp_group import (
    BALANCE,
    LR,
    SPLIT,
    WORLD,
    batches,
    initial_model,
    join_group,
    launch,
)
from tests.helpers import virtual_for

# Two stages, two micro-batches per process: zb_h1's order with the weight
# passes moved last.
USER_ORDER = "F0m0 F1m0 F0m1 B1m0 B0m0 F1m1 B1m1 B0m1 W1m0 W0m0 W0m1 W1m1"


@dataclass(frozen=True)
class Case:
    """One training run: a step kind per step, and the pipeline's options.

    Step kinds: ``forward`` (``loss(ddp(x)).backward()``), ``train_step``
    (``mpstream.distributed.train_step``), ``no_sync`` (``train_step`` inside
    ``ddp.no_sync()``, no optimizer step: the gradient accumulates into the
    next step's).
    """

    steps: tuple[str, ...]
    schedule: Any = "gpipe"
    checkpoint: str = "never"
    options: dict[str, Any] = field(default_factory=dict)
    graphed: bool = False  # stages replayed (emulated): train_step reduces their buffers


def _cases() -> dict[str, Case]:
    cases = {}
    for path in ("forward", "train_step"):
        for schedule in ("gpipe", "1f1b"):
            for mode in ("never", "except_last", "always"):
                cases[f"{path}-{schedule}-{mode}"] = Case((path, path), schedule, mode)
    ranked = ("looped_bfs", "interleaved_zb", "zbv", "dualpipev")
    for schedule in ("interleaved_1f1b", "zb_h1", *ranked, USER_ORDER):
        for mode in ("never", "except_last", "always"):
            name = "custom" if schedule == USER_ORDER else schedule
            cases[f"train_step-{name}-{mode}"] = Case(("train_step",) * 2, schedule, mode)
    options: dict[str, dict[str, Any]] = {
        "find_unused": {"find_unused_parameters": True},
        "static_graph": {"static_graph": True},
        "bucket_view": {"gradient_as_bucket_view": True},
        "tiny_buckets": {"bucket_cap_mb": 1e-4},
    }
    for name, opts in options.items():
        for path in ("forward", "train_step"):
            cases[f"{path}-{name}"] = Case((path, path), "1f1b", "always", opts)
    cases["alternate"] = Case(("forward", "train_step", "forward", "train_step"), "1f1b", "always")
    cases["no_sync"] = Case(("no_sync", "train_step"), "1f1b", "except_last")
    for schedule in ("1f1b", "zb_h1"):
        cases[f"graphed-{schedule}"] = Case(("train_step",) * 2, schedule, graphed=True)
    cases["graphed-tiny_buckets"] = Case(
        ("train_step",) * 2, "gpipe", options={"bucket_cap_mb": 1e-4}, graphed=True
    )
    cases["graphed-no_sync"] = Case(("no_sync", "train_step"), "1f1b", "except_last", graphed=True)
    # Chosen at the first step, from given costs (each process on its own).
    auto = Auto(costs=((1.0, 1.0, 1.0),) * 2, cache=None)
    cases["train_step-auto"] = Case(("train_step",) * 2, auto, "except_last")
    return cases


CASES = _cases()


def reference(case: Case) -> dict[str, Tensor]:
    """One process, whole batches, no pipeline: parameters after ``case``'s steps."""
    model = initial_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for kind, (x, y) in zip(case.steps, batches(len(case.steps))):
        nn.MSELoss()(model(x), y).backward()
        if kind != "no_sync":
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- what each process runs --------------------------------------------------


def _run_case(case: Case, rank: int) -> dict[str, Tensor]:
    # Rank 1 starts from other weights: DDP's initial broadcast must fix them.
    pipe = Pipe(
        initial_model(seed=rank),
        split_size=SPLIT,
        balance=BALANCE,
        devices=["cpu", "cpu"],
        schedule=case.schedule,
        checkpoint=case.checkpoint,
        # Both stages on the CPU: interleaved 1F1B as two ranks of one
        # stage, the other round-robin schedules and the V as one rank of two.
        virtual_stages=1 if case.schedule == "interleaved_1f1b" else virtual_for(case.schedule, 2),
        graphs=Emulated() if case.graphed else False,
    )
    ddp = mpdist.wrap(pipe, **case.options)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    loss_fn = nn.MSELoss()
    for kind, (x, y) in zip(case.steps, batches(len(case.steps))):
        xs, ys = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        if kind == "forward":
            loss_fn(ddp(xs), ys).backward()
        elif kind == "train_step":
            mpdist.train_step(ddp, xs, ys, loss_fn)
        else:
            with ddp.no_sync():
                mpdist.train_step(ddp, xs, ys, loss_fn)
        if kind != "no_sync":
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in pipe.state_dict().items()}


def _run_gradient_presence(rank: int) -> dict[str, Tensor | None]:
    """Gradients set by hand: present on both ranks, on one, on none."""
    pipe = Pipe(initial_model(), balance=BALANCE, devices=["cpu", "cpu"])
    ddp = mpdist.wrap(pipe)
    weights = [p for name, p in pipe.named_parameters() if name.endswith("weight")]
    both, one, none = weights
    both.grad = torch.full_like(both, 1.0 + 2.0 * rank)  # 1 and 3: mean 2
    one.grad = torch.full_like(one, 4.0) if rank == 1 else None  # mean with zeros: 2
    none.grad = None
    mpdist.sync_gradients(ddp)
    return {"both": both.grad, "one": one.grad, "none": none.grad}


def _run_overlap(rank: int) -> dict[str, Any]:
    """A step whose last stage's all-reduces start before the first stage's
    last backward; then a step that fails in that backward, after they
    started, and one more step: as if the failed one never ran."""
    pipe = Pipe(initial_model(), split_size=SPLIT, balance=BALANCE, devices=["cpu", "cpu"])
    ddp = mpdist.wrap(pipe)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    log: list[str] = []
    fail = [False]

    def hook(*_: Any) -> None:
        log.append("stage 0 backward")
        if fail[0] and log.count("stage 0 backward") % 2 == 0:
            raise KeyError("backward failed")

    pipe.partitions[0][0].register_full_backward_hook(hook)
    real = dist.all_reduce

    def logged(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        log.append("all_reduce")
        return real(tensor, *args, **kwargs)

    dist.all_reduce = logged  # type: ignore[assignment]
    try:
        x, y = batches(1)[0]
        xs, ys = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        mpdist.train_step(ddp, xs, ys, nn.MSELoss())
        first = list(log)
        log.clear()
        opt.zero_grad()
        fail[0] = True
        failed = ""
        try:
            mpdist.train_step(ddp, xs, ys, nn.MSELoss())
        except KeyError as exc:
            failed = str(exc)
        during = list(log)
        grads = [p.grad for p in pipe.parameters()]
        fail[0] = False
        mpdist.train_step(ddp, xs, ys, nn.MSELoss())
        opt.step()
    finally:
        dist.all_reduce = real  # type: ignore[assignment]
    return {
        "first": first, "during": during, "failed": failed, "grads_after_failure": grads,
        "params": {k: v.detach().clone() for k, v in pipe.state_dict().items()},
    }  # fmt: skip


def _four_stages() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(*(nn.Linear(6, 6) for _ in range(4))).double()


def _uneven_batch(rank: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    rows = 2 + rank  # 2 and 3 micro-batches of one row
    return (torch.randn(rows, 6, generator=g, dtype=torch.float64),
            torch.randn(rows, 6, generator=g, dtype=torch.float64))  # fmt: skip


def _run_uneven(rank: int) -> dict[str, Any]:
    """zb_h1 over four stages ends them in another order with 2 micro-batches
    (rank 0) than with 3 (rank 1); the all-reduces must still pair up. Then
    a step that fails in stage 0 on rank 0 (after later stages issued) and
    in stage 3 on rank 1 (before any did), then one that succeeds."""
    pipe = Pipe(_four_stages(), split_size=1, balance=[1] * 4, devices=["cpu"] * 4,
                schedule="zb_h1")  # fmt: skip
    ddp = mpdist.wrap(pipe)
    x, y = _uneven_batch(rank)
    mpdist.train_step(ddp, x, y, nn.MSELoss())
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}  # type: ignore[union-attr]
    pipe.zero_grad()
    failing = pipe.partitions[0 if rank == 0 else 3][0]
    handle = failing.register_full_backward_hook(
        lambda *_: (_ for _ in ()).throw(KeyError("backward failed"))
    )
    failed = ""
    try:
        mpdist.train_step(ddp, x, y, nn.MSELoss())
    except KeyError as exc:
        failed = str(exc)
    handle.remove()
    untouched = all(p.grad is None for p in pipe.parameters())
    # Rank 1 alone fails before its step begins (a target of another batch
    # size); rank 0's step, done meanwhile, is undone too.
    refused = ""
    try:
        mpdist.train_step(ddp, x, y if rank == 0 else y[:1], nn.MSELoss())
    except (ValueError, RuntimeError) as exc:
        refused = f"{type(exc).__name__}: {exc}"
    untouched = untouched and all(p.grad is None for p in pipe.parameters())
    mpdist.train_step(ddp, x, y, nn.MSELoss())
    after = {n: p.grad.clone() for n, p in pipe.named_parameters()}  # type: ignore[union-attr]
    return {
        "grads": grads, "failed": failed, "untouched": untouched, "after": after,
        "refused": refused,
    }  # fmt: skip


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    try:
        join_group(rank, store_path)
        results: dict[str, Any] = {name: _run_case(case, rank) for name, case in CASES.items()}
        results["presence"] = _run_gradient_presence(rank)
        results["overlap"] = _run_overlap(rank)
        results["uneven"] = _run_uneven(rank)
        results["buffers-forward"] = run_buffers(rank, "forward")
        results["buffers-train_step"] = run_buffers(rank, "train_step")
        for path in ("forward", "train_step"):
            results[f"buffers-{path}-accumulate"] = run_buffers(rank, path, accumulate=True)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_worker, tmp_path_factory.mktemp("ddp"))


# -- two processes ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_parameters_equal_the_single_process_whole_batch(
    ranks: list[dict[str, Any]], name: str
) -> None:
    expected = reference(CASES[name])
    for rank, results in enumerate(ranks):
        got = results[name]
        assert list(got) == list(expected)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], msg=f"rank {rank}: {key}")


def test_sync_gradients_averages_with_zeros_and_keeps_none(ranks: list[dict[str, Any]]) -> None:
    for results in ranks:
        grads = results["presence"]
        torch.testing.assert_close(grads["both"], torch.full_like(grads["both"], 2.0))
        torch.testing.assert_close(grads["one"], torch.full_like(grads["one"], 2.0))
        assert grads["none"] is None


def test_a_stages_all_reduces_start_while_earlier_stages_still_run_backward(
    ranks: list[dict[str, Any]],
) -> None:
    for results in ranks:
        log = results["overlap"]["first"]
        # The last stage ended first: its all-reduces are issued before the
        # first stage's last backward, the first stage's after it.
        last_backward = max(i for i, e in enumerate(log) if e == "stage 0 backward")
        assert log.index("all_reduce") < last_backward < len(log) - 1
        assert log[-1] == "all_reduce"  # which gradients exist anywhere, after the step


def test_a_failed_step_waits_for_its_all_reduces_and_leaves_no_gradient(
    ranks: list[dict[str, Any]],
) -> None:
    one_step = reference(Case(("train_step",)))
    for rank, results in enumerate(ranks):
        got = results["overlap"]
        assert "backward failed" in got["failed"]
        assert "all_reduce" in got["during"]  # the last stage's had started
        assert all(g is None for g in got["grads_after_failure"])  # zeroed before: put back
        for key in one_step:
            torch.testing.assert_close(got["params"][key], one_step[key], msg=f"rank {rank}: {key}")


def test_processes_whose_stages_end_in_other_orders_average_the_right_gradients(
    ranks: list[dict[str, Any]],
) -> None:
    # Each process's own gradients, from the unsplit model; their mean.
    own = []
    for rank in range(WORLD):
        model = _four_stages()
        x, y = _uneven_batch(rank)
        nn.MSELoss()(model(x), y).backward()
        own.append({n: p.grad for n, p in model.named_parameters()})
    for results in ranks:
        for key, grad in results["uneven"]["grads"].items():
            torch.testing.assert_close(grad, (own[0][key] + own[1][key]) / 2, msg=key)


def test_steps_failing_at_different_points_leave_the_next_step_paired(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, results in enumerate(ranks):
        got = results["uneven"]
        assert "backward failed" in got["failed"] and got["untouched"]
        why = "ValueError: target" if rank == 1 else "RuntimeError: another process"
        assert got["refused"].startswith(why), got["refused"]
        for key, grad in got["after"].items():  # as the first step: nothing of the failed one
            torch.testing.assert_close(grad, got["grads"][key], msg=key)


def test_train_step_handles_buffers_as_the_ddp_forward_does(ranks: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(ranks):
        for kind in ("", "-accumulate"):
            forward, stepped = (
                results[f"buffers-forward{kind}"],
                results[f"buffers-train_step{kind}"],
            )
            assert forward.keys() == stepped.keys()
            for key in forward:
                where = f"rank {rank}{kind}: {key}"
                torch.testing.assert_close(stepped[key], forward[key], msg=where)
    # Each rank's statistics are its own after a step; sync_buffers makes them rank 0's.
    r0, r1 = ranks[0]["buffers-train_step"], ranks[1]["buffers-train_step"]
    assert not torch.equal(r0["1.running_mean@1"], r1["1.running_mean@1"])
    for key in ("1.running_mean", "1.running_var", "4.running_var", "1.num_batches_tracked"):
        torch.testing.assert_close(r1[f"{key}@synced"], r0[f"{key}@1"])
