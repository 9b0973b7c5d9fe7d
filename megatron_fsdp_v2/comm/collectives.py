"""The collectives a wrapped model issues, and their counting.

Every collective of the core goes through here (the schedule's all-gathers, reduce-scatters and
all-reduces, the gradient-norm all-reduce, buffer and parameter broadcasts, the wrap-time checks
that ranks agree; checkpoint I/O uses torch.distributed.checkpoint's own), so ``comm_stats()`` is exact and
the group's ledger (ledger.py, [Note: ranks that issue different collectives]) sees them all;
``fully_shard`` resets the counts once the model is wrapped. Bytes are counted as the full
buffer a collective covers (the gathered output of an all-gather, the input of a reduce-scatter,
the tensor of an all-reduce), which is what the ZeRO papers call "Psi" per collective.

[Note: stream ordering on CUDA]
Collectives are issued with ``async_op=True`` from the compute stream. ProcessGroupNCCL runs each
one on its own internal NCCL stream, which first waits (an event, not a host sync) for the work
already queued on the issuing stream; ``Work.wait()`` makes the *current* stream wait for the
collective, again with an event. So:
* a prefetch all-gather issued at unit i's pre-forward overlaps unit i's compute and is waited for
  only at unit i+1's pre-forward; the backward prefetch does the same in reverse order;
* a reduce-scatter issued when a unit's grads are complete overlaps the next unit's backward; the
  engine waits for it when the next group's first gradient arrives (the memory bound), and
  the temporary input buffer is freed only after that wait, so the caching allocator never hands
  its bytes to a kernel that could run before the collective finished reading them;
* the host never blocks: there is no ``torch.cuda.synchronize()`` in the schedule.
On CPU (gloo) the same calls run with gloo's own threads; the code path is identical.

Which strategy calls which collective is decided by ``strategy.py``, ``group/param_group.py`` and ``group/reduce.py``,
never here: the collective functions do not know which strategy calls them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from .flat_names import all_gather_single, reduce_scatter_single
from .ledger import CollectiveLedger, LedgerMode
from .ledger_registry import ledger_and_mode


class PendingCollective(NamedTuple):
    """An issued asynchronous collective and what to run once it has completed."""

    work: object                      # torch.distributed Work or None (already complete)
    on_complete: Callable[[], None]


def wait_pending(pending: Optional[PendingCollective]) -> None:
    """Wait for every Work of ``pending`` (one or a list; None: nothing issued), then run its
    ``on_complete``."""
    if pending is None:
        return
    for work in (pending.work if isinstance(pending.work, list) else [pending.work]):
        if work is not None:
            work.wait()
    pending.on_complete()


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


@dataclass
class CommStats:
    """Number of calls and bytes per collective since the last ``reset()``, and the bytes of each
    collective split by the dtype they are (bf16 weights, float8 weights, fp32 gradients, ...)."""

    counts: dict = field(default_factory=lambda: {name: 0 for name in COLLECTIVES})
    nbytes: dict = field(default_factory=lambda: {name: 0 for name in COLLECTIVES})
    # per collective: {torch.dtype: bytes}; what the bytes are, which is not always the dtype that
    # travels (an extension group gathers its float8 and bf16 outputs as one uint8 buffer)
    dtype_bytes: dict = field(default_factory=lambda: {name: {} for name in COLLECTIVES})
    # FSDP2's extension protocol: the metadata tensors (torchao's float8 scales) its gathers
    # carried beside the gathered bytes; they stay on the rank (the class reduces their amax itself)
    scale_count: int = 0
    scale_bytes: int = 0

    def record(self, name: str, tensor: torch.Tensor, carried: Optional[dict] = None) -> None:
        """One call of collective ``name`` covering ``tensor``; ``carried``: ``{dtype: bytes}`` of what
        ``tensor``'s bytes are, where that is not ``tensor.dtype`` (same total)."""
        nbytes = tensor.numel() * tensor.element_size()
        self.counts[name] += 1
        self.nbytes[name] += nbytes
        by_dtype = self.dtype_bytes[name]
        if carried is None:
            by_dtype[tensor.dtype] = by_dtype.get(tensor.dtype, 0) + nbytes
            return
        for dtype, part in carried.items():
            by_dtype[dtype] = by_dtype.get(dtype, 0) + part

    def record_scales(self, tensors: list) -> None:
        self.scale_count += len(tensors)
        self.scale_bytes += sum(t.numel() * t.element_size() for t in tensors)

    def reset(self) -> None:
        for name in COLLECTIVES:
            self.counts[name] = 0
            self.nbytes[name] = 0
            self.dtype_bytes[name].clear()
        self.scale_count = self.scale_bytes = 0

    # what a CUDA-graph replay adds (graphs/graphed_step.py: the counts of the captured step)
    def snapshot(self) -> "CommStats":
        """A copy of the counts now (later calls do not change it)."""
        return CommStats(dict(self.counts), dict(self.nbytes), {n: dict(d) for n, d in self.dtype_bytes.items()},
                         self.scale_count, self.scale_bytes)

    def since(self, before: "CommStats") -> "CommStats":
        """What was counted after ``before`` (a ``snapshot()`` of this one)."""
        return CommStats({n: self.counts[n] - before.counts[n] for n in COLLECTIVES},
                         {n: self.nbytes[n] - before.nbytes[n] for n in COLLECTIVES},
                         {n: {dtype: part - before.dtype_bytes[n].get(dtype, 0)
                              for dtype, part in self.dtype_bytes[n].items() if part != before.dtype_bytes[n].get(dtype, 0)}
                          for n in COLLECTIVES},
                         self.scale_count - before.scale_count, self.scale_bytes - before.scale_bytes)

    def add(self, delta: "CommStats") -> None:
        """Count ``delta`` (a ``since()``) once more, as if its collectives ran again."""
        for name in COLLECTIVES:
            self.counts[name] += delta.counts[name]
            self.nbytes[name] += delta.nbytes[name]
            by_dtype = self.dtype_bytes[name]
            for dtype, part in delta.dtype_bytes[name].items():
                by_dtype[dtype] = by_dtype.get(dtype, 0) + part
        self.scale_count += delta.scale_count
        self.scale_bytes += delta.scale_bytes

    def as_dict(self) -> dict:
        """``{collective: {"count": n, "bytes": b}}`` plus ``"total_bytes"`` and ``"bytes_by_dtype"``:
        ``{collective: {"torch.bfloat16": b1, "torch.float32": b2, ...}}`` for each collective that
        ran, its bytes split by what they are (``str(dtype)``; a float8 weight gathered as bytes
        counts as ``"torch.float8_e4m3fn"``). After gathers through FSDP2's extension protocol also
        ``"gather_scales"``: the metadata tensors (float8 scales) they used, not in ``"total_bytes"``
        (computed on every rank, not sent by us)."""
        out = {name: {"count": self.counts[name], "bytes": self.nbytes[name]} for name in COLLECTIVES}
        out["total_bytes"] = sum(self.nbytes.values())
        out["bytes_by_dtype"] = {name: {str(dtype): part for dtype, part in self.dtype_bytes[name].items()}
                                 for name in COLLECTIVES if self.dtype_bytes[name]}
        if self.scale_count:
            out["gather_scales"] = {"count": self.scale_count, "bytes": self.scale_bytes}
        return out


class Communicator:
    """Collectives over one data-parallel process group, counted into one ``CommStats``."""

    def __init__(self, process_group: Optional[dist.ProcessGroup]) -> None:
        self.group = process_group
        self.size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.stats = CommStats()
        # [Note: ranks that issue different collectives]: what is recorded and checked before each call
        ledger, mode = ledger_and_mode(process_group)
        self.ledger: CollectiveLedger = ledger
        self.ledger_mode: LedgerMode = mode

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False, label: str = "",
                   carried: Optional[dict] = None):
        """Gather equal shards from every rank into ``output`` (rank order); ``carried``: ``{dtype:
        bytes}`` of what ``output``'s bytes are when it is a byte buffer (counted so, not as uint8)."""
        self.ledger.before("all_gather", output, label, self.ledger_mode)
        self.stats.record("all_gather", output, carried)
        return all_gather_single(output, shard, group=self.group, async_op=async_op)

    def reduce_scatter(self, shard_out: torch.Tensor, full: torch.Tensor, async_op: bool = False, label: str = "",
                       splits: Optional[tuple] = None):
        """Sum ``full`` over ranks and leave this rank's equal slice of the sum in ``shard_out``, or,
        with ``splits`` (every rank's number of elements, in rank order, summing to ``full``'s), this
        rank's slice of those sizes (torch's list ``reduce_scatter``: grouped reduces on NCCL)."""
        self.ledger.before("reduce_scatter", full, label, self.ledger_mode)
        self.stats.record("reduce_scatter", full)
        if splits is not None and len(set(splits)) > 1:   # equal splits: the flat call (no staging copy)
            return dist.reduce_scatter(shard_out, list(full.split(list(splits))), op=dist.ReduceOp.SUM,
                                       group=self.group, async_op=async_op)
        return reduce_scatter_single(shard_out, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, label: str = "",
                   op: dist.ReduceOp = dist.ReduceOp.SUM):
        """Reduce ``tensor`` over ranks in place (sum, or ``op``, e.g. MAX for an inf-norm)."""
        self.ledger.before("all_reduce", tensor, label, self.ledger_mode)
        self.stats.record("all_reduce", tensor)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, send: torch.Tensor, output_splits: list, send_splits: list,
                   covered_numel: int, async_op: bool = False, label: str = ""):
        """Send ``send``'s consecutive pieces of ``send_splits`` elements to ranks 0, 1, ... and
        receive every rank's piece for this rank into ``output`` (``output_splits``, in rank order).

        Counted as ``covered_numel`` elements of ``send``'s dtype: what the exchange moves over all
        ranks together, the same number on every rank (as an all-gather counts its whole output), which
        the caller knows from a plan every rank shares (e.g. optim/matrix_owners.py's)."""
        # every rank names the exchange's whole size (its own send differs between ranks)
        covered = torch.empty(covered_numel, dtype=send.dtype, device="meta")
        self.ledger.before("all_to_all", covered, label, self.ledger_mode)
        self.stats.record("all_to_all", covered)
        return dist.all_to_all_single(output, send, list(output_splits), list(send_splits), group=self.group,
                                      async_op=async_op)

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable ``obj`` (error paths only: never on the training schedule)."""
        self.ledger.before("all_gather_object", None, "what differs (error path)", self.ledger_mode)
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, tensors: list, src_group_rank: int = 0, label: str = "") -> None:
        """Overwrite ``tensors`` (any dtypes) with group rank ``src_group_rank``'s values.

        One broadcast per dtype and device of a flat copy, as torch DDP coalesces its buffer
        broadcasts; counted as the flat tensor's bytes."""
        by_kind: dict = {}
        for tensor in tensors:
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        src = dist.get_global_rank(self.group, src_group_rank) if self.group is not None else src_group_rank
        with torch.no_grad():
            for same_kind in by_kind.values():
                flat = torch.cat([t.reshape(-1) for t in same_kind])
                self.ledger.before("broadcast", flat, label, self.ledger_mode)
                self.stats.record("broadcast", flat)
                dist.broadcast(flat, src=src, group=self.group)
                offset = 0
                for tensor in same_kind:
                    tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
