"""CPU offload by fraction: which groups live in host memory, and the copies that keep them fed.

[Note: offload by fraction]
``fully_shard(..., offload=OffloadPolicy(fraction=f))`` keeps the main-weight shards (and so the
optimizer state the user's optimizer creates from them) of whole parameter groups in host memory,
chosen from the *last* group in forward order back until at least ``f`` of all main-weight bytes
are chosen (``choose_offloaded``). The last groups are the right ones on both sides of a step:
their reduced gradients land first in backward (so their device-to-host copies hide behind the
rest of backward) and their weights are needed last in forward (so their host-to-device copies
hide behind the first units' all-gathers and compute).

An offloaded group's optimizer-facing main parameters *are* host tensors, so one unmodified
``torch.optim`` optimizer steps them on the CPU and the other groups' on the device (torch's
optimizers group tensors by device; ``fused=True`` runs the fused kernel on each, CPU included).
Per step, for an offloaded group:

  reduce lands     the reduced shard (device) is copied to the host gradient (``d2h``): on a
                   side stream, not waited for; the device copy is freed once the copy is done.
                   The first landing since ``zero_grad`` writes the host gradient straight (no
                   zeroing pass before it, no staging buffer); later ones (gradient
                   accumulation) land in a host staging buffer (made once, kept) and are added
                   on the host when the next landing or the end of backward needs them.
  end of backward  the host waits for the copies (``flush``); ``.grad`` of the host main
                   parameters point at the host gradient.
  optimizer step   on the CPU for these parameters (the user's optimizer). Opted in with
                   ``step_in_backward=True``, each group steps on a host thread as soon
                   as its gradient landed, overlapped with the rest of backward, and (ZeRO-3)
                   that thread starts its upload at once (backward_steps.py, [Note: offloaded
                   steps during backward]).
  after the step   the engine's post-step hook starts the host-to-device copy of the main shard
                   of every group not uploaded yet
                   (``upload``) on the side stream, cast to the compute dtype on the device
                   (one group's main-dtype shard is a transient device buffer). ZeRO-3 keeps the
                   result as a persistent compute-weight shard the all-gather reads; ZeRO-1/2
                   write straight into their slot of the replicated weights; DDP into its weights.
  next forward     the all-gather (or the unit's forward, DDP) makes the device stream wait for
                   the copy's event: a device-side wait, the host never blocks on it.

On a device without streams (CPU) every copy is a plain synchronous ``copy_``; the placement
logic, the choice of groups and the arithmetic are the same, so CPU runs test them bitwise.

Memory (ZeRO-3, N ranks, per offloaded parameter): on the device the compute-weight shard, 2/N
bytes (bf16), kept from the upload after a step to the next step (both gathers, forward and
backward, read it): this is what ours keeps above FSDP2's ``CPUOffloadPolicy``, which copies its
fp32 shard to the device at every gather instead (twice per step, 8/N bytes over the link against
our 4/N). On the host 4 (main) + 4 (gradient) + 8 (Adam) bytes / N, and 4 more with gradient
accumulation (the staging buffer). Pinned host buffers are page-locked at their exact size
(host_memory.py; torch's caching host allocator would round a group's 805 MB up to 1 GiB).

[Note: a device buffer made on the stepping thread]
With ``release_after_gather`` the thread that stepped a group during backward makes the group's
device compute shard again for its upload, while backward goes on queueing work on the compute
stream. Made in the compute stream's pool (that thread's current stream), the caching allocator
could hand it a block backward freed a moment ago, which compute-stream work queued after the
hand-over's event (all the upload waits for) still reads or writes: the upload then raced that work
(on the H200 a 941M GPT's loss drifted from the second step on, or became NaN, in some runs and not
others). So the buffer comes from the pool of the thread's upload stream, where every earlier block
was last used by that stream's copies, and a compute shard's release tells the allocator that the
compute stream read it (``record_stream``), so that its block is reused only after that read ran.
Waiting for the compute stream's work up to the allocation instead would have tied the upload (and
the thread, which keeps one upload in flight) to the end of the device's backward.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .host_memory import pinned_empty
from .policy import OffloadPolicy

__all__ = ["HostLink", "OffloadedGroup", "release_shards_after_gathers"]


def release_shards_after_gathers(units: Sequence, policy: Optional[OffloadPolicy]) -> None:
    """``policy.release_after_gather``: the offloaded groups of non-root units free their device
    compute shard after each gather; the root's after its gather at the start of backward (it
    stays gathered through backward, so with one micro-batch per step nothing reads its shard
    again before the next step's upload and freeing it costs no copy; a later micro-batch's
    forward copies it again, waited for there)."""
    if policy is None or not policy.release_after_gather:
        return
    for unit in units:
        for group in unit.groups:
            if group.offloaded is not None:
                if unit.is_root:
                    group.offloaded.release_after_backward_gather = True
                else:
                    group.offloaded.release_after_gather = True


class HostLink:
    """The copies between one device and host memory, and the side stream they run on."""

    def __init__(self, device: torch.device, policy: OffloadPolicy) -> None:
        self.device = device
        self.host = torch.device("cpu")
        accelerator = device.type != "cpu"
        self.pin = policy.pin_memory and accelerator
        self._module = torch.get_device_module(device) if accelerator else None
        # side streams: gradients down and weights up run on the two copy directions at once; the
        # stepping thread's uploads (new weights for the next forward) get a third, so that a
        # backward's re-upload of a released shard (needed now) never queues behind them: copies
        # on one stream run in the order they were issued
        self.stream = self._module.Stream(device=device) if accelerator and policy.overlap else None
        self.upload_stream = self._module.Stream(device=device) if self.stream is not None else None
        self.thread_upload_stream = self._module.Stream(device=device) if self.stream is not None else None

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked at its exact size when pinning ([Note: pinned buffers at their exact size])."""
        if self.pin:
            return pinned_empty(numel, dtype, self.device)
        return torch.empty(numel, dtype=dtype, device=self.host)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        out = self.host_empty(tensor.numel(), tensor.dtype)
        out.copy_(tensor.reshape(-1))
        return out

    def copy(self, dst: torch.Tensor, make_src: Callable[[], torch.Tensor], upload: bool = False, after=None):
        """``dst.copy_(make_src())`` after the work queued so far on the compute stream (or, given
        ``after``, an event recorded on it: a copy started from another host thread), on a side
        stream when there is one (``upload``: a host-to-device one, the thread's own given
        ``after``); returns its event (None: done already). ``make_src`` runs on that stream too,
        so device temporaries it allocates are that stream's."""
        if self.stream is None:
            with torch.no_grad():
                dst.copy_(make_src())
            return None
        stream = self.stream if not upload else self.upload_stream if after is None else self.thread_upload_stream
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(self.current_compute_stream())
        with torch.no_grad(), self._module.stream(stream):
            src = make_src()
            dst.copy_(src, non_blocking=True)
            if src.device != self.host:
                src.record_stream(stream)           # the caching allocator keeps it until the copy ran
            if dst.device != self.host:
                dst.record_stream(stream)
            event = self._module.Event()
            event.record(stream)
        return event

    def device_empty(self, numel: int, dtype: torch.dtype, for_thread_upload: bool = False) -> torch.Tensor:
        """A device buffer an upload writes: from the calling thread's stream's pool, or, for an
        upload the stepping thread starts, from its upload stream's ([Note: a device buffer made
        on the stepping thread])."""
        if for_thread_upload and self.thread_upload_stream is not None:
            with self._module.stream(self.thread_upload_stream):
                return torch.empty(numel, dtype=dtype, device=self.device)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def compute_event(self, timing: bool = False):
        """An event recorded now on the compute stream (None without streams); ``timing``: one
        whose device time can be read (benchmarks' timelines)."""
        if self.stream is None:
            return None
        event = self._module.Event(enable_timing=timing)
        event.record(self.current_compute_stream())
        return event

    def current_compute_stream(self):
        """The calling thread's current stream on the device: the compute stream for the main
        thread and autograd's (not for the stepping thread)."""
        return self._module.current_stream(self.device)

    def device_waits(self, event) -> None:
        """The compute stream waits for ``event`` (the host does not)."""
        if event is not None:
            self.current_compute_stream().wait_event(event)

    @staticmethod
    def host_waits(event) -> None:
        if event is not None:
            event.synchronize()


class OffloadedGroup:
    """What an offloaded ParamGroup holds besides its host main shard: the host gradient, the
    copies in flight and (ZeRO-3) the device compute-weight shard."""

    def __init__(self, link: HostLink, grad_numel: int, grad_dtype: torch.dtype, compute_numel: int,
                 compute_dtype: torch.dtype) -> None:
        self.link = link
        self.grad = link.host_empty(grad_numel, grad_dtype).zero_()
        self.grad_fresh = True            # holds nothing of this accumulation yet (zeroed lazily)
        self.grad_staging: Optional[torch.Tensor] = None     # a later landing's values, to add on the host
        # {parameter index: its .grad over ``grad`` as the optimizer sees it}, made at the first
        # attach (``grad`` is this group's for life): group/param_group.py
        self.grads_facing_optimizer: dict = {}
        self._pending: list = []          # (event, what the host does once it completed)
        self._compute = (compute_numel, compute_dtype)
        self.compute_shard = link.device_empty(compute_numel, compute_dtype) if compute_numel else None
        self.release_after_gather = False     # OffloadPolicy.release_after_gather, for non-root groups
        self.release_after_backward_gather = False    # the same for the root's groups
        self.stepped_early = False            # stepped during this backward (backward_steps.py)
        self._upload_event = None
        self.uploaded_version: Optional[int] = None

    # -- gradients -----------------------------------------------------------------------------
    def land_grads(self, reduced: torch.Tensor, scale: float, overwrite: bool) -> None:
        """Take a reduce's result (device, any dtype): ``grad = reduced * scale`` if ``overwrite``
        or nothing landed since ``zero``, else ``grad += reduced * scale`` (on the host, later).

        ``overwrite`` is for a persistent source (DDP / ZeRO-1's full-size buffer, which the next
        backward writes again): the compute stream waits for its copy before going on. A
        temporary source (ZeRO-2/3's reduce output) is only kept alive until its copy ran.

        A fresh landing writes the host gradient straight (no zeroing pass over it first, no
        staging buffer); only a later landing of the same accumulation goes through ``staging``."""
        self._settle()
        if overwrite or self.grad_fresh:
            def scaled():
                out = reduced.to(self.grad.dtype)
                return out.mul_(scale) if scale != 1.0 else out
            event = self.link.copy(self.grad, scaled)
            self._pending.append((event, None))
            if overwrite:
                self.link.device_waits(event)
        else:
            if self.grad_staging is None:
                self.grad_staging = self.link.host_empty(self.grad.numel(), self.grad.dtype)
            event = self.link.copy(self.grad_staging, lambda: reduced.to(self.grad.dtype))
            self._pending.append((event, lambda: self.grad.add_(self.grad_staging, alpha=scale)))
        self.grad_fresh = False

    def _settle(self) -> None:
        """Wait for the copies in flight and apply their pending additions."""
        pending, self._pending = self._pending, []
        for event, then in pending:
            self.link.host_waits(event)
            if then is not None:
                with torch.no_grad():
                    then()

    def wait_landed(self) -> None:
        """The calling host thread waits for the gradient copies in flight (applying nothing: any
        thread may wait while another flushes; ``flush`` then finds them done)."""
        for event, _ in list(self._pending):
            self.link.host_waits(event)

    def flush(self) -> None:
        """Make ``grad`` final on the host: wait for the copies, apply the pending additions (a
        buffer nothing landed in since ``zero`` is zeroed now)."""
        self._settle()
        if self.grad_fresh:
            self.grad.zero_()
            self.grad_fresh = False

    def zero(self) -> None:
        """A fresh accumulation: the next landing overwrites (no pass over the host buffer now)."""
        self.flush()
        self.grad_fresh = True

    # -- weights -----------------------------------------------------------------------------
    def upload(self, main: torch.Tensor, dst: torch.Tensor, version: int, after=None) -> None:
        """Start the copy of the host ``main`` shard into ``dst`` (device, compute dtype), after the
        compute stream's work so far (or after the event ``after``, see ``HostLink.copy``)."""
        if dst.dtype == main.dtype:
            make_src = lambda: main                                  # noqa: E731
        else:
            make_src = lambda: main.to(self.link.device, non_blocking=True)   # noqa: E731  cast on the device
        self._upload_event = self.link.copy(dst, make_src, upload=True, after=after)
        self.uploaded_version = version

    def device_compute_shard(self, for_thread_upload: bool = False) -> torch.Tensor:
        """ZeRO-3's device compute-weight shard, made again if it was released (for an upload
        the stepping thread starts: in its upload stream's pool, [Note: a device buffer made on the
        stepping thread])."""
        if self.compute_shard is None:
            self.compute_shard = self.link.device_empty(*self._compute, for_thread_upload=for_thread_upload)
        return self.compute_shard

    def after_gather(self, in_backward: bool = False) -> None:
        """A gather read the compute shard: free it if the policy says so (the next gather, seeing
        no upload of the current version, copies it again)."""
        if self.release_after_gather or (in_backward and self.release_after_backward_gather):
            if self.link.stream is not None:      # read last by the compute stream (the gather)
                self.compute_shard.record_stream(self.link.current_compute_stream())
            self.compute_shard = None
            self.uploaded_version = None

    def wait_upload_on_host(self) -> None:
        """The calling host thread waits until the last upload ran."""
        self.link.host_waits(self._upload_event)

    def wait_upload(self) -> None:
        """The compute stream waits for the last upload."""
        self.link.device_waits(self._upload_event)
