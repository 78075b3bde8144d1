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


class FakeCudaTensor:
    """Stands in for a CUDA tensor: logs the streams it is recorded on."""

    is_cuda = True

    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)
        self.recorded: list[object] = []

    def record_stream(self, stream: object) -> None:
        self.recorded.append(stream)


class FakeCudaStream:
    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)


def test_record_stream_on_cpu_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded: list[object] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: recorded.append(s))
    x = torch.ones(3)
    record_stream(x, CPU_STREAM)
    record_stream(x, FakeCudaStream(0))  # type: ignore[arg-type]  # a host tensor
    assert recorded == []
    torch.testing.assert_close(x, torch.ones(3))
    # A CUDA tensor is recorded on a stream of its own device, and only there.
    gpu = FakeCudaTensor(0)
    same, other = FakeCudaStream(0), FakeCudaStream(1)
    for stream in (CPU_STREAM, other, same):
        record_stream(gpu, stream)  # type: ignore[arg-type]
    assert gpu.recorded == [same]


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
