"""Gather, and the check of what a stage returns (mpstream.runtime.gathering):
each error names where in the output."""

from __future__ import annotations

import pytest
import torch

from mpstream.runtime.gathering import check_output, gather


@pytest.mark.parametrize("bad", [object(), {1, 2}, (torch.ones(1), torch.nn.ReLU())])
def test_check_output_names_the_stage(bad: object) -> None:
    with pytest.raises(TypeError, match="stage 2 returned a"):
        check_output(bad, 2)


@pytest.mark.parametrize("good", [[torch.ones(1)], None, 3.0, (torch.ones(1), "s"), ()])
def test_tensors_and_plain_values_pass_between_stages(good: object) -> None:
    assert check_output(good, 2) is good


def test_gather_lists_plain_values_per_micro_batch() -> None:
    out = gather([(torch.ones(2), 1, "a"), (torch.zeros(1), 2, "b")])
    torch.testing.assert_close(out[0], torch.tensor([1.0, 1.0, 0.0]))
    assert out[1:] == ([1, 2], ["a", "b"])


def test_gather_rejects_inconsistent_outputs() -> None:
    with pytest.raises(ValueError, match=r"the output is a tuple of 2 items for micro-batch 0 "):
        gather([(torch.ones(1), torch.ones(1)), (torch.ones(1),)])
    with pytest.raises(ValueError, match="^the output is a scalar per micro-batch"):
        gather([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(ValueError, match=r"^output\[1\] is a tensor for some micro-batches only"):
        gather([(torch.ones(1), 1, "a"), (torch.ones(1), torch.ones(1), "a")])
    with pytest.raises(ValueError, match=r"^output\['x'\] is a tensor for some micro-batches"):
        gather([{"x": 1.0}, {"x": torch.ones(1)}])


def test_a_tensor_beside_a_plain_value_in_some_micro_batches_is_named() -> None:
    # (y, z) is a flat tuple of tensors, (y, None) and (y, 3) are not: the
    # two took different paths and met as "differently shaped values".
    y = torch.ones(2, 3)
    assert gather([(y, 3), (y, 4)])[1] == [3, 4]  # plain values may differ
    for plain, said in [(None, "NoneType: None"), (3, "int: 3")]:
        for outputs, tensor, other in [([(y, plain), (y, y)], 1, 0), ([(y, y), (y, plain)], 0, 1)]:
            with pytest.raises(ValueError) as e:
                gather(outputs)
            assert str(e.value) == (
                f"output[1] is a tensor for some micro-batches only (micro-batch {tensor}: "
                f"shape (2, 3), micro-batch {other}: {said}); return a tensor there for every "
                f"micro-batch"
            )


@pytest.mark.parametrize(
    ("outputs", "where"),
    [
        ([{"a": torch.ones(1), "b": 2}, {"a": torch.ones(1), "c": 2}],
         "the output is a dict with keys ['a', 'b'] for micro-batch 0 and a dict with keys "
         "['a', 'c'] for micro-batch 1"),
        ([(1, [1, 2]), (1, [1, 2]), (1, [1])],
         "output[1] is a list of 2 items for micro-batch 0 and a list of 1 item for "
         "micro-batch 2"),
        ([(torch.ones(1), (1, 2)), (torch.ones(1), 3)],
         "output[1] is a tuple of 2 items for micro-batch 0 and int 3 for micro-batch 1"),
        ([{"x": (1, None)}, {"x": (1, [2])}],
         "output['x'][1] is None for micro-batch 0 and a list of 1 item for micro-batch 1"),
        ([((1,),), ([1],)],
         "output[0] is a tuple of 1 item for micro-batch 0 and a list of 1 item for "
         "micro-batch 1"),
    ],
)  # fmt: skip
def test_outputs_of_different_structures_are_told_where_they_part(
    outputs: list[object], where: str
) -> None:
    with pytest.raises(ValueError) as e:
        gather(outputs)
    assert str(e.value).startswith(
        f"the last stage returned values of different structures across micro-batches: "
        f"{where}. Return the same structure"
    ), str(e.value)
