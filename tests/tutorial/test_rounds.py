"""Round-robin timing in groups that fit in device memory (``tutorial.rounds``).

Device memory is faked: each configuration takes some units of a budget, and
a call raises the out-of-memory error CUDA would when what is held exceeds it.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from mpstream.tutorial import bench, design, graphed, rounds


class _Model:
    def __init__(self, key: str, size: int, live: dict[str, int]) -> None:
        self.key, self.size, self.live = key, size, live
        live[key] = size

    def __del__(self) -> None:
        self.live.pop(self.key, None)


def _fake(sizes: dict[str, int], budget: int) -> tuple[Any, Any, list[str]]:
    live: dict[str, int] = {}
    calls: list[str] = []

    def build(key: str) -> _Model:
        return _Model(key, sizes[key], live)

    def call(model: _Model) -> float:
        calls.append(model.key)
        if sum(live.values()) > budget:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {model.size}")
        return float(len(calls))

    return build, call, calls


def test_everything_that_fits_is_one_group_timed_round_robin() -> None:
    build, call, calls = _fake({"a": 1, "b": 1, "c": 1}, budget=3)
    timed = rounds.round_robin(["a", "b", "c"], build, call, warmup=1, repeat=3)
    assert timed.groups == 1 and set(timed.group.values()) == {0}
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {k: len(v) for k, v in timed.times.items()} == {"a": 3, "b": 3, "c": 3}


def test_a_configuration_that_runs_out_of_memory_starts_a_new_group() -> None:
    build, call, calls = _fake({"a": 2, "b": 2, "c": 2, "d": 1}, budget=4)
    timed = rounds.round_robin(["a", "b", "c", "d"], build, call, warmup=1, repeat=2)
    # a, b fit; c fails beside them, is dropped, a and b are timed and freed;
    # c and d then fit together.
    assert timed.group == {"a": 0, "b": 0, "c": 1, "d": 1}
    assert timed.groups == 2
    assert {k: len(v) for k, v in timed.times.items()} == {"a": 2, "b": 2, "c": 2, "d": 2}
    assert calls == ["a", "b", "c", "a", "b", "b", "a", "c", "d", "c", "d", "d", "c"]


def test_what_a_group_held_is_freed_before_the_next_one() -> None:
    build, call, _ = _fake({"a": 2, "b": 2, "c": 2}, budget=2)
    built: list[weakref.ref[_Model]] = []

    def tracked(key: str) -> _Model:
        model = build(key)
        built.append(weakref.ref(model))
        return model

    timed = rounds.round_robin(["a", "b", "c"], tracked, call, warmup=1, repeat=1)
    assert timed.group == {"a": 0, "b": 1, "c": 2}
    gc.collect()
    assert all(ref() is None for ref in built)


def test_a_configuration_too_big_alone_is_a_clear_error() -> None:
    build, call, _ = _fake({"a": 1, "huge": 9}, budget=4)
    with pytest.raises(
        torch.cuda.OutOfMemoryError,
        match=r"^'huge' does not fit in device memory even alone \(CUDA out of memory\. Tried",
    ) as raised:
        rounds.round_robin(["a", "huge"], build, call, warmup=1, repeat=1, label=repr)
    assert isinstance(raised.value.__cause__, torch.cuda.OutOfMemoryError)  # the original


def test_skip_unfit_leaves_a_configuration_too_big_alone_out_and_says_so() -> None:
    build, call, _ = _fake({"a": 1, "huge": 9, "b": 1}, budget=4)
    ticks: list[int] = []
    timed = rounds.round_robin(
        ["a", "huge", "b"], build, call, warmup=1, repeat=2, tick=lambda: ticks.append(1),
        skip_unfit=True,
    )  # fmt: skip
    assert set(timed.times) == {"a", "b"} and timed.group == {"a": 0, "b": 1}
    assert list(timed.unfit) == ["huge"]
    assert timed.unfit["huge"].startswith("does not fit in device memory even alone (CUDA out")
    assert len(ticks) == 3 * 3  # the bar ends full: the calls 'huge' will not make count
    last = rounds.round_robin(["a", "huge"], build, call, warmup=1, repeat=1, skip_unfit=True)
    assert set(last.times) == {"a"} and list(last.unfit) == ["huge"]  # nothing after it
    alone = rounds.round_robin(["huge"], build, call, warmup=1, repeat=1, skip_unfit=True)
    assert not alone.times and list(alone.unfit) == ["huge"]


def test_skip_unfit_leaves_a_configuration_that_raises_out_and_says_why() -> None:
    # One configuration that cannot run (a library version it was not
    # tried with) must not cost the others' times.
    build, call, _ = _fake({"a": 1, "broken": 1, "b": 1}, budget=9)

    def breaks(key: str) -> _Model:
        if key == "broken":
            raise TypeError("an argument this version lacks")
        return build(key)

    timed = rounds.round_robin(
        ["a", "broken", "b"], breaks, call, warmup=1, repeat=2, skip_unfit=True
    )
    assert set(timed.times) == {"a", "b"} and timed.group == {"a": 0, "b": 0}
    assert timed.unfit == {"broken": "failed: TypeError: an argument this version lacks"}
    with pytest.raises(TypeError, match="this version lacks"):  # without skip_unfit: at once
        rounds.round_robin(["a", "broken"], breaks, call, warmup=1, repeat=1)


def test_progress_counts_each_call_once_when_a_configuration_is_retried() -> None:
    build, call, _ = _fake({"a": 1, "b": 1}, budget=9)
    refused = {"b"}

    def check(key: str, model: _Model) -> None:
        if key in refused:
            refused.clear()
            raise rounds.NoRoom("no room")

    ticks: list[int] = []
    rounds.round_robin(
        ["a", "b"], build, call, warmup=2, repeat=3, check=check, tick=lambda: ticks.append(1)
    )
    assert len(ticks) == 2 * (2 + 3)  # what calls() promises: warm-ups and rounds


def test_a_cuda_error_that_says_out_of_memory_starts_a_new_group_too() -> None:
    live: dict[str, int] = {}

    def build(key: str) -> _Model:
        return _Model(key, 1, live)

    def call(model: _Model) -> float:
        if len(live) > 1:  # a graph's instantiation failing, as CUDA words it
            raise RuntimeError("CUDA error: out of memory")
        return 1.0

    timed = rounds.round_robin(["a", "b"], build, call, warmup=1, repeat=1)
    assert timed.group == {"a": 0, "b": 1}
    # A library's handle whose workspace found no room says it its own way.
    for said in ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                 "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"):  # fmt: skip
        assert rounds.says_out_of_memory(said)
    assert not rounds.says_out_of_memory("CUDA error: operation not permitted when capturing")


def test_a_capture_that_fell_back_while_timing_is_an_error() -> None:
    build, call, _ = _fake({"a": 1}, budget=9)
    checked: list[str] = []

    def check(key: str, model: _Model) -> None:
        checked.append(key)
        if len(checked) > 1:  # no warm-up: the capture ran in the timed rounds
            raise rounds.NoRoom("stage 0 runs eagerly (capture failed: out of memory)")

    with pytest.raises(RuntimeError, match="during the timed rounds, so its times are not"):
        rounds.round_robin(["a"], build, call, warmup=0, repeat=2, check=check)
    with pytest.raises(ValueError, match="repeat must be at least 1, got 0"):
        rounds.round_robin(["a"], build, call, warmup=0, repeat=0)


def test_a_check_can_say_there_was_no_room() -> None:
    build, call, _ = _fake({"a": 1, "b": 1}, budget=9)
    refused = {"b"}

    def check(key: str, model: _Model) -> None:
        if key in refused:
            refused.clear()  # fits on its own, in the next group
            raise rounds.NoRoom("stage 0 runs eagerly (capture failed: OutOfMemoryError: ...)")

    timed = rounds.round_robin(["a", "b"], build, call, warmup=1, repeat=1, check=check)
    assert timed.group == {"a": 0, "b": 1}


def test_other_errors_are_not_taken_for_memory() -> None:
    def build(key: str) -> object:
        raise ValueError("unknown model")

    with pytest.raises(ValueError, match="unknown model"):
        rounds.round_robin(["a"], build, lambda m: 0.0, warmup=1, repeat=1)


def test_bench_names_each_measurements_group(monkeypatch: pytest.MonkeyPatch) -> None:
    config = bench.Config(repeat=1, warmup=1, split_size=2, split_sizes=(2, 4))
    live: set[int] = set()

    class Fake(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name
            live.add(id(self))

        def __del__(self) -> None:
            live.discard(id(self))

    def train_once(model: Fake, config: bench.Config, devices: Any) -> float:
        if len(live) > 3:  # three models fit in this fake device
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return 1.0

    monkeypatch.setattr(bench, "make_model", lambda name, *args: Fake(name))
    monkeypatch.setattr(bench, "train_once", train_once)
    cpu = torch.device("cpu")
    results = bench.run(config, cpu, cpu)
    groups = {(m.model, m.split_size): m.group for m in results.models + results.sweep}
    assert groups == {
        ("single device", None): 0,
        ("model parallel", None): 0,
        ("tutorial pipeline", 2): 0,
        ("mpstream", 2): 1,
        ("tutorial pipeline", 4): 1,
        ("mpstream", 4): 1,
    }
    assert all(len(m.times) == 1 for m in results.models + results.sweep)
    assert "timed in " in bench.table(results) and "groups" in bench.table(results)
    assert results.get("mpstream", 2).to_json()["group"] == groups[("mpstream", 2)]
    assert "group" not in design.Measurement("IDRIS loop", 8, [1.0]).to_json()  # not run's


def _with_stages(*reasons: str | None) -> nn.Module:
    from mpstream.runtime.graphed import GraphReport, StageReport

    report = GraphReport(
        [StageReport(i, torch.device("cpu"), r is None, r) for i, r in enumerate(reasons)]
    )
    model = nn.Module()
    model.__dict__["pipe"] = type("P", (), {"graph_report": lambda self: report})()
    return model


def test_graphed_stages_that_fell_back_are_no_graphed_time() -> None:
    label = "mpstream, graphed stages (split 8)"
    graphed.check_stages(label, _with_stages(None, None))
    oom = "capture failed: OutOfMemoryError: CUDA out of memory"
    with pytest.raises(rounds.NoRoom, match=r"^stage 1 runs eagerly \(capture failed"):
        graphed.check_stages(label, _with_stages(None, oom))
    with pytest.raises(RuntimeError, match="would not be a graphed step's"):
        graphed.check_stages(label, _with_stages("capture failed: ValueError: dropout", None))
    graphed.check_stages("single device", nn.Linear(2, 2))  # no pipe: nothing to check


def test_spread_of_steady_and_noisy_rounds() -> None:
    steady = rounds.spread([1.0, 1.1, 0.9, 1.0])
    assert not steady.noisy and steady.low == 0.9 and steady.high == 1.1
    assert steady.q1 >= steady.low and steady.q3 <= steady.high
    assert rounds.spread([2.0]) == rounds.Spread(0.0, 1.0, 2.0, 2.0, 2.0, 2.0)
    # The case: one round of 15.3 s among 0.6 s ones.
    assert rounds.noisy([0.58, 15.3, 0.61])
    # Either limit alone makes a measurement noisy.
    wide = rounds.spread([1.0] * 19 + [1.55])
    assert wide.cv < rounds.MAX_CV and wide.max_over_min > rounds.MAX_RANGE and wide.noisy
    varied = rounds.spread([0.8, 1.2, 0.8, 1.2])
    assert varied.cv > rounds.MAX_CV and varied.max_over_min <= rounds.MAX_RANGE and varied.noisy
    with pytest.raises(ValueError, match="no rounds"):
        rounds.spread([])


def test_machine_load_and_its_line(monkeypatch: pytest.MonkeyPatch) -> None:
    load = rounds.machine_load()
    assert int(load["cpus"] or 0) >= 1
    quiet = {"before": {"load_1min": 0.5, "cpus": 4}, "after": {"load_1min": 1.0, "cpus": 4}}
    assert rounds.load_line(quiet) == (
        "machine load (1-minute average): 0.50 before, 1.00 after, on 4 CPUs"
    )
    busy = {**quiet, "after": {"load_1min": 6.0, "cpus": 4}}
    assert rounds.load_line(busy).endswith(
        "busier than its CPUs: other work competed with the timing"
    )
    monkeypatch.delattr("os.getloadavg")  # where the system does not say (Windows)
    assert rounds.machine_load()["load_1min"] is None
    assert rounds.load_line({"before": rounds.machine_load()}) == ""


def test_an_interrupt_keeps_what_was_timed_and_frees_the_models() -> None:
    # a, b fit; c and d make a second group, interrupted in its first round.
    build, call, calls = _fake({"a": 2, "b": 2, "c": 2, "d": 1}, budget=4)

    def stopped(model: _Model) -> float:
        if len(calls) == 11:  # a b c(no room) | a b twice | c d warm-up | c d | stop
            raise KeyboardInterrupt
        return call(model)

    with pytest.raises(KeyboardInterrupt):  # by default it propagates
        rounds.round_robin(["a", "b", "c", "d"], build, stopped, warmup=1, repeat=2)
    calls.clear()
    models: list[weakref.ref[_Model]] = []

    def kept(key: str) -> _Model:
        model = build(key)
        models.append(weakref.ref(model))
        return model

    timed = rounds.round_robin(
        ["a", "b", "c", "d"], kept, stopped, warmup=1, repeat=2, interruptible=True
    )
    assert timed.interrupted
    assert {k: len(v) for k, v in timed.times.items()} == {"a": 2, "b": 2, "c": 1, "d": 1}
    assert all(timed.times.values())  # the interrupted call left no empty entry
    assert timed.group == {"a": 0, "b": 0, "c": 1, "d": 1}  # the group it stopped in
    assert all(ref() is None for ref in models)  # the held models were let go
    build, call, calls = _fake({"a": 1}, budget=1)
    assert not rounds.round_robin(["a"], build, call, warmup=1, repeat=1).interrupted


def _interrupt_as_import_error() -> None:
    """As Python 3.11 and transformers' lazy import turn an interrupt
    during an import: a RuntimeError (a class's ``__set_name__``), then a
    ModuleNotFoundError from it."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise RuntimeError("Error calling __set_name__") from interrupt
    except RuntimeError as error:
        raise ModuleNotFoundError("Could not import module 'LlamaForCausalLM'") from error


def _interrupt_as_export_error() -> None:
    """As torch.export unwinding an interrupt: an AssertionError raised while
    handling it, which mpstream's export turns into a TypeError."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise AssertionError("Trying to pop empty mode stack")  # noqa: B904
    except AssertionError as error:
        raise TypeError("torch.export could not export") from error


@pytest.mark.parametrize("interrupt", [_interrupt_as_import_error, _interrupt_as_export_error])
def test_an_interrupt_a_library_turned_into_another_error_is_an_interrupt(
    interrupt: Any,
) -> None:
    # Ctrl-C or SIGTERM while c is built again for the second group (the
    # transformer bench's Hugging Face configuration: its import and export
    # take seconds): what the first group timed still comes back.
    build, call, _ = _fake({"a": 2, "b": 2, "c": 2}, budget=4)
    built: list[str] = []

    def interrupted(key: str) -> _Model:
        built.append(key)
        if built.count("c") == 2:
            interrupt()
        model: _Model = build(key)
        return model

    with pytest.raises((ModuleNotFoundError, TypeError)):  # by default it propagates
        rounds.round_robin(["a", "b", "c"], interrupted, call, warmup=1, repeat=2)
    built.clear()
    timed = rounds.round_robin(
        ["a", "b", "c"], interrupted, call, warmup=1, repeat=2, interruptible=True
    )
    assert timed.interrupted
    assert {k: len(v) for k, v in timed.times.items()} == {"a": 2, "b": 2}

    def broken(key: str) -> _Model:
        raise TypeError("no interrupt behind it")

    with pytest.raises(TypeError, match="no interrupt behind it"):  # an error still
        rounds.round_robin(["a"], broken, call, warmup=1, repeat=1, interruptible=True)
