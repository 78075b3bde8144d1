"""Traced splits refused, each error saying what, where and what to do: an
untraceable submodule (and the leaf_modules that traces it), bad split
points (a parameter's name, a submodule a kind of call does not call), tied
weights across devices, a forward returning its own tensor."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.stages.fx import trace
from mpstream.stages.placement import place
from mpstream.stages.points import SplitPointError, split_candidates
from tests.models import Decoder


class Looping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Branchy()
        self.head = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inner(x))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:  # data-dependent control flow: untraceable
            return self.lin(x)
        return x


def test_untraceable_modules_say_what_where_and_what_to_do() -> None:
    with pytest.raises(
        TypeError, match=r"(?s)inside submodule 'inner': TraceError.*leaf_modules=\['inner'\]"
    ):
        Pipe(Looping(), split_points=["head"], devices=["cpu"] * 2, tracer="fx")
    x = torch.ones(3, 2)
    # Without tracer='fx', torch.export is tried at the first call, on its
    # arguments: it cannot follow the branch either, and the error says both.
    pipe = Pipe(Looping(), split_points=["head"], devices=["cpu"] * 2)
    with pytest.raises(
        TypeError,
        match=r"(?s)could not export Looping inside submodule 'inner'.*"
        r"torch.fx could not trace it either.*TraceError.*leaf_modules=\['inner'\]",
    ):
        pipe(x)
    for leaf in ("inner", Branchy):
        model = Looping()
        expected = model(x)
        pipe = Pipe(model, split_points=["head"], devices=["cpu"] * 2, leaf_modules=[leaf])
        torch.testing.assert_close(pipe(x), expected)


def test_split_point_errors() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*candidates: 'embed', 'pos'|'nope'.*'blocks.0'"):
        Pipe(Decoder(), split_points=["nope"], devices=["cpu"] * 2)
    with pytest.raises(ValueError, match="out of call order: 'blocks.1' runs before 'blocks.3'"):
        Pipe(Decoder(), split_points=["blocks.3", "blocks.1"], devices=["cpu"] * 3)
    with pytest.raises(ValueError, match="stage 1 would be empty"):
        Pipe(Decoder(), split_points=["blocks.1", "blocks.1"], devices=["cpu"] * 3)
    with pytest.raises(ValueError, match="devices has 2 entries but split_points make 3"):
        Pipe(Decoder(), split_points=["blocks.1", "blocks.2"], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match="balance= partitions an nn.Sequential"):
        Pipe(Decoder(), split_points=["blocks.1"], balance=[1, 1], devices=["cpu"] * 2)
    # torch.distributed.pipelining's split_spec: its END would begin a stage too early.
    with pytest.raises(TypeError, match=r"not a split_spec mapping \(\{'blocks.1': END\}\)"):
        end = type("SplitPoint", (), {"name": "END"})()
        Pipe(Decoder(), split_points={"blocks.1": end}, devices=["cpu"] * 2)  # type: ignore[arg-type]
    assert "blocks.3" in split_candidates(Decoder())


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_split_point_naming_a_parameter_is_refused_by_both_tracers(tracer: str) -> None:
    # torchvision's ViT reads encoder.pos_embedding and class_token, which look
    # like split points; torch.fx began a stage where one was first read, and
    # torch.export refused it as naming no submodule.
    with pytest.raises(SplitPointError, match="'pos' names a parameter of Decoder, not a sub"):
        pipe = Pipe(Decoder(), split_points=["pos"], devices=["cpu"] * 2, tracer=tracer)
        pipe(torch.randint(0, 11, (2, 5)))


class TrainingHead(nn.Module):
    """A head called in training only, as GoogLeNet's and Inception's aux heads."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.aux, self.b = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.training:
            h = h + self.aux(h)
        return self.b(h)


def test_a_split_point_a_kind_of_call_does_not_call_is_named_with_those_it_calls() -> None:
    x = torch.randn(4, 2)
    pipe = Pipe(TrainingHead().train(), chunks=2, split_points=["aux"], devices=["cpu"] * 2)
    pipe(x)
    pipe.eval()
    with pytest.raises(
        SplitPointError,
        match=r"'aux' names a submodule of TrainingHead that the traced forward does not call "
        r"in this kind of call .* candidates it calls: 'a', 'b'\n\(traced for this kind of call: "
        r"eval",
    ):
        pipe(x)
    assert pipe.train()(x).shape == (4, 2)


def test_tied_weights_across_devices_are_refused() -> None:
    model = Decoder()
    traced = trace(model, ["blocks.2"])
    with pytest.raises(ValueError, match=r"embed.weight = head.weight is used by stage 0 \(cpu\)"):
        place(
            model, traced.partitions, traced.tensors, [torch.device("cpu"), torch.device("cuda", 0)]
        )


class ReturnsItsTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
        self.shift = nn.Parameter(torch.zeros(2))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.b(self.a(x)), self.shift


def test_a_forward_returning_its_own_tensor_is_named() -> None:
    with pytest.raises(TypeError, match="returns its tensor 'shift' as it is"):
        Pipe(ReturnsItsTensor(), split_points=["b"], devices=["cpu"] * 2, tracer="fx")
