"""One stage's graphed calls: what a run's first check drops, when a stage
turns eager, how the calls kept are bounded, and what its report counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mpstream.runtime.graphed import state as state_module
from mpstream.runtime.graphed.state import StageState, storage_bytes


class Call:
    """What :class:`StageState` reads of a graphed call."""

    def __init__(self, busy: bool = False, reads: object = None) -> None:
        self.pending: Any = object() if busy else None
        self.sources = [None] if reads is None else [None, (reads, 0, True)]
        self.passes = {"forward": None, "backward": None}
        self.reserved = 10
        self.label = ""
        # No buffers of its own (state.static_buffers reads these).
        self.static_in: list[torch.Tensor] = []
        self.given: list[torch.Tensor | None] = []
        self.grad_to: list[torch.Tensor | None] = []
        self.pooled_out = True
        self.static_out: list[torch.Tensor] = []
        self.static_grad_out: list[torch.Tensor] = []
        self.static_grad_in: list[torch.Tensor | None] = []

    def busy(self) -> bool:
        return self.pending is not None


def state(module: nn.Module | None = None) -> StageState:
    st = StageState(0, module or nn.Linear(2, 2), torch.device("cpu"), "stage 0 of 1", True)
    st.prepare(2)
    return st


def test_a_replaced_parameter_drops_the_calls_and_their_captures_count_again() -> None:
    layer = nn.Linear(2, 2)
    st = state(layer)
    st.add(("a",), Call())  # type: ignore[arg-type]
    st.prepare(2)
    assert list(st.calls) == [("a",)] and st.captures == 1 and st.recaptures == 0
    layer.weight = nn.Parameter(layer.weight.detach().clone())
    st.prepare(2)
    assert not st.calls and st.store is None
    st.add(("a",), Call())  # type: ignore[arg-type]
    assert (st.captures, st.recaptures) == (2, 1)


def test_a_tensor_hook_turns_the_stage_eager_and_names_the_parameter() -> None:
    layer = nn.Linear(2, 2)
    st = state(layer)
    st.add(("a",), Call())  # type: ignore[arg-type]
    layer.bias.register_hook(lambda g: g)
    st.prepare(2)
    assert st.reason is not None and "'bias'" in st.reason and not st.calls
    assert not st.report().graphed


def test_a_parameter_swapped_in_with_a_hook_already_on_it_turns_the_stage_eager() -> None:
    # Hooks are scanned again once one is registered anywhere, and whenever
    # the parameters change: this hook was registered before the last scan.
    layer = nn.Linear(2, 2)
    st = state(layer)
    hooked = nn.Parameter(torch.randn(2))
    hooked.register_hook(lambda g: g)
    st.prepare(2)
    assert st.reason is None
    layer.bias = hooked
    st.prepare(2)
    assert st.reason is not None and "'bias'" in st.reason


def test_the_training_flags_are_one_number_per_tuple_of_them_never_reused() -> None:
    # A call's key holds one number, not a flag per module (hashed at every
    # call); the number tells every tuple of flags apart, even once the
    # tuples kept are forgotten. (Dropout reads its flag; a Linear's is not
    # part of the key.)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.Dropout()) for _ in range(70)])
    st = state(model)
    numbers = {st.modes: "all train"}
    assert isinstance(st.modes, int)
    for i in range(70):  # more tuples than a stage keeps
        model[i][1].eval()
        st.prepare(2)
        assert st.modes not in numbers
        numbers[st.modes] = f"layer {i} in eval"
        model[i][1].train()
    st.prepare(2)
    assert st.modes not in numbers  # forgotten: a new number, never another's
    again = st.modes
    st.prepare(2)
    assert st.modes == again


def test_a_lazy_module_is_captured_from_the_run_after_its_first() -> None:
    lazy = nn.LazyLinear(2)
    st = state(lazy)
    assert st.lazy and st.baked is None
    lazy(torch.ones(1, 3))
    st.prepare(2)
    assert not st.lazy and st.baked is not None


def test_room_drops_the_least_recently_used_idle_call_then_the_rest_at_the_next_run() -> None:
    st = state()
    for key, busy in (("old",), False), (("busy",), True), (("new",), False):
        st.add(key, Call(busy))  # type: ignore[arg-type]
    st.used.clear()  # a new run: none of them replayed yet
    assert st.room(3) and list(st.calls) == [("busy",), ("new",)] and st.evicted
    st.used.add(("busy",))
    st.used.add(("new",))
    assert not st.room(2)  # both are needed by this run
    st.prepare(2)  # one is still busy: the others stay
    assert len(st.calls) == 2 and st.evicted
    st.calls[("busy",)].pending = None
    st.prepare(3)  # none busy: the evicted stage's graphs all go together
    assert not st.calls and not st.evicted and st.dropped == {("busy",), ("new",)}
    report = st.report()
    assert (report.slots, report.captures, report.graphs) == (3, 3, 0)


def test_calls_reading_a_dropped_call_go_once_idle_and_the_stages_others_with_them() -> None:
    st = state()
    producer = Call()
    st.add(("idle",), Call(reads=producer))  # type: ignore[arg-type]
    st.add(("busy",), Call(busy=True, reads=producer))  # type: ignore[arg-type]
    st.add(("own",), Call())  # type: ignore[arg-type]
    assert not st.drop_stale({producer}) and len(st.calls) == 3  # type: ignore[arg-type]
    assert st.drop_stale(set())  # the producer's call was dropped
    # A pending backward still replays the busy one: it stays, and so do the
    # others, whose graphs go with it.
    assert list(st.calls) == [("busy",), ("own",)] and st.evicted and st.waiting
    st.calls[("busy",)].pending = None
    assert st.drop_stale(set()) and not st.calls and not st.evicted and not st.waiting
    assert st.removed == 3


def test_static_bytes_count_each_storage_once() -> None:
    a, b = torch.zeros(4, dtype=torch.float64), torch.zeros(3, dtype=torch.float32)
    # A view and an alias of ``a`` share its storage: counted once.
    assert storage_bytes([a, a[1:], a.detach(), b, b.view(3, 1)]) == 4 * 8 + 3 * 4
    assert storage_bytes([]) == 0


def test_numbers_of_call_keys_are_bounded_and_never_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Shapes that keep changing (or producers captured again) make new keys
    # at every capture: past the bound, the numbers of keys no kept call
    # holds are forgotten, with which of their calls were dropped.
    monkeypatch.setattr(state_module, "_NUMBERS_KEPT", 4)
    st = state()
    seen = set()
    for i in range(10):
        at = (st.number(("shape", i)), 0)
        assert at[0] not in seen  # a number is never another key's
        seen.add(at[0])
        if i % 3 == 0:
            st.add(at, Call())  # type: ignore[arg-type]
        else:
            st.dropped.add(at)
        # At most the bound, or twice the calls kept (max_calls bounds them).
        assert len(st.numbers) <= max(4, 2 * len(st.calls)) and len(st.dropped) <= 4
    kept = {number for number, _ in st.calls}
    assert kept <= set(st.numbers.values())  # a kept call's key keeps its number
    assert st.number(("shape", 9)) == max(seen)  # the newest key is still known


def test_a_dropped_call_captured_again_after_its_key_was_forgotten_is_a_recapture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(state_module, "_NUMBERS_KEPT", 4)
    layer = nn.Linear(2, 2)
    st = state(layer)
    for generation in (0, 1):  # two calls of one key (two forwards awaiting their backward)
        st.add((st.number(("a",)), generation), Call())  # type: ignore[arg-type]
    layer.weight = nn.Parameter(layer.weight.detach().clone())
    st.prepare(2)  # both dropped
    for i in range(10):  # keys never captured: numbered, forgotten, not kept aside
        st.number(("shape", i))
    assert ("a",) not in st.numbers
    number = st.number(("a",))
    for generation in (0, 2, 1):  # generation 2 was never captured
        st.add((number, generation), Call())  # type: ignore[arg-type]
    assert (st.captures, st.recaptures) == (5, 2)
    assert len(st.numbers) <= 4 and not st.forgotten  # "a" numbered again, none kept aside


def test_keys_kept_aside_after_their_calls_were_dropped_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Shapes that keep changing, each call dropped (a replaced tensor): the
    # keys set aside to count a recapture must not pile up either.
    monkeypatch.setattr(state_module, "_NUMBERS_KEPT", 4)
    layer = nn.Linear(2, 2)
    st = state(layer)
    for i in range(50):
        st.add((st.number(("shape", i)), 0), Call())  # type: ignore[arg-type]
        layer.weight = nn.Parameter(layer.weight.detach().clone())
        st.prepare(2)  # the call dropped
    assert len(st.numbers) <= 4
    assert len(st.forgotten) <= 4
    assert len(st.dropped) <= 4
    st.add((st.number(("shape", 49)), 0), Call())  # type: ignore[arg-type]
    assert (st.captures, st.recaptures) == (51, 1)  # the newest key is still a recapture
