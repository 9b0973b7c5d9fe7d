"""Megatron-FSDP (Megatron-Core 0.19.2's ``use_megatron_fsdp`` wrapper,
``megatron.core.distributed.fsdp``) on CPU / gloo -- FOR THE TESTS ONLY, like cpu_compat.py.

``megatron_fsdp_on_cpu()`` (use inside ``patch_megatron_for_cpu``) patches, while it is active:

* the global ``torch`` of the Megatron-FSDP modules: cpu_compat's shim, plus ``torch.device("cuda:N")``
  -> CPU, ``torch.cuda.current_device()`` -> 0 and streams / events whose ``wait`` / ``record`` are
  no-ops (Megatron-FSDP checks ``self.device`` against ``cuda:<current device>`` and waits on
  reduce-scatter events);
* ``DeviceMesh.from_group(..., device_type="cuda")`` in ``mcore_fsdp_adapter``: a CPU mesh (DTensors
  of a CUDA mesh move their local pieces to the GPU);
* ``torch.Tensor.cuda``: the tensor itself (``validate_uneven_dtensor`` moves its boundary flags to
  the GPU). Only Megatron code runs while this is active: build and train Megatron-FSDP inside it,
  our wrapper outside;
* ``torch.distributed``'s collectives as those modules call them: each runs synchronously when it is
  called, whatever ``async_op`` says (an ``async_op=True`` call returns a finished stand-in), and
  ``_coalescing_manager`` in ``param_and_grad_buffer`` coalesces nothing. Megatron-FSDP prefetches
  parameters with ``async_ops=True`` and orders the rest by CUDA events, which are no-ops here, so on
  gloo the collectives would run on gloo's threads while this thread goes on. A worker died of heap
  corruption (``malloc(): unaligned tcache chunk detected``) when only the coalescing manager was
  made to wait, and one died of SIGSEGV inside a coalesced all-gather (torch 2.14.1, CI): one
  synchronous collective at a time makes program order the only order. Values are the same.

Also needed (a config, not a patch): ``DistributedDataParallelConfig(gradient_reduce_div_fusion=False)``
(gloo has no ``PREMUL_SUM``). ``fill_empty_optimizer_states`` gives torch's Adam state to parameters
whose shard is empty on this rank: torch's Adam (no Transformer Engine / apex) skips a parameter
without a gradient, so ranks would disagree on the state's keys and Megatron's
``preprocess_state_dict_for_uneven_dtensor`` (a collective per DTensor, in key order) would hang.
"""

from __future__ import annotations

import contextlib
import importlib
import types

import torch

from testing.cpu_compat import _CpuTorchModule, _NullStream, _Patcher

__all__ = ["MEGATRON_FSDP_MODULES", "fill_empty_optimizer_states", "megatron_fsdp_on_cpu"]

_ADAPTER_MODULE = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"
_BUFFER_MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
MEGATRON_FSDP_MODULES = (
    _ADAPTER_MODULE,
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
    _BUFFER_MODULE,
    "megatron.core.distributed.fsdp.src.megatron_fsdp.utils",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor",
)

_REAL_DEVICE = torch.device


class _CpuDeviceType(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _REAL_DEVICE)

    def __call__(cls, *args, **kwargs):
        if args and (isinstance(args[0], int) or (isinstance(args[0], str) and args[0].startswith("cuda"))):
            return _REAL_DEVICE("cpu")
        return _REAL_DEVICE(*args, **kwargs)


class _CpuDevice(metaclass=_CpuDeviceType):
    """``torch.device`` as the patched modules see it: CUDA devices are the CPU."""


class _Event(_NullStream):
    def wait(self, *_a, **_k):
        pass

    def record(self, *_a, **_k):
        pass

    def record_event(self, *_a, **_k):
        return self


class _FsdpCpuTorch(_CpuTorchModule):
    def __init__(self):
        super().__init__()
        self.device = _CpuDevice
        base = type(self.cuda)

        class Cuda(base):
            @staticmethod
            def current_device():
                return 0

            @staticmethod
            def current_stream(*_a, **_k):
                return _Event()

            @staticmethod
            def Stream(*_a, **_k):  # noqa: N802 (mirrors torch.cuda.Stream)
                return _Event()

            @staticmethod
            def Event(*_a, **_k):  # noqa: N802
                return _Event()

        self.cuda = Cuda()
        self.distributed = _SynchronousDistributed()


class _CpuMesh:
    @staticmethod
    def from_group(*args, **kwargs):
        from torch.distributed import DeviceMesh

        kwargs["device_type"] = "cpu"
        return DeviceMesh.from_group(*args, **kwargs)


class _FinishedWork:
    """What an ``async_op=True`` collective returns here: it finished before it was returned."""

    def wait(self, *_a, **_k) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_SYNCHRONOUS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather", "reduce_scatter",
                "broadcast", "all_to_all_single", "barrier")


def _synchronous(collective):
    def call(*args, **kwargs):
        wanted_async = kwargs.pop("async_op", False)
        result = collective(*args, **kwargs)
        return _FinishedWork() if wanted_async else result

    return call


class _SynchronousDistributed(types.ModuleType):
    """``torch.distributed`` as the patched modules see it: the collectives of ``_SYNCHRONOUS`` run
    at the call; everything else is the real module."""

    def __init__(self):
        super().__init__("torch.distributed")
        for name in _SYNCHRONOUS:
            setattr(self, name, _synchronous(getattr(torch.distributed, name)))

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


@contextlib.contextmanager
def _no_coalescing(group=None, device=None, async_ops=False):
    """``_coalescing_manager`` here: the collectives inside already ran, one by one."""
    yield _FinishedWork()


@contextlib.contextmanager
def megatron_fsdp_on_cpu():
    p = _Patcher()
    try:
        shim = _FsdpCpuTorch()
        for name in MEGATRON_FSDP_MODULES:
            p.setattr(importlib.import_module(name), "torch", shim)
        p.setattr(importlib.import_module(_ADAPTER_MODULE), "DeviceMesh", _CpuMesh)
        buffers = importlib.import_module(_BUFFER_MODULE)
        p.setattr(buffers, "_coalescing_manager", _no_coalescing)
        p.setattr(torch.Tensor, "cuda", lambda tensor, *_a, **_k: tensor)
        yield
    finally:
        p.undo()


def fill_empty_optimizer_states(optimizer) -> None:
    """Zero Adam state (and the others' step) for the parameters torch's Adam skipped on this rank."""
    for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = leaf.optimizer
        steps = [s["step"] for s in inner.state.values() if "step" in s]
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state.get(param):
                    inner.state[param] = {"step": steps[0].clone(), "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}
