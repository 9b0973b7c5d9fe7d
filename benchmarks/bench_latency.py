#!/usr/bin/env python3
"""The latency-bound step (issue 62): a small Hugging Face Llama at micro-batch 1, where the CPU sets
the step time, under no wrapper, torch FSDP2 and megatron_fsdp_v2, eager, each decoder layer
compiled, and the whole step replayed as one CUDA graph. One process per system::

    python benchmarks/bench_latency.py                           # issue 62's model, N = 1 (NCCL)
    python benchmarks/bench_latency.py --fake-world-size 8       # rank 0 of a fake 8-way group
    python benchmarks/bench_latency.py --strategies all          # ours eager/compiled at every strategy too
    python benchmarks/bench_latency.py --profile ours-optim_grads_params-compiled,fsdp2-compiled
    python benchmarks/bench_latency.py --device cpu --layers 2 --hidden 64 --intermediate 128 --heads 4 \\
        --vocab 128 --seq 32 --steps 4 --warmup 2 --systems plain-eager,ours-optim-eager   # CPU smoke

Model: ``LlamaForCausalLM`` from a config (12 layers, hidden 768, intermediate 2048, 12 heads,
vocab 32768, seq 512), fp32 weights, bf16 compute, micro-batch 1, AdamW. Systems:

- ``plain-eager``: no wrapper, ``torch.autocast(bf16)``, ``AdamW(fused=True)``;
- ``plain-graph``: the same step captured by hand (``torch.cuda.graph``, autocast's weight cache off,
  ``AdamW(fused=True, capturable=True)``): the limit;
- ``fsdp2-{eager,compiled,graph}``: ``fully_shard`` per decoder layer and the root,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; ``graph``: captured by hand the same way;
- ``ours-<strategy>-{eager,compiled,graph}``: ``fully_shard(unit_modules=[LlamaDecoderLayer],
  mixed_precision=MixedPrecisionPolicy(param_dtype=bf16))``; ``graph``: ``make_graphed_step``.
``compiled``: ``layer.compile()`` for each decoder layer before wrapping. ``graph`` systems use
``AdamW(fused=True, capturable=True)`` and ``zero_grad(set_to_none=False)``, the others
``AdamW(fused=True)``.

Reported per system: the median and minimum step time in ms over ``--steps`` after ``--warmup``
(each step timed between two ``torch.cuda.synchronize()``), peak allocated and reserved GiB, and
the loss after the last step. ``--profile`` writes, per named system, torch.profiler's table of the
most expensive CPU-side calls over 3 steps, and counts kernel launches per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def system_names(strategies) -> list[str]:
    names = ["plain-eager", "plain-graph", "fsdp2-eager", "fsdp2-compiled", "fsdp2-graph"]
    for strategy in STRATEGIES:
        if strategy in strategies:
            names += [f"ours-{strategy}-eager", f"ours-{strategy}-compiled"]
        names.append(f"ours-{strategy}-graph")
    return names


# ============================================================================= one system (child)
def init_group(args) -> torch.device:
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.fake_world_size:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world_size)
    else:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=0, world_size=1)
    return device


def build_model(args, device, compiled: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq,
                         tie_word_embeddings=False, use_cache=False, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    with torch.device(device):
        model = LlamaForCausalLM(config).float().train()
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    if compiled:
        for layer in layers:
            layer.compile()
    return model, layers


def build_system(args, device, name: str):
    """(model, optimizer, step function, graphed) for system ``name``."""
    kind, _, rest = name.partition("-")
    strategy, mode = (rest.rsplit("-", 1) if kind == "ours" else (None, rest))
    model, layers = build_model(args, device, compiled=mode == "compiled")
    autocast = contextlib.nullcontext
    if kind == "plain":
        cache = mode != "graph"             # autocast's weight-cast cache cannot live in a graph
        autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)  # noqa: E731
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

        model = fully_shard(model, sharding_strategy=strategy, unit_modules=[LlamaDecoderLayer],
                            mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    on_cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_cuda or None,
                                  capturable=mode == "graph" and on_cuda)

    def step(tokens):
        with autocast():
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=mode != "graph")
        return loss.detach()
    return model, optimizer, step, mode == "graph"


def capture_by_hand(step, tokens, warmup: int):
    """FSDP2's and the no-wrapper graph: warm-up on a side stream, capture, replay."""
    static = tokens.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step(static)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        out = step(static)

    def replay(batch):
        static.copy_(batch)
        graph.replay()
        return out
    return replay


def run_child(args) -> dict:
    device = init_group(args)
    name = args.child
    model, optimizer, step, graphed = build_system(args, device, name)
    g = torch.Generator().manual_seed(1000)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device)
    runner = step
    if graphed and device.type == "cuda":
        if name.startswith("ours"):
            from megatron_fsdp_v2 import make_graphed_step

            runner = make_graphed_step(step, model, optimizer, warmup_steps=3)
        else:
            runner = capture_by_hand(step, tokens, warmup=3)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, loss = [], None
    for index in range(args.warmup + args.steps):
        if index == args.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        loss = runner(tokens)
        sync()
        if index >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    result = {"system": name, "median_ms": statistics.median(times), "min_ms": min(times),
              "loss": float(loss)}
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    if name in args.profile.split(","):
        result["profile"] = profile(runner, tokens, sync)
    dist.destroy_process_group()
    return result


def profile(runner, tokens, sync) -> dict:
    """torch.profiler over 3 steps: the costliest CPU-side calls and kernel launches per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities, with_stack=False) as prof:
        for _ in range(3):
            runner(tokens)
        sync()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    table = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    return {"kernel_launches_per_step": launches / 3, "table": table + "\n" + python_profile(runner, tokens, sync)}


def python_profile(runner, tokens, sync) -> str:
    """cProfile over 3 steps: the wrappers' own Python functions (ours, FSDP2's) by total time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        runner(tokens)
    sync()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("tottime")
    stats.print_stats(r"megatron_fsdp_v2|_fully_shard|_fsdp|dynamo/eval_frame|autograd", 25)
    return "\n".join(out.getvalue().splitlines()[-32:])


# ============================================================================= the parent
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="", help="comma-separated names (default: see --strategies)")
    p.add_argument("--strategies", default="optim_grads_params",
                   help="ours' strategies run eager and compiled too ('all'); graphs run at every strategy")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--fake-world-size", type=int, default=0)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--profile", default="", help="comma-separated systems to profile")
    p.add_argument("--json", default="", help="write every system's result here")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_system(argv: list[str], name: str) -> dict:
    cmd = [sys.executable, __file__, *argv, "--child", name, "--port", str(free_port())]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"system": name, "error": "\n".join((done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-25:])}
    return json.loads(lines[-1][len("RESULT "):])


def table(results: list[dict]) -> str:
    rows = ["| system | median ms | min ms | peak / reserved GiB | loss |", "|---|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['system']} | error: {r['error'].splitlines()[-1][:120]} | | | |")
            continue
        memory = f"{r['peak_gib']:.2f} / {r['reserved_gib']:.2f}" if "peak_gib" in r else "-"
        rows.append(f"| {r['system']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {memory} | {r['loss']:.4f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_child(args)), flush=True)
        return 0
    strategies = STRATEGIES if args.strategies == "all" else tuple(args.strategies.split(","))
    names = args.systems.split(",") if args.systems else system_names(strategies)
    results = []
    for name in names:
        results.append(run_system(argv, name))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "profile"}), flush=True)
    print(table(results))
    for r in results:
        if "profile" in r:
            print(f"\n## profile of {r['system']}: {r['profile']['kernel_launches_per_step']:.0f} kernel launches per step\n")
            print(r["profile"]["table"])
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": argv, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
