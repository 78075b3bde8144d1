"""A registered class whose constructor changes its fields when rebuilt:
refused by name, as input, target, stage output and pipeline output."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mpstream import Pipe
from mpstream.runtime.gathering import gather
from mpstream.runtime.graphed import Emulated
from mpstream.runtime.microbatch import leaves, scatter
from mpstream.runtime.rebuilds import check_rebuilds


@dataclasses.dataclass
class Doubled:
    """Its __post_init__ transforms a field: rebuilt, the field doubles again."""

    x: Tensor

    def __post_init__(self) -> None:
        self.x = self.x * 2


@dataclasses.dataclass
class Checked:
    """Its __post_init__ only validates: rebuilt, its fields are the same."""

    x: Tensor

    def __post_init__(self) -> None:
        if self.x.dim() != 2:
            raise ValueError("x needs two dimensions")


class Keyless:
    """Registered without keys to its fields: named by leaf."""

    def __init__(self, x: Tensor) -> None:
        self.x = x - 1


class Scaled:
    """Registered by hand, with an unflatten that transforms."""

    def __init__(self, x: Tensor) -> None:
        self.x = x + 1


pytree.register_dataclass(Doubled)
pytree.register_dataclass(Checked)
pytree.register_pytree_node(
    Scaled,
    lambda s: ([s.x], None),
    lambda items, _: Scaled(items[0]),
    flatten_with_keys_fn=lambda s: ([(pytree.GetAttrKey("x"), s.x)], None),
)

pytree.register_pytree_node(Keyless, lambda s: ([s.x], None), lambda items, _: Keyless(items[0]))


def test_a_transforming_post_init_is_refused_by_name_before_anything_is_split() -> None:
    batch = {"a": torch.ones(4, 2), "b": Doubled(torch.ones(4, 2))}
    with pytest.raises(TypeError, match=r"input\['b'\]\.x is held by a Doubled whose") as e:
        scatter(batch, 2, None)
    assert "validate only" in str(e.value) and "register an unflatten" in str(e.value)
    with pytest.raises(TypeError, match=r"target\.x is held by a Scaled"):
        scatter(Scaled(torch.ones(4, 2)), None, 3, "target")
    with pytest.raises(TypeError, match=r"the pipeline's output\[0\]\.x .* Doubled"):
        gather([(Doubled(torch.ones(2, 2)),), (Doubled(torch.ones(2, 2)),)])
    with pytest.raises(TypeError, match=r"input leaf 1 is held by a Keyless"):
        scatter((torch.ones(4), Keyless(torch.ones(4))), 2, None)


def test_a_validating_post_init_and_builtin_structures_pass() -> None:
    x = torch.arange(8.0).view(4, 2)
    parts = scatter((Checked(x), {"y": [x]}), 2, None)
    torch.testing.assert_close(parts[1][0].x, x[2:])
    torch.testing.assert_close(gather([p[0] for p in parts]).x, x)
    pair = torch.return_types.max((x, x))
    check_rebuilds(pair, "input", *leaves(pair))


class Read(nn.Module):
    def forward(self, batch: Any) -> Tensor:
        return batch.x


class Wrap(nn.Module):
    def __init__(self, kind: type[Any]) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, y: Tensor) -> Any:
        return self.kind(y)


def pipes(layers: list[nn.Module], balance: list[int], **kw: Any) -> list[Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*layers).double()
    return [model] + [
        Pipe(copy.deepcopy(model), balance=balance, devices=["cpu"] * 2, graphs=g, **kw)
        for g in (False, Emulated())
    ]


SPLITS = [{"chunks": 2}, {"split_size": 3}]  # dividing the batch of 8, and not


@pytest.mark.parametrize("kw", SPLITS)
@pytest.mark.parametrize("kind", [Doubled, Scaled])
def test_a_pipe_refuses_what_it_would_rebuild_wrong(kind: type[Any], kw: dict[str, Any]) -> None:
    x, y = torch.randn(8, 4, dtype=torch.double), torch.randn(8, 3, dtype=torch.double)
    mse = nn.functional.mse_loss
    _, *chains = pipes([Read(), nn.Linear(4, 3)], [1, 1], **kw)
    for pipe in chains:
        with pytest.raises(TypeError, match=r"input\[0\]\.x .* " + kind.__name__):
            pipe(kind(x))
        with pytest.raises(TypeError, match=r"input\[0\]\.x .* " + kind.__name__):
            pipe.train_step(kind(x), y, mse)
        assert all(p.grad is None for p in pipe.parameters())
    _, *chains = pipes([nn.Linear(4, 3), nn.Tanh()], [1, 1], **kw)
    for pipe in chains:
        with pytest.raises(TypeError, match=r"target\.x .* " + kind.__name__):
            pipe.train_step(x, kind(y), lambda out, t: mse(out, t.x))
        assert all(p.grad is None for p in pipe.parameters())
    between = [nn.Linear(4, 4), Wrap(kind), Read(), nn.Linear(4, 3)]
    output = [nn.Linear(4, 4), nn.Linear(4, 3), Wrap(kind)]
    for layers, balance, stage in ((between, [2, 2], 0), (output, [1, 2], 1)):
        _, *chains = pipes(layers, balance, **kw)
        for pipe in chains:
            with pytest.raises(TypeError, match=rf"stage {stage}'s output\.x .* {kind.__name__}"):
                pipe(x)


@pytest.mark.parametrize("kw", SPLITS)
def test_a_validating_post_init_gives_the_plain_models_results(kw: dict[str, Any]) -> None:
    x, y = torch.randn(8, 4, dtype=torch.double), torch.randn(8, 3, dtype=torch.double)
    layers = [Read(), nn.Linear(4, 4), Wrap(Checked), Read(), nn.Linear(4, 3), Wrap(Checked)]
    model, *chains = pipes(layers, [3, 3], **kw)

    def loss(out: Checked, t: Checked) -> Tensor:
        return nn.functional.mse_loss(out.x, t.x)

    expected = loss(model(Checked(x)), Checked(y))
    expected.backward()
    for pipe in chains:
        torch.testing.assert_close(pipe(Checked(x)).x, model(Checked(x)).x)
        torch.testing.assert_close(pipe.train_step(Checked(x), Checked(y), loss), expected)
        for got, want in zip(pipe.parameters(), model.parameters()):
            torch.testing.assert_close(got.grad, want.grad)
