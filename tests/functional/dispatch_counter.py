"""Count c10d collectives as they are dispatched (a ``TorchDispatchMode``), independently of the
engine's own ``comm_stats()``. Same idea as tests/unit/comm_counter.py, kept here so the functional
suite depends on nothing outside this directory but the package under test.

The mode is thread-local state that the autograd engine carries into its CUDA device threads, so
collectives issued from backward hooks are seen too.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# c10d op -> (collective, index of the full buffer it covers, index of the process group)
_OPS = {
    "c10d._allgather_base_.default": ("all_gather", 0, 2),           # (output, input, group, ...)
    "c10d._reduce_scatter_base_.default": ("reduce_scatter", 1, 2),  # (output, input, group, ...)
    "c10d.allreduce_.default": ("all_reduce", 0, 1),                 # ([tensors], group, ...)
}


def _same_group(boxed, group) -> bool:
    """Is the dispatched (boxed) process group ``group``? True when it cannot be told."""
    import torch.distributed as dist

    try:
        return dist.ProcessGroup.unbox(boxed) is group
    except Exception:  # noqa: BLE001 - older torch: count every call
        return True


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives on ``group`` (default: the world group); Megatron's own collectives on
    its tensor-parallel group (the vocab-parallel cross entropy all-reduces even at TP=1) are not ours."""

    def __init__(self, group=None) -> None:
        super().__init__()
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = str(func)
            if name not in _OPS:
                self.calls.append((f"unexpected {name}", 0))
            elif _same_group(args[_OPS[name][2]], self.group):
                kind, index, _ = _OPS[name]
                tensor = args[index]
                if isinstance(tensor, (list, tuple)):
                    tensor = tensor[0]
                self.calls.append((kind, tensor.numel() * tensor.element_size()))
        return func(*args, **(kwargs or {}))

    def take(self) -> dict:
        """{collective: (calls, bytes)} since the last take."""
        out: dict = {}
        for kind, nbytes in self.calls:
            count, total = out.get(kind, (0, 0))
            out[kind] = (count + 1, total + nbytes)
        self.calls.clear()
        return out
