"""A deleted model is freed: after ``del model, optimizer; gc.collect()`` nothing of it is alive.

Training loops that rebuild models (RL reference models, notebooks, sweeps) would otherwise leak
one model per rebuild. The traps are references the cycle collector cannot see: autograd nodes
holding Python objects (saved-tensor hooks, packed tensors) and state torch copies from the
thread (the saved-tensor hooks active while an async collective is issued).
"""

import contextlib
import gc
import weakref
from typing import Optional

import torch

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard
from megatron_fsdp_v2.runtime.pre_backward import ForwardRecord, SavedWeightHooks
from testing.settled import settled

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn


def _describe(tensor) -> str:
    """A live tensor in words: its type, shape and dtype, and the types of what holds it."""
    holders = sorted({type(r).__qualname__ for r in gc.get_referrers(tensor)} - {"list", "frame"})
    return f"{type(tensor).__name__}{tuple(tensor.shape)} {tensor.dtype} held by {holders}"


def _live_tensors(known: Optional[frozenset] = None) -> tuple[int, int, frozenset, list]:
    """(count, storage bytes, ids, the tensors not in ``known`` in words) of the tensors the cycle
    collector can see, once settled (testing/settled.py)."""
    count, nbytes, alive = settled(_tensors_now, key=lambda reading: reading[:2])
    new = [_describe(t) for i, t in alive.items() if known is not None and i not in known]
    return count, nbytes, frozenset(alive), new


def _tensors_now() -> tuple[int, int, dict]:
    count = nbytes = 0
    alive = {}
    for obj in gc.get_objects():
        if torch.Tensor in type(obj).__mro__:          # (isinstance would run DTensor's instance check)
            count += 1
            alive[id(obj)] = obj
            if type(obj) in (torch.Tensor, torch.nn.Parameter):
                nbytes += obj.untyped_storage().nbytes()
    return count, nbytes, alive


def _build_train_drop(rank: int, strategy: str) -> dict:
    """Build, train two steps (a no_sync micro-batch each), run an evaluation forward and a
    training forward whose backward never runs, drop everything; return weak references."""
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches(0, rank, 2)
    for _ in range(2):
        for i, (x, y) in enumerate(batches):
            with (model.no_sync() if i == 0 else contextlib.nullcontext()):
                loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model(batches[0][0])
    abandoned = loss_fn(model(batches[1][0]), batches[1][1])     # its backward never runs
    refs = {
        "module": weakref.ref(model),
        "engine": weakref.ref(model._fsdp_engine),
        "main parameter": weakref.ref(next(iter(model.parameters()))),
        "compute parameter": weakref.ref(model.blocks[0].up.weight),
        "group": weakref.ref(model._fsdp_engine.groups[-1]),
        "forward hook": weakref.ref(next(iter(model._forward_pre_hooks.values()))),
        "gradient hook": weakref.ref(next(iter(model.blocks[0].up.weight._post_accumulate_grad_hooks.values()))),
        "allocator": weakref.ref(model._fsdp_engine.allocator),
    }
    del model, opt, abandoned
    return refs


def lifetime_worker(rank, world_size):
    out = {}
    for strategy in STRATEGY_NAMES:
        figures, alive = [], None
        for _ in range(2):
            refs = _build_train_drop(rank, strategy)
            count, nbytes, alive, new = _live_tensors(alive)
            figures.append((count, nbytes, new))
            out.setdefault(strategy, []).append(sorted(k for k, r in refs.items() if r() is not None))
        out[strategy].append(figures)
    return out


def test_a_deleted_model_leaves_nothing_alive_every_strategy():
    for rank, out in enumerate(run_distributed(lifetime_worker, 2)):
        for strategy, (first, second, figures) in out.items():
            print(f"rank {rank} {strategy}: alive after 1st {first}, 2nd {second}; "
                  f"(tensors, bytes) after each {figures}")
            assert first == [] and second == [], (rank, strategy, first, second)
            # a second cycle: no growth (the third item names the tensors the second cycle left)
            assert figures[1] == figures[0][:2] + ([],), (rank, strategy, figures)


class _GroupStandIn:
    """What the hooks read of a group: its gathered compute weights."""

    def __init__(self) -> None:
        self.model_weights = torch.ones(8)


def test_saved_tensor_hooks_handed_to_autograd_hold_nothing_of_the_model():
    """torch may keep the thread's saved-tensor hooks beyond the forward (they are part of the
    thread-local state an async collective captures): holding them must not hold the groups."""
    group = _GroupStandIn()
    hooks = SavedWeightHooks(lambda record, g: None, [group], ForwardRecord())
    hooks.enter()
    kept = torch._C._autograd._top_saved_tensors_default_hooks(False)
    hooks.exit()
    assert kept is not None and len(kept) == 2
    group_ref, hooks_ref = weakref.ref(group), weakref.ref(hooks)
    del group, hooks
    gc.collect()
    assert group_ref() is None and hooks_ref() is None
    pack, unpack = kept
    assert unpack(pack(torch.ones(2))).tolist() == [1.0, 1.0]     # still callable, holding nothing


def test_a_saved_activation_is_packed_without_its_history():
    """Packing a node's own output with its grad_fn would make the node hold itself through C++:
    a forward whose backward never runs would keep its graph (and the weights it saved) forever."""
    weights = _GroupStandIn()
    hooks = SavedWeightHooks(lambda record, g: None, [weights], ForwardRecord())
    x = torch.randn(3, requires_grad=True)
    y = x.tanh()
    packed = hooks.pack(y)
    assert packed.grad_fn is None and packed.data_ptr() == y.data_ptr()
    assert hooks.pack(x) is x                       # a leaf is kept as is (a parameter re-gathered later)
