"""Norm statistics that two stages' forwards would write at once.

Each stage runs on its own stream, so the forwards of two stages (of
different micro-batches) overlap on a device. A norm layer that tracks
running statistics writes buffers in every training-mode forward: its
``running_mean``, ``running_var`` and ``num_batches_tracked``, a
:class:`~mpstream.memory.batchnorm.DeferredBatchNorm` its accumulators, an
exported stage the buffers its graph hands to a batch norm operator. One
reached from two stages (a module a traced forward calls before and after a
split point, or held by a layer of each) would be written from two streams
with nothing ordering the writes: on a GPU they race, and the statistics
come out wrong without an error. :class:`SharedWrites` finds such buffers
once per set of stages and refuses a run that would write them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from torch import Tensor, fx, nn
from torch.nn.modules.batchnorm import _NormBase

from .batchnorm import DeferredBatchNorm
from .checkpoint import graph_writes

__all__ = ["SharedWrites"]


def _writers(stage: nn.Module) -> Iterator[tuple[nn.Module, list[Tensor]]]:
    """The modules of ``stage`` whose training-mode forward writes buffers,
    each with those buffers."""
    for m in stage.modules():
        if isinstance(m, DeferredBatchNorm):
            # Its running statistics are written after the run, on the
            # caller's stream; in the stage only its own accumulators.
            yield m, [m.sum, m.sum_squares, m.count]
        elif isinstance(m, _NormBase):
            # Whatever its track_running_stats now: the flag is read at each
            # run (_writes), as its forward reads it.
            yield m, list(m.buffers(recurse=False))
        elif isinstance(m, fx.GraphModule):
            # A norm operator's statistics only. torch.export writes any
            # other buffer a forward mutates back where the forward ends,
            # often in a later stage; on one device that stage receives the
            # very tensor the earlier one changed in place and copies it
            # onto itself (a counter per call, docs/guide.md).
            yield m, graph_writes(m, statistics=True)


def _writes(module: nn.Module) -> bool:
    """Whether a run now writes the buffers :func:`_writers` gave for
    ``module``: a plain norm's forward reads ``track_running_stats`` at each
    call (set after construction, no walk sees it change)."""
    if not module.training:
        return False  # in eval mode nothing is written
    if isinstance(module, _NormBase) and not isinstance(module, DeferredBatchNorm):
        return module.track_running_stats
    return True


class SharedWrites:
    """The norm statistics that more than one stage writes in training mode.

    Args:
        root: the module that names the layers (the pipe).
        partitions: the stages' modules.
    """

    def __init__(self, root: nn.Module, partitions: Sequence[nn.Module]) -> None:
        found: dict[int, tuple[nn.Module, Tensor, set[int]]] = {}
        for s, part in enumerate(partitions):
            for module, buffers in _writers(part):
                for b in buffers:
                    found.setdefault(id(b), (module, b, set()))[2].add(s)
        modules: dict[int, str] = {}  # the first name of each
        for name, m in root.named_modules(remove_duplicate=False):
            modules.setdefault(id(m), name)
        tensors: dict[int, str] = {}
        for name, b in root.named_buffers(remove_duplicate=False):
            tensors.setdefault(id(b), name)
        # An exported stage's graph writes a norm's buffers as the norm's
        # training flag was when it was exported (the pipe's own flag may
        # differ: pipe.eval(), then the norm alone train()): that flag says.
        norms: dict[int, nn.Module] = {}
        for m in root.modules():
            if isinstance(m, _NormBase):
                for b in m.buffers(recurse=False):
                    norms.setdefault(id(b), m)
        #: Per buffer two stages write: the module whose flag says whether
        #: it is written, how errors name it, and the stages.
        self.shared: list[tuple[nn.Module, str, list[int]]] = []
        named: set[str] = set()
        for module, b, stages in found.values():
            if len(stages) < 2:
                continue
            if isinstance(module, fx.GraphModule):
                label = f"the buffer '{tensors.get(id(b), '?')}'"
                module = norms.get(id(b), module)
            else:
                name = modules.get(id(module), type(module).__name__)
                label = f"the norm layer '{name}' ({type(module).__name__})"
            if label not in named:
                named.add(label)
                self.shared.append((module, label, sorted(stages)))

    def check(self, labels: Callable[[], Sequence[str]]) -> None:
        """Refuses a run in which two stages would write one norm's statistics.

        Args:
            labels: gives each stage's label (called only to refuse).

        Raises:
            ValueError: naming the norm (or an exported stage's buffer) and
                the stages, and what to do.
        """
        for module, label, stages in self.shared:
            if not _writes(module):
                continue
            names = labels()
            which = ", ".join(map(str, stages[:-1])) + f" and {stages[-1]}"
            where = "; ".join(names[s] for s in stages)
            raise ValueError(
                f"{label} is run by stages {which}, whose forwards run "
                f"at once on their own streams ({where}); in training mode each writes its "
                f"running statistics, and writes from two streams at once race (on a GPU the "
                f"statistics come out wrong without an error). Keep its calls in one stage "
                f"(split points that do not fall between them), give each call a norm of its "
                f"own, or run it in eval mode or with track_running_stats=False"
            )
