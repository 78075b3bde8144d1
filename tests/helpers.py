"""Models, comparisons, an operator counter and a scheduler of virtual CUDA
devices shared by the tests."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpstream.runtime.scheduler import EventScheduler
from mpstream.schedules.schedule import Schedule


def mlp(widths: Sequence[int], dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """Linear+Tanh layers of the given widths (float64 so sums compare exactly)."""
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers).to(dtype)


def staged(model: nn.Sequential, balance: Sequence[int]) -> nn.Sequential:
    """Groups ``model``'s layers into one child per stage (the tutorial's style)."""
    children = list(model)
    parts = []
    start = 0
    for n in balance:
        parts.append(nn.Sequential(*children[start : start + n]))
        start += n
    return nn.Sequential(*parts)


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    """Every parameter gradient of ``a`` equals ``b``'s, in registration order."""
    pa, pb = list(a.named_parameters()), list(b.named_parameters())
    assert len(pa) == len(pb)
    for (name, x), (_, y) in zip(pa, pb):
        assert x.grad is not None, f"no gradient for {name}"
        torch.testing.assert_close(x.grad, y.grad, msg=f"gradient of {name}")


def reference_on_micro_batches(
    model: nn.Module, x: Tensor, split_size: int, loss: Callable[[Tensor], Tensor]
) -> Tensor:
    """Runs ``model`` on each micro-batch, concatenates, back-propagates once.

    The reference for BatchNorm in train mode, which normalises each
    micro-batch on its own.
    """
    out = torch.cat([model(part) for part in x.split(split_size)])
    loss(out).backward()
    return out


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def virtual_for(name: object, stages: int, ranks: int | None = None) -> int | None:
    """``virtual_stages`` of a built-in schedule over ``stages`` stages that
    share one device: a V's 2, a round-robin one's ``stages / ranks``
    (default: two stages per rank where the count is even, else one), None
    for a schedule of a rank per stage (or an explicit order)."""
    from mpstream.schedules import placement_of

    kind = placement_of(name)
    if kind == "v":
        return 2
    if kind == "round_robin":
        return stages // ranks if ranks else (2 if stages % 2 == 0 else 1)
    return None


def fits(name: object, stages: int) -> bool:
    """Whether ``name`` runs over ``stages`` stages on one device with
    :func:`virtual_for` (a V needs an even number)."""
    from mpstream.schedules import placement_of

    return placement_of(name) != "v" or stages % 2 == 0


class Ops(TorchDispatchMode):
    """Counts the aten operators dispatched inside, by name (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def run_all(sched: EventScheduler, schedule: Schedule) -> None:
    """Runs every task of ``schedule`` in its order, then waits for the run."""
    sched.begin_run(schedule)
    for t in schedule.tasks:
        sched.end(sched.begin(t.index))
    sched.join()


def virtual_scheduler(n: int) -> EventScheduler:
    """A scheduler of ``n`` CUDA devices that touches none: only its plan is made."""
    return EventScheduler([torch.device("cuda", i) for i in range(n)], virtual=True)
