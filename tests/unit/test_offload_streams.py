"""Which stream's pool a released compute shard is made again in, and what its release tells the
allocator: the order that keeps the stepping thread's uploads from racing backward ([Note: a
device buffer made on the stepping thread] in offload/host_link.py). CPU has no streams, so a stand-in
device module logs stream contexts, allocations and ``record_stream`` calls."""

import contextlib

import pytest
import torch

from megatron_fsdp_v2.offload.host_link import HostLink, OffloadedGroup
from megatron_fsdp_v2.offload.policy import OffloadPolicy


class _Event:
    def __init__(self, enable_timing=False):
        self.stream = None

    def record(self, stream):
        self.stream = stream

    def synchronize(self):
        pass


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.stream.name if event.stream else None))

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))


class _Module:
    """The device module a HostLink uses, with the compute stream current unless entered."""

    def __init__(self, log):
        self.log = log
        self.compute = _Stream("compute", log)
        self.current = self.compute
        self.Event = _Event

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before


@pytest.fixture
def stand_in(monkeypatch):
    log = []
    link = HostLink(torch.device("cpu"), OffloadPolicy(fraction=1.0, pin_memory=False))
    module = _Module(log)
    link._module = module
    link.stream, link.upload_stream, link.thread_upload_stream = (
        _Stream(n, log) for n in ("down", "up", "thread_up"))
    real_empty = torch.empty

    def logged_empty(*args, **kwargs):
        if kwargs.get("device") is not None:          # host buffers too: the log is cleared after construction
            log.append(("empty", module.current.name))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", logged_empty)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, s: log.append(("record_stream", s.name)), raising=False)
    group = OffloadedGroup(link, grad_numel=8, grad_dtype=torch.float32, compute_numel=8,
                           compute_dtype=torch.bfloat16)
    group.release_after_gather = True
    log.clear()
    return link, group, log


def test_a_release_tells_the_allocator_the_compute_stream_read_the_shard(stand_in):
    _, group, log = stand_in
    group.after_gather()
    assert group.compute_shard is None
    assert log == [("record_stream", "compute")]


def test_the_stepping_threads_upload_makes_the_shard_in_its_own_streams_pool(stand_in):
    link, group, log = stand_in
    group.after_gather()
    log.clear()
    handed_at = _Event()
    handed_at.record(link._module.compute)
    main = torch.arange(8, dtype=torch.float32)
    shard = group.device_compute_shard(for_thread_upload=True)
    group.upload(main, shard, version=1, after=handed_at)
    # made while the thread's upload stream was current, then copied there after the hand-over's event
    assert log[0] == ("empty", "thread_up")
    assert ("wait_event", "thread_up", "compute") in log
    assert not any(entry[0] == "wait_stream" for entry in log)
    assert torch.equal(group.compute_shard, main.to(torch.bfloat16))


def test_the_compute_threads_reupload_makes_the_shard_in_the_compute_pool_after_its_work(stand_in):
    _, group, log = stand_in
    group.after_gather()
    log.clear()
    shard = group.device_compute_shard()
    group.upload(torch.ones(8), shard, version=1)
    assert log[0] == ("empty", "compute")
    assert ("wait_stream", "up", "compute") in log
