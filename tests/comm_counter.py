"""Count c10d collectives independently of our own ``comm_stats`` (a TorchDispatchMode).

The mode is thread-local state that the autograd engine carries into its worker threads, so
collectives issued from backward hooks are seen too. Used by the CPU tests, the functional
GPU suite (``tests/functional``) and benchmarks/bench_llama.py.
"""

from __future__ import annotations

import torch
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


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class EveryCollectiveCounter(CollectiveCounter):
    """``CollectiveCounter`` (flat c10d collectives, as the CPU tests count them) plus the list
    forms (``dist.all_gather``, ``dist.reduce_scatter``), the coalesced ones and the functional
    ``_c10d_functional`` ops (DTensor redistributes, e.g. torchao's precompute all-reduce; FSDP2
    under compiled autograd). ``ignore_compile_internals``: torch.compile keeps compiling while
    it counts (a plain dispatch mode makes dynamo skip every frame it would compile)."""

    _EXTRA = {   # op -> (collective, index of the counted buffer(s), multiplier index or None)
        "c10d.allgather_.default": ("all_gather", 0, None),                      # ([[out]], [in], group)
        "c10d.allgather_coalesced_.default": ("all_gather", 0, None),
        "c10d.allgather_into_tensor_coalesced_.default": ("all_gather", 0, None),  # ([out], [in], group)
        "c10d.reduce_scatter_.default": ("reduce_scatter", 1, None),             # ([out], [[in]], group)
        "c10d.reduce_scatter_tensor_coalesced_.default": ("reduce_scatter", 1, None),
        "c10d.allreduce_coalesced_.default": ("all_reduce", 0, None),
        "_c10d_functional.all_gather_into_tensor.default": ("all_gather", 0, 1),   # (in, group_size, name)
        "_c10d_functional.all_gather_into_tensor_out.default": ("all_gather", 0, 1),
        "_c10d_functional.all_gather_into_tensor_coalesced.default": ("all_gather", 0, 1),
        "_c10d_functional.reduce_scatter_tensor.default": ("reduce_scatter", 0, None),
        "_c10d_functional.reduce_scatter_tensor_coalesced.default": ("reduce_scatter", 0, None),
        "_c10d_functional.all_reduce.default": ("all_reduce", 0, None),
        "_c10d_functional.all_reduce_.default": ("all_reduce", 0, None),
        "_c10d_functional.all_reduce_coalesced.default": ("all_reduce", 0, None),
        "_c10d_functional.all_reduce_coalesced_.default": ("all_reduce", 0, None),
        "_c10d_functional.broadcast.default": ("broadcast", 0, None),
        "_c10d_functional.broadcast_.default": ("broadcast", 0, None),
    }
    _IGNORED = ("_c10d_functional.wait_tensor.default", "_c10d_functional._wrap_tensor_autograd.default",
                "c10d.barrier.default", "c10d.monitored_barrier_.default")

    def __init__(self, group=None) -> None:
        super().__init__(group)
        self.gathered_by_dtype: dict[str, int] = {}   # all-gather bytes by the dtype that travels

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _note_dtype(self, buffers, nbytes: int) -> None:
        first = buffers
        while isinstance(first, (list, tuple)):
            first = first[0]
        name = str(first.dtype).replace("torch.", "")
        self.gathered_by_dtype[name] = self.gathered_by_dtype.get(name, 0) + nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            name = str(func)
            if name in _OPS:
                before = len(self.calls)
                out = super().__torch_dispatch__(func, types, args, kwargs)
                if len(self.calls) > before and self.calls[-1][0] == "all_gather":
                    self._note_dtype(args[_OPS[name][1]], self.calls[-1][1])
                return out
            if name in self._EXTRA:
                kind, index, mult = self._EXTRA[name]
                nbytes = _nbytes(args[index]) * (int(args[mult]) if mult is not None else 1)
                self.calls.append((kind, nbytes))
                if kind == "all_gather":
                    self._note_dtype(args[index], nbytes)
            elif name not in self._IGNORED:
                self.calls.append((f"unexpected {name}", 0))
        return func(*args, **(kwargs or {}))
