#!/usr/bin/env python3
"""Checkpoints that do not stop training (issue 64): issue 47's 8B-shaped Hugging Face Llama (8
decoder layers, hidden 4096, intermediate 14336, GQA 32/8; fp32 main weights and AdamW state, 22.6
GiB at dp 1) on one GPU, saved to local disk by ours and by torch FSDP2 + DCP, side by side::

    python benchmarks/bench_checkpoint.py --dir /tmp/bench_checkpoint --out results.md --json results.json
    python benchmarks/bench_checkpoint.py --tiny        # CPU smoke (gloo, 1 rank; seconds)

Each system runs in a process of its own, one after the other (``--in-process``: one process,
cleaned up between systems; ``--tiny`` does that). Per system, in this order, so that at most one
checkpoint (24 GB) is on the disk at a time:

1. build the model (bf16 compute, fp32 main weights, fused AdamW), ``--warmup`` steps, then
   ``--steps`` timed steps: the normal step time (median);
2. an asynchronous save (ours: ``async_save_checkpoint``; FSDP2: ``dcp.async_save`` of
   ``get_state_dict``, DCP's default staging, on a gloo group of its own as torchtitan does): the
   time training is blocked (until the call returns), the time until the background write and
   commit complete, and every step that starts while it writes (run back to back until it is
   done); ours twice (the first allocates the staging buffers, the second reuses them);
3. a synchronous save (ours: ``save_checkpoint``; FSDP2: ``dcp.save``): the time it blocks;
4. a load of that checkpoint into the same model (ours: ``load_checkpoint``; FSDP2: ``dcp.load``
   then ``set_state_dict``), from the page cache as it was just written.

GPU memory: the staging an asynchronous save adds while it blocks (``max_memory_allocated`` and
``max_memory_reserved`` above what was allocated / reserved when it began), and the peak
allocated / reserved from the start of the last asynchronous save to the end of the load.

Then a resharding load per system: the dp-1 checkpoint of step 3 loaded by rank 0 of torch's fake
8-way group (``init_process_group("fake")``: collectives are no-ops, so a rank reads its eighth of
the state as it would at dp 8), ours as ``--reshard-strategy`` (ZeRO-1 by default; saved as
ZeRO-3), FSDP2 as itself. The goals of issue 64 are checked at the end (one run, one GPU).
``--time-budget S`` skips what would start after S seconds (named in the results).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _path in (REPO, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_llama import DEFAULTS as LLAMA, build_llama, decoder_layers  # noqa: E402

GIB = float(1 << 30)
TINY = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128, seq=32, micro_batch=2)
PHASES = ("ours", "fsdp2", "reshard-ours", "reshard-fsdp2")


# =============================================================================================
# One system: build, train, save, load
# =============================================================================================


def init_group(args, fake_world: int = 0) -> torch.device:
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_world)
    else:
        from tests.dist_pool import free_port

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return device


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args, device, kind: str, strategy: str):
    """``(model, optimizer, tokens)``: the Llama from seed 1234 under ours or FSDP2, fused AdamW."""
    model = build_llama(SimpleNamespace(args=args, device=device))
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

        model = fully_shard(model, sharding_strategy=strategy, unit_modules=[LlamaDecoderLayer],
                            mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True if device.type == "cuda" else None)
    g = torch.Generator().manual_seed(1000)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device)
    return model, opt, tokens


def step(model, opt, tokens) -> None:
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def memory(device, counter: str) -> Optional[float]:
    """``torch.cuda.<counter>`` in GiB (``max_memory_allocated``, ``memory_reserved``, ...); None on CPU."""
    return getattr(torch.cuda, counter)(device) / GIB if device.type == "cuda" else None


def timed(fn: Callable, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


class Ours:
    """megatron_fsdp_v2's calls."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def save(self, path):
        from megatron_fsdp_v2 import save_checkpoint

        save_checkpoint(path, self.model, self.opt)

    def async_save(self, path):
        from megatron_fsdp_v2 import async_save_checkpoint

        return async_save_checkpoint(path, self.model, self.opt)

    def load(self, path):
        from megatron_fsdp_v2 import load_checkpoint

        load_checkpoint(path, self.model, self.opt)


class Fsdp2:
    """torch FSDP2 + DCP's calls, on ``get_state_dict`` (torchtitan's recipe)."""

    def __init__(self, model, opt):
        self.model, self.opt, self.gloo = model, opt, None

    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, path):
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state(), checkpoint_id=path)

    def async_save(self, path):
        import torch.distributed.checkpoint as dcp

        if self.gloo is None:
            self.gloo = dist.new_group(backend="gloo")
        return dcp.async_save(self.state(), checkpoint_id=path, process_group=self.gloo)

    def load(self, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self.state()
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def async_round(api, path: str, device, model, opt, tokens, max_steps: int) -> Dict[str, Any]:
    """One asynchronous save while training goes on: blocking time, time to completion, the steps
    that started while it wrote."""
    done: List[float] = []
    sync(device)
    before = memory(device, "memory_allocated"), memory(device, "memory_reserved")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    future = api.async_save(path)
    blocked = time.perf_counter() - start
    future.add_done_callback(lambda _: done.append(time.perf_counter()))
    extra = [None if b is None else memory(device, name) - b
             for b, name in zip(before, ("max_memory_allocated", "max_memory_reserved"))]
    during = []
    while not future.done() and len(during) < max_steps:
        during.append(timed(lambda: step(model, opt, tokens), device))
    future.result()
    return dict(blocking_s=blocked, complete_s=(done[0] if done else time.perf_counter()) - start,
                staging_gpu_gib=extra[0], staging_gpu_reserved_gib=extra[1], steps_during_write_s=during,
                step_during_write_s=statistics.median(during) if during else None)


def run_system(args, kind: str) -> Dict[str, Any]:
    """Phases 1-4 of the docstring for ``kind``; the synchronous checkpoint stays for the reshard phase."""
    device = init_group(args)
    out: Dict[str, Any] = dict(system=kind, skipped=[])
    model, opt, tokens = build(args, device, kind, "optim_grads_params")
    api = Ours(model, opt) if kind == "ours" else Fsdp2(model, opt)
    for _ in range(args.warmup):
        step(model, opt, tokens)
    out["step_s_all"] = [timed(lambda: step(model, opt, tokens), device) for _ in range(args.steps)]
    out["step_s"] = statistics.median(out["step_s_all"])
    out["state_gib"] = sum(t.numel() * t.element_size() for t in _local_tensors(model, opt)) / GIB
    work = os.path.join(args.dir, kind)
    rounds = ("first", "second") if kind == "ours" else ("first",)
    for name in rounds:
        if over_budget(args):
            out["skipped"].append(f"async save ({name})")
            continue
        out[f"async_{name}"] = async_round(api, f"{work}_async", device, model, opt, tokens, args.max_write_steps)
        shutil.rmtree(f"{work}_async", ignore_errors=True)
    if kind == "ours" and "async_first" in out:
        from megatron_fsdp_v2.checkpoint.save_load import _stager_of

        out["staging_host_gib"] = _stager_of(model).host_bytes / GIB
    if over_budget(args):
        out["skipped"] += ["sync save", "load"]
    else:
        out["sync_save_s"] = timed(lambda: api.save(f"{work}_sync"), device)
        out["load_s"] = timed(lambda: api.load(f"{work}_sync"), device)
    # from the last asynchronous save to the end of the load (the staging a checkpoint adds); None on CPU
    out["peak_gib"] = memory(device, "max_memory_allocated")
    out["reserved_gib"] = memory(device, "max_memory_reserved")
    return out


def _local_tensors(model, opt) -> list:
    from megatron_fsdp_v2.row_sharded import local_piece

    pieces = [local_piece(p.detach()) for p in model.parameters()]
    return pieces + [local_piece(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def run_reshard(args, kind: str) -> Dict[str, Any]:
    """The dp-1 checkpoint of ``kind`` loaded by rank 0 of a fake 8-way group."""
    device = init_group(args, fake_world=args.fake_world_size)
    strategy = args.reshard_strategy if kind == "ours" else "optim_grads_params"
    model, opt, tokens = build(args, device, kind, strategy)
    api = Ours(model, opt) if kind == "ours" else Fsdp2(model, opt)
    if kind == "fsdp2":          # FSDP2's optimizer state exists after a step (ours shapes it from the checkpoint)
        step(model, opt, tokens)
    return dict(system=f"reshard-{kind}", saved="ZeRO-3 at dp 1", loaded=f"{strategy} as rank 0 of fake dp "
                f"{args.fake_world_size}", load_s=timed(lambda: api.load(os.path.join(args.dir, f"{kind}_sync")),
                                                        device))


# =============================================================================================
# Driver
# =============================================================================================


def over_budget(args) -> bool:
    return time.time() - args.started > args.time_budget


def run_phase(args, phase: str) -> Dict[str, Any]:
    kind = phase.split("-")[-1]
    try:
        return run_reshard(args, kind) if phase.startswith("reshard") else run_system(args, kind)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_child(args, argv: List[str], phase: str) -> Dict[str, Any]:
    """``phase`` in a fresh process (its pinned buffers and CUDA cache go with it)."""
    result = os.path.join(args.dir, f"{phase}.json")
    command = [sys.executable, __file__, *argv, "--phase", phase, "--phase-json", result,
               "--started", repr(args.started)]
    done = subprocess.run(command, cwd=REPO)
    if done.returncode != 0:
        return dict(system=phase, error=f"exit status {done.returncode}")
    with open(result) as f:
        return json.load(f)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def goals(results: Dict[str, Dict[str, Any]]) -> List[tuple]:
    """Issue 64's goals as (goal, value, met)."""
    ours, fsdp2 = results.get("ours", {}), results.get("fsdp2", {})
    steady = ours.get("async_second") or ours.get("async_first") or {}
    theirs = fsdp2.get("async_first") or {}
    rows = [("ours async blocking / ours sync save <= 0.1", ratio(steady.get("blocking_s"), ours.get("sync_save_s")),
             0.1),
            ("ours async blocking / FSDP2 async_save blocking <= 1", ratio(steady.get("blocking_s"),
                                                                         theirs.get("blocking_s")), 1.0),
            ("ours step during the write / normal step <= 1.1", ratio(steady.get("step_during_write_s"),
                                                                     ours.get("step_s")), 1.1),
            ("ours sync save / FSDP2 dcp.save <= 1", ratio(ours.get("sync_save_s"), fsdp2.get("sync_save_s")), 1.0),
            ("ours load / FSDP2 dcp.load <= 1", ratio(ours.get("load_s"), fsdp2.get("load_s")), 1.0)]
    return [(text, value, None if value is None else value <= bound) for text, value, bound in rows]


def _s(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(meta: Dict[str, Any], results: Dict[str, Dict[str, Any]]) -> str:
    lines = [f"# bench_checkpoint.py, {meta['date']}", "", f"`{meta['command']}`", "",
             f"{meta['device_name']}, torch {meta['torch']}, {meta['num_params'] / 1e6:.1f} M parameters, "
             f"checkpoints in `{meta['dir']}`, {meta['elapsed_s']:.0f} s in all.", "",
             "| system | state GiB | step s | async blocking s (1st / 2nd) | async complete s (1st / 2nd) | "
             "steps during write: n, median s | staging: host GiB, GPU allocated / reserved GiB | sync save s | "
             "load s | peak allocated / reserved GiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in ("ours", "fsdp2"):
        r = results.get(kind)
        if r is None or "error" in r or "step_s" not in r:
            lines.append(f"| {kind} | {(r or {}).get('error') or 'not run'} | | | | | | | | |")
            continue
        rounds = [r.get(f"async_{n}") for n in ("first", "second") if r.get(f"async_{n}")]
        last = rounds[-1] if rounds else {}
        lines.append(f"| {kind} | {_s(r.get('state_gib'))} | {r['step_s']:.4f} | "
                     f"{' / '.join(_s(x['blocking_s']) for x in rounds)} | "
                     f"{' / '.join(_s(x['complete_s']) for x in rounds)} | "
                     f"{len(last.get('steps_during_write_s') or [])}, {_s(last.get('step_during_write_s'))} | "
                     f"{_s(r.get('staging_host_gib'))}, {_s(last.get('staging_gpu_gib'))} / "
                     f"{_s(last.get('staging_gpu_reserved_gib'))} | {_s(r.get('sync_save_s'))} | "
                     f"{_s(r.get('load_s'))} | "
                     f"{_s(r.get('peak_gib'))} / {_s(r.get('reserved_gib'))} |")
    lines += ["", "| resharding load | saved | loaded | load s | / FSDP2's |", "|---|---|---|---:|---:|"]
    theirs = results.get("reshard-fsdp2", {}).get("load_s")
    for kind in ("reshard-ours", "reshard-fsdp2"):
        r = results.get(kind, {})
        lines.append(f"| {kind} | {r.get('saved', '-')} | {r.get('loaded', r.get('error', 'not run'))} | "
                     f"{_s(r.get('load_s'))} | {_s(ratio(r.get('load_s'), theirs))} |")
    lines += ["", "| goal (issue 64) | value | met |", "|---|---:|---|"]
    lines += [f"| {text} | {_s(value)} | {'-' if met is None else ('yes' if met else 'NO')} |"
              for text, value, met in goals(results)]
    skipped = [f"{k}: {', '.join(r['skipped'])}" for k, r in results.items() if r.get("skipped")]
    if skipped:
        lines += ["", "Skipped by --time-budget: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key in TINY:
        p.add_argument("--" + key.replace("_", "-"), type=int, default=LLAMA[key], help=f"default {LLAMA[key]}")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on CPU, gloo, one process (a smoke run)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda (cpu with --tiny)")
    p.add_argument("--dir", default="/tmp/bench_checkpoint", help="where checkpoints are written (emptied first)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before anything (default 3)")
    p.add_argument("--steps", type=int, default=5, help="timed normal steps (default 5)")
    p.add_argument("--max-write-steps", type=int, default=200, help="at most this many steps during one write")
    p.add_argument("--fake-world-size", type=int, default=8, help="the resharding load's fake group (default 8)")
    p.add_argument("--reshard-strategy", default="optim", help="ours' strategy at the resharding load (default "
                   "optim = ZeRO-1; the checkpoint is saved as optim_grads_params = ZeRO-3)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds; later phases are skipped (default 420)")
    p.add_argument("--in-process", action="store_true", help="every phase in this process (default with --tiny)")
    p.add_argument("--out", help="write the markdown here")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--phase-json", help=argparse.SUPPRESS)
    p.add_argument("--started", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
        args.device, args.in_process, args.warmup, args.steps = args.device or "cpu", True, 1, 2
    args.device = args.device or "cuda"
    args.started = time.time() if args.started is None else args.started
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.phase:                                   # a child: one phase, its numbers to --phase-json
        result = run_phase(args, args.phase)
        with open(args.phase_json, "w") as f:
            json.dump(result, f)
        return 0
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    results: Dict[str, Dict[str, Any]] = {}
    try:
        for phase in [p for p in args.phases.split(",") if p]:
            if over_budget(args):
                results[phase] = dict(system=phase, skipped=["all"])
                continue
            results[phase] = run_phase(args, phase) if args.in_process else run_child(args, argv, phase)
            print(f"bench_checkpoint: {phase}: {json.dumps(results[phase])[:400]}", flush=True)
            if phase.startswith("reshard"):
                shutil.rmtree(os.path.join(args.dir, phase.split("-")[-1] + "_sync"), ignore_errors=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench_llama import llama_config

    with torch.device("meta"):
        num_params = sum(p.numel() for p in LlamaForCausalLM(llama_config(args)).parameters())
    meta = dict(date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), dir=args.dir, num_params=num_params,
                command=" ".join(["python", "benchmarks/bench_checkpoint.py", *map(shlex.quote, argv)]),
                device_name=torch.cuda.get_device_name(0) if args.device == "cuda" else (platform.processor() or "cpu"),
                torch=torch.__version__, elapsed_s=time.time() - args.started)
    text = markdown(meta, results)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, results=results, goals=goals(results)), indent=1))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
