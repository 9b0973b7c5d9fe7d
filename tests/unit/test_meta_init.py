"""Models built on the meta device (issue: meta-device initialization), CPU gloo at dp 1, 2 and 4.

* Meta construction + ``fully_shard`` gives bitwise the weights of eager construction +
  ``fully_shard`` for every strategy: transformer-encoder layers (``nn.MultiheadAttention``'s
  ``_reset_parameters`` after its ``out_proj``), a tied embedding / head, 0-d parameters.
* ``init_fn`` replaces ``reset_parameters``; parameters and buffers nothing initializes raise naming them.
* Peak bytes while wrapping <= this rank's persistent bytes afterwards + one unit's full fp32 weights
  + 1 MiB (counted by a dispatch mode that tracks every CPU storage an op creates).
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard
from megatron_fsdp_v2.wrap.meta_init import _post_order

from .dist_utils import run_distributed

WORLDS = (1, 2, 4)


class Encoder(nn.Module):
    """Transformer-encoder layers built one by one (``nn.TransformerEncoder`` deep-copies one layer:
    its eager layers are equal, which no initialization after construction replays)."""

    def __init__(self, width=16, depth=2, ffn=32):
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, 2, ffn, dropout=0.0, batch_first=True)
                                    for _ in range(depth))
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


class Tied(nn.Module):
    """Embedding and head share one weight; eager ties ``embedding.weight = head.weight`` (the head's
    initialization is the last writer, as under meta initialization)."""

    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.embedding.weight = self.head.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embedding(tokens))))


class Gain(nn.Module):
    """A 0-d parameter with its own reset_parameters."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.gain, 0.5, 1.5)

    def forward(self, x):
        return x * self.gain


class WithScalars(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.g = Gain()
        self.b = nn.Linear(6, 2)

    def forward(self, x):
        return self.b(self.g(self.a(x)))


MODELS = {"encoder": (Encoder, [nn.TransformerEncoderLayer]), "tied": (Tied, None), "scalars": (WithScalars, [Gain])}


def _wrapped_weights(build, units, strategy, meta):
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            module = build()
    else:
        module = build()
    model = fully_shard(module, sharding_strategy=strategy, unit_modules=units)
    return model.full_state_dict()


def bitwise_worker(rank, world):
    out = {}
    for name, (build, units) in MODELS.items():
        for strategy in STRATEGY_NAMES:
            eager = _wrapped_weights(build, units, strategy, meta=False)
            meta = _wrapped_weights(build, units, strategy, meta=True)
            out[(name, strategy)] = (sorted(eager) == sorted(meta),
                                     [k for k in eager if k in meta and not torch.equal(eager[k], meta[k])],
                                     len(eager))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_meta_initialization_equals_eager_initialization(world):
    for rank, out in enumerate(run_distributed(bitwise_worker, world)):
        for key, (same_keys, differing, count) in out.items():
            assert same_keys and count > 0, (world, rank, key)
            assert differing == [], (world, rank, key)


class LiveBytes(TorchDispatchMode):
    """Bytes of CPU storages created by ops and still referenced; the peak of that."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if type(t) is torch.Tensor and t.device.type == "cpu":   # not wrappers (DTensor): no storage
                self._track(t)
        return out

    def _track(self, t):
        # by the storage, not the tensor object: ``param.data = torch.empty(...)`` drops the
        # tensor at once while the parameter keeps its storage (storages keep their Python object
        # as long as they live, so the finalizer runs when the memory is freed)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.now += self.live[key]
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._drop, key)

    def _drop(self, key):
        size = self.live.pop(key, None)
        if size is not None:
            self.now -= size


def memory_worker(rank, world):
    out = {}
    for strategy in STRATEGY_NAMES:
        torch.manual_seed(0)
        with torch.device("meta"):
            module = Encoder(width=256, depth=4, ffn=1024)           # 12.6 MB of fp32 weights
        with LiveBytes() as tracker:
            model = fully_shard(module, sharding_strategy=strategy, unit_modules=[nn.TransformerEncoderLayer])
        persistent = model.persistent_bytes()["total"]
        unit_full = max(sum(g.layout.total_numel * 4 for g in unit.groups) for unit in model._fsdp_engine.units)
        out[strategy] = (tracker.peak, persistent, unit_full, 4 * sum(p.numel() for p in module.parameters()))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_wrapping_from_meta_keeps_only_shards(world):
    for rank, out in enumerate(run_distributed(memory_worker, world)):
        for strategy, (peak, persistent, unit_full, model_bytes) in out.items():
            print(f"dp {world} rank {rank} {strategy}: peak {peak} B, persistent {persistent} B, "
                  f"one unit {unit_full} B, model {model_bytes} B")
            assert peak <= persistent + unit_full + (1 << 20), (world, rank, strategy, peak, persistent, unit_full)
            assert unit_full < model_bytes / 3                            # the bound is not the whole model


class NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, 4))

    def forward(self, x):
        return x @ self.w


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("freqs", torch.empty(4))

    def forward(self, x):
        return self.lin(x) * self.freqs


def errors_worker(rank, world):
    out = {}
    for name, build in (("param", NoInit), ("buffer", Rotary)):
        with torch.device("meta"):
            module = build()
        try:
            fully_shard(module, sharding_strategy="optim_grads_params")
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)

    def init_fn(m):                               # the documented way: fill what reset_parameters does not
        if isinstance(m, NoInit):
            nn.init.ones_(m.w)
        if isinstance(m, Rotary):
            m.lin.reset_parameters()
            m.freqs.copy_(torch.arange(4.0))
    for name, build in (("param_init_fn", NoInit), ("buffer_init_fn", Rotary)):
        with torch.device("meta"):
            module = build()
        model = fully_shard(module, sharding_strategy="optim_grads", init_fn=init_fn)
        full = model.full_state_dict()
        out[name] = full["w"].sum().item() if "w" in full else model.freqs.tolist()
    return out


def test_uninitialized_parameters_and_buffers_raise_and_init_fn_fills_them():
    for out in run_distributed(errors_worker, 2):
        assert "parameters ['w'] were built on the meta device but no initializer covers them" in out["param"]
        assert "init_fn" in out["param"]
        assert "buffers ['freqs'] are still on the meta device" in out["buffer"]
        assert out["param_init_fn"] == 12.0
        assert out["buffer_init_fn"] == [0.0, 1.0, 2.0, 3.0]


def _init_fn_worker(rank, world):
    from megatron_fsdp_v2 import MixedPrecisionPolicy

    def reinit(module):                    # every module is a step; only leaves with weights write
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        elif isinstance(module, nn.MultiheadAttention):
            module._reset_parameters()

    out = {}
    for strategy in ("optim_grads_params", "optim"):
        states, peaks = [], []
        for meta in (False, True):
            torch.manual_seed(0)
            tracker = LiveBytes()
            with tracker:
                with torch.device("meta") if meta else torch.device("cpu"):
                    module = Encoder(width=128, depth=4, ffn=512)
                model_bytes = 4 * sum(p.numel() for p in module.parameters())
                torch.manual_seed(1)         # (eager construction drew its own values first)
                if not meta:                 # the same initializers in the same (post-)order
                    for m in [m for _, m in _post_order(module)]:
                        reinit(m)
                model = fully_shard(module, sharding_strategy=strategy, unit_modules=[nn.TransformerEncoderLayer],
                                    mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                                    init_fn=reinit if meta else None)
            peaks.append(tracker.peak - model.persistent_bytes()["total"])
            states.append(model.full_state_dict())
        eager, meta = states
        out[strategy] = ([k for k in eager if not torch.equal(eager[k], meta[k])], peaks[1] / model_bytes)
    return out


def test_an_init_fn_run_on_every_module_keeps_one_module_materialized_and_its_values_in_fp32():
    # With init_fn every module is an initializer step, the root's too: its subtree is the model,
    # so the whole model stayed materialized until the root's step (a 66.7B GPT at a fake 8-way
    # group ran out of memory in the wrap: docs/benchmarks_history.md, "Offload, 2026-12-03 evening"). Only the
    # parameters an initializer touches count now. And ZeRO-3's placeholders already carried the
    # bf16 compute dtype, so the values were drawn in bf16: they are drawn in the dtype the model
    # was built in, bitwise the eager initialization's.
    for rank, out in enumerate(run_distributed(_init_fn_worker, 2)):
        for strategy, (differing, peak_share) in out.items():
            assert differing == [], (rank, strategy, differing)
            assert peak_share < 0.25, (rank, strategy, peak_share)


class AssignsData(nn.Module):
    """An initializer that replaces ``.data`` instead of writing into it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 3))
        self.b = nn.Parameter(torch.empty(3))

    def reset_parameters(self):
        self.w.data = torch.full_like(self.w, 2.0)     # reads w: the dry run sees it touched
        nn.init.constant_(self.b, 3.0)

    def forward(self, x):
        return x @ self.w + self.b


def _assigns_data_worker(rank, world):
    out = {}
    for strategy in ("optim_grads_params", "no_shard"):
        with torch.device("meta"):
            module = AssignsData()
        full = fully_shard(module, sharding_strategy=strategy).full_state_dict()
        out[strategy] = (full["w"].unique().tolist(), full["b"].unique().tolist())
    return out


def test_an_initializer_that_assigns_data_lands_in_the_main_weights_at_dp1():
    """At dp 1 (and under no_shard) initializers write straight into the main piece; an initializer
    that sets ``.data`` to a new tensor instead still has its values stored (wrap/meta_init.py)."""
    (out,) = run_distributed(_assigns_data_worker, 1)
    assert out == {"optim_grads_params": ([2.0], [3.0]), "no_shard": ([2.0], [3.0])}
