"""Shared machinery of the functional suite: the process group, a Megatron GPT and its data. The
training loops (Megatron's own DDP as the reference, ours through the Megatron adapter or, when the
adapter is not importable, ``fully_shard`` with a plain loop), the cached loss curves and the golden
file live in ``training.py``; the sizes docs/design.md predicts in ``tests/design_sizes.py`` (shared with the CPU suite). Both are
re-exported at the end of this module, so tests keep using ``harness.<name>``.


Everything here is imported lazily by the tests (``torch.distributed`` and Megatron work only after
``setup_world()``), so collecting the suite on a machine without CUDA costs nothing and needs no
launcher. Every function that takes a ``World`` must be called on every rank in the same order: the
tests only compare numbers after they have been gathered to every rank, so an assertion fails on all
ranks at once instead of leaving the others waiting in a collective.

CPU smoke mode (``FUNCTIONAL_CPU_SMOKE=1``, for developing the suite without a GPU): gloo, fp32, a
tiny GPT, 3 iterations, Megatron's CUDA-only spots patched by ``testing/cpu_compat.py``.
It checks the plumbing of the tests, not the GPU claims (the CUDA-memory and golden checks skip).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from megatron_fsdp_v2 import STRATEGY_NAMES
from tests.dist_pool import free_port

STRATEGIES = tuple(STRATEGY_NAMES)                 # no_shard, optim, optim_grads, optim_grads_params
REFERENCE = "megatron_ddp"
HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_PATH = os.path.join(HERE, "golden", "losses.json")
LOSS_RTOL = 0.01                                   # "within 1% at every iteration"
MEASURED_FILE = "losses_measured.json"             # written under FUNCTIONAL_RESULTS_DIR by rank 0


def smoke_mode() -> bool:
    return os.environ.get("FUNCTIONAL_CPU_SMOKE", "") == "1"


def _smoke_bf16() -> bool:
    """FUNCTIONAL_CPU_SMOKE_BF16=1: bf16 in smoke mode too (Megatron's bf16 optimizer, i.e. the
    reference, needs CUDA: run only the tests that do not train Megatron DDP)."""
    return os.environ.get("FUNCTIONAL_CPU_SMOKE_BF16", "") == "1"


def results_dir() -> str:
    return os.environ.get("FUNCTIONAL_RESULTS_DIR") or os.path.join(tempfile.gettempdir(),
                                                                   "megatron_fsdp_v2_functional")


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


# ---------------------------------------------------------------------------------------------
# What is trained
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTSpec:
    """A Megatron ``GPTModel`` (local layer spec) and how it is trained; stored with the goldens."""

    layers: int = 4
    hidden: int = 512
    heads: int = 8
    seq: int = 512
    vocab: int = 4096
    micro_batch_size: int = 2
    micro_batches: int = 4           # k: gradient-accumulation micro-batches per iteration
    iters: int = 50
    lr: float = 3e-4
    adam_beta2: float = 0.95
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    bf16: bool = True
    noise: float = 0.25               # fraction of tokens replaced by random ones (keeps the loss well above 0)
    model_seed: int = 1234
    data_seed: int = 100

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def loss_spec() -> GPTSpec:
    """The loss-curve / determinism model: 4 layers, hidden 512, seq 512, vocab 4096, bf16, k=4, 50 iterations."""
    if smoke_mode():
        return GPTSpec(layers=2, hidden=32, heads=4, seq=16, vocab=64, iters=3, lr=1e-2, bf16=_smoke_bf16())
    return GPTSpec()


def memory_spec() -> GPTSpec:
    """8 layers: ZeRO-2's design bound (root + 2 units of full grads) is below the gradient bytes it
    saves over ZeRO-1 at 2 ranks, so ``ZeRO-2 peak <= ZeRO-1 peak`` is guaranteed from N = 2 on."""
    if smoke_mode():
        return GPTSpec(layers=4, hidden=32, heads=4, seq=16, vocab=64, iters=2, lr=1e-2, bf16=_smoke_bf16())
    return GPTSpec(layers=8, iters=2)


def short_spec() -> GPTSpec:
    """Communication counts and checkpoints: the loss model, a few iterations."""
    return dataclasses.replace(loss_spec(), iters=3)


# ---------------------------------------------------------------------------------------------
# The process group
# ---------------------------------------------------------------------------------------------


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device
    backend: str
    gpu_name: str
    subgroups: Dict[int, object] = field(default_factory=dict)   # size -> group of ranks [0, size)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


_WORLD: Optional[World] = None
_TEARDOWN = contextlib.ExitStack()


def setup_world() -> World:
    """Join (or create) the process group and initialise Megatron's parallel state. Idempotent.

    Under ``torchrun`` the env:// variables are set; otherwise (plain ``pytest``) a world of one
    process is made from defaults. CUDA: NCCL on ``cuda:LOCAL_RANK``, deterministic algorithms on
    (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` is set by conftest before CUDA starts)."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    import torch.distributed as dist

    if "RANK" not in os.environ:       # not under torchrun: a world of one, env vars removed at teardown
        defaults = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(free_port()))
        added = [key for key in defaults if key not in os.environ]
        os.environ.update({key: defaults[key] for key in added})
        _TEARDOWN.callback(lambda: [os.environ.pop(key, None) for key in added])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    smoke = smoke_mode()
    if smoke:
        device, backend, name = torch.device("cpu"), "gloo", "cpu"
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("the functional suite needs CUDA (or FUNCTIONAL_CPU_SMOKE=1)")
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
        name = torch.cuda.get_device_name(device)
    timeout = datetime.timedelta(seconds=float(os.environ.get("FUNCTIONAL_PG_TIMEOUT_S", "300")))
    created = False
    if not dist.is_initialized():
        kwargs = dict(backend=backend, timeout=timeout)
        if not smoke:
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        created = True
    previous_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    _TEARDOWN.callback(torch.use_deterministic_algorithms, previous_deterministic)
    if created:
        _TEARDOWN.callback(dist.destroy_process_group)

    if smoke:
        from testing.cpu_compat import (destroy_megatron_parallel_state, init_megatron_parallel_state,
                                        patch_megatron_for_cpu)

        _TEARDOWN.enter_context(patch_megatron_for_cpu())
        init_megatron_parallel_state(dist.get_world_size())
        _TEARDOWN.callback(destroy_megatron_parallel_state)
    else:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        _TEARDOWN.callback(ps.destroy_model_parallel)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    _WORLD = World(dist.get_rank(), dist.get_world_size(), local_rank, device, backend, name)
    # Subgroups for checkpoint resharding: created collectively, once, by every rank.
    size = _WORLD.size
    while size > 1:
        size //= 2
        _WORLD.subgroups[size] = dist.new_group(list(range(size)))
    return _WORLD


def teardown_world() -> None:
    global _WORLD
    _WORLD = None
    _TEARDOWN.close()


def all_gather_object(obj) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


@contextlib.contextmanager
def shared_tmpdir(world: World):
    """A directory every rank sees (all ranks of a torchrun job share one host)."""
    path = broadcast_object(tempfile.mkdtemp(prefix="mfsdp_functional_") if world.rank == 0 else None)
    try:
        yield path
    finally:
        barrier()
        if world.rank == 0:
            import shutil

            shutil.rmtree(path, ignore_errors=True)


def release_memory(world: World) -> None:
    gc.collect()
    if world.is_cuda:
        torch.cuda.synchronize(world.device)
        torch.cuda.empty_cache()


def reseed(seed: int) -> None:
    """Same initial weights and RNG-tracker states for every run."""
    torch.manual_seed(seed)
    if smoke_mode():
        from testing.cpu_compat import cpu_model_parallel_manual_seed

        cpu_model_parallel_manual_seed(seed)
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Model and data
# ---------------------------------------------------------------------------------------------


def transformer_config(spec: GPTSpec):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from testing.cpu_compat import UNFUSED_KERNELS

    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    return TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        use_cpu_initialization=True,            # init from the CPU RNG: identical on every GPU type
        params_dtype=dtype, pipeline_dtype=dtype, bf16=spec.bf16, fp16=False,
        hidden_dropout=0.0, attention_dropout=0.0, **UNFUSED_KERNELS,
        deterministic_mode=True,                # Megatron's embedding lookup without F.embedding's backward
    )


def build_gpt(spec: GPTSpec, world: World):
    """``(module, config, transformer_layer_class)``: the GPT on ``world.device``; with bf16 inside
    ``Float16Module`` (bf16 weights, fp32 logits/loss) exactly as Megatron-LM wraps it."""
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from testing.megatron_gpt import local_gpt

    config = transformer_config(spec)
    reseed(spec.model_seed)
    gpt = local_gpt(config, spec.vocab, spec.seq).to(world.device)
    module = Float16Module(config, gpt) if spec.bf16 else gpt
    return module, config, TransformerLayer


_BATCHES: dict = {}


def _token_chain(spec: GPTSpec) -> tuple:
    """The data's fixed Markov chain (same on every rank): Zipf-distributed first tokens and
    ``SUCCESSORS`` Zipf-drawn successors per token."""
    g = torch.Generator().manual_seed(spec.data_seed)
    zipf = 1.0 / torch.arange(1, spec.vocab + 1, dtype=torch.float64) ** 1.1
    zipf = zipf[torch.randperm(spec.vocab, generator=g)]
    successors = torch.multinomial(zipf.float(), spec.vocab * SUCCESSORS, replacement=True, generator=g)
    return zipf.float(), successors.view(spec.vocab, SUCCESSORS)


SUCCESSORS = 4


def batches(spec: GPTSpec, rank: int, world: World, n: Optional[int] = None) -> List[dict]:
    """``n`` (default iters * k) micro-batches of data-parallel rank ``rank``, on the device.

    Token sequences of a fixed Markov chain: a Zipf-distributed first token, then one of 4 fixed
    successors of the current token (the marginal is Zipf-like: learnt in a few steps; the successors
    over the run), with a fraction ``spec.noise`` of tokens replaced by uniform random ones. The loss
    falls from ln(vocab) but stays well above zero, so a 1% relative tolerance means something at
    every iteration."""
    n = spec.iters * spec.micro_batches if n is None else n
    key = (spec, rank, n, str(world.device))
    if key not in _BATCHES:
        first, successors = _token_chain(spec)
        g = torch.Generator().manual_seed(spec.data_seed + 1 + rank)
        b, s, v = spec.micro_batch_size, spec.seq, spec.vocab
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s).to(world.device)
        pos = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous().to(world.device)
        out = []
        for _ in range(n):
            tokens = torch.empty(b, s + 1, dtype=torch.long)
            tokens[:, 0] = torch.multinomial(first, b, replacement=True, generator=g)
            choice = torch.randint(0, SUCCESSORS, (b, s), generator=g)
            noisy = torch.rand(b, s, generator=g) < spec.noise
            random_tokens = torch.randint(0, v, (b, s), generator=g)
            for i in range(s):
                nxt = successors[tokens[:, i], choice[:, i]]
                tokens[:, i + 1] = torch.where(noisy[:, i], random_tokens[:, i], nxt)
            out.append(dict(tokens=tokens[:, :-1].contiguous().to(world.device),
                            labels=tokens[:, 1:].contiguous().to(world.device),
                            loss_mask=torch.ones(b, s, dtype=torch.float32, device=world.device),
                            attention_mask=causal, position_ids=pos))
        _BATCHES[key] = out
    return _BATCHES[key]


# ---------------------------------------------------------------------------------------------
# Re-exports: the training loops, curves and golden file (training.py) and the design sizes
# (tests/design_sizes.py), under the names the tests and validate_megatron.py use. Imported
# last: both modules import the names above from here.
# ---------------------------------------------------------------------------------------------

from tests.design_sizes import design_persistent_bytes, expected_group_numels  # noqa: E402,F401
from .training import (Curve, _megatron_schedule_loop, _optimizer_config, _train_with_adapter,  # noqa: E402,F401
                       adapter_status, curve, golden_meta, golden_path, load_golden, measured_entry,
                       merge_golden, plain_step, relative_gaps, save_golden, shard_gpt, state_digest,
                       train_megatron_ddp, train_ours, write_measured)
