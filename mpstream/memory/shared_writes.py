"""Buffers that two stages' forwards would use at once, one writing.

Each stage runs on its own stream, so the forwards of two stages (of
different micro-batches) overlap on a device. A norm layer that tracks
running statistics writes buffers in every training-mode forward: its
``running_mean``, ``running_var`` and ``num_batches_tracked``, a
:class:`~mpstream.memory.batchnorm.DeferredBatchNorm` its accumulators, an
exported stage the buffers its graph hands to a batch norm operator. One
reached from two stages (a module a traced forward calls before and after a
split point, or held by a layer of each) would be written from two streams
with nothing ordering the writes: on a GPU they race, and the statistics
come out wrong without an error. So with any buffer a traced stage's graph
writes (an in-place update, a functional norm in training mode) and another
stage uses (:mod:`~mpstream.stages.buffer_uses` reads both off the graphs):
a read from one stream during a write from another races as well, and which
micro-batch's value it reads depends on timing, where the module reads one.
Only buffers written count: buffers all stages merely read (tied or
constant tensors, a norm in eval mode, frozen statistics) are safe, and
parameters change only between runs. :class:`SharedWrites` finds such
buffers once per set of stages and refuses a run that would write them; a
module the stages run whole, whose forward no graph shows, is watched at
its first call instead (:mod:`~mpstream.memory.buffer_watch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from torch import Tensor, fx, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy

from .batchnorm import DeferredBatchNorm
from .buffer_watch import Owner, Watch

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


def _writes(module: nn.Module | None) -> bool:
    """Whether a run now writes the buffers :func:`_writers` gave for
    ``module``: a plain norm's forward reads ``track_running_stats`` at each
    call (set after construction, no walk sees it change). None: a graph's
    write, which its graph, traced for the mode, always runs."""
    if module is None:
        return True
    if not module.training:
        return False  # in eval mode nothing is written
    if isinstance(module, _NormBase) and not isinstance(module, DeferredBatchNorm):
        return module.track_running_stats
    return True


def _listed(stages: Sequence[int]) -> str:
    """``"0"``, ``"0 and 1"``, ``"0, 1 and 2"``."""
    if len(stages) == 1:
        return str(stages[0])
    return ", ".join(map(str, stages[:-1])) + f" and {stages[-1]}"


def _stages(stages: Sequence[int]) -> str:
    """``"stage 0"``, ``"stages 0 and 1"``."""
    return f"stage{'s' * (len(stages) > 1)} {_listed(stages)}"


class _Shared:
    """One buffer (or norm layer) more than one stage uses, one writing."""

    def __init__(
        self, gate: nn.Module | None, label: str, writers: set[int], users: set[int], layer: bool
    ) -> None:
        #: The module whose flags say whether a run writes (None: always).
        self.gate = gate
        self.label = label
        self.writers = sorted(writers)
        self.users = sorted(users)
        #: Whether found as the layer (run by the stages), not a buffer.
        self.layer = layer

    def message(self, names: Sequence[str]) -> str:
        """The refusal, ``names`` the stages' labels."""
        where = "; ".join(names[s] for s in self.users)
        if isinstance(self.gate, _NormBase):
            what = (
                "Keep its calls in one stage (split points that do not fall between them), "
                "give each call a norm of its own, or run it in eval mode or with "
                "track_running_stats=False"
            )
        else:
            what = (
                "Keep the code that uses it in one stage (split points that do not fall "
                "between its uses), or give each stage a buffer of its own"
            )
        if isinstance(self.gate, _NormBase) and self.layer:
            return (
                f"{self.label} is run by stages {_listed(self.users)}, whose forwards run "
                f"at once on their own streams ({where}); in training mode each writes its "
                f"running statistics, and writes from two streams at once race (on a GPU the "
                f"statistics come out wrong without an error). {what}"
            )
        readers = [s for s in self.users if s not in self.writers]
        how = f"{_stages(self.writers)} {'write' if len(self.writers) > 1 else 'writes'} it"
        if readers:
            how += f" and {_stages(readers)} {'read' if len(readers) > 1 else 'reads'} it"
        return (
            f"{self.label} is used by stages {_listed(self.users)}, whose forwards run at "
            f"once on their own streams ({where}); {how}, and a write from one "
            f"stream while another reads or writes the buffer races (on a GPU its values "
            f"come out wrong without an error; which micro-batch's update a stage sees "
            f"depends on timing). {what}"
        )


class SharedWrites:
    """The buffers that one stage writes and another uses, by module or graph.

    Args:
        root: the module that names the layers and buffers (the pipe).
        partitions: the stages' modules.
        graphs: per stage, the buffers its graphs write and those they read
            (:func:`~mpstream.stages.buffer_uses.buffer_uses`); none given,
            norm layers' statistics alone.
    """

    def __init__(
        self,
        root: nn.Module,
        partitions: Sequence[nn.Module],
        graphs: Sequence[tuple[Sequence[Tensor], Sequence[Tensor]]] = (),
    ) -> None:
        # Per buffer: the module it is found through (None: a graph's),
        # the tensor, the stages writing it and those using it.
        found: dict[int, tuple[nn.Module | None, Tensor, set[int], set[int]]] = {}

        def note(module: nn.Module | None, b: Tensor, s: int, writes: bool) -> None:
            entry = found.setdefault(id(b), (module, b, set(), set()))
            if writes:
                entry[2].add(s)
            entry[3].add(s)

        for s, part in enumerate(partitions):
            for module, buffers in _writers(part):
                for b in buffers:
                    note(module, b, s, True)
        for s, (written, read) in enumerate(graphs):
            for b in written:
                note(None, b, s, True)
            for b in read:
                note(None, b, s, False)
        # The buffers of the modules the stages run whole (no graph shows
        # what their forward does): each module's, and the stages reaching it.
        whole: dict[int, tuple[nn.Module, set[int]]] = {}
        for s, part in enumerate(partitions):
            for m in part.modules():
                if not isinstance(m, (fx.GraphModule, _NormBase)) and m._buffers:
                    whole.setdefault(id(m), (m, set()))[1].add(s)
        modules: dict[int, str] = {}  # the first name of each
        for name, m in root.named_modules(remove_duplicate=False):
            modules.setdefault(id(m), name)
        tensors: dict[int, str] = {}
        for name, b in root.named_buffers(remove_duplicate=False):
            tensors.setdefault(id(b), name)
        # A plain tensor attribute of the model (no buffer) is held by the
        # stages reading it, under the name the model's code spells it.
        plain: set[int] = set()
        for part in partitions:
            for gm in part.modules():
                for attr, target in getattr(gm, "_mpstream_attrs", {}).items():
                    t = getattr(gm, attr, None)
                    if type(t) is Tensor and id(t) not in tensors:  # not a parameter
                        tensors[id(t)] = target
                        plain.add(id(t))
        # A graph writes a norm's buffers as the norm's training flag was
        # when it was traced or exported (the pipe's own flag may differ:
        # pipe.eval(), then the norm alone train()): that flag says.
        norms: dict[int, nn.Module] = {}
        for m in root.modules():
            if isinstance(m, _NormBase):
                for b in m.buffers(recurse=False):
                    norms.setdefault(id(b), m)
        self.shared: list[_Shared] = []
        named: set[str] = set()
        for owner, b, writers, users in found.values():
            if not writers or len(users) < 2:
                continue
            gate = owner
            if owner is None:
                kind = "tensor attribute" if id(b) in plain else "buffer"
                label = f"the {kind} '{tensors.get(id(b), '?')}'"
                gate = norms.get(id(b))
            else:
                name = modules.get(id(owner), type(owner).__name__)
                label = f"the norm layer '{name}' ({type(owner).__name__})"
            if label not in named:
                named.add(label)
                layer = owner is not None
                self.shared.append(_Shared(gate, label, writers, users, layer))
        owners = []
        for m, stages in whole.values():
            # A lazy buffer holds nothing yet to copy (its module sizes it
            # at its first call, as no other stage can race with).
            buffers = [b for b in m.buffers(recurse=False) if not is_lazy(b)]
            # Stages whose graphs use its buffers reach them too.
            reach = stages.union(*(found[id(b)][3] for b in buffers if id(b) in found))
            if len(reach) > 1:
                named_buffers = [(tensors.get(id(b), "?"), b) for b in buffers]
                name = modules.get(id(m), type(m).__name__)
                owners.append(Owner(m, name, named_buffers, sorted(reach)))
        #: The modules run whole by several stages, watched at their first call.
        self.watch = Watch(owners)

    def check(self, labels: Callable[[], Sequence[str]]) -> None:
        """Refuses a run in which one stage would write a buffer another
        uses, found in the stages' modules and graphs; then watches the
        modules run whole by several stages (:class:`~.buffer_watch.Watch`).

        Args:
            labels: gives each stage's label (called only to refuse).

        Raises:
            ValueError: naming the norm layer or buffer and the stages, and
                what to do.
        """
        for shared in self.shared:
            if _writes(shared.gate):
                raise ValueError(shared.message(labels()))
        self.watch.arm(labels)
