"""``python -m megatron_fsdp_v2.plan``: the per-rank memory and communication table of every
strategy, for a Megatron GPT given Megatron-LM's model flags or a torch model given by import path.

    python -m megatron_fsdp_v2.plan --num-layers 16 --hidden-size 2048 --num-attention-heads 16 \\
        --seq-length 2048 --vocab-size 32000 --bf16 --world-size 8 --hybrid 2x4
    python -m megatron_fsdp_v2.plan --model my_pkg.models:build --unit-modules my_pkg.models:Block \\
        --param-dtype bf16 --world-size 4

The table printed is the compact one (strategy, kept and peak bytes, bytes moved per step, fits /
chosen: plan/compact.py), at most 100 columns; ``--wide`` prints every column (``str(plan)``) and
``--json`` the same numbers as JSON, in bytes (``Plan.as_dict()``). The notices Megatron and torch
print while a Megatron GPT is built come as one line per kind (megatron_fsdp_v2/notices.py);
``--verbose`` shows each.

``--model`` is called with no arguments under ``torch.device("meta")`` (nothing is allocated);
the Megatron GPT is built on the meta device too (megatron_fsdp_v2/megatron/plan_model.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from typing import Optional, Sequence

import torch

from ..mixed_precision import MixedPrecisionPolicy
from ..strategy import STRATEGY_NAMES
from .memory import OPTIMIZER_STATE_COPIES
from .optimizer_step import STEP_KERNELS
from .compact import compact_table
from .planner import plan
from ..notices import notices_summarized

#: Builds the Megatron GPT of the Megatron-LM flags (the adapter's package; needs megatron-core).
MEGATRON_GPT = "megatron_fsdp_v2.megatron.plan_model:megatron_gpt_on_meta"

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _load(path: str, argument: str):
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"{argument} must be module.path:name, got {path!r}.")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"{argument} {path!r}: {error}") from None


def _shape(text: str):
    outer, sep, inner = text.partition("x")
    if not sep or not outer.isdigit() or not inner.isdigit():
        raise argparse.ArgumentTypeError(f"--hybrid must be OUTERxINNER (e.g. 2x4), got {text!r}")
    return int(outer), int(inner)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_fsdp_v2.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("a torch model")
    g.add_argument("--model", help="module.path:callable returning the nn.Module (built on the meta device)")
    g.add_argument("--unit-modules", default="", help="comma list of module.path:Class (unit classes)")
    g.add_argument("--param-dtype", choices=sorted(DTYPES), default=None,
                   help="compute dtype (MixedPrecisionPolicy.param_dtype); default: none (no policy)")
    g.add_argument("--grad-comm-dtype", choices=sorted(DTYPES), default=None)
    g = p.add_argument_group("a Megatron GPT (Megatron-LM's flags)")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--vocab-size",
                 "--ffn-hidden-size", "--num-query-groups", "--max-position-embeddings"):
        g.add_argument(flag, type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--grad-reduce-in-fp32", action="store_true")
    g = p.add_argument_group("the job")
    g.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    g.add_argument("--hybrid", type=_shape, action="append", default=[],
                   help="also plan hybrid sharding OUTERxINNER (repeatable)")
    g.add_argument("--strategies", default=",".join(STRATEGY_NAMES))
    g.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE_COPIES), default="adam")
    g.add_argument("--optimizer-kernel", choices=STEP_KERNELS, default="foreach",
                   help="the optimizer's kernel, whose step temporaries are fitted too: foreach (torch's default "
                        "on CUDA), fused (fused=True; Megatron's TE or Apex FusedAdam) or single (foreach=False)")
    g.add_argument("--micro-batches", type=int, default=1)
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    g.add_argument("--reduce-root-per-child", action="store_true")
    g.add_argument("--budget-gib", type=float, default=None, help="choose as sharding_strategy='auto' would")
    g.add_argument("--offload-fractions", default="",
                   help="comma list of CPU offload fractions to plan as well (OffloadPolicy(fraction=f)); 0 = none")
    g.add_argument("--activation-gib", type=float, default=None,
                   help="the activation peak of one forward and backward without any wrapper: adds the peak "
                        "with activations (and the budget check uses it)")
    g = p.add_argument_group("the output")
    g.add_argument("--wide", action="store_true",
                   help="the full table: every kind of bytes and every collective (default: the compact "
                        "table, at most 100 columns)")
    g.add_argument("--json", action="store_true",
                   help="print the plan as JSON instead of a table: every number of --wide, in bytes")
    g.add_argument("--verbose", action="store_true",
                   help="show each notice Megatron and torch print while the Megatron GPT is built (default: "
                        "one line per kind of notice that needs no action: megatron_fsdp_v2/notices.py)")
    return p.parse_args(argv)


def _megatron_model(args):
    missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
               if getattr(args, f) is None]
    if missing:
        raise SystemExit("give --model module:callable, or a Megatron GPT's flags; missing: "
                         + ", ".join("--" + f.replace("_", "-") for f in missing))
    # loaded by name, as --model is: the core imports no Megatron code unless a Megatron GPT is asked for
    megatron_gpt_on_meta = _load(MEGATRON_GPT, "the Megatron GPT builder")
    return megatron_gpt_on_meta(
        args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length, args.vocab_size,
        args.ffn_hidden_size, args.num_query_groups, args.max_position_embeddings,
        args.untie_embeddings_and_output_weights, args.bf16, args.fp16, args.grad_reduce_in_fp32,
        args.make_vocab_size_divisible_by)


def _torch_model(args):
    build = _load(args.model, "--model")
    with torch.device("meta"):
        model = build()
    units = [_load(u, "--unit-modules") for u in args.unit_modules.split(",") if u] or None
    policy = None
    if args.param_dtype or args.grad_comm_dtype:
        policy = MixedPrecisionPolicy(param_dtype=DTYPES.get(args.param_dtype),
                                      grad_comm_dtype=DTYPES.get(args.grad_comm_dtype))
    return model, units, policy


def _fractions(text: str):
    """``--offload-fractions``: None (no offload planned) or the fractions, 0 always among them."""
    if not text.strip():
        return None
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--offload-fractions must be comma-separated numbers in [0, 1], got {text!r}") from None
    return sorted({0.0, *values})


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    with contextlib.nullcontext() if args.verbose else notices_summarized():
        return _print_plan(args)


def _print_plan(args: argparse.Namespace) -> int:
    model, units, policy = _torch_model(args) if args.model else _megatron_model(args)
    budget = None if args.budget_gib is None else int(args.budget_gib * (1 << 30))
    fractions = _fractions(args.offload_fractions)
    activations = None if args.activation_gib is None else int(args.activation_gib * (1 << 30))
    result = plan(model, args.strategies.split(","), world_size=args.world_size,
                  hybrid_shape=[None, *args.hybrid], mixed_precision=policy, optimizer=args.optimizer,
                  micro_batches=args.micro_batches, unit_modules=units, device=args.device,
                  reduce_root_per_child=args.reduce_root_per_child,
                  broadcast_buffers=bool(args.model), budget_bytes=budget,
                  offload_fractions=fractions, activation_bytes=activations,
                  optimizer_kernel=args.optimizer_kernel)
    params = sum(p.numel() for p in model.parameters())
    if args.json:
        print(json.dumps({"model": type(model).__name__, "parameters": params,
                          "world_size": args.world_size, **result.as_dict()}, indent=1))
        return 0
    print(f"{type(model).__name__}: {params / 1e6:.1f}M parameters, world size {args.world_size}")
    print(result if args.wide else compact_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
