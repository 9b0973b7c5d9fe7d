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
                    "megatron.core.timers", "megatron.core.rerun_state_machine"]


@contextlib.contextmanager
def launcher_on_cpu(argv: Optional[List[str]] = None):
    """The launcher module (``examples/pretrain_gpt.py``), its training on CPU within: the stand-ins
    above applied, undone on exit. The default process group must exist (gloo). Given the launcher's
    ``argv``, its warning set-up (``--verbose`` or not) comes first: the stand-ins import Megatron."""
    sys.path[:0] = [p for p in (REPO, os.path.join(REPO, "examples")) if p not in sys.path]
    import torch

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
        with cpu_compat.patch_megatron_for_cpu(*TRAINING_MODULES):
            sys.modules[TRAINING_MODULES[0]].torch.cuda = LauncherCuda()     # the shim all patched modules share
            yield pretrain_gpt
    finally:
        pretrain_gpt.forward_step, torch.nn.Module.cuda = saved_forward_step, saved_cuda


def main(argv: List[str]) -> None:
    """Run the launcher's ``main(argv)`` on CPU under torchrun's environment."""
    import torch

    torch.distributed.init_process_group("gloo")
    with launcher_on_cpu(argv) as pretrain_gpt:
        pretrain_gpt.main(argv)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
