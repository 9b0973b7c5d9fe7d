"""Machinery shared by the ported upstream suites (``test_upstream_*.py``).

Each suite runs one worker per world size (``run_distributed``) that executes every ported case
for every strategy and returns a report; the pytest functions only read that report. So that one
broken case cannot take the others down:

* every (case, strategy) runs on its own gloo group with a short timeout (a rank that raised while
  the other waits in a collective turns into a timeout error there instead of a hang), and the
  ranks meet on the default group after each case;
* checks never raise: ``Checks`` records mismatches and the case keeps going, so all ranks issue
  the same collectives whatever the numbers are. Only exceptions from the code under test abort a
  case; they are recorded with their traceback.

Reference models are plain (unwrapped) copies fed the same per-rank batch whose gradients are
averaged over the group by hand: what torch DDP / FSDP2's ``replicate`` reference computes.
Full weights are read with ``model.full_state_dict()`` and full gradients with ``full_grads``, so
nothing here depends on how a strategy lays out its shards.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from datetime import timedelta
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard

from .dist_utils import run_distributed

CASE_TIMEOUT_S = 30.0
ONLY = os.environ.get("UPSTREAM_ONLY")      # debugging: run a comma-separated subset of cases

all_strategies = pytest.mark.parametrize("strategy", STRATEGY_NAMES)


class CaseSkipped(Exception):
    """Raised by a case when it does not apply to a strategy; the message is the reason."""


@dataclasses.dataclass
class Ctx:
    """What a case function gets: this rank, its group, and the recorder of failed checks."""

    rank: int
    world: int
    group: dist.ProcessGroup
    checks: "Checks"
    info: dict

    def shard(self, module: nn.Module, strategy: str, **kwargs) -> nn.Module:
        return fully_shard(module, sharding_strategy=strategy, process_group=self.group, **kwargs)

    def average_grads(self, ref: nn.Module) -> None:
        """DDP's gradient: the mean over ranks of each rank's local gradient (None stays None)."""
        for param in ref.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=self.group)
                param.grad.div_(self.world)

    def all_true(self, flag: bool) -> bool:
        """True when ``flag`` holds on every rank of the group."""
        t = torch.tensor([0 if flag else 1], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        return int(t.item()) == 0

    def any_true(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        return int(t.item()) > 0


class Checks:
    """Records failed comparisons instead of raising (see the module docstring)."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def fail(self, message: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(message)

    def true(self, condition, message: str) -> bool:
        if not bool(condition):
            self.fail(message)
            return False
        return True

    def close(self, label: str, got, want, rtol: Optional[float] = None, atol: Optional[float] = None) -> bool:
        """``torch.testing.assert_close`` (its dtype-based defaults when rtol/atol are None), recorded."""
        try:
            if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape != want.shape:
                raise AssertionError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
            kwargs = {} if rtol is None and atol is None else {"rtol": rtol or 0.0, "atol": atol or 0.0}
            torch.testing.assert_close(got, want, check_dtype=False, **kwargs)
            return True
        except AssertionError as err:
            text = str(err).strip().splitlines()
            self.fail(f"{label}: " + " | ".join(line.strip() for line in text[:4]))
            return False

    def equal(self, label: str, got, want) -> bool:
        return self.close(label, got, want, rtol=0.0, atol=0.0)

    def weights(self, model: nn.Module, ref: nn.Module, label: str = "weights", rtol=None, atol=None,
                rename: Optional[Callable[[str], str]] = None) -> None:
        """Full weights of the wrapped model against the reference's parameters and buffers."""
        full = model.full_state_dict()
        if rename is not None:
            full = {rename(k): v for k, v in full.items()}
        for name, want in ref.state_dict().items():
            if name not in full:
                self.fail(f"{label}: {name} missing from full_state_dict (keys {sorted(full)[:6]}...)")
                continue
            self.close(f"{label} {name}", full[name].to(want.dtype), want, rtol=rtol, atol=atol)

    def grads(self, model: nn.Module, ref: nn.Module, group, label: str = "grads", rtol=None, atol=None,
              rename: Optional[Callable[[str], str]] = None) -> None:
        """Full gradients of the wrapped model against the reference's ``.grad`` (None must match)."""
        got, state = full_grads(model, group)
        if rename is not None:
            got = {rename(k): v for k, v in got.items()}
            state = {rename(k): v for k, v in state.items()}
        for name, param in ref.named_parameters():
            if name not in state:
                continue          # a tied alias: checked under its first name
            if state[name] == "mixed":
                self.fail(f"{label} {name}: .grad is None on some ranks only")
                continue
            if param.grad is None or state[name] == "none":
                self.true(param.grad is None and state[name] == "none",
                          f"{label} {name}: reference grad is {'None' if param.grad is None else 'set'}, "
                          f"ours is {state[name]}")
                continue
            self.close(f"{label} {name}", got[name].to(param.grad.dtype), param.grad, rtol=rtol, atol=atol)


def full_grads(model: nn.Module, group) -> tuple[dict, dict]:
    """({name: full gradient}, {name: "set" / "none" / "mixed"}) of a wrapped model.

    The optimizer-facing parameters are this rank's main-weight shards and ``full_state_dict()``
    gathers them, whatever the layout: copy each shard's gradient into it, gather, put the weights
    back. Only call it when no autograd graph that saved those weights is still pending."""
    mains = dict(model.named_parameters())
    names = list(mains)
    flags = torch.tensor([1 if mains[n].grad is not None else 0 for n in names], dtype=torch.int64)
    total = flags.clone()
    dist.all_reduce(total, group=group)
    size = dist.get_world_size(group)
    state = {}
    for i, name in enumerate(names):
        count = int(total[i])
        state[name] = "set" if count == size else ("none" if count == 0 else "mixed")
    saved = {}
    with torch.no_grad():
        for name, main in mains.items():
            saved[name] = main.detach().clone()
            main.copy_(main.grad if main.grad is not None else torch.zeros_like(main))
        gathered = model.full_state_dict()
        for name, main in mains.items():
            main.copy_(saved[name])
    return {n: gathered[n] for n in names}, state


def _new_group():
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=CASE_TIMEOUT_S))


def _drop_group(group) -> None:
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - a timed-out group may refuse; it is not used again
        pass


def run_cases(rank: int, world: int, cases: list, strategies=STRATEGY_NAMES, only=None) -> dict:
    """Run ``case(ctx, strategy)`` for every case and strategy; {(case name, strategy): result}.

    ``cases`` holds functions or (name, function) pairs; with ``only`` (case names) the others are
    left out. A result is ``("ok", failures, info)``, ``("skip", reason, info)`` or ``("error",
    traceback, info)``; ``info["seconds"]`` is the time the case took. Each case gets a fresh group,
    replaced after a strategy errored on any rank."""
    report = {}
    for entry in cases:
        name, fn = entry if isinstance(entry, tuple) else (entry.__name__.removeprefix("case_"), entry)
        if only is not None and name not in only:
            continue
        group = _new_group()
        for strategy in strategies:
            checks, info = Checks(), {}
            ctx = Ctx(rank, world, group, checks, info)
            start, cpu = time.perf_counter(), time.process_time()
            try:
                fn(ctx, strategy)
                result = ("ok", checks.failures, info)
            except CaseSkipped as skip:
                result = ("skip", str(skip), info)
            except Exception:  # noqa: BLE001 - reported per case
                result = ("error", traceback.format_exc(limit=12)[-3000:], info)
            info["seconds"] = time.perf_counter() - start
            info["cpu_seconds"] = time.process_time() - cpu
            report[(name, strategy)] = result
            errored = torch.tensor([1 if result[0] == "error" else 0])
            dist.all_reduce(errored)                  # on the default group: `group` may be broken
            if int(errored.item()):
                _drop_group(group)
                group = _new_group()
        _drop_group(group)
    return report


def reports_fixture(worker, world_size: int, label: str):
    """A module-scoped fixture: the reports of ``worker(rank, world_size, root, only)`` run on
    ``world_size`` ranks, ``root`` a fresh directory named after ``label``, ``only`` the cases
    UPSTREAM_ONLY names (None: all). Assign it to the fixture's name in the test module."""

    @pytest.fixture(scope="module")
    def reports(tmp_path_factory):
        return run_distributed(worker, world_size, str(tmp_path_factory.mktemp(label)),
                               ONLY.split(",") if ONLY else None, timeout=600.0)

    return reports


def check(reports: list, name: str, strategy: str) -> None:
    """``check_report``, or a skip where UPSTREAM_ONLY left the case out."""
    if (name, strategy) not in reports[0]:
        pytest.skip("not selected by UPSTREAM_ONLY")
    check_report(reports, name, strategy)


def check_report(reports: list, name: str, strategy: str) -> None:
    """pytest side: fail with every rank's failures or traceback; skip with the case's reason."""
    results = [r[(name, strategy)] for r in reports]
    errors = [f"rank {i}:\n{res[1]}" for i, res in enumerate(results) if res[0] == "error"]
    if errors:
        pytest.fail(f"{name}[{strategy}] raised:\n" + "\n".join(errors), pytrace=False)
    failures = [f"rank {i}: {msg}" for i, res in enumerate(results) if res[0] == "ok" for msg in res[1]]
    if failures:
        pytest.fail(f"{name}[{strategy}]:\n" + "\n".join(failures[:12]), pytrace=False)
    if all(res[0] == "skip" for res in results):
        pytest.skip(results[0][1])


# ---------------------------------------------------------------- models shared by the suites
class MLP(nn.Module):
    """Linear -> ReLU -> Linear -> ReLU (+ an optional buffer), like FSDP2's test MLP."""

    def __init__(self, dim: int, hidden_mult: int = 4, bias: bool = True, with_buffer: bool = False) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden_mult * dim, bias=bias)
        self.out_proj = nn.Linear(hidden_mult * dim, dim, bias=bias)
        if with_buffer:
            self.register_buffer("offset", torch.randn(dim))
        else:
            self.offset = None

    def forward(self, x):
        z = F.relu(self.out_proj(F.relu(self.in_proj(x))))
        return z if self.offset is None else z + self.offset


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    """Decoder-only LM: token + position embeddings, ``layers`` blocks, norm, output head
    (optionally tied to the token embedding). ``checkpoint_blocks`` recomputes each block
    in backward with ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, layers: int = 2, seq: int = 8,
                 tie: bool = False, checkpoint_blocks: bool = False) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.output.weight = self.tok.weight
        self.checkpoint_blocks = checkpoint_blocks

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            if self.checkpoint_blocks:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.output(self.norm(h))


class DoubleLinear(nn.Module):
    """Two linears on the same input; returns both outputs or only the first."""

    def __init__(self, dim: int, use_second_linear: bool = True) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.use_second_linear = use_second_linear

    def forward(self, x):
        if self.use_second_linear:
            return F.relu(self.lin1(x)), F.relu(self.lin2(x))
        return F.relu(self.lin1(x))


def live_temporary_bytes(model: nn.Module) -> int:
    """Bytes of temporary full-size buffers (ZeRO-3 gathered weights, ZeRO-2/3 full grads) still
    allocated: docs/design.md, "Allocators"."""
    engine = getattr(model, "_fsdp_engine", None)
    if engine is None:                      # the attribute's earlier name
        engine = model._fsdp
    return int(engine.allocator.live_bytes)
