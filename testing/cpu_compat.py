"""CPU compatibility patches for Megatron-Core 0.19.2 -- FOR THE DEMO AND THE TESTS ONLY.

Megatron-Core hard-codes CUDA in a handful of places that a tiny ``GPTModel`` trained on CPU
(gloo, several real processes) runs through. ``patch_megatron_for_cpu()`` patches exactly those,
only inside Megatron modules and only while the context manager is active:

* never ``torch.cuda`` itself, and never anything in ``megatron_fsdp_v2`` (our engine and the
  Megatron adapter must run unmodified; code of ours that hard-coded CUDA would still fail on CPU);
* this module lives outside the installed package (``testing/`` of the checkout): nothing in
  ``megatron_fsdp_v2`` and nothing in ``examples/pretrain_gpt.py`` imports it, so production (GPU)
  runs never see these patches.

Users: ``examples/megatron_demo.py`` (``make demo``), the CPU tests (``tests/megatron_cpu.py``
re-exports everything here), the functional suite's CPU smoke mode and the benchmarks' CPU dry run
(``UNFUSED_KERNELS`` also on GPUs). The patch list is in ``patch_megatron_for_cpu``'s docstring.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from megatron_fsdp_v2.comm import all_gather_single, reduce_scatter_single

__all__ = [
    "UNFUSED_KERNELS",
    "patch_megatron_for_cpu",
    "init_megatron_parallel_state",
    "destroy_megatron_parallel_state",
    "cpu_model_parallel_manual_seed",
    "distributed_optimizer_on_cpu",
]


#: ``TransformerConfig`` settings that keep every kernel plain PyTorch (Megatron's fusions need
#: Transformer Engine, apex or CUDA extensions): CPU runs need them, and benchmarks use them so
#: every system runs the same kernels.
UNFUSED_KERNELS = dict(bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                       persist_layer_norm=False, apply_rope_fusion=False)


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # torch.cuda.current_device() style
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class _NullStream:
    """Stands in for a CUDA stream / event: every synchronisation is a no-op on CPU."""

    def wait_event(self, *_a, **_k):
        pass

    def wait_stream(self, *_a, **_k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *_a, **_k):
        return self

    def query(self):
        return True


class _CpuCudaNamespace(types.SimpleNamespace):
    """What ``torch.cuda`` looks like to the patched Megatron modules."""

    def __getattr__(self, name):  # anything not overridden: the real torch.cuda
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"  # only ever used as a ``device=`` argument in the patched modules

    @staticmethod
    def current_stream(*_a, **_k):
        return _NullStream()

    @staticmethod
    def stream(*_a, **_k):
        return contextlib.nullcontext()

    @staticmethod
    def Stream(*_a, **_k):  # noqa: N802 (mirrors torch.cuda.Stream)
        return _NullStream()

    @staticmethod
    def synchronize(*_a, **_k):
        pass

    @staticmethod
    def empty_cache():
        pass


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


class _CpuTorchModule(types.ModuleType):
    """Replaces the global name ``torch`` inside selected Megatron modules only.

    Factory functions called with ``device="cuda"`` (or ``torch.cuda.current_device()``)
    allocate on CPU, ``torch.cuda.current_stream()/stream()`` are no-ops; everything else is
    the real ``torch``.
    """

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn")

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCudaNamespace()
        for name in self._FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


# Generator that plays the role of the (absent) CUDA default generator for Megatron's
# CudaRNGStatesTracker.  Keeping it separate from the CPU default generator preserves the
# tracker's "CPU RNG state must not change inside fork()" invariant.
_FAKE_CUDA_GENERATOR = torch.Generator(device="cpu")


def _cpu_get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    return _FAKE_CUDA_GENERATOR.get_state()


def _cpu_set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    _FAKE_CUDA_GENERATOR.set_state(new_state)


def _cpu_tracker_add(self, name, seed):
    """CPU version of ``CudaRNGStatesTracker.add`` (random.py: uses torch.cuda.get_rng_state)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception("seed {} already exists".format(seed))
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception("cuda rng state {} already exists".format(name))
    self.states_[name] = torch.Generator(device="cpu").manual_seed(seed).get_state()


def _cpu_global_memory_buffer_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    """``GlobalMemoryBuffer.get_tensor`` (utils.py) allocating on CPU instead of CUDA."""
    required_len = functools.reduce(lambda a, b: a * b, tensor_shape, 1)
    buf = self.buffer.get((name, dtype), None)
    if buf is None or buf.numel() < required_len:
        buf = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        self.buffer[(name, dtype)] = buf
    return buf[0:required_len].view(*tensor_shape)


def _cpu_local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``utils.local_multi_tensor_l2_norm`` returning a CPU tensor (original: device="cuda")."""
    l2 = [[torch.norm(t) for t in tensor_list] for tensor_list in tensor_lists]
    l2_reduced = torch.norm(torch.tensor(l2))
    return torch.tensor([float(l2_reduced)], dtype=torch.float), None


def _make_cpu_clip_grad_by_total_norm_fp32(clip_grads_module):
    """``clip_grads.clip_grad_by_total_norm_fp32`` without its CUDA-only type assertion.

    The original asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``; the CPU copy asserts
    float32 instead and is otherwise identical (runs in clip_grads' namespace).
    """
    cg = clip_grads_module

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        grads = []
        for param in parameters:
            g = param.decoupled_grad if use_decoupled_grad else param.grad
            if g is None:
                continue
            assert g.dtype in (torch.float32, torch.bfloat16) if use_decoupled_grad else (
                g.dtype == torch.float32
            ), g.dtype
            grads.append(cg.to_local_if_dtensor(g).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        dummy_overflow_buf = torch.zeros(1, dtype=torch.int)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff.clamp_max_(1.0)
            assert cg.multi_tensor_scale_tensor_impl is not None
            cg.multi_tensor_applier(
                cg.multi_tensor_scale_tensor_impl, dummy_overflow_buf, [grads, grads], clip_coeff
            )
        elif clip_coeff < 1.0:
            cg.multi_tensor_applier(
                cg.multi_tensor_scale_impl, dummy_overflow_buf, [grads, grads], clip_coeff
            )

    return clip_grad_by_total_norm_fp32


def _cpu_embedding_sync(original):
    """``LanguageModule.setup_embeddings_and_output_layer`` moves the tied word embedding to CUDA
    (``weight.data.cuda()``) before all-reducing it over the first and last pipeline stages: the
    same call with that move as a no-op (only for the duration of this Megatron method)."""
    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **k: tensor
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    return setup_embeddings_and_output_layer


class _Patcher:
    def __init__(self):
        self._undo: List[Callable[[], None]] = []

    def setattr(self, obj, name, value):
        missing = object()
        old = obj.__dict__.get(name, missing) if hasattr(obj, "__dict__") else getattr(obj, name)

        def undo():
            if old is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

        setattr(obj, name, value)
        self._undo.append(undo)

    def undo(self):
        while self._undo:
            self._undo.pop()()


# Megatron modules whose global ``torch`` is replaced by ``_CpuTorchModule``, and why.
_MODULES_WITH_CPU_TORCH = {
    # forward_backward_no_pipelining: total_num_tokens = torch.zeros([], ..., device="cuda")
    "megatron.core.pipeline_parallel.schedules": "total_num_tokens on cuda",
    # _ParamAndGradBuffer: grad_data/param_data on torch.cuda.current_device();
    # _ParamAndGradBucketGroup.start_grad_sync: torch.cuda.current_stream()
    "megatron.core.distributed.param_and_grad_buffer": "Megatron DDP buffers",
    # MixedPrecisionOptimizer/FP32Optimizer: found_inf, _dummy_overflow_buf, _scale on 'cuda'
    "megatron.core.optimizer.optimizer": "Megatron optimizer scalars",
    # get_grad_norm_fp32 / count_zeros_fp32: total_norm etc. on 'cuda'
    "megatron.core.optimizer.clip_grads": "grad-norm accumulators",
    # dist_checkpointing.save: FileSystemWriterAsync.preload_tensors calls torch.cuda.synchronize()
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "checkpoint writer sync",
    # save_state_dict_async_finalize: the all-ranks failure flag is a tensor on 'cuda'
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "checkpoint failure flag",
    # MoEAlltoAllTokenDispatcher: a class-level torch.cuda.Stream() for device-to-host copies
    "megatron.core.transformer.moe.token_dispatcher": "MoE dispatcher side stream",
    # TopKRouter.gating: moves CPU weights to torch.cuda.current_device() at every forward
    "megatron.core.transformer.moe.router": "MoE router weights",
    # FullCudaGraphWrapper (--cuda-graph-impl full_iteration): StaticBufferLoader's stream, the capture stream
    "megatron.core.full_cuda_graph": "full-iteration graph streams",
}


def _cpu_copy_tensors_in_struct(src):
    """``full_cuda_graph.copy_tensors_in_struct`` without its ``.cuda()``: the static input buffers of
    Megatron's full-iteration CUDA graph, kept on the CPU."""
    if isinstance(src, (tuple, list)):
        return type(src)(_cpu_copy_tensors_in_struct(item) for item in src)
    if isinstance(src, dict):
        return {key: _cpu_copy_tensors_in_struct(value) for key, value in src.items()}
    return src.clone().detach() if isinstance(src, torch.Tensor) else src


def _fresh_full_iteration_graph_state(p: "_Patcher") -> None:
    """``FullCudaGraphWrapper`` counts iterations and keeps its static inputs in class attributes: a
    case starts from none (its warm-up counts from 0) and leaves the next none; its copies go to CPU."""
    import megatron.core.full_cuda_graph as mgraph

    p.setattr(mgraph, "copy_tensors_in_struct", _cpu_copy_tensors_in_struct)
    for name in ("curr_iteration", "cuda_graph", "result"):
        p.setattr(mgraph.FullCudaGraphWrapper, name, dict.fromkeys(("training", "validation"),
                                                                     0 if name == "curr_iteration" else None))
    p.setattr(mgraph.StaticBufferLoader, "static_buffers", {"training": [], "validation": []})


def _gloo_uneven_gather(original):
    """``mappings._gather_along_first_dim`` with uneven ``output_split_sizes`` (MoE token dispatch
    under tensor parallelism) pads every piece to the largest and gathers evenly: gloo's
    ``all_gather`` refuses pieces of different sizes, NCCL's takes them."""
    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        most = max(output_split_sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        out = input_.new_empty((most * group.size(), *input_.shape[1:]))
        all_gather_single(out, padded, group=group)
        return torch.cat([out[r * most:r * most + n] for r, n in enumerate(output_split_sizes)])
    return gather


def _gloo_uneven_reduce_scatter(original):
    """``mappings._reduce_scatter_along_first_dim`` with uneven ``input_split_sizes``: pads every
    piece to the largest and reduce-scatters evenly (gloo has no list reduce-scatter)."""
    @functools.wraps(original)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        most = max(input_split_sizes)
        padded = input_.new_zeros((most * group.size(), *input_.shape[1:]))
        for r, piece in enumerate(torch.split(input_, input_split_sizes, dim=0)):
            padded[r * most:r * most + piece.shape[0]] = piece
        out = input_.new_empty((most, *input_.shape[1:]))
        reduce_scatter_single(out, padded, group=group)
        return out[:input_split_sizes[group.rank()]].contiguous()
    return reduce_scatter


def _cpu_maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` as the token dispatcher sees it: a CUDA tensor comes
    back as numpy when asked; on CPU the original returns the tensor itself, whose split sizes
    gloo's ``all_to_all_single`` refuses (it takes a list of ints)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


@contextlib.contextmanager
def patch_megatron_for_cpu(*extra_modules: str):
    """Context manager applying the minimal CPU patches to Megatron-Core 0.19.2.
    ``extra_modules``: more modules (by name) whose global ``torch`` gets the shim of patch 3,
    e.g. ``"megatron.training.checkpointing"`` (tracker-file iteration checks on 'cuda').

    Patches (all undone on exit):
      1. ``megatron.core.utils.GlobalMemoryBuffer.get_tensor`` allocates on CPU
         (DotProductAttention's baddbmm buffer uses ``torch.cuda.current_device()``).
      2. ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
         and ``CudaRNGStatesTracker.add`` use a dedicated CPU ``torch.Generator`` standing in
         for the CUDA default generator (``tracker.fork()`` is entered by attention and
         embeddings even with dropout 0; ``model_parallel_cuda_manual_seed`` calls ``add``).
      3. The global name ``torch`` inside ``pipeline_parallel.schedules`` (``total_num_tokens``),
         ``distributed.param_and_grad_buffer`` (Megatron DDP grad buffers, streams),
         ``optimizer.optimizer``, ``optimizer.clip_grads`` (scalar tensors on 'cuda') and
         ``dist_checkpointing.strategies.filesystem_async`` / ``state_dict_saver``
         (``torch.cuda.synchronize``, a failure flag on 'cuda') becomes a
         shim mapping ``device="cuda"`` factories and
         ``torch.cuda.current_device()/current_stream()/stream()`` to CPU / no-ops.
      6. MoE (alltoall dispatcher): ``token_dispatcher.maybe_move_tensor_to_cpu`` gives numpy split
         sizes for CPU tensors too (gloo's all-to-all takes lists of ints); the uneven first-dimension
         gather / reduce-scatter of ``tensor_parallel.mappings`` (tokens under TP) pad to the largest
         piece (gloo takes only even ones).
      5. ``LanguageModule.setup_embeddings_and_output_layer`` (pipeline stages sharing the word
         embedding: ``weight.data.cuda()`` before the all-reduce) runs with that move a no-op.
      7. ``full_cuda_graph`` (``--cuda-graph-impl full_iteration``): patch 3's shim for its streams,
         ``copy_tensors_in_struct`` without ``.cuda()``, and ``FullCudaGraphWrapper``'s class-level
         iteration count and ``StaticBufferLoader``'s static inputs fresh for the context.
      4. ``clip_grad_by_total_norm_fp32`` (asserts ``grad.type() == 'torch.cuda.FloatTensor'``)
         is replaced in ``clip_grads`` and ``optimizer.optimizer`` by a copy asserting float32;
         ``clip_grads.l2_norm_impl`` (the no-TE/no-apex fallback allocates on 'cuda') by a CPU copy.
      Building/running the model and the schedule needs 1, 2 and the ``schedules`` shim; the
      other shims and 4 are for Megatron DDP and Megatron optimizers (``FP32Optimizer``,
      ``ChainedOptimizer`` grad norm, clipping).  The shims live in Megatron module globals only,
      so package code imported from those modules' functions would see them too.
      Not covered: ``DistributedOptimizer`` on the non-FSDP path (``param.type()`` checks for
      ``torch.cuda.*Tensor`` in distrib_optimizer.py) and pipeline-parallel p2p.

    ``torch.cuda`` itself is never patched, so package code that hard-codes CUDA still fails.
    """
    import importlib

    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.utils as mutils

    p = _Patcher()
    try:
        p.setattr(mutils.GlobalMemoryBuffer, "get_tensor", _cpu_global_memory_buffer_get_tensor)
        p.setattr(mrandom, "_get_cuda_rng_state", _cpu_get_cuda_rng_state)
        p.setattr(mrandom, "_set_cuda_rng_state", _cpu_set_cuda_rng_state)
        p.setattr(mrandom.CudaRNGStatesTracker, "add", _cpu_tracker_add)
        from megatron.core.models.common.language_module.language_module import LanguageModule

        p.setattr(LanguageModule, "setup_embeddings_and_output_layer",
                  _cpu_embedding_sync(LanguageModule.setup_embeddings_and_output_layer))
        import megatron.core.transformer.moe.token_dispatcher as mdispatch

        p.setattr(mdispatch, "maybe_move_tensor_to_cpu", _cpu_maybe_move_tensor_to_cpu)
        import megatron.core.tensor_parallel.mappings as mmappings

        p.setattr(mmappings, "_gather_along_first_dim", _gloo_uneven_gather(mmappings._gather_along_first_dim))
        p.setattr(mmappings, "_reduce_scatter_along_first_dim",
                  _gloo_uneven_reduce_scatter(mmappings._reduce_scatter_along_first_dim))
        _fresh_full_iteration_graph_state(p)
        shim = _CpuTorchModule()
        for modname in (*_MODULES_WITH_CPU_TORCH, *extra_modules):
            mod = importlib.import_module(modname)
            p.setattr(mod, "torch", shim)
        # Optimizer grad clipping (optimizer.py imported the function by name).
        import megatron.core.optimizer.clip_grads as mclip
        import megatron.core.optimizer.optimizer as mopt

        cpu_clip = _make_cpu_clip_grad_by_total_norm_fp32(mclip)
        p.setattr(mclip, "clip_grad_by_total_norm_fp32", cpu_clip)
        p.setattr(mopt, "clip_grad_by_total_norm_fp32", cpu_clip)
        if mclip.l2_norm_impl is mutils.local_multi_tensor_l2_norm:  # no TE / apex installed
            p.setattr(mclip, "l2_norm_impl", _cpu_local_multi_tensor_l2_norm)
        yield
    finally:
        p.undo()


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _while_patched(method, patch_on, patch_off):
    @functools.wraps(method)
    def run(*args, **kwargs):
        patch_on()
        try:
            return method(*args, **kwargs)
        finally:
            patch_off()
    return run


@contextlib.contextmanager
def distributed_optimizer_on_cpu():
    """Megatron's ``DistributedOptimizer`` on its Megatron-DDP path (not the ``use_megatron_fsdp``
    one) on CPU, for reference runs and checkpoints in the tests (use inside
    ``patch_megatron_for_cpu``):

    * its constructor asks ``param.type()`` for ``'torch.cuda.FloatTensor'`` and the like: while
      it runs, ``Tensor.type()`` (no arguments) names CPU float tensors as CUDA ones;
    * ``get_parameter_state_dp_zero`` (the ``fully_reshardable`` gather) moves tensors with
      ``.cuda()``: a no-op while it runs;
    * its module's global ``torch`` gets patch 3's shim (``torch.cuda.current_device()`` buffers);
    * ``_set_main_param_and_optimizer_states`` leaves Adam's ``step`` alone. Without Transformer
      Engine or apex Megatron falls back to torch's Adam, which keeps ``step`` as a per-parameter
      state tensor (TE's FusedAdam keeps it in ``param_groups``). ``load_state_dict`` sets it from
      the checkpoint's ``param_groups``, then this per-parameter copy raises ``KeyError: 'step'``
      on a ``fully_reshardable`` load and puts the pre-load step back on a ``dp_reshardable`` one;
      skipping it gives the GPU (FusedAdam) behaviour: the saved step;
    * after ``load_state_dict`` every parameter gets its own ``step`` tensor: Megatron hands the
      same tensor to all of them, and torch's Adam then adds 1 to it once per parameter per step.
    """
    import megatron.core.optimizer.distrib_optimizer as mdo

    cls, p = mdo.DistributedOptimizer, _Patcher()
    real_type, real_cuda = torch.Tensor.type, torch.Tensor.cuda

    def cpu_type(tensor, *args, **kwargs):
        name = real_type(tensor, *args, **kwargs)
        return _CUDA_TYPE_NAMES.get(name, name) if not args and not kwargs else name

    def types_on():
        torch.Tensor.type = cpu_type

    def types_off():
        torch.Tensor.type = real_type

    def cuda_on():
        torch.Tensor.cuda = lambda tensor, *a, **k: tensor

    def cuda_off():
        torch.Tensor.cuda = real_cuda

    try:
        p.setattr(cls, "__init__", _while_patched(cls.__init__, types_on, types_off))
        p.setattr(cls, "get_parameter_state_dp_zero", _while_patched(cls.get_parameter_state_dp_zero, cuda_on, cuda_off))
        p.setattr(mdo, "torch", _CpuTorchModule())
        set_states = cls._set_main_param_and_optimizer_states

        def set_states_but_step(self, model_param, tensors):
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            step = state.pop("step", None)
            try:
                return set_states(self, model_param, {k: v for k, v in tensors.items() if k != "step"})
            finally:
                if step is not None:
                    state["step"] = step

        p.setattr(cls, "_set_main_param_and_optimizer_states", set_states_but_step)
        load_state_dict = cls.load_state_dict

        def load_with_own_steps(self, state_dict):
            load_state_dict(self, state_dict)
            for state in self.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()

        p.setattr(cls, "load_state_dict", load_with_own_steps)
        yield
    finally:
        p.undo()


# ---------------------------------------------------------------------------------------------
# Parallel state
# ---------------------------------------------------------------------------------------------


def cpu_model_parallel_manual_seed(seed: int) -> None:
    """CPU replacement for ``tensor_parallel.model_parallel_cuda_manual_seed``.

    Seeds the CPU default generator with ``seed`` and registers Megatron's RNG-tracker states
    (``model_parallel_cuda_manual_seed`` itself works under ``patch_megatron_for_cpu`` too;
    its ``torch.cuda.manual_seed`` is lazily queued and never executed without a GPU).
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_megatron_parallel_state(world_size: Optional[int] = None, seed: int = 1234, **kwargs):
    """Initialise Megatron's parallel_state on top of an existing gloo default group.

    ``initialize_model_parallel(1, 1)`` works unchanged on gloo (DP group = all ranks).
    Must be called inside ``patch_megatron_for_cpu()`` (the RNG seeding uses patch 2).
    Extra kwargs go to ``initialize_model_parallel``.
    """
    from megatron.core import parallel_state as ps

    assert dist.is_initialized(), "call torch.distributed.init_process_group('gloo') first"
    if world_size is not None:
        assert dist.get_world_size() == world_size
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    kwargs.setdefault("tensor_model_parallel_size", 1)
    kwargs.setdefault("pipeline_model_parallel_size", 1)
    ps.initialize_model_parallel(**kwargs)
    cpu_model_parallel_manual_seed(seed)


def destroy_megatron_parallel_state():
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


