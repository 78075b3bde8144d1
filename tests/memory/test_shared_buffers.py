"""Buffers other than a norm layer's that one stage writes and another uses
(mpstream.memory.shared_writes, mpstream.stages.buffer_uses): a traced
stage's in-place update of a buffer (``self.ema.add_(...)``), a functional
batch norm on a module's own buffers in training mode, a counter an exported
stage hands on to the next. The stages' forwards run at once on their own
streams, so such a run is refused by the buffer's name before anything
changes; buffers only read, and a buffer one stage alone uses, run as the
plain model."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpstream import Pipe
from tests.helpers import assert_same_grads


class _Buffers(nn.Module):
    """Buffers and what ``forward`` does to them (``use``)."""

    def __init__(self, use: Callable[[_Buffers, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.use = use
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("rm", torch.zeros(4))
        self.register_buffer("rv", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.use(self, x)


def _ema(m: _Buffers, x: torch.Tensor) -> torch.Tensor:
    m.ema.add_(x.detach().mean(0))  # fx: a call_method on the buffer's get_attr
    return x


def _item(m: _Buffers, x: torch.Tensor) -> torch.Tensor:
    m.ema[0] = x.detach().mean()  # fx: __setitem__ called on the buffer
    return x


def _count(m: _Buffers, x: torch.Tensor) -> torch.Tensor:
    m.calls.add_(1)
    return x


def _norm(m: _Buffers, x: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, m.rm, m.rv, training=True)


def _frozen(m: _Buffers, x: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, m.rm, m.rv, training=False) + m.ema  # read only


class _Twice(nn.Module):
    """``c`` called before and after the split point ``b``."""

    def __init__(self, use: Callable[[_Buffers, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a, self.c, self.b = nn.Linear(4, 4), _Buffers(use), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.c(self.a(x))))


class _Once(_Twice):
    """``c`` called before the split point only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.c(self.a(x)))


class _WriteThenRead(_Twice):
    """Stage 0 updates ``c.ema``; stage 1 reads it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.c(self.a(x))) + self.c.ema


def _pipe(model: nn.Module, tracer: str, force_copies: bool = False) -> Pipe:
    return Pipe(model, chunks=2, split_points=["b"], devices=["cpu", "cpu"], tracer=tracer,
                sample=torch.randn(4, 4), force_copies=force_copies)  # fmt: skip


def _refused(pipe: Pipe, said: str) -> None:
    before = copy.deepcopy(pipe.state_dict())
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    with pytest.raises(ValueError, match=said):
        pipe.train_step(x, y, nn.MSELoss())
    with pytest.raises(ValueError, match=said):
        pipe(x)
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)  # nothing written
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize(
    ("use", "tracer", "buffer"),
    [
        (_ema, "fx", "ema"),
        (_ema, "export", "ema"),
        (_item, "fx", "ema"),
        (_norm, "fx", "rm"),
        (_norm, "export", "rm"),
        (_count, "export", "calls"),
    ],
)
def test_a_buffer_two_stages_write_is_refused(use: Callable[..., torch.Tensor], tracer: str,
                                              buffer: str) -> None:  # fmt: skip
    torch.manual_seed(0)
    said = rf"the buffer 'c\.{buffer}' is used by stages 0 and 1, .* stages 0 and 1 write it"
    _refused(_pipe(_Twice(use), tracer), said)


def test_an_exported_counter_handed_on_is_refused_with_forced_copies() -> None:
    # Stage 0 passes the counter it updated on to stage 1, which adds to
    # what it receives: the very buffer on one device (a race), with
    # force_copies=True a copy, and the second update per micro-batch was
    # lost (calls 2 after 2 micro-batches, where the module counts 4).
    torch.manual_seed(0)
    said = r"the buffer 'c\.calls' is used by stages 0 and 1, .* stages 0 and 1 write it"
    _refused(_pipe(_Twice(_count), "export", force_copies=True), said)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_buffer_one_stage_writes_and_another_reads_is_refused(tracer: str) -> None:
    torch.manual_seed(0)
    said = r"'c\.ema' is used by stages 0 and 1, .* stage 0 writes it and stage 1 reads it"
    _refused(_pipe(_WriteThenRead(_ema), tracer), said)


class _PlainAttribute(nn.Module):
    """A count kept in a plain tensor attribute (no buffer): torch.export
    lifts it, stage 0 updates it and stage 1 reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.calls = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.b(self.a(x)) + self.calls


def test_a_plain_tensor_attribute_is_named_as_the_code_spells_it() -> None:
    # It was "the buffer '?'": the pipe holds no buffer of that name.
    pipe = Pipe(_PlainAttribute(), chunks=2, split_points=["b"], devices=["cpu", "cpu"],
                tracer="export", sample=torch.randn(4, 4))  # fmt: skip
    _refused(pipe, r"the tensor attribute 'calls' is used by stages 0 and 1, .* stage 0 writes it")


def _plain_on_micro_batches(plain: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of ``plain`` run on each half of the batch in turn, as the
    pipe's two micro-batches, back-propagated."""
    out = torch.cat([plain(x[:4]), plain(x[4:])])
    loss = nn.MSELoss()(out, y)
    loss.backward()
    return loss


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize(
    ("model", "use"),
    [(_Once, _ema), (_Once, _count), (_Once, _norm), (_Twice, _frozen)],
)
def test_a_buffer_one_stage_writes_or_all_read_trains_as_the_plain_model(
    tracer: str, model: type[_Twice], use: Callable[..., torch.Tensor]
) -> None:
    # Written by one stage alone, or only read by both (a norm's frozen
    # statistics, a constant): nothing races, the pipe runs.
    if tracer == "fx" and use is _count:
        pytest.skip("fx runs self.calls.add_(1) while tracing: refused at construction")
    torch.manual_seed(0)
    plain = model(use)
    plain.c.ema.fill_(0.5)
    pipe = _pipe(copy.deepcopy(plain), tracer)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, _plain_on_micro_batches(plain, x, y))
    assert_same_grads(pipe, plain)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name)


def test_a_counter_two_stages_update_runs_in_one_stage() -> None:
    # As the error says: split points that keep the uses in one stage.
    torch.manual_seed(0)
    plain = _Twice(_count)
    pipe = Pipe(copy.deepcopy(plain), chunks=2, split_points=["c"], devices=["cpu", "cpu"],
                tracer="export", sample=torch.randn(4, 4))  # fmt: skip
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, _plain_on_micro_batches(plain, x, y))
    assert int(pipe.c.calls) == int(plain.c.calls) == 4


class _Counting(nn.Module):
    """Counts its calls itself: torch.export writes the count back where
    the forward ends (stage 1), from the update stage 0 makes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.b(self.a(x))


@pytest.mark.parametrize("force_copies", [False, True])
def test_an_exported_counter_written_back_counts_as_the_plain_model(force_copies: bool) -> None:
    # The write-back ran in stage 1, from its own stream, while stage 0
    # updated the count for the next micro-batch; with copies between the
    # stages it wrote back the copy it received (a count of 2 after 4
    # micro-batches). It now runs in stage 0, where the count is made.
    torch.manual_seed(0)
    plain = _Counting()
    pipe = Pipe(copy.deepcopy(plain), chunks=4, split_points=["b"], devices=["cpu", "cpu"],
                tracer="export", sample=torch.randn(4, 4), force_copies=force_copies)  # fmt: skip
    for part in pipe.partitions[1:]:
        assert "copy_" not in str(part.graph)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss = pipe.train_step(x, y, nn.MSELoss())
    out = torch.cat([plain(part) for part in x.chunk(4)])
    expected = nn.MSELoss()(out, y)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert_same_grads(pipe, plain)
    assert int(pipe.calls) == int(plain.calls) == 4


class _LastSeen(nn.Module):
    """Adds what it kept at the last call (read after the split point) and
    keeps a value made before it: torch.export writes it back where the
    forward ends, in stage 1, the one stage using the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        kept = h.detach().mean(0)
        out = self.b(h) + self.seen
        self.seen = kept
        return out


@pytest.mark.parametrize("force_copies", [False, True])
def test_an_exported_write_back_stays_in_the_stage_reading_the_buffer(force_copies: bool) -> None:
    # Moved to stage 0, where its value is made, the write-back made stage 0
    # write a buffer stage 1 reads: the run was refused (it ran as the plain
    # model before the move, stage 1 alone using the buffer).
    torch.manual_seed(0)
    plain = _LastSeen()
    pipe = Pipe(copy.deepcopy(plain), chunks=2, split_points=["b"], devices=["cpu", "cpu"],
                tracer="export", sample=torch.randn(4, 4), force_copies=force_copies)  # fmt: skip
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss = pipe.train_step(x, y, nn.MSELoss())
    out = torch.cat([plain(part) for part in x.chunk(2)])
    expected = nn.MSELoss()(out, y)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert_same_grads(pipe, plain)
    torch.testing.assert_close(pipe.seen, plain.seen)


class _LastSeenOfThree(_LastSeen):
    """``_LastSeen`` with a stage after the one reading the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(super().forward(x))


def test_an_exported_write_back_runs_in_the_last_stage_reading_the_buffer() -> None:
    # At the forward's end (stage 2) it wrote the buffer stage 1 reads: a
    # race, refused; in stage 0 as well. In stage 1 it runs as the plain model.
    torch.manual_seed(0)
    plain = _LastSeenOfThree()
    pipe = Pipe(copy.deepcopy(plain), chunks=2, split_points=["b", "c"], devices=["cpu"] * 3,
                tracer="export", sample=torch.randn(4, 4))  # fmt: skip
    x = torch.randn(8, 4)
    torch.testing.assert_close(pipe(x), torch.cat([plain(part) for part in x.chunk(2)]))
    torch.testing.assert_close(pipe.seen, plain.seen)
