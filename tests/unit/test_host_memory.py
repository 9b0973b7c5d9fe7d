"""Pinned host buffers at their exact size ([Note: pinned buffers at their exact size]): on CPU
with a stand-in for CUDA's runtime (what is registered, and when it is unregistered); on a GPU
for real."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from megatron_fsdp_v2.offload import host_memory


@pytest.fixture
def fake_cudart(monkeypatch):
    calls = []
    runtime = types.SimpleNamespace(cudaHostRegister=lambda ptr, n, flags: calls.append(("register", ptr, n)) or 0,
                                    cudaHostUnregister=lambda ptr: calls.append(("unregister", ptr)) or 0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    return calls


def test_a_large_buffer_is_registered_at_its_size_and_unregistered_when_its_last_view_dies(fake_cudart):
    numel = 2_100_001                        # 8.4 MB of fp32: torch's host allocator would take 16 MiB
    out = host_memory.pinned_empty(numel, torch.float32, torch.device("cuda", 0))
    ptr = out.data_ptr()
    assert out.numel() == numel and out.dtype == torch.float32 and out.device.type == "cpu"
    assert fake_cudart == [("register", ptr, 4 * numel)]
    view = out[10:20]
    del out
    gc.collect()
    assert fake_cudart == [("register", ptr, 4 * numel)], "unregistered while a view still reads the memory"
    del view
    gc.collect()
    assert fake_cudart == [("register", ptr, 4 * numel), ("unregister", ptr)]


def test_a_failed_registration_names_the_setting_that_avoids_it(monkeypatch, fake_cudart):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: types.SimpleNamespace(cudaHostRegister=lambda *a: 2))
    with pytest.raises(RuntimeError, match=r"page-locking 4194304 bytes .* cudaError 2; "
                                           r"OffloadPolicy\(pin_memory=False\)"):
        host_memory.pinned_empty(1 << 20, torch.float32, torch.device("cuda", 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: page-locks host memory")
def test_on_the_gpu_the_buffer_is_pinned_and_copies_without_waiting_for_the_host():
    numel = (3 << 20) + 1
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if hasattr(
        torch.cuda, "host_memory_stats") else None
    host = host_memory.pinned_empty(numel, torch.float32, torch.device("cuda", 0))
    assert host.is_pinned()
    if before is not None:      # not from torch's caching host allocator: nothing rounded up there
        assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    host.copy_(torch.arange(numel, dtype=torch.float32))
    device = torch.empty(numel, device="cuda")
    device.copy_(host, non_blocking=True)
    back = host_memory.pinned_empty(numel, torch.float32, torch.device("cuda", 0)).zero_()
    back.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, host)
