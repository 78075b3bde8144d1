"""Pipelines under DDP against the plain model under the same DDP, two gloo processes.

``tests/test_distributed.py`` compares with one process on the whole batch,
which is what DDP computes only when every process has as many rows. Here
the processes' shares differ (DDP then averages the two processes' mean
losses), a split size leaves a shorter last micro-batch, the batch shrinks
from step to step (an uneven last batch), ``static_graph`` and
``find_unused_parameters`` see those changing micro-batch counts, and a
``torch.distributed.checkpoint`` checkpoint resumes the run on a pipe split
otherwise. Under DDP's ``Join``, ``train_step`` with as many batches on every
process trains as without it, and with fewer on one process is refused
rather than breaking the group. Pipelines split differently in the two
processes are refused before their all-reduces pair the wrong stages.
"""

from __future__ import annotations

import contextlib
import datetime
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from mpstream import Pipe
from mpstream import distributed as mpdist
from tests.ddp_group import BALANCE, LR, batches, initial_model, join_group, launch

# Rows of (rank 0, rank 1) at each step, taken from that step's global batch.
SHARES = ((5, 3), (4, 4), (3, 1))
SPLIT = 2  # 5 rows: micro-batches of 2, 2 and 1
# Each run: the path it trains on, Pipe's options, DDP's options.
CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "forward": ("forward", {"schedule": "gpipe"}, {}),
    "forward-static_graph": ("forward", {"checkpoint": "always"}, {"static_graph": True}),
    "train_step-1f1b": ("train_step", {"schedule": "1f1b", "checkpoint": "except_last"}, {}),
    "train_step-zb_h1": ("train_step", {"schedule": "zb_h1"}, {"find_unused_parameters": True}),
}


def share(step: int, rank: int) -> tuple[Tensor, Tensor]:
    x, y = batches(len(SHARES))[step]
    first, second = SHARES[step]
    rows = slice(0, first) if rank == 0 else slice(first, first + second)
    return x[rows], y[rows]


def _train(rank: int, ddp: DistributedDataParallel, path: str) -> dict[str, Tensor]:
    """Every step of :data:`SHARES`: the losses, each step's gradients, the parameters."""
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    out: dict[str, Tensor] = {}
    losses = []
    for step in range(len(SHARES)):
        x, y = share(step, rank)
        if path == "train_step":
            loss = mpdist.train_step(ddp, x, y, nn.MSELoss())
        else:
            loss = nn.MSELoss()(ddp(x), y)
            loss.backward()
        losses.append(loss.detach())
        for name, p in ddp.module.named_parameters():
            assert p.grad is not None, name
            out[f"{name}.grad@{step}"] = p.grad.clone()
        opt.step()
        opt.zero_grad()
    out.update((k, v.detach().clone()) for k, v in ddp.module.state_dict().items())
    out["loss"] = torch.stack(losses)
    return out


def _run_against_plain(rank: int) -> dict[str, dict[str, Tensor]]:
    # Rank 1 starts from other weights: DDP's first broadcast must fix them.
    results = {"plain": _train(rank, DistributedDataParallel(initial_model(seed=rank)), "forward")}
    for name, (path, options, ddp_options) in CONFIGS.items():
        pipe = Pipe(initial_model(seed=rank), split_size=SPLIT, balance=BALANCE,
                    devices=["cpu", "cpu"], **options)  # fmt: skip
        ddp = mpdist.wrap(pipe, **ddp_options)
        results[name] = _train(rank, ddp, path)
        del ddp  # its reducer before the group (see docs/ddp.md)
    return results


def _uneven_under_join(rank: int, ddp: DistributedDataParallel, throw: bool) -> str:
    """Rank 0 has two batches, rank 1 one, under ``Join([ddp])``: the error raised."""
    try:
        with Join([ddp], throw_on_early_termination=throw):
            for step in range(2 - rank):
                mpdist.train_step(ddp, *share(step, rank), nn.MSELoss())
    except RuntimeError as exc:
        return str(exc)
    return ""


def _run_join(rank: int) -> dict[str, Any]:
    """Equal batch counts under ``Join``; uneven ones, with and without
    ``throw_on_early_termination`` (the latter on a group of its own,
    which the joined process waits on until its short timeout)."""
    ddp = mpdist.wrap(Pipe(initial_model(seed=rank), split_size=SPLIT, balance=BALANCE,
                           devices=["cpu", "cpu"], schedule="1f1b"))  # fmt: skip
    with Join([ddp]):
        equal = _train(rank, ddp, "train_step")
    thrown = _uneven_under_join(rank, ddp, throw=True)
    mpdist.train_step(ddp, *share(0, rank), nn.MSELoss())  # the group still pairs up
    del ddp
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    ddp = mpdist.wrap(Pipe(initial_model(), split_size=SPLIT, balance=BALANCE,
                           devices=["cpu", "cpu"]), process_group=short)  # fmt: skip
    refused = _uneven_under_join(rank, ddp, throw=False) if rank == 0 else ""
    if rank == 1:
        with contextlib.suppress(RuntimeError):  # the timeout of the joined process
            _uneven_under_join(rank, ddp, throw=False)
    del ddp
    return {"equal": equal, "thrown": thrown, "refused": refused}


def _adam_run(balance: list[int]) -> tuple[Pipe, DistributedDataParallel, torch.optim.Optimizer]:
    pipe = Pipe(initial_model(), split_size=SPLIT, balance=balance, devices=["cpu", "cpu"],
                schedule="1f1b")  # fmt: skip
    ddp = mpdist.wrap(pipe)
    return pipe, ddp, torch.optim.Adam(ddp.parameters(), lr=LR)


def _adam_steps(rank: int, ddp: DistributedDataParallel, opt: Any, steps: range) -> None:
    for step in steps:
        mpdist.train_step(ddp, *share(step, rank), nn.MSELoss())
        opt.step()
        opt.zero_grad()


def _run_dcp(rank: int, out_dir: str) -> dict[str, dict[str, Tensor]]:
    """Three Adam steps straight; one step, a DCP checkpoint, which the
    unsplit model under DDP loads, and a pipe of another balance with a new
    optimizer loads and trains two more steps on."""
    pipe, ddp, opt = _adam_run(BALANCE)
    _adam_steps(rank, ddp, opt, range(3))
    straight = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe, ddp, opt = _adam_run(BALANCE)
    _adam_steps(rank, ddp, opt, range(1))
    saved = {k: v.clone() for k, v in pipe.state_dict().items()}
    model_state, optim_state = get_state_dict(ddp, opt)
    where = str(Path(out_dir) / "dcp")
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=where)
    del ddp
    plain = DistributedDataParallel(initial_model(seed=5))
    _dcp_load(plain, torch.optim.Adam(plain.parameters(), lr=LR), where)
    unsplit = {k: v.clone() for k, v in plain.module.state_dict().items()}
    del plain
    pipe, ddp, opt = _adam_run([4, 2])
    _dcp_load(ddp, opt, where)
    _adam_steps(rank, ddp, opt, range(1, 3))
    resumed = {k: v.clone() for k, v in pipe.state_dict().items()}
    del ddp
    return {"straight": straight, "resumed": resumed, "saved": saved, "unsplit": unsplit}


def _dcp_load(ddp: DistributedDataParallel, opt: Any, where: str) -> None:
    model_state, optim_state = get_state_dict(ddp, opt)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=where)
    set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    try:
        join_group(rank, store_path)
        results = {
            "against_plain": _run_against_plain(rank),
            "dcp": _run_dcp(rank, out_dir),
            "join": _run_join(rank),
        }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_worker, tmp_path_factory.mktemp("ddp_plain"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_losses_gradients_and_parameters_equal_the_plain_model_under_ddp(
    ranks: list[dict[str, Any]], name: str
) -> None:
    for rank, results in enumerate(ranks):
        plain, got = results["against_plain"]["plain"], results["against_plain"][name]
        assert list(got) == list(plain)
        for key in plain:
            torch.testing.assert_close(got[key], plain[key], msg=f"rank {rank}: {key}")
    # DDP kept the replicas alike, whatever each process's share.
    for key, value in ranks[0]["against_plain"][name].items():
        if key != "loss":
            torch.testing.assert_close(ranks[1]["against_plain"][name][key], value, msg=key)


def test_a_distributed_checkpoint_resumes_on_another_balance_and_loads_unsplit(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, results in enumerate(ranks):
        got = results["dcp"]
        for expected, loaded in (("straight", "resumed"), ("saved", "unsplit")):
            assert list(got[loaded]) == list(got[expected])
            for key, value in got[expected].items():
                torch.testing.assert_close(got[loaded][key], value, msg=f"rank {rank}: {key}")


def test_train_step_under_join_pairs_up_or_refuses_with_what_to_do(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, results in enumerate(ranks):
        got, plain = results["join"], results["against_plain"]["plain"]
        for key in plain:  # as many batches everywhere: as without Join
            torch.testing.assert_close(got["equal"][key], plain[key], msg=f"rank {rank}: {key}")
        # throw_on_early_termination: torch's errors on every process.
        assert "exhausted" in got["thrown"], got["thrown"]
    refused = ranks[0]["join"]["refused"]
    assert "1 of the group's 2 processes ran out of batches inside Join([ddp])" in refused
    assert "drop_last=True" in refused and "throw_on_early_termination=True" in refused


# -- pipelines that differ between processes ---------------------------------------

# One Linear(6, 6) in float64 is 42 elements: a bucket of exactly one layer,
# so that differently split pipelines issue all-reduces of the same sizes.
ONE_LAYER_MB = (42 * 8 + 0.5) / 2**20


def _layers() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(*(nn.Linear(6, 6) for _ in range(4))).double()


def _mismatch_worker(rank: int, store_path: str, out_dir: str) -> None:
    try:
        join_group(rank, store_path)
        results: dict[str, Any] = {}
        balance = [1, 3] if rank == 0 else [3, 1]
        pipe = Pipe(_layers(), split_size=1, balance=balance, devices=["cpu", "cpu"])
        try:
            mpdist.wrap(pipe, bucket_cap_mb=ONE_LAYER_MB)
            results["wrap"] = ""
        except ValueError as exc:
            results["wrap"] = str(exc)
        # Built without wrap(): train_step checks at its first call.
        ddp = DistributedDataParallel(pipe, bucket_cap_mb=ONE_LAYER_MB)
        x, y = torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
        try:
            mpdist.train_step(ddp, x, y, nn.MSELoss())
            results["train_step"] = ""
        except ValueError as exc:
            results["train_step"] = str(exc)
        results["no_grads"] = all(p.grad is None for p in pipe.parameters())
        # The same split everywhere passes, and trains.
        same = Pipe(_layers(), split_size=1, balance=[2, 2], devices=["cpu", "cpu"])
        mpdist.train_step(mpdist.wrap(same, bucket_cap_mb=ONE_LAYER_MB), x, y, nn.MSELoss())
        results["same"] = True
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        del ddp
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_pipelines_split_differently_across_processes_are_refused(tmp_path: Any) -> None:
    # Their all-reduces would pair one process's stage 1 with the other's
    # stage 0: the same sizes here, so nothing would fail, the gradients
    # would just be averaged with the wrong ones.
    for rank, results in enumerate(launch(_mismatch_worker, tmp_path)):
        for where in ("wrap", "train_step"):
            assert "differ between the processes" in results[where], (rank, where, results)
        assert results["no_grads"] and results["same"]
