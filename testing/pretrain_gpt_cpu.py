"""``examples/pretrain_gpt.py`` on CPU (gloo): Megatron-LM's own training loop with our wrapper,
for trying the Megatron path without a GPU (a dry run of the logic, not of GPU numerics)::

    torchrun --nproc-per-node 2 testing/pretrain_gpt_cpu.py --data-parallel-sharding-strategy optim_grads \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 1e-3 --vocab-size 512 --mock-data \\
        --transformer-impl local --no-persist-layer-norm --no-masked-softmax-fusion \\
        --use-cpu-initialization --distributed-backend gloo --eval-iters 0 --eval-interval 1000 --log-interval 1

Every argument is the launcher's (Megatron-LM's). On top of ``cpu_compat.patch_megatron_for_cpu``
(Megatron-Core's CUDA-only spots), the ``torch`` of Megatron-LM's training modules gets a
``torch.cuda`` stand-in (a device "exists", ``set_device`` / memory statistics are no-ops, the CUDA
RNG is the patches' CPU generator), ``nn.Module.cuda`` returns the module unchanged (``get_model``
moves the model to the GPU) and the launcher's ``forward_step`` leaves the batch on CPU. The process
group is gloo, created here. Checkout scaffolding, not installed; never imported by the library.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Megatron-LM modules whose ``torch.cuda`` calls the stand-in answers.
TRAINING_MODULES = ["megatron.training.initialize", "megatron.training.training", "megatron.training.checkpointing",
                    "megatron.training.utils.common_utils", "megatron.training.utils.utils",
                    "megatron.training.dist_signal_handler", "megatron.training.global_vars",
                    "megatron.core.timers", "megatron.core.rerun_state_machine",
                    "megatron.core.dist_checkpointing.strategies.async_utils"]


@contextlib.contextmanager
def launcher_on_cpu(argv: Optional[List[str]] = None):
    """The launcher module (``examples/pretrain_gpt.py``), its training on CPU within: the stand-ins
    above applied, undone on exit. The default process group must exist (gloo). Given the launcher's
    ``argv``, its warning set-up (``--verbose`` or not) comes first: the stand-ins import Megatron."""
    sys.path[:0] = [p for p in (REPO, os.path.join(REPO, "examples")) if p not in sys.path]
    import torch

    from megatron_fsdp_v2.notices import summarize_notices

    if argv is not None and "--verbose" not in argv:
        summarize_notices()             # before the launcher imports Megatron: its import-time notices too
    import pretrain_gpt
    if argv is not None:
        pretrain_gpt.set_up_warnings(argv)
    from testing import cpu_compat

    class LauncherCuda(cpu_compat._CpuCudaNamespace):
        is_available = staticmethod(lambda: True)
        device_count = staticmethod(lambda: 1)
        set_device = staticmethod(lambda *a, **k: None)
        max_memory_allocated = memory_allocated = memory_reserved = max_memory_reserved = \
            staticmethod(lambda *a, **k: 0)
        reset_peak_memory_stats = staticmethod(lambda *a, **k: None)
        # Megatron's validation of --use-megatron-fsdp reads the GPU generation: Hopper's
        get_device_properties = staticmethod(lambda *a, **k: types.SimpleNamespace(major=9, minor=0))
        get_rng_state = staticmethod(lambda *a, **k: cpu_compat._FAKE_CUDA_GENERATOR.get_state())
        set_rng_state = staticmethod(lambda state, *a, **k: cpu_compat._FAKE_CUDA_GENERATOR.set_state(state))

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
        return output, functools.partial(pretrain_gpt.loss_func, batch["loss_mask"])

    saved_forward_step, saved_cuda = pretrain_gpt.forward_step, torch.nn.Module.cuda
    pretrain_gpt.forward_step = forward_step
    torch.nn.Module.cuda = lambda self, *a, **k: self
    try:
        with cpu_compat.patch_megatron_for_cpu(*TRAINING_MODULES), _forked_checkpoint_worker():
            sys.modules[TRAINING_MODULES[0]].torch.cuda = LauncherCuda()     # the shim all patched modules share
            yield pretrain_gpt
    finally:
        pretrain_gpt.forward_step, torch.nn.Module.cuda = saved_forward_step, saved_cuda


@contextlib.contextmanager
def _forked_checkpoint_worker():
    """``--async-save --use-persistent-ckpt-worker``: Megatron-LM starts its checkpoint worker
    process from a forkserver, a fresh interpreter without the stand-ins (its first call,
    ``torch.cuda.set_device(rank % torch.cuda.device_count())``, divides by zero on CPU); forked,
    it inherits them."""
    from megatron.training import initialize

    original = initialize.init_persistent_async_worker
    initialize.init_persistent_async_worker = lambda rank, mp_mode="spawn": original(rank, "fork")
    try:
        yield
    finally:
        initialize.init_persistent_async_worker = original
        _stop_checkpoint_workers()


def _stop_checkpoint_workers() -> None:
    """End the worker process and the results queue's manager process Megatron-LM keeps in module
    globals, and forget them (the next run in this process starts its own)."""
    from megatron.core.dist_checkpointing.strategies import async_utils as core_async, filesystem_async
    from megatron.training import async_utils

    if async_utils._async_calls_queue is not None:
        async_utils._async_calls_queue.close(abort=True)
        async_utils._async_calls_queue = None
    core_async.AsyncCallsQueue._persistent_caller = None
    if filesystem_async._results_queue is not None:
        filesystem_async._results_queue._manager.shutdown()
        filesystem_async._results_queue = None


def main(argv: List[str]) -> None:
    """Run the launcher's ``main(argv)`` on CPU under torchrun's environment."""
    import torch

    torch.distributed.init_process_group("gloo")
    with launcher_on_cpu(argv) as pretrain_gpt:
        pretrain_gpt.main(argv)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
