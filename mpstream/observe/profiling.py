"""``mpstream.profile``: record what every stream of a pipeline did.

Inside ``with mpstream.profile(model) as prof:`` every task of every
:class:`~mpstream.Pipe` in ``model`` is timed: with CUDA events on their
streams on a GPU, with the host clock on the CPU. Scheduled tasks (forward,
copies, and in ``train_step`` backward and gradient copies) are timed by the
C++ scheduler; a backward that autograd runs after ``pipe(x)`` is timed by
marks on the stage's stream. Afterwards ``prof`` is a
:class:`~mpstream.observe.timeline.Timeline`. Stage and copy work also shows up in
``torch.profiler`` as ``record_function`` ranges named
``mpstream/<kind>/stage<s>/mb<m>``.

Device times are measured against one reference event per device, recorded
on the caller's streams when the block starts. The devices are synchronized
first, so each reference marks the same moment on every device to within
the launch skew of the records (microseconds); a copy's start and end are
read on its two devices. Host-clock times (CPU stages) share the block's
start as their zero.

A call that raises inside the block leaves no spans: its run number is
skipped (``prof.runs()`` may read ``[1, 3]``), so summaries average whole
runs only. However the block ends, the pipes stop timing and the profile
stops recording: one whose timings could not be collected (reading them
raised) holds none and says why when read; that error is raised at the
block's end, or added as a note to the body's own error, which stays the
one raised.

Several pipes in one model get their own rows (``pipe<i>/`` before each
stream's name) and stage numbers one after another (pipe 1's stage 0
follows pipe 0's last stage; ``meta["pipe_stages"]`` says which are whose),
so summaries and :func:`~mpstream.observe.fitting.fit` keep them apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from ..pipe import Pipe
from ..runtime import annotate, synchronize
from .timeline import Span, Timeline

__all__ = ["profile", "Profile", "pipes_in"]


def pipes_in(model: nn.Module) -> list[Pipe]:
    """Every Pipe inside ``model``, registered or held as a plain attribute."""
    found: dict[int, Pipe] = {}
    for m in model.modules():
        for candidate in (m, *vars(m).values()):
            if isinstance(candidate, Pipe):
                found.setdefault(id(candidate), candidate)
    return list(found.values())


class Profile(Timeline):
    """The timeline of a ``with mpstream.profile(...)`` block, filled at exit."""

    def __init__(self, pipes: list[Pipe]) -> None:
        super().__init__([], {}, "measured", {"torch": torch.__version__})
        self._pipes = pipes
        self.recording = True
        #: Why the block's end collected no timings (None: it did).
        self.failure: str | None = None

    def check_readable(self) -> None:
        """Raises inside the block: the spans are collected as it ends; and
        after it where collecting them failed.

        Raises:
            RuntimeError: the block has not ended yet, or its timings could
                not be collected.
        """
        if self.recording:
            raise RuntimeError(
                "a profile is filled when its `with mpstream.profile(...)` block ends: read it "
                "(summary, plot, export_chrome_trace, simulate_fit) after the block"
            )
        if self.failure is not None:
            raise RuntimeError(
                f"this profile holds no timings: {self.failure}; run the block again in a new "
                f"`with mpstream.profile(...)`"
            )

    def _finish(self, body: BaseException | None) -> None:
        """At the block's end (``body``: what the block raised, if it did):
        collects the timings, or none if that fails, which is raised, or
        noted on ``body``; the profile stops recording either way and the
        pipes' timings are cleared."""
        try:
            self._collect()
        except BaseException as exc:
            self.spans, self.stream_devices = [], {}
            self.meta = {"torch": torch.__version__}
            self.failure = f"collecting them at the end of the block raised {exc!r}"
            if body is None:
                raise
            annotate(body, f"mpstream.profile: {self.failure} (the profile holds no timings)")
        finally:
            self.recording = False
            # A timeline outlives its block (reports keep it): it must not
            # keep the pipes, their weights and graph memory, alive with it.
            pipes, self._pipes = self._pipes, []
            for pipe in pipes:
                pipe.scheduler.clear_timings()

    def _collect(self) -> None:
        many = len(self._pipes) > 1
        first = 0  # this pipe's first stage number in the timeline
        for i, pipe in enumerate(self._pipes):
            sched = pipe.scheduler
            prefix = f"pipe{i}/" if many else ""
            count = len(pipe.devices)  # one per stage, known before a first-call split
            if many:
                self.meta.setdefault("pipe_stages", []).append([first, first + count])
            times = sched.timings()
            used = {t.stream for t in times}
            for name, device in zip(sched.slot_names, sched.slot_devices):
                # io streams only carry host transfers: a row only if used.
                if not name.startswith("caller@") and (not name.startswith("io@") or name in used):
                    self.stream_devices[prefix + name] = str(device)
            for t in times:
                span = Span(*t._replace(stream=prefix + t.stream))
                self.spans.append(_numbered_from(span, first) if first else span)
            first += count
        self.meta["devices"] = sorted({str(d) for p in self._pipes for d in p.devices})


def _numbered_from(span: Span, first: int) -> Span:
    """``span`` of a pipe whose stages are numbered from ``first``. The
    input's copy (stage -1) keeps -1; its receiving stage is shifted."""
    peer = span.peer if span.peer >= 0 else span.stage + 1
    return replace(span, stage=span.stage + first if span.stage >= 0 else -1, peer=peer + first)


@contextmanager
def profile(model: nn.Module) -> Iterator[Profile]:
    """Times every task of the pipelines in ``model`` while the block runs.

    Args:
        model: a :class:`~mpstream.Pipe`, or any module holding pipes (the
            tutorial's ``StreamPipelineResNet50``, a DDP wrapper).

    Yields:
        A :class:`Profile`, readable after the block: ``summary()``,
        ``export_chrome_trace(path)``, ``plot(path)``.

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: ``model`` contains no Pipe, or a pipe in it is being
            profiled already (blocks do not nest: the inner one would take
            the outer one's timings).

    At the block's end, an error reading the timings (a device error) is
    raised, unless the block raised already: it is then a note on the
    block's error. The profile holds no timings then, and says so when read.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"profile takes a Pipe or a module holding pipes, got {type(model).__name__} "
            f"(several pipes: profile a module holding them, such as nn.ModuleList(pipes))"
        )
    pipes = pipes_in(model)
    if not pipes:
        raise ValueError(f"{type(model).__name__} contains no mpstream.Pipe to profile")
    if any(pipe.scheduler.timing for pipe in pipes):
        raise ValueError(
            "a pipe in this model is being profiled already (an enclosing mpstream.profile "
            "block, or a tool that profiles, such as profile_stages): profile blocks do not "
            "nest; end the outer one first"
        )
    # Idle streams when the references are recorded: see the module docstring.
    synchronize(d for pipe in pipes for d in pipe.devices)
    previous = [pipe.scheduler.timing for pipe in pipes]
    prof = Profile(pipes)
    body: BaseException | None = None
    try:
        for pipe in pipes:
            pipe.scheduler.clear_timings()
            pipe.scheduler.timing = True
        yield prof
    except BaseException as exc:
        body = exc
        raise
    finally:
        # Whatever raised (the body, a pipe's setup, the collection), no
        # pipe is left timing: a later block would refuse it as nested.
        for pipe, was in zip(pipes, previous):
            pipe.scheduler.timing = was
        prof._finish(body)
