"""``isinstance`` and ``type`` on an argument of a module split by torch.fx
(``batch.pop("s", None) if isinstance(batch, dict) else None``) are answered
from the call, as the plain module answers it, and the argument's type is
part of the call's kind: a dict, a tuple, a tensor and None each run their
own branch. fx alone traces every argument as a proxy, which is no dict,
tuple or tensor: every call ran the last branch, with no error."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, fx, nn

from mpstream import NoChunk, Pipe
from mpstream.stages.fx_tracer import Tracer
from mpstream.stages.type_tests import answering_types
from tests.helpers import assert_same_grads
from tests.stages.test_traced import fx_split


class ReadsByType(nn.Module):
    """Reads its batch by its type, as Hugging Face code often does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, batch: Any, mask: Tensor | None = None) -> Tensor:
        assert isinstance(type(self), type) and isinstance(ReadsByType, type)  # still classes
        assert type[int] is not None
        s = batch.pop("s", None) if isinstance(batch, dict) else None
        if isinstance(s, tuple):  # a value popped from the argument
            s = s[0]
        elif isinstance(s, torch.Tensor):
            s = s * 2
        if isinstance(batch, (tuple, list)):
            x = batch[0] * batch[1]
            if type(batch) is list:  # type() too
                x = -x
        elif isinstance(batch, torch.Tensor):
            x = batch
        else:
            x = batch["x"]
            if isinstance(batch.get("w"), torch.Tensor):  # an item of the argument
                x = x * batch["w"]
        h = self.a(x)
        if s is not None:
            h = h + s
        if isinstance(mask, torch.Tensor):
            h = h * mask
        return self.c(self.b(h))  # type: ignore[no-any-return]


def _calls(x: Tensor) -> dict[str, Callable[[], tuple[Any, ...]]]:
    """Each kind of call, made anew (``pop`` changes the caller's dict)."""
    s, w, m = x * 3, x + 1, (x > 0).double()
    return {
        "dict with s": lambda: ({"x": x, "s": s},),
        "dict": lambda: ({"x": x},),
        "dict with s in a tuple": lambda: ({"x": x, "s": (s,)},),
        "dict with w and a mask": lambda: ({"x": x, "w": w}, m),
        "tensor": lambda: (x,),
        "tensor and a whole mask": lambda: (x, NoChunk(m[0])),  # a tensor in each micro-batch
        "tuple": lambda: ((x, w),),
        "list and a mask": lambda: ([x, w], m),
        "dict with s and a mask": lambda: ({"x": x, "s": s}, m),
    }


def _unwrapped(call: tuple[Any, ...]) -> tuple[Any, ...]:
    """The call as the plain module takes it."""
    return tuple(a.tensor if isinstance(a, NoChunk) else a for a in call)


@pytest.mark.parametrize("split_size", [2, 3])
@pytest.mark.parametrize("force_copies", [False, True])
@pytest.mark.parametrize("first", ["dict with s", "tensor"])
def test_isinstance_on_an_argument_is_answered_as_the_plain_model_does(
    split_size: int, force_copies: bool, first: str
) -> None:
    # Every kind ran the last branch: a call holding "s" ran without it (and
    # without "w", and the mask), a wrong result without a word; a tensor
    # or tuple was indexed by "x".
    torch.manual_seed(0)
    model = ReadsByType().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    calls = _calls(x)
    pipe = Pipe(copy.deepcopy(model), split_points=["b", "c"], devices=["cpu"] * 3,
                split_size=split_size, tracer="fx", force_copies=force_copies,
                sample=calls[first]())  # fmt: skip
    for name, call in [*calls.items(), (first, calls[first])]:
        pipe.zero_grad()
        model.zero_grad()
        out, expected = pipe(*call()), model(*_unwrapped(call()))
        torch.testing.assert_close(out, expected, msg=name)
        out.square().sum().backward()
        expected.square().sum().backward()
        assert_same_grads(pipe, model)
    # One trace per kind: each runs other code.
    assert len(fx_split(pipe).traces) == 9
    described = "\n".join(pipe.split_report().traces)
    for kind in ("type(batch) is dict", "type(batch) is torch.Tensor", "type(batch) is tuple",
                 "type(batch) is list", "type(mask) is torch.Tensor"):  # fmt: skip
        assert kind in described


def test_isinstance_on_an_argument_without_a_call_to_answer_it_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"tests the type of batch \(isinstance\).*sample="):
        Pipe(ReadsByType(), split_points=["b"], devices=["cpu"] * 2, tracer="fx")
    # The default tracer lets torch.export split it, which runs the test.
    pipe = Pipe(ReadsByType(), split_points=["b"], devices=["cpu"] * 2, chunks=2)
    assert pipe.split_report().tracer == "torch.export"


class ReadsAnAttribute(nn.Module):
    """Tests the type of what the call holds at no item it has."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        x = batch["x"]
        if isinstance(batch["x"].mT, torch.Tensor):
            x = x * 2
        return self.b(self.a(x))  # type: ignore[no-any-return]


def test_isinstance_where_the_call_holds_no_value_is_refused_naming_it() -> None:
    x = torch.randn(4, 4)
    with pytest.raises(TypeError, match=r"type of batch\['x'\]\.mT \(isinstance\)"):
        Pipe(ReadsAnAttribute(), split_points=["b"], devices=["cpu"] * 2, tracer="fx",
             sample=({"x": x},))  # fmt: skip


def test_isinstance_in_the_module_is_the_builtin_again_after_tracing() -> None:
    x = torch.randn(4, 4)
    Pipe(ReadsByType(), split_points=["b"], devices=["cpu"] * 2, tracer="fx", sample=(x,))
    assert "isinstance" not in globals() and "type" not in globals()


def equal_in_two_stages(model: nn.Module) -> Tensor:
    """Checks a pipe of ``model`` split before ``b``, traced by torch.fx,
    against the plain model, forward and gradients; returns the input."""
    torch.manual_seed(0)
    model.double()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, split_size=4,
                tracer="fx", sample=(x,))  # fmt: skip
    out, expected = pipe(x), model(x)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(pipe, model)
    return x


class MakesClasses(nn.Module):
    """Uses ``type`` as the class it is, not to test an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        made = type.__new__(type, "Made", (), {"scale": 2.0})
        assert type.mro(made) == [made, object]

        class Meta(type):
            pass

        tagged = Meta("Tagged", (), {})
        assert isinstance(tagged, Meta) and issubclass(Meta, type) and not isinstance(x, Meta)
        return self.b(self.a(x) * made.scale)  # type: ignore[attr-defined, no-any-return]


def test_type_as_a_class_in_a_traced_forward_is_the_builtin_type() -> None:
    # type.__new__ and type.mro(made) raised TypeError while tracing (the
    # stand-in for type was no subclass of it), and a class derived from the
    # stand-in made plain classes.
    equal_in_two_stages(MakesClasses())


class Gated(ReadsByType):
    """Calls ``gate`` while it is traced (the tests' own thread rendezvous)."""

    def __init__(self, gate: Callable[[], object]) -> None:
        super().__init__()
        self.gate: Callable[[], object] | None = gate

    def forward(self, batch: Any, mask: Tensor | None = None) -> Tensor:
        if self.gate is not None:
            self.gate()
        return super().forward(batch, mask)


def test_two_threads_tracing_at_once_leave_the_builtins_and_split_as_the_plain_model() -> None:
    # The second trace saved the first's isinstance as what to put back, and
    # put it back after the first had restored the builtin: the module's
    # globals kept the first trace's isinstance and type for good.
    torch.manual_seed(0)
    model = ReadsByType().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    first_in, second_in, first_done = threading.Event(), threading.Event(), threading.Event()
    built: dict[str, Pipe] = {}
    errors: list[BaseException] = []

    def build(name: str, gate: Callable[[], object]) -> None:
        try:
            gated = Gated(gate).double()
            gated.load_state_dict(model.state_dict())
            built[name] = Pipe(gated, split_points=["b", "c"], devices=["cpu"] * 3, split_size=4,
                               tracer="fx", sample=({"x": x, "s": x},))  # fmt: skip
        except BaseException as exc:  # noqa: BLE001  (reported by the test's thread)
            errors.append(exc)
        finally:
            if name == "first":
                first_done.set()

    # The first trace waits (a while) for the second to start tracing, which
    # then outlasts it: taking turns, the second starts after the first ends.
    def first_gate() -> None:
        first_in.set()
        second_in.wait(1)

    def second_gate() -> None:
        second_in.set()
        first_done.wait(5)

    first = threading.Thread(target=build, args=("first", first_gate))
    second = threading.Thread(target=build, args=("second", second_gate))
    first.start()
    first_in.wait(5)
    second.start()
    first.join()
    second.join()
    assert not errors, errors
    assert "isinstance" not in globals() and "type" not in globals()
    for pipe in built.values():
        for call in _calls(x).values():
            pipe.zero_grad()
            model.zero_grad()
            out, expected = pipe(*call()), model(*_unwrapped(call()))
            torch.testing.assert_close(out, expected)
            out.square().sum().backward()
            expected.square().sum().backward()
            assert_same_grads(pipe, model)


class KeepsAView(nn.Module):
    """Keeps a view of its input on itself, its layers in a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        # torch's nn.Module code (its __setattr__ here) keeps the builtins.
        assert "isinstance" not in vars(torch.nn.modules.module)
        self.seen = batch["x"].mT
        x = batch["x"]
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_module_list_leaves_torchs_module_code_as_it_is() -> None:
    # The ModuleList's forward is nn.Module's, so torch's module.py got the
    # trace's isinstance: Module.__setattr__ tested batch["x"].mT and the
    # trace was refused ("forward tests the type of batch['x'].mT").
    torch.manual_seed(0)
    model = KeepsAView().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["layers.1", "layers.2"], devices=["cpu"] * 3,
                split_size=4, tracer="fx", sample=({"x": x},))  # fmt: skip
    out, expected = pipe({"x": x}), model({"x": x})
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(pipe, model)


# A forward in a module with globals of its own named isinstance and type.
_OWN: dict[str, Any] = {"isinstance": lambda obj, classes: "own", "type": 3.0}
_SOURCE = (
    "def forward(self, x):\n"
    "    scale = type if isinstance(x, int) == 'own' else 1.0\n"
    "    return self.b(self.a(x) * scale)\n"
)
exec(_SOURCE, _OWN)


class OwnNames(nn.Module):
    """Its forward's module holds an ``isinstance`` and a ``type`` of its own."""

    forward = _OWN["forward"]

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


def test_a_module_s_own_isinstance_and_type_are_what_its_traced_forward_calls() -> None:
    # The trace put its own isinstance and type over the module's: the code
    # scaled by 1.0 where the plain model scales by 3.0, without a word.
    x = equal_in_two_stages(OwnNames())
    assert _OWN["type"] == 3.0 and _OWN["isinstance"](x, int) == "own"


def test_a_trace_inside_a_trace_answers_from_its_own_call_and_restores_the_outer() -> None:
    # A trace run while another one is (a pipe built inside a traced
    # forward) took the outer trace's answers for the module's own.
    scope = ReadsByType.forward.__globals__
    outer, inner = Tracer([], values={"batch": {}}), Tracer([], values={"batch": ()})
    outer.graph = fx.Graph()
    batch = outer.create_proxy("placeholder", "batch", (), {})  # the argument
    with answering_types(outer, [ReadsByType()]):
        assert scope["isinstance"](batch, dict)  # the outer call's: a dict
        with answering_types(inner, [ReadsByType()]):
            assert not scope["isinstance"](batch, dict)  # the inner call's: a tuple
        assert scope["isinstance"](batch, dict)
    assert "isinstance" not in scope and "type" not in scope


class ReadsByAttribute(nn.Module):
    """Tells a dict batch from a tensor by an attribute only a dict has."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: Any) -> Tensor:
        x = batch["x"] * 2 if hasattr(batch, "keys") else batch
        if hasattr(batch, "get") and hasattr(batch.get("w"), "shape"):  # an item's too
            x = x * batch["w"]
        return self.b(self.a(x))  # type: ignore[no-any-return]


@pytest.mark.parametrize("first", ["dict", "tensor"])
def test_hasattr_on_an_argument_is_answered_as_the_plain_model_does(first: str) -> None:
    # fx's proxy has every attribute: a tensor batch was indexed by "x".
    torch.manual_seed(0)
    model = ReadsByAttribute().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    calls = {"dict": ({"x": x},), "dict with w": ({"x": x, "w": x + 1},), "tensor": (x,)}
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, split_size=4,
                tracer="fx", sample=calls[first])  # fmt: skip
    for name, call in calls.items():
        pipe.zero_grad()
        model.zero_grad()
        out, expected = pipe(*call), model(*call)
        torch.testing.assert_close(out, expected, msg=name)
        out.square().sum().backward()
        expected.square().sum().backward()
        assert_same_grads(pipe, model)
    assert "hasattr" not in globals()
    with pytest.raises(TypeError, match=r"tests the type of batch \(hasattr\).*sample="):
        Pipe(ReadsByAttribute(), split_points=["b"], devices=["cpu"] * 2, tracer="fx")
