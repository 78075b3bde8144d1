"""``mpstream.Pipe``: an ``nn.Sequential`` pipelined over devices and streams."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .microbatch import Value, as_value, batch_device, gather, scatter
from .partition import DeviceLike, check_positive, split_module
from .schedule import Schedule
from .scheduler import EventScheduler
from .worker import Worker

__all__ = ["Pipe"]


class Pipe(nn.Module):
    """Pipeline-parallel wrapper running each stage on its own CUDA stream.

    The batch is split into micro-batches along dim 0. Stage ``s`` computes
    every micro-batch on a dedicated compute stream; its output moves to the
    next stage's device on dedicated copy streams; CUDA events from mpstream's
    C++ scheduler order all of it, so the copy of one micro-batch overlaps the
    compute of the next. Backward runs through autograd on the same streams.
    On CPU the streams are placeholders and the results are the same.

    Args:
        module: an ``nn.Sequential``. Without ``balance``/``devices`` each
            child is one stage and must already sit on its device.
        chunks: number of micro-batches (like ``torch.chunk``).
        split_size: micro-batch size (like ``torch.split``); give at most one
            of ``chunks`` and ``split_size``; neither means one micro-batch.
        balance: layers per stage; the module's children are partitioned
            and each partition moved to its entry of ``devices``.
        devices: one device per stage (several stages may share a device).

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``; ``chunks`` or
            ``split_size`` is not an int.
        ValueError: ``chunks``/``split_size`` < 1 or both given; a layer is
            repeated; a stage spans devices; balance/devices do not fit.

    Example::

        model = nn.Sequential(part0.to("cuda:0"), part1.to("cuda:1"))
        pipe = mpstream.Pipe(model, split_size=12)
        loss_fn(pipe(x), y.to("cuda:1")).backward()
    """

    def __init__(
        self,
        module: nn.Module,
        chunks: int | None = None,
        *,
        split_size: int | None = None,
        balance: Sequence[int] | None = None,
        devices: Sequence[DeviceLike] | None = None,
    ) -> None:
        super().__init__()
        if chunks is not None and split_size is not None:
            raise ValueError("give either chunks or split_size, not both")
        self._chunks = None if chunks is None else check_positive("chunks", chunks)
        self._split_size = None if split_size is None else check_positive("split_size", split_size)
        stages = split_module(module, balance, devices)
        for name, layer in stages.layers:
            self.add_module(name, layer)
        # Not registered: the layers above own the parameters, so state_dict
        # keys stay those of the wrapped Sequential whatever the split.
        self.__dict__["_partitions"] = nn.ModuleList(stages.partitions)
        self.__dict__["_devices"] = list(stages.devices)
        self.__dict__["_balance"] = list(stages.balance)
        self.__dict__["_runtime"] = None

    # -- configuration -------------------------------------------------
    @property
    def partitions(self) -> nn.ModuleList:
        """One ``nn.Sequential`` per stage."""
        return self.__dict__["_partitions"]  # type: ignore[no-any-return]

    @property
    def devices(self) -> list[torch.device]:
        """The device of each stage."""
        return list(self.__dict__["_devices"])

    @property
    def balance(self) -> list[int]:
        """Layers per stage."""
        return list(self.__dict__["_balance"])

    @property
    def chunks(self) -> int | None:
        """Number of micro-batches, or None when ``split_size`` is set."""
        return self._chunks

    @chunks.setter
    def chunks(self, value: int | None) -> None:
        self._chunks = None if value is None else check_positive("chunks", value)
        if value is not None:
            self._split_size = None

    @property
    def split_size(self) -> int | None:
        """Micro-batch size, or None when ``chunks`` is set."""
        return self._split_size

    @split_size.setter
    def split_size(self, value: int | None) -> None:
        self._split_size = None if value is None else check_positive("split_size", value)
        if value is not None:
            self._chunks = None

    @property
    def scheduler(self) -> EventScheduler:
        """The event scheduler and stage streams (created on first use)."""
        return self._rt()[0]

    def _rt(self) -> tuple[EventScheduler, Worker, dict[tuple[Any, ...], Schedule]]:
        rt = self.__dict__["_runtime"]
        if rt is None:
            sched = EventScheduler(self.devices)
            rt = (sched, Worker(list(self.partitions), sched), {})
            self.__dict__["_runtime"] = rt
        return rt  # type: ignore[no-any-return]

    def schedule_for(self, micros: int, input_device: torch.device) -> Schedule:
        """The (cached) forward schedule for ``micros`` micro-batches."""
        devs = self.__dict__["_devices"]
        key = ("gpipe", micros, input_device)
        cache = self._rt()[2]
        sched = cache.get(key)
        if sched is None:
            copy_in = [input_device != devs[0]] + [
                devs[s] != devs[s - 1] for s in range(1, len(devs))
            ]
            sched = Schedule("gpipe", len(devs), micros, copy_in)
            cache[key] = sched
        return sched

    # -- running -------------------------------------------------------
    def forward(self, x: Value | list[torch.Tensor]) -> Value:
        """Runs the pipeline on a batch.

        Args:
            x: a Tensor or a tuple/list of Tensors, split along dim 0. It may
                sit on the CPU (pinned or not) or on any device.

        Returns:
            The output on the last stage's device, concatenated along dim 0:
            a Tensor or a tuple of Tensors, as the last stage returns.

        Raises:
            TypeError: a non-tensor input, or a stage returned something other
                than a Tensor or a tuple of Tensors (the stage is named).
            ValueError: an empty batch, or tensors of different batch sizes.
        """
        value = as_value(x)
        micro = scatter(value, self._chunks, self._split_size)
        schedule = self.schedule_for(len(micro), batch_device(value))
        _, worker, _ = self._rt()
        return gather(worker.forward(micro, schedule))

    # -- Sequential-like access -----------------------------------------
    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(m for m in self._modules.values() if m is not None)

    def __getitem__(self, index: int | slice) -> nn.Module:
        layers = [m for m in self._modules.values() if m is not None]
        if isinstance(index, slice):
            return nn.Sequential(*layers[index])
        return layers[index]

    def train(self, mode: bool = True) -> Pipe:
        """Sets training mode on the layers and the partition wrappers."""
        super().train(mode)
        self.partitions.train(mode)
        return self

    # -- placement is fixed ----------------------------------------------
    def cuda(self, device: Any = None) -> Pipe:  # type: ignore[override]
        raise TypeError("Pipe's stages are placed at construction; .cuda() would move them all")

    def cpu(self) -> Pipe:  # type: ignore[override]
        raise TypeError("Pipe's stages are placed at construction; .cpu() would move them all")

    def to(self, *args: Any, **kwargs: Any) -> Pipe:  # type: ignore[override]
        """Converts dtype (``.to(torch.half)``); device moves raise ``TypeError``."""
        device, _, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            raise TypeError(
                "Pipe's stages are placed at construction; .to(device) would move them all "
                "(use .to(dtype) to convert)"
            )
        return super().to(*args, **kwargs)  # type: ignore[no-any-return]

    # -- pickling / deepcopy: streams and the C++ scheduler are rebuilt -----
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_runtime"] = None
        return state

    def extra_repr(self) -> str:
        split = (
            f"split_size={self._split_size}" if self._split_size else f"chunks={self._chunks or 1}"
        )
        devs = ", ".join(str(d) for d in self.__dict__["_devices"])
        return f"{split}, balance={self.__dict__['_balance']}, devices=[{devs}]"
