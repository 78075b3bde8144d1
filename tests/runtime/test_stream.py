"""CPU stream placeholder and helpers."""

from __future__ import annotations

import pytest
import torch

from mpstream.runtime.stream import (
    CPU_STREAM,
    current_stream,
    device_type_code,
    is_cuda,
    new_stream,
    record_stream,
    stream_id,
)


def test_cpu_streams_are_the_placeholder() -> None:
    cpu = torch.device("cpu")
    assert new_stream(cpu) is CPU_STREAM
    assert current_stream(cpu) is CPU_STREAM
    assert not is_cuda(CPU_STREAM)
    assert stream_id(CPU_STREAM) is None


def test_record_stream_on_cpu_is_a_no_op() -> None:
    record_stream(torch.ones(3), CPU_STREAM)


def test_device_type_codes() -> None:
    assert device_type_code(torch.device("cpu")) == 0
    assert device_type_code(torch.device("cuda", 0)) == 1
    with pytest.raises(ValueError, match="meta"):
        device_type_code(torch.device("meta"))
    with pytest.raises(ValueError, match="'cuda' and 'cpu'"):
        new_stream(torch.device("meta"))


@pytest.mark.cuda
def test_cuda_streams_are_distinct_and_ids_round_trip() -> None:
    dev = torch.device("cuda", 0)
    a, b = new_stream(dev), new_stream(dev)
    assert is_cuda(a) and a != b
    assert stream_id(a) == a.stream_id
    assert current_stream(dev) == torch.cuda.current_stream(dev)
