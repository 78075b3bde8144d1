"""mpstream.Pipe's errors on CPU: bad micro-batching, modules, inputs and stage
outputs are named, and a stage that fails leaves the pipe usable."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe

BATCH = 12
SPLITS = [1, 3, 7, BATCH, 20]  # 7 does not divide 12; 20 exceeds it


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"chunks": 0}, ValueError, "chunks must be at least 1"),
        ({"chunks": -2}, ValueError, "chunks must be at least 1"),
        ({"split_size": 0}, ValueError, "split_size must be at least 1"),
        ({"chunks": 2, "split_size": 3}, ValueError, "either chunks or split_size"),
        ({"chunks": 2.0}, TypeError, "chunks must be an int"),
        ({"split_size": True}, TypeError, "split_size must be an int"),
    ],
)
def test_bad_micro_batching(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Pipe(nn.Sequential(nn.Linear(2, 2)), **kwargs)  # type: ignore[arg-type]


def test_setters_validate() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2)), chunks=2)
    with pytest.raises(ValueError, match="split_size must be at least 1"):
        pipe.split_size = 0
    with pytest.raises(ValueError, match="chunks must be at least 1"):
        pipe.chunks = 0
    assert pipe.chunks == 2
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        pipe.checkpoint = "nevr"
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipe.schedule = "1fb1"
    assert (pipe.checkpoint, pipe.schedule) == ("never", "gpipe")
    pipe.checkpoint, pipe.schedule = "always", "1f1b"
    assert pipe(torch.randn(4, 2)).shape == (4, 2)


def test_module_errors() -> None:
    with pytest.raises(TypeError, match="nn.Sequential"):
        Pipe(nn.Linear(2, 2))
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="same module"):
        Pipe(nn.Sequential(OrderedDict([("a", lin), ("b", lin)])))
    child = nn.Module()
    child.register_parameter("w", nn.Parameter(torch.ones(1)))
    child.register_buffer("b", torch.ones(1, device="meta"))
    # Meta is the CPU's only second device, and holds no values: Pipe says
    # so first (split_module's "several devices": tests/stages/test_sequential.py).
    with pytest.raises(ValueError, match="tensor '0.b' is on the meta device"):
        Pipe(nn.Sequential(child))


@pytest.mark.parametrize("bad", [None, 3, "x", [torch.ones(2, 2), 1]])
def test_non_tensor_input(bad: object) -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2)), chunks=2)
    with pytest.raises(TypeError):
        pipe(bad)  # type: ignore[arg-type]


def test_empty_batch() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2)), chunks=2)
    with pytest.raises(ValueError, match="empty batch"):
        pipe(torch.ones(0, 2))


class Bad(nn.Module):
    def __init__(self, result: object) -> None:
        super().__init__()
        self.result = result

    def forward(self, x: Tensor) -> object:
        return self.result


@pytest.mark.parametrize("result", [object(), {1, 2}, (torch.ones(1), nn.Linear(1, 1))])
def test_bad_stage_output_names_the_stage(result: object) -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), Bad(result)), chunks=2)
    with pytest.raises(TypeError, match="stage 1 returned a"):
        pipe(torch.ones(4, 2))
    assert not pipe.scheduler.native.running


@pytest.mark.parametrize(
    ("result", "gathered"),
    [
        ([torch.ones(1)], [torch.ones(2)]),
        (None, [None, None]),
        ({"x": 1}, {"x": [1, 1]}),
        ((torch.ones(1), 2), (torch.ones(2), [2, 2])),
    ],
)
def test_any_structure_of_tensors_and_plain_values_comes_out(
    result: object, gathered: object
) -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), Bad(result)), chunks=2)
    out = pipe(torch.ones(4, 2))
    torch.testing.assert_close(out, gathered)


@pytest.mark.parametrize(
    ("result", "name"),
    [
        (torch.tensor(1.0), "the output"),
        ((torch.ones(1), torch.tensor(1.0)), "output[1]"),
        ({"logits": torch.ones(1), "aux_loss": torch.tensor(1.0)}, "output['aux_loss']"),
        ([torch.ones(1), {"aux": (2, torch.tensor(1.0))}], "output[1]['aux'][1]"),
    ],
)
def test_a_scalar_per_micro_batch_is_named_by_its_path(result: object, name: str) -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), Bad(result)), chunks=2)
    with pytest.raises(ValueError) as caught:
        pipe(torch.ones(4, 2))
    text = str(caught.value)
    assert text.startswith(f"{name} is a scalar per micro-batch"), text
    assert "leaf" not in text
    assert "Return it per sample" in text and "reduce it after the pipe" in text
    assert not pipe.scheduler.native.running


def test_a_scalar_in_a_model_output_is_named_by_its_key() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    result = outputs.MoeCausalLMOutputWithPast(logits=torch.ones(1), aux_loss=torch.tensor(1.0))
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), Bad(result)), chunks=2)
    with pytest.raises(ValueError, match=r"^output\['aux_loss'\] is a scalar per micro-batch"):
        pipe(torch.ones(4, 2))


class Boom(Exception):
    pass


class FailOn(nn.Module):
    """Raises on the n-th call; counts calls."""

    def __init__(self, fail_at: int | None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0
        self.error = Boom("stage failed")

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise self.error
        return x * 2


@pytest.mark.parametrize("failing_stage", [0, 1, 2])
def test_stage_exception_propagates_and_later_micro_batches_do_not_start(
    failing_stage: int,
) -> None:
    stages = [FailOn(3 if s == failing_stage else None) for s in range(3)]
    pipe = Pipe(nn.Sequential(*stages), split_size=1)
    x = torch.ones(8, 1)
    with pytest.raises(Boom) as info:
        pipe(x)
    assert info.value is stages[failing_stage].error
    # Micro-batch 2 failed at stage s in clock cycle 2 + s. Stage 0 is at most
    # one cycle ahead of each later stage, so it never started micro-batch 4+.
    assert stages[0].calls <= 2 + failing_stage + 1
    for s in range(failing_stage + 1, 3):
        assert stages[s].calls <= 2
    assert not pipe.scheduler.native.running
    assert pipe.scheduler.events_free == pipe.scheduler.events_created
    for st in stages:
        st.fail_at = None
    torch.testing.assert_close(pipe(x), x * 8)


def test_torch_error_in_a_stage_leaves_the_pipe_usable() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3)), chunks=2)
    with pytest.raises(RuntimeError, match="shapes"):
        pipe(torch.ones(4, 5))
    assert not pipe.scheduler.native.running
    assert pipe(torch.ones(4, 2)).shape == (4, 3)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


@pytest.mark.parametrize(
    ("module", "kwargs", "match"),
    [
        (_Blocks(), {"split_points": ["b"], "balance": "time"}, "pass one of the two"),
        (_Blocks(), {"balance": "bogus"}, "balance must be a list of ints, 'time' or 'size'"),
        (_Blocks(), {"split_points": ["b"], "leaf_modules": ["a.typo"]}, "'a.typo'"),
        (
            _Blocks(),
            {"split_points": ["b"], "leaf_modules": ["a"], "tracer": "export"},
            "tracer='export' does not use it",
        ),
        (nn.Sequential(nn.Linear(4, 4)), {"tracer": "export"}, r"^tracer=: an nn.Sequential"),
        (nn.Sequential(nn.Linear(4, 4)), {"leaf_modules": ["0"]}, "leaf_modules=: an nn"),
        (
            nn.Sequential(nn.Linear(4, 4)),
            {"sample": torch.randn(2, 4)},
            "sample=: an nn.Sequential is split by its layers .* or profiling",
        ),
    ],
)
def test_arguments_the_split_would_ignore_are_refused(
    module: nn.Module, kwargs: dict[str, object], match: str
) -> None:
    devices = ["cpu"] * 2 if "split_points" in kwargs or "balance" in kwargs else None
    with pytest.raises(ValueError, match=match):
        Pipe(module, devices=devices, **kwargs)  # type: ignore[arg-type]


# torchgpipe's GPipe(module, [1, 1], chunks=8): with chunks= as well, Python
# itself would refuse the call before Pipe could say why.
@pytest.mark.parametrize("kwargs", [{}, {"chunks": 8, "devices": ["cpu", "cpu"]}])
def test_a_balance_passed_as_torchgpipe_did_is_named(kwargs: dict[str, object]) -> None:
    with pytest.raises(
        TypeError, match=r"balance is keyword-only .*Pipe\(module, balance=\[1, 1\]\)"
    ):
        Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], **kwargs)  # type: ignore[arg-type]


def test_one_leaf_module_may_be_given_as_a_string() -> None:
    model = _Blocks()
    pipe = Pipe(model, split_points=["b"], leaf_modules="a", devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4)
    torch.testing.assert_close(pipe(x), model(x))


@pytest.mark.parametrize("layers", [list, tuple])
@pytest.mark.parametrize("deferred_batch_norm", [False, True])
def test_a_list_of_layers_is_told_to_become_a_sequential(
    layers: type, deferred_batch_norm: bool
) -> None:
    given = layers([nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)])
    kind = layers.__name__
    with pytest.raises(TypeError) as info:
        Pipe(given, chunks=2, deferred_batch_norm=deferred_batch_norm)
    assert str(info.value) == (
        f"Pipe takes one nn.Module, got a {kind} of 3 modules: wrap them in "
        f"nn.Sequential(*layers) (each layer is then a stage's unit, balance= counts them)"
    )
    # What it says works.
    assert Pipe(nn.Sequential(*given), chunks=2, balance=[2, 1], devices=["cpu"] * 2)(
        torch.randn(4, 4)
    ).shape == (4, 2)


def test_what_is_no_module_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="^Pipe takes an nn.Module to split into stages, got str$"):
        Pipe("resnet50", chunks=2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"balance": [2, 1], "devices": ["cpu"] * 2},
        {"split_points": ["2"], "devices": ["cpu"] * 2},
    ],
    ids=["placed", "balanced", "traced"],
)
def test_a_model_on_the_meta_device_is_told_to_be_materialised(
    kwargs: dict[str, object],
) -> None:
    def layers() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 2))

    with torch.device("meta"):
        model = layers()
    with pytest.raises(ValueError, match=r"tensor '0.weight' is on the meta device.*to_empty"):
        Pipe(model, chunks=2, **kwargs)  # type: ignore[arg-type]
    for i in (0, 2):  # the layers materialised, the BatchNorm's buffers not
        model[i].to_empty(device="cpu")
    with pytest.raises(ValueError, match="tensor '1.running_mean' is on the meta device"):
        Pipe(model, chunks=2, **kwargs)  # type: ignore[arg-type]
    # What it says works.
    model.to_empty(device="cpu")
    model.load_state_dict(layers().state_dict())
    assert Pipe(model, chunks=2, **kwargs)(torch.randn(4, 4)).shape == (4, 2)  # type: ignore[arg-type]


class _Clashing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.balance = nn.Linear(4, 2)  # also a Pipe property

    def forward(self, x: Tensor) -> Tensor:
        return self.balance(self.body(x))  # type: ignore[no-any-return]


@pytest.mark.parametrize("traced", [False, True], ids=["sequential", "traced"])
def test_a_layer_named_as_a_pipe_attribute_is_refused_and_the_model_left_as_it_was(
    traced: bool,
) -> None:
    # The name is checked once the model is converted (and placed): the
    # refusal must undo that, as every other construction error does.
    if traced:
        model: nn.Module = _Clashing()
        kwargs: dict[str, object] = {"split_points": ["balance"], "tracer": "fx"}
    else:
        layers = OrderedDict(body=nn.Linear(4, 4), norm=nn.BatchNorm1d(4), schedule=nn.Linear(4, 2))
        model, kwargs = nn.Sequential(layers), {"balance": [2, 1]}
    name = "balance" if traced else "schedule"
    with pytest.raises(ValueError, match=f"attribute '{name}' clashes with Pipe's own"):
        Pipe(model, devices=["cpu"] * 2, deferred_batch_norm=True, **kwargs)  # type: ignore[arg-type]
    assert [type(m) for m in model.modules() if "Norm" in type(m).__name__] == [nn.BatchNorm1d]


def test_force_copies_takes_a_bool_not_a_string_that_reads_as_true() -> None:
    import numpy as np

    layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    pipe = Pipe(layers, balance=[1, 1], devices=["cpu"] * 2, force_copies=np.bool_(True))
    assert pipe.force_copies is True
    pipe.force_copies = 0
    assert pipe.force_copies is False
    for wrong in ("false", 2, None, torch.ones(2)):
        with pytest.raises(TypeError, match="force_copies must be a bool"):
            pipe.force_copies = wrong  # type: ignore[assignment]
    with pytest.raises(TypeError, match="force_copies must be a bool, got 'no'"):
        Pipe(nn.Sequential(nn.Linear(2, 2)), force_copies="no")  # type: ignore[arg-type]


def test_deferred_batch_norm_takes_a_bool_not_a_string_that_reads_as_true() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(TypeError, match="deferred_batch_norm must be a bool, got 'no'"):
        Pipe(model, deferred_batch_norm="no")  # type: ignore[arg-type]
    assert type(model[1]) is nn.BatchNorm1d  # not converted
    # 0 and 1 count, as for force_copies.
    assert type(Pipe(model, deferred_batch_norm=0)[1]) is nn.BatchNorm1d
    assert type(Pipe(model, deferred_batch_norm=1)[1]) is not nn.BatchNorm1d


def test_a_valid_call_is_checked_without_walking_the_keys_to_its_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every pipe(batch) and train_step checks its inputs on the host: a dict
    # batch or pipe(x, mask=None) took the key walk (four times the plain
    # flattening) only to name an object that was not there.
    from mpstream.pipe import inputs

    x = torch.randn(4, 2)
    calls = [((x,), {"mask": None}), (({"x": x, "y": [x, 1]},), {}), ((), {"x": x, "n": 3})]
    with monkeypatch.context() as patched:
        patched.setattr(inputs.pytree, "tree_flatten_with_path", None)  # any walk fails
        for args, kwargs in calls:
            inputs.check_holds_tensor(args, kwargs)
    with pytest.raises(TypeError, match=r"Pipe input holds no tensor; got tuple: \(\)"):
        inputs.check_holds_tensor((), {})
    with pytest.raises(TypeError, match=r"Pipe input x\['b'\] is a Holder holding tensors \(t\)"):
        inputs.check_holds_tensor((), {"x": {"b": Holder(x)}})


class Holder:
    """An object pytree does not look into."""

    def __init__(self, t: Tensor) -> None:
        self.t = t


@pytest.mark.parametrize("name", ["balance", "devices", "partitions", "split_points"])
def test_what_is_fixed_at_construction_says_so_when_set(name: str) -> None:
    pipe = Pipe(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), balance=[1, 1], devices=["cpu"] * 2
    )
    before = getattr(pipe, name)
    with pytest.raises(AttributeError, match=f"pipe.{name} is fixed when the Pipe is built"):
        setattr(pipe, name, before)
    assert getattr(pipe, name) == before
    pipe.chunks = 2  # what may change still does
    assert pipe(torch.randn(4, 4)).shape == (4, 2)
