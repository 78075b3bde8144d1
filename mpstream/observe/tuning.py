"""Split-size (and balance) autotuning, with a JSON cache.

The tutorial's closing advice is to "first generate the curve to figure out
the best split size". :func:`tune` generates it: it times a training (or
forward) step at increasing split sizes, stops once times have risen for a
while, returns the best configuration with the whole curve, and remembers the
result in a plain JSON file keyed by model, devices, batch shape and torch
version.
"""

from __future__ import annotations

import importlib.util
import json
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._warn import warn
from ..pipe import Pipe, SingleMicroBatchWarning
from ..runtime import Value, as_value, synchronize
from .measuring import untouched
from .profiling import pipes_in
from .spread import MAX_CV, MAX_RANGE, noisy
from .tune_args import check_knobs, checked_sizes, needs_target
from .tune_cache import batch_shape, default_cache, load, loss_key, model_key, store
from .tune_result import TunePoint, TuneResult, from_cache

__all__ = ["TunePoint", "TuneResult", "tune", "default_cache"]

Factory = Callable[..., nn.Module]


def _devices(model: nn.Module) -> list[torch.device]:
    if isinstance(model, Pipe):
        return model.devices
    return sorted({p.device for p in model.parameters()}, key=str) or [torch.device("cpu")]


class _Target:
    """What is timed at each configuration: a model built or reconfigured for it."""

    def __init__(self, target: nn.Module | Factory, tune_balance: bool) -> None:
        self.target = target
        self.tune_balance = tune_balance
        if isinstance(target, nn.Module):
            if tune_balance:
                raise ValueError(
                    "to tune the balance, pass a factory(split_size, balance) that builds the model"
                )
            if not hasattr(target, "split_size"):
                raise TypeError(
                    f"{type(target).__name__} has no split_size to tune; pass a Pipe, a model "
                    f"with a settable split_size, or a factory(split_size) that builds one"
                )
        elif not callable(target):
            raise TypeError(f"tune needs a module or a factory, got {type(target).__name__}")

    def build(self, split_size: int, balance: list[int] | None) -> nn.Module:
        if isinstance(self.target, nn.Module):
            self.target.split_size = split_size  # type: ignore[assignment]
            return self.target
        model = self.target(split_size, balance) if self.tune_balance else self.target(split_size)
        if not isinstance(model, nn.Module):
            raise TypeError(f"the factory returned {type(model).__name__}, not an nn.Module")
        return model


def _time_step(
    model: nn.Module,
    sample: Value,
    loss_fn: Callable[..., Tensor] | None,
    target: Any,
    repeat: int,
    warmup: int,
) -> list[float]:
    devices = _devices(model)
    times = []
    with warnings.catch_warnings():
        # A split size of the whole batch is a point of the curve, tried on
        # purpose: no advice against it while timing it.
        warnings.simplefilter("ignore", SingleMicroBatchWarning)
        for i in range(warmup + repeat):
            synchronize(devices)
            start = time.perf_counter()
            if loss_fn is None:
                with torch.no_grad():
                    model(sample)
            elif target is None:
                torch.autograd.backward(loss_fn(model(sample)))
            elif isinstance(model, Pipe):
                # The pipe's own schedule; its step, not the averaging a DDP
                # wrapper of it needs (timed only: the gradients are dropped).
                model._train_step(sample, target, loss_fn, None, None)
            else:
                torch.autograd.backward(loss_fn(model(sample), target))
            synchronize(devices)
            if i >= warmup:
                times.append(time.perf_counter() - start)
            if loss_fn is not None:
                model.zero_grad(set_to_none=True)
    return times


def tune(
    pipe_or_factory: nn.Module | Factory,
    sample: Value,
    loss_fn: Callable[..., Tensor] | None = None,
    split_sizes: Sequence[int] | None = None,
    *,
    target: Any = None,
    balances: Sequence[Sequence[int]] | None = None,
    repeat: int = 3,
    warmup: int = 1,
    patience: int = 2,
    tolerance: float = 0.05,
    cache: str | Path | None = "default",
    refresh: bool = False,
    progress: bool = True,
    plot: str | Path | None = None,
) -> TuneResult:
    """Finds the fastest split size (and optionally balance) by measurement.

    Args:
        pipe_or_factory: a :class:`~mpstream.Pipe` or any model with a
            settable ``split_size`` (its split size is changed in place; its
            gradients and buffers are put back after timing), or a
            factory ``f(split_size)`` (``f(split_size, balance)`` with
            ``balances``) returning a model.
        sample: a full batch, as the model takes it.
        loss_fn: ``loss_fn(output) -> scalar``; each step is forward +
            backward of it, which autograd runs fill-drain (GPipe) whatever
            the pipe's schedule. With ``target``, ``loss_fn(output,
            target)``, and a Pipe's step is its ``train_step``: its own
            schedule (1F1B, zero-bubble, ...). None times the forward
            alone, without grad.
        split_sizes: candidates up to the batch size, each given once,
            tried in increasing order; default a ladder up to the batch size.
        target: the batch's target, to time ``train_step`` (see ``loss_fn``).
        balances: stage balances to try (needs a factory).
        repeat: timed steps per configuration (the median is used).
        warmup: untimed steps before them.
        patience: stop a sweep once this many sizes since the last new best
            were slower than it by more than ``tolerance``.
        tolerance: relative slack before a size counts as slower.
        cache: JSON file of earlier results; ``'default'`` is
            :func:`default_cache`, None disables caching. Its key leaves
            out ``repeat``, ``warmup``, ``patience`` and ``tolerance`` (how
            a result is measured, not what for): a cached result is
            returned whatever they are now.
        refresh: measure again even if the cache has this configuration
            (with this call's ``repeat``, ``warmup``, ``patience`` and
            ``tolerance``).
        progress: show a progress bar.
        plot: also save the tradeoff curve here (PNG).

    Returns:
        The best configuration, the curve, and whether it came from cache.
        A sweep whose timings of one configuration disagree (noisy, see
        :mod:`~.spread`) is warned about and not cached.

    Raises:
        ValueError: bad split sizes (one repeated, or larger than the batch), repeat
            or patience below 1, a negative warmup, a negative or NaN
            tolerance; ``target`` without ``loss_fn``; a ``loss_fn`` of
            (output, target) without ``target``; a pipe
            whose schedule is an explicit order (written for one
            micro-batch count) over several split sizes.
        TypeError: a model without ``split_size``, a factory that does not
            return a module, or repeat, warmup or patience not an int (or
            tolerance not a number).
    """
    value = as_value(sample, "sample")
    batch = (value if isinstance(value, Tensor) else value[0]).size(0)
    sizes = checked_sizes(split_sizes, batch)
    if target is not None and loss_fn is None:
        raise ValueError("target= times a training step: give loss_fn(output, target) too")
    if target is None and loss_fn is not None and needs_target(loss_fn):
        raise ValueError(
            "loss_fn takes (output, target) but tune got no target=: give target= (a Pipe's "
            "step is then its train_step, with its schedule), or a loss of the output alone "
            "(lambda out: F.mse_loss(out, y))"
        )
    check_knobs(repeat, warmup, patience, tolerance)
    if balances is not None and not balances:
        raise ValueError(
            "balances=[] lists no balance to try: leave it out to tune the split alone"
        )
    # A balance given twice (a profiled 'time' equal to a listed one) is timed once.
    unique = list(dict.fromkeys(tuple(b) for b in balances)) if balances else []
    configs: list[list[int] | None] = [list(b) for b in unique] or [None]
    models = _Target(pipe_or_factory, balances is not None)

    with _restored_on_error(pipe_or_factory):
        first = models.build(sizes[0], configs[0])
        step = "forward" if loss_fn is None else ("backward" if target is None else "train_step")
        key = {
            **model_key(first),
            "devices": [str(d) for d in _devices(first)],
            "batch": batch_shape(value),
            "torch": torch.__version__,
            "mode": step,
            **loss_key(loss_fn, target),
            "split_sizes": sizes,
            "balances": configs,
        }
        # Warned cached or not: the cached times were taken the same way.
        own = step == "train_step" and isinstance(first, Pipe)  # its schedule is timed
        if own and isinstance(first.schedule, tuple) and len(sizes) > 1:
            raise ValueError(
                "tune times several split sizes, and so several micro-batch counts, but the "
                "pipe's schedule is an explicit order written for one count: tune it with a "
                "built-in schedule (pipe.schedule = '1f1b', say), then write the order for "
                "the split size it picks"
            )
        other = sorted({p.schedule for p in pipes_in(first) if p.schedule != "gpipe"}, key=repr)
        if step != "forward" and not own and other:
            how = (
                "pass target= and loss_fn(output, target) to time it"
                if isinstance(first, Pipe)
                else "tune the Pipe itself with target= to time it"
            )
            warn(
                f"tune times forward + backward of the loss, which autograd runs fill-drain; "
                f"the schedule {', '.join(map(repr, other))} runs only in a Pipe's "
                f"train_step: {how}"
            )
        key_text = json.dumps(key, sort_keys=True)
        path = default_cache() if cache == "default" else (Path(cache) if cache else None)
        entries = load(path) if path is not None else {}
        cached = None
        if path is not None and not refresh:
            cached = from_cache(entries, key_text, key, path)
        if cached is not None:
            if isinstance(pipe_or_factory, nn.Module):
                # Building the key set the first candidate: leave the best one.
                pipe_or_factory.split_size = cached.split_size  # type: ignore[assignment]
            if plot is not None:
                cached.plot(plot)
            return cached
        curve: list[TunePoint] = []
        stopped = False
        user = pipe_or_factory if isinstance(pipe_or_factory, nn.Module) else None
        with (
            untouched(user) if user is not None else nullcontext(),
            _bar(len(sizes) * len(configs), progress) as bar,
        ):
            for balance in configs:
                best = float("inf")
                worse = 0
                for i, size in enumerate(sizes):
                    same = i == 0 and balance == configs[0]
                    model = first if same else models.build(size, balance)
                    times = _time_step(model, value, loss_fn, target, repeat, warmup)
                    point = TunePoint(size, balance, times)
                    curve.append(point)
                    bar.set_postfix(split=size, median=f"{point.median:.4f}s")
                    bar.update(1)
                    if point.median < best:
                        best, worse = point.median, 0
                    elif point.median > best * (1 + tolerance):
                        worse += 1
                        if worse >= patience:
                            # Early only if sizes are left untried.
                            stopped = stopped or i < len(sizes) - 1
                            bar.update(len(sizes) - i - 1)
                            break
        result = TuneResult(min(curve, key=lambda p: p.median), curve, stopped, False, key)
        if user is not None:
            user.split_size = result.split_size  # type: ignore[assignment]
    shaky = [p for p in curve if len(p.times) > 1 and noisy(p.times)]
    if shaky:
        # A choice among disagreeing timings would stay in the cache for good.
        where = ", ".join(
            f"split {p.split_size}{f' balance {p.balance}' if p.balance else ''} "
            f"({min(p.times) * 1e3:.3g}-{max(p.times) * 1e3:.3g} ms)"
            for p in shaky
        )
        warn(
            f"tune: the timings of {where} disagree (coefficient of variation above "
            f"{MAX_CV:.0%} or slowest/fastest above {MAX_RANGE:.1f}x): the machine was busy, "
            f"and the choice may say more about it than about the model; not cached, so the "
            f"next call measures again (on a quiet machine, or with a larger repeat=)"
        )
    elif path is not None:
        store(path, key_text, result.to_json())
    if plot is not None:
        result.plot(plot)
    return result


@contextmanager
def _bar(total: int, progress: bool) -> Iterator[Any]:
    """A tqdm progress bar, drawn only on a terminal, or a silent stand-in
    (tqdm is optional: without it, no bar)."""
    if progress and importlib.util.find_spec("tqdm") is not None:
        from tqdm import tqdm

        with tqdm(total=total, desc="tuning", unit="config", disable=None) as bar:
            yield bar
    else:
        yield _Silent()


class _Silent:
    def set_postfix(self, **_: Any) -> None:
        pass

    def update(self, _: int = 1) -> None:
        pass


@contextmanager
def _restored_on_error(model: nn.Module | Factory) -> Iterator[None]:
    """Puts a user's model back at its own split size (or chunks) if
    tuning fails part-way; on success it keeps the best split size."""
    if not isinstance(model, nn.Module):
        yield
        return
    saved = {n: getattr(model, n) for n in ("split_size", "chunks") if hasattr(model, n)}
    try:
        yield
    except BaseException:
        if saved.get("chunks") is not None:
            model.chunks = saved["chunks"]  # type: ignore[assignment]
        else:
            model.split_size = saved["split_size"]  # type: ignore[assignment]
        raise
