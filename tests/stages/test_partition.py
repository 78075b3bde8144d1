"""The split of layer costs into stages: optimal against brute force, and its errors."""

from __future__ import annotations

import itertools
import random

import pytest

from mpstream.stages.partition import partition, stage_costs


def brute_force(costs: list[float], stages: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_partition_is_optimal(seed: int) -> None:
    rng = random.Random(seed)
    costs = [rng.uniform(0, 10) for _ in range(rng.randint(3, 9))]
    stages = rng.randint(1, len(costs))
    balance = partition(costs, stages)
    assert len(balance) == stages and sum(balance) == len(costs) and min(balance) >= 1
    assert max(stage_costs(costs, balance)) == pytest.approx(brute_force(costs, stages))


def test_partition_examples_and_errors() -> None:
    assert partition([1, 1, 1, 1], 2) == [2, 2]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert partition([1, 2, 3], 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        partition([1, 1], 3)
    with pytest.raises(ValueError, match="cannot split 1 layer into 2"):
        partition([1], 2)
    with pytest.raises(ValueError, match="at least 1"):
        partition([1, 1], 0)
    with pytest.raises(ValueError, match="negative"):
        partition([1, -1], 1)
    for bad in (float("inf"), float("nan")):  # an empty stage, an arbitrary split
        with pytest.raises(ValueError, match=r"finite and not negative, got .* at 0"):
            partition([bad, 1, 1], 2)


@pytest.mark.parametrize("stages", [2.0, True, "2"])
def test_partition_names_stages_that_are_not_an_int(stages: object) -> None:
    with pytest.raises(TypeError, match="stages must be an int, got"):
        partition([1, 1, 1], stages)  # type: ignore[arg-type]
