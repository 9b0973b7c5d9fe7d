"""Count c10d collectives independently of our own ``comm_stats`` (a TorchDispatchMode).

The mode is thread-local state that the autograd engine carries into its worker threads, so
collectives issued from backward hooks are seen too. Used by the CPU tests and the functional
GPU suite (``tests/functional``).
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# c10d op -> (collective, index of the full buffer it covers, index of the process group)
_OPS = {
    "c10d._allgather_base_.default": ("all_gather", 0, 2),           # (output, input, group, ...)
    "c10d._reduce_scatter_base_.default": ("reduce_scatter", 1, 2),  # (output, input, group, ...)
    "c10d.allreduce_.default": ("all_reduce", 0, 1),                 # ([tensors], group, ...)
    "c10d.broadcast_.default": ("broadcast", 0, 1),                  # ([tensors], group, root, ...)
    "c10d.alltoall_base_.default": ("all_to_all", 1, 2),             # (output, input, group, ...): what this rank sends
}


def _same_group(boxed, group) -> bool:
    """Is the dispatched (boxed) process group ``group``? True when it cannot be told."""
    import torch.distributed as dist

    try:
        return dist.ProcessGroup.unbox(boxed) is group
    except Exception:  # noqa: BLE001 - older torch: count every call
        return True


class CollectiveCounter(TorchDispatchMode):
    """Records (collective, bytes) for every c10d collective dispatched while active.

    With ``group`` only collectives on that group count (Megatron's own collectives on its
    tensor-parallel group, e.g. the vocab-parallel cross entropy's all-reduces even at TP=1, are
    not ours). An op not in the table is recorded as ``"unexpected <op>"`` so comparisons fail."""

    def __init__(self, group=None) -> None:
        super().__init__()
        self.group = group
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = str(func)
            if name not in _OPS:
                self.calls.append((f"unexpected {name}", 0))
            elif self.group is None or _same_group(args[_OPS[name][2]], self.group):
                kind, index, _ = _OPS[name]
                tensor = args[index]
                if isinstance(tensor, (list, tuple)):
                    tensor = tensor[0]
                self.calls.append((kind, tensor.numel() * tensor.element_size()))
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        """{collective: (calls, bytes)} recorded so far."""
        out: dict = {}
        for kind, nbytes in self.calls:
            count, total = out.get(kind, (0, 0))
            out[kind] = (count + 1, total + nbytes)
        return out

    def take(self) -> dict:
        """{collective: (calls, bytes)} since the last take."""
        summary = self.summary()
        self.calls.clear()
        return summary
