"""Deferred BatchNorm: running statistics updated once per mini-batch.

Pipelining normalises each micro-batch on its own (as the single-device model
would on that micro-batch), but a plain BatchNorm would also update its
running statistics once per micro-batch, with micro-batch statistics.
:class:`DeferredBatchNorm` instead accumulates per-channel sums over the
micro-batches of a mini-batch and updates the running statistics once, with
the whole mini-batch's mean and unbiased variance: what the single-device
model computes on the whole batch. :func:`deferred_update` makes a pipeline
call all or nothing: the update is applied once every stage has finished, and
a call that raises leaves the statistics as they were.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import is_lazy

from .._warn import warn
from .._words import count_of
from .checkpoint import is_recomputing

__all__ = [
    "DeferredBatchNorm",
    "convert_deferred_batch_norm",
    "converted",
    "deferred_norms",
    "deferred_update",
]


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm for any input rank (N, C, ...) with deferred statistics.

    :meth:`begin` starts a mini-batch of ``micros`` micro-batches and
    :meth:`commit` ends it (``Pipe`` calls both at every call and step); the
    running statistics are updated after that many training-mode forwards,
    or, while :attr:`hold` is set, by :meth:`commit`.
    """

    expected: int
    sum: Tensor
    sum_squares: Tensor
    count: Tensor
    #: How many have been made in this process: a pipe that found its
    #: deferred norms looks again when this changes (a conversion after the
    #: pipe was built).
    created = 0

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, True, device, dtype)
        # Accumulated in float64 so sum-of-squares stays accurate; not part of
        # state_dict, so checkpoints match the plain model's keys.
        kw = {"device": device, "dtype": torch.float64}
        self.register_buffer("sum", torch.zeros(num_features, **kw), persistent=False)  # type: ignore[arg-type]
        self.register_buffer("sum_squares", torch.zeros(num_features, **kw), persistent=False)  # type: ignore[arg-type]
        self.register_buffer("count", torch.zeros((), **kw), persistent=False)  # type: ignore[arg-type]
        self.expected = 1
        self.tracked = 0
        self.calls = 0  # forwards counted since begin()
        self.hold = False
        self.warned = False  # about calls pooled, said once
        DeferredBatchNorm.created += 1
        _accumulate_eagerly()

    def __setstate__(self, state: dict[str, object]) -> None:
        # Unpickled or deep-copied, a norm is made without __init__.
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        _accumulate_eagerly()

    def _check_rank(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")

    def _check_input_dim(self, input: Tensor) -> None:
        self._check_rank(input)
        # The training forward passes no running statistics to batch_norm, so
        # without an affine weight nothing there checks the channels, and a
        # single channel would broadcast into every channel's sums.
        if input.size(1) != self.num_features:
            raise ValueError(
                f"expected input with {count_of(self.num_features, 'channel')} (dim 1, "
                f"num_features), got shape {tuple(input.shape)}"
            )

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # .half()/.to(dtype) convert floating buffers; the accumulators stay
        # float64 whatever the layer's dtype.
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for name in ("sum", "sum_squares", "count"):
            buf = self._buffers[name]
            if buf is not None and buf.dtype != torch.float64:
                self._buffers[name] = buf.to(torch.float64)
        return self

    def reset_accumulation(self) -> None:
        """Drops statistics accumulated for an unfinished mini-batch."""
        self.sum.zero_()
        self.sum_squares.zero_()
        self.count.zero_()
        self.tracked = 0

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        self._accumulate(input)
        return out

    # Run eagerly under torch.compile (_accumulate_eagerly).
    def _accumulate(self, input: Tensor) -> None:
        if is_recomputing():
            return
        with torch.no_grad():
            dims = [0, *range(2, input.dim())]
            x = input.detach().to(torch.float64)
            self.sum += x.sum(dims)
            self.sum_squares += (x * x).sum(dims)
            self.count += x.numel() // x.size(1)
        self.count_forward()

    def count_forward(self) -> None:
        """Counts one micro-batch accumulated, and updates the running
        statistics once the mini-batch is complete (unless held). A forward
        replayed from a CUDA graph accumulates on the device without running
        this Python, so the replay calls it."""
        self.tracked += 1
        self.calls += 1
        if self.tracked >= self.expected and not self.hold:
            with torch.no_grad():
                self._commit()

    def begin(self, micros: int) -> None:
        """Starts a mini-batch of ``micros`` micro-batches (``Pipe`` calls
        this at every call and step)."""
        if self.tracked:
            # Sums from after the last mini-batch (a recompute outside
            # mpstream's checkpointing) are no part of this one.
            self.reset_accumulation()
        self.expected, self.calls = micros, 0

    def commit(self) -> None:
        """Ends a mini-batch: what is accumulated still updates the running
        statistics.

        A layer that a forward skipped for some micro-batches updates once,
        from those it ran on, as the plain model's layer would from the
        samples it saw; its sums are not carried into the next mini-batch.
        A layer called more than once per micro-batch (one module used twice
        in a forward) cannot update as a plain BatchNorm would, from each
        call's own whole batch: its calls' statistics are pooled, and update
        the running statistics (and ``num_batches_tracked``) once per call
        of a micro-batch, as often as the plain layer's. It says so once,
        with a warning (:meth:`say_pooled`).
        """
        self.say_pooled()
        if self.tracked:
            with torch.no_grad():
                self._commit(max(1, -(-self.calls // self.expected)))

    def say_pooled(self) -> None:
        """Warns, once, if the layer ran more than once per micro-batch in
        this mini-batch (see :meth:`commit`); an error under
        ``warnings.simplefilter("error")``, raised before anything updates."""
        if self.calls > self.expected and not self.warned:
            self.warned = True
            warn(
                f"DeferredBatchNorm({self.num_features}) ran {self.calls} times in a mini-batch "
                f"of {count_of(self.expected, 'micro-batch', 'micro-batches')}: called more than "
                f"once per micro-batch, its calls' statistics are pooled, where a plain "
                f"BatchNorm updates once per call from that call's whole batch. Use a "
                f"BatchNorm per call site for the plain model's statistics"
            )

    def _commit(self, times: int = 1) -> None:
        """Updates the running statistics ``times`` times with the
        accumulated ones (once per call of a micro-batch, see :meth:`commit`)."""
        mean = self.sum / self.count
        var = (self.sum_squares / self.count - mean * mean).clamp_(min=0)
        unbiased = var * self.count / (self.count - 1).clamp(min=1)
        # Through .data, as BatchNorm's own update: graphs of earlier eval-mode
        # forwards may have saved these buffers.
        running_mean = cast(Tensor, self.running_mean).data
        running_var = cast(Tensor, self.running_var).data
        tracked = cast(Tensor, self.num_batches_tracked)
        mean, unbiased = mean.to(running_mean.dtype), unbiased.to(running_var.dtype)
        for _ in range(times):
            tracked += 1
            if self.momentum is None:
                # A cumulative average: the factor 1/tracked stays on the device
                # (float(tracked) would synchronize the host once per layer), in
                # float64: an integer tensor's reciprocal is float32.
                factor = tracked.to(torch.float64).reciprocal().to(running_mean.dtype)
                running_mean.lerp_(mean, factor)
                running_var.lerp_(unbiased, factor)
            else:
                running_mean.mul_(1 - self.momentum).add_(mean, alpha=self.momentum)
                running_var.mul_(1 - self.momentum).add_(unbiased, alpha=self.momentum)
        self.reset_accumulation()

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Replaces every BatchNorm in ``module`` (in place) with a deferred one.

        Parameters and buffers are reused, so optimizers and state_dict keys
        are unaffected.

        Returns:
            ``module``, or its replacement if it is itself a BatchNorm.

        Raises:
            TypeError: ``module`` holds an ``nn.SyncBatchNorm`` (nothing is
                replaced then). A deferred layer keeps its statistics within
                one process, so converting it would silently drop the
                synchronisation across processes that it was chosen for.
        """
        synced = [
            name or type(module).__name__
            for name, m in module.named_modules(remove_duplicate=False)
            if isinstance(m, nn.SyncBatchNorm)
        ]
        if synced:
            raise TypeError(
                f"deferred_batch_norm=True cannot take the nn.SyncBatchNorm layer(s) "
                f"{', '.join(repr(n) for n in synced)}: a DeferredBatchNorm keeps its statistics "
                f"within one process, which would silently drop their synchronisation across "
                f"processes. Use nn.BatchNorm layers there (under DDP each process then keeps its "
                f"own statistics, as plain DDP does), or leave deferred_batch_norm off"
            )
        return cls._convert(module)

    @classmethod
    def _convert(cls, module: nn.Module) -> nn.Module:
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            if not module.track_running_stats:
                return module
            # A lazy BatchNorm's parameters and buffers take their size at
            # the first forward: so must the deferred layer's accumulators.
            lazy = any(is_lazy(t) for t in (*module.parameters(False), *module.buffers(False)))
            new = (_LazyDeferredBatchNorm if lazy else cls)(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                device=cast(Tensor, module.running_mean).device,
            )
            if module.affine:
                new.weight = module.weight
                new.bias = module.bias
            new.running_mean = module.running_mean
            new.running_var = module.running_var
            new.num_batches_tracked = module.num_batches_tracked
            new.train(module.training)
            return new
        # Every occurrence, not named_children(), which yields a module held
        # twice only once: a BatchNorm called twice would keep its second
        # call plain, updating the shared statistics once per micro-batch.
        # Each occurrence gets its own deferred layer over the same
        # parameters and buffers, which then updates them once per call, as
        # the single-device model does.
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            replaced = cls._convert(child)
            if replaced is not child:
                setattr(module, name, replaced)
        return module


_eager = False  # whether DeferredBatchNorm._accumulate is kept out of torch.compile


def _accumulate_eagerly() -> None:
    """Keeps torch.compile out of :meth:`DeferredBatchNorm._accumulate`:
    compiled, its counter and the recompute flag would be guarded on and
    the stage recompiled at every micro-batch (eager instead: one graph
    break per layer in a compiled stage). Done when the first norm is made,
    not where the method is defined: ``torch.compiler.disable`` imports
    ``torch._dynamo``, seconds that every ``import mpstream`` (each CLI
    command) would pay, and a norm exists before anything compiles it."""
    global _eager
    if not _eager:
        method = DeferredBatchNorm._accumulate
        DeferredBatchNorm._accumulate = torch.compiler.disable(method)  # type: ignore[method-assign, no-untyped-call]
        _eager = True


class _LazyDeferredBatchNorm(LazyModuleMixin, DeferredBatchNorm):
    """The conversion of a lazy BatchNorm not yet run: its uninitialised
    parameters and buffers, sized at the first forward from the input's
    channels (as the lazy layer would), with the accumulators; it is a
    :class:`DeferredBatchNorm` from then on."""

    cls_to_become = DeferredBatchNorm

    def reset_parameters(self) -> None:
        if not self.has_uninitialized_params() and self.num_features != 0:
            super().reset_parameters()

    def initialize_parameters(self, input: Tensor) -> None:  # type: ignore[override]
        if not self.has_uninitialized_params():
            return
        self._check_rank(input)
        self.num_features = input.shape[1]
        for name in ("weight", "bias", "running_mean", "running_var"):
            t = getattr(self, name)
            if t is not None and is_lazy(t):
                t.materialize((self.num_features,))
        self.reset_parameters()
        device = cast(Tensor, self.running_mean).device
        for name in ("sum", "sum_squares"):
            self._buffers[name] = torch.zeros(self.num_features, device=device, dtype=torch.float64)
        self._buffers["count"] = self.count.to(device)


@contextmanager
def converted(module: nn.Module) -> Iterator[nn.Module]:
    """``DeferredBatchNorm.convert(module)``, undone if the block raises (a
    pipe that fails to build leaves the caller's model as it was)."""
    swapped = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent._modules.items()
        if isinstance(child, _BatchNorm)
        and not isinstance(child, DeferredBatchNorm)
        and child.track_running_stats
    ]
    result = DeferredBatchNorm.convert(module)
    try:
        yield result
    except BaseException:
        for parent, name, child in swapped:
            setattr(parent, name, child)
        raise


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Module-level alias of :meth:`DeferredBatchNorm.convert`."""
    return DeferredBatchNorm.convert(module)


def deferred_norms(module: nn.Module) -> list[DeferredBatchNorm]:
    """The deferred BatchNorm layers inside ``module``."""
    return [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]


@contextmanager
def deferred_update(norms: Sequence[DeferredBatchNorm], micros: int) -> Iterator[None]:
    """One pipeline call over ``micros`` micro-batches, all or nothing.

    The deferred ``norms`` (as :func:`deferred_norms` finds them in a
    pipeline) accumulate but do not update inside the block. If it
    completes, each one that ran updates its running statistics
    (:meth:`DeferredBatchNorm.commit`; on the caller's streams, which the
    pipeline has ordered after every stage). If it raises, the partial sums are dropped: the
    statistics stay as they were, and the next mini-batch updates them
    exactly as if the failed call had not happened. So does a warning that
    the calls of one are pooled raised as an error (``-W error``): every
    norm says it before any updates.
    """
    for norm in norms:
        norm.begin(micros)
        norm.hold = True
    try:
        yield
        for norm in norms:
            norm.say_pooled()
    except BaseException:
        for norm in norms:
            norm.reset_accumulation()
        raise
    finally:
        for norm in norms:
            norm.hold = False
    for norm in norms:
        norm.commit()
