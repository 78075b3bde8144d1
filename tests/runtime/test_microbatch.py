"""Scatter and input validation (mpstream.runtime.microbatch)."""

from __future__ import annotations

import pytest
import torch

from mpstream.runtime.gathering import gather
from mpstream.runtime.microbatch import (
    NoChunk,
    as_value,
    batch_device,
    describe,
    scatter,
    scatter_sized,
)


@pytest.mark.parametrize(
    ("chunks", "split", "sizes"),
    [
        (None, None, [10]),
        (1, None, [10]),
        (3, None, [4, 4, 2]),
        (4, None, [3, 3, 3, 1]),
        (20, None, [1] * 10),
        (None, 3, [3, 3, 3, 1]),
        (None, 10, [10]),
        (None, 50, [10]),
    ],
)
def test_scatter_sizes(chunks: int | None, split: int | None, sizes: list[int]) -> None:
    x = torch.arange(10.0)
    parts = scatter(x, chunks, split)
    assert [len(p) for p in parts] == sizes
    torch.testing.assert_close(gather(parts), x)
    assert scatter_sized(x, chunks, split)[1] == sizes


def test_scatter_sized_says_the_split_tensors_sizes() -> None:
    # A NoChunk tensor comes out whole and plain: its rows are no micro-batch's size.
    value = {"mask": NoChunk(torch.ones(2)), "x": (torch.zeros(5, 3), "plain")}
    micros, sizes = scatter_sized(value, 2, None)
    assert sizes == [3, 2]
    assert [len(m["x"][0]) for m in micros] == sizes
    assert [len(m["mask"]) for m in micros] == [2, 2]


def test_scatter_tuple_keeps_structure() -> None:
    x = (torch.arange(6.0), torch.arange(12.0).view(6, 2))
    parts = scatter(x, None, 4)
    assert len(parts) == 2 and all(isinstance(p, tuple) and len(p) == 2 for p in parts)
    out = gather(parts)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], x[0])
    torch.testing.assert_close(out[1], x[1])


def test_list_input_becomes_tuple() -> None:
    value = as_value([torch.ones(2), torch.zeros(2)])
    assert isinstance(value, tuple)


@pytest.mark.parametrize("bad", [3, "x", None, {"a": torch.ones(1)}])
def test_non_tensor_input_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="Tensor"):
        as_value(bad)


def test_non_tensor_in_tuple_names_the_index() -> None:
    with pytest.raises(TypeError, match=r"input\[1\] is int"):
        as_value((torch.ones(2), 5))


def test_empty_batch_and_scalars_are_value_errors() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        as_value(torch.ones(0, 3))
    with pytest.raises(ValueError, match="scalar"):
        as_value(torch.tensor(1.0))
    with pytest.raises(ValueError, match="empty tuple"):
        as_value(())
    with pytest.raises(ValueError, match="batch size"):
        as_value((torch.ones(2), torch.ones(3)))


def test_mixed_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="several devices"):
        batch_device((torch.ones(2), torch.ones(2, device="meta")))


def test_scatter_splits_tensors_and_passes_the_rest_whole() -> None:
    mask = torch.ones(3, 3)
    args = (torch.arange(5.0), 7, None, NoChunk(mask), {"ids": torch.arange(5), "tag": "x"})
    parts = scatter(args, None, 2)
    assert len(parts) == 3
    for i, (x, n, none, m, d) in enumerate(parts):
        torch.testing.assert_close(x, torch.arange(5.0)[2 * i : 2 * i + 2])
        assert n == 7 and none is None and m is mask and d["tag"] == "x"
        torch.testing.assert_close(d["ids"], torch.arange(5)[2 * i : 2 * i + 2])


def test_tensors_of_other_batch_sizes_are_refused() -> None:
    # Even where they would split into as many micro-batches: row i of one
    # would no longer meet row i of the other (a tensor meant whole, say).
    for chunks, split_size in [(3, None), (2, None), (None, 3)]:
        with pytest.raises(ValueError, match=r"different batch sizes \(dim 0\): \[4, 6\]"):
            scatter((torch.zeros(6), {"other": torch.zeros(4)}), chunks, split_size)
    parts = scatter((torch.zeros(6), NoChunk(torch.zeros(4))), 3, None)  # meant whole
    assert [(len(a), len(b)) for a, b in parts] == [(2, 4)] * 3
    # One micro-batch is the batch as given (a broadcast row, say).
    ((x, row),) = scatter((torch.zeros(6), torch.zeros(1)), 1, None)
    assert (len(x), len(row)) == (6, 1)


def test_scatter_needs_a_tensor_and_plain_leaves() -> None:
    with pytest.raises(TypeError, match=r"no tensor to split.*got tuple of int and str"):
        scatter((1, "a"), 2, None)
    with pytest.raises(TypeError, match=r"target holds no tensor.*got str: 'y'.*torch.as_tensor"):
        scatter("y", 2, None, "target")
    with pytest.raises(TypeError, match="holds a object"):
        scatter((torch.ones(2), object()), 2, None)
    with pytest.raises(TypeError, match="NoChunk wraps a Tensor"):
        NoChunk(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("hello", "str: 'hello'"),
        ([1.0, 2.0], "list of float: [1.0, 2.0]"),
        ((1, "a"), "tuple of int and str: (1, 'a')"),
        ({"ids": 3}, "dict of int: {'ids': 3}"),
        (None, "NoneType: None"),
        (list(range(1000)), "list of int: [0, 1, 2, 3, 4, 5, ...]"),
    ],
)
def test_describe_names_the_type_what_it_holds_and_its_start(value: object, text: str) -> None:
    assert describe(value) == text


def test_a_batch_whose_every_tensor_is_wrapped_in_nochunk_is_named() -> None:
    x = torch.randn(4, 2)
    with pytest.raises(TypeError, match=r"input: every tensor is wrapped in mpstream.NoChunk"):
        scatter((NoChunk(x), NoChunk(x), 3), 2, None)
    with pytest.raises(TypeError, match="target holds no tensor to split"):
        scatter(("a", 3), 2, None, "target")
