"""Count c10d collectives independently of our own ``comm_stats`` (a TorchDispatchMode)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# op name -> (our collective name, which argument holds the "full buffer" the collective covers)
_OPS = {
    "c10d._allgather_base_.default": ("all_gather", 0),        # (output, input, ...)
    "c10d._reduce_scatter_base_.default": ("reduce_scatter", 1),  # (output, input, ...)
    "c10d.allreduce_.default": ("all_reduce", 0),              # ([tensors], ...)
}


class CollectiveCounter(TorchDispatchMode):
    """Records (collective, bytes) for every c10d collective dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if func.namespace == "c10d":
            if name not in _OPS:
                raise AssertionError(f"unexpected collective {name}")
            kind, index = _OPS[name]
            tensor = args[index]
            if isinstance(tensor, (list, tuple)):
                tensor = tensor[0]
            self.calls.append((kind, tensor.numel() * tensor.element_size()))
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        out: dict = {}
        for kind, nbytes in self.calls:
            count, total = out.get(kind, (0, 0))
            out[kind] = (count + 1, total + nbytes)
        return out

    def take(self) -> dict:
        summary = self.summary()
        self.calls.clear()
        return summary
