"""Pulled copies (runtime/peer.py): the peer view aliases its source with
the same sizes, strides and offset, keeps it alive, and refuses another
kind of device; a pull equals the source. Across two GPUs (skipped
elsewhere) the copy runs on the receiver's stream and is ordered by it."""

from __future__ import annotations

import gc

import pytest
import torch

from mpstream.runtime.peer import enable_peer_access, pull

view = torch.ops.mpstream.peer_view


def test_a_peer_view_aliases_its_source_and_keeps_it_alive() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    x = base[1:, 2:5]  # an offset, non-contiguous view
    v = view(x, torch.device("cpu"))
    assert v.data_ptr() == x.data_ptr() and v.stride() == x.stride() and v.shape == x.shape
    torch.testing.assert_close(v, x)
    expected = x.clone()
    del base, x
    gc.collect()
    torch.testing.assert_close(v, expected)  # the source's storage lives on
    v.add_(1)  # writes go to the source's memory
    torch.testing.assert_close(v, expected + 1)


def test_a_peer_view_refuses_another_kind_of_device_and_lazy_bits() -> None:
    with pytest.raises(RuntimeError, match="cannot be viewed from meta"):
        view(torch.ones(2), torch.device("meta"))
    lazy = torch.ones(2, dtype=torch.complex64).conj()  # a bit a pointer cannot carry
    with pytest.raises(RuntimeError, match="resolve the tensor's conjugate"):
        view(lazy, torch.device("cpu"))
    torch.testing.assert_close(view(lazy.resolve_conj(), torch.device("cpu")), lazy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_a_pull_is_a_new_tensor_equal_to_its_source(dtype: torch.dtype) -> None:
    x = (torch.arange(12) % 3).to(dtype).reshape(3, 4).t()
    y = pull(x, torch.device("cpu"))
    assert y.data_ptr() != x.data_ptr() and y.dtype == dtype
    torch.testing.assert_close(y, x)


def test_peer_access_among_cpus_is_nothing_to_enable(monkeypatch: pytest.MonkeyPatch) -> None:
    # What enable_peer_access asks of CUDA, faked: no pair has a peer path.
    asked: list[tuple[str, ...]] = []

    def can_access(a: torch.device, b: torch.device) -> bool:
        asked.append(("peer?", str(a), str(b)))
        return False

    def synchronize(device: torch.device) -> None:
        asked.append(("synchronize", str(device)))

    monkeypatch.setattr(torch.cuda, "can_device_access_peer", can_access)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    cpu = torch.device("cpu")
    enable_peer_access([cpu, cpu])
    assert asked == []  # nothing asked, nothing copied, nothing waited for
    # CPUs beside GPUs are left out too; the GPUs are asked, and refused here.
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="cuda:0 cannot read cuda:1's memory"):
        enable_peer_access([cpu, cuda0, cpu, cuda1])
    assert asked == [("peer?", "cuda:0", "cuda:1")]
    asked.clear()
    enable_peer_access([cuda0, cpu, cuda0])  # one GPU: no pair to enable
    assert asked == [("synchronize", "cuda:0")]


two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


@pytest.mark.cuda
@two_gpus
def test_a_pull_between_gpus_runs_on_the_receivers_stream() -> None:
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    enable_peer_access([d0, d1])
    x = torch.randn(1024, 1024, device=d0)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(d0))
    side = torch.cuda.Stream(d1)
    with torch.cuda.stream(side):
        side.wait_event(ready)
        torch.cuda._sleep(50_000_000)  # the copy queues behind this on the receiver only
        y = pull(x, d1)
    assert y.device == d1
    assert not side.query(), "the copy was issued on the receiver's stream"
    torch.cuda.current_stream(d1).wait_stream(side)
    torch.testing.assert_close(y.cpu(), x.cpu())


def test_a_peer_view_of_meta_and_fake_tensors_is_only_its_shape() -> None:
    # Tracing (FakeTensorMode, torch.export) and meta tensors have no memory
    # to view: the operator's kernel for them gives the shape alone (it
    # crashed the process before: the C++ kernel read a fake data pointer).
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    meta = torch.empty(4, 6, device="meta").t()
    v = view(meta, torch.device("meta"))
    assert v.device.type == "meta" and v.shape == (6, 4) and v.stride() == meta.stride()
    with FakeTensorMode():
        fake = torch.empty(3, 5, dtype=torch.float16)[:, 1:]
        f = view(fake, torch.device("cpu"))
    assert isinstance(f, FakeTensor) and f.shape == (3, 4) and f.stride() == (5, 1)
    assert f.dtype == torch.float16
