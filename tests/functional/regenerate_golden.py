"""Regenerate the golden loss curves of the functional suite (tests/functional/golden/losses.json).

The file holds, per GPU type (``torch.cuda.get_device_name()``) and world size, the per-iteration
loss of Megatron DDP and of every strategy on the loss-curve model (harness.loss_spec), plus a
``_meta`` record (the spec, versions, date)::

    {"NVIDIA H200": {"1": {"megatron_ddp": [...], "no_shard": [...], ..., "_meta": {...}}}}

Two ways to fill an entry:

* train now, on GPUs (about a minute on one H200)::

      torchrun --nproc-per-node=$NGPU -m tests.functional.regenerate_golden [--out PATH]

* from curves a finished functional run measured (no GPU needed; every functional run writes
  ``$FUNCTIONAL_RESULTS_DIR/losses_measured.json``)::

      python -m tests.functional.regenerate_golden --from losses_measured.json [more.json ...]

Only the entry for that GPU type and world size is replaced; the rest of the file is kept. Review
the diff before committing: a golden curve is a claim that these numbers are right.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):          # run as a file: make ``tests.functional`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from tests.functional import harness  # noqa: E402


def _print_entry(gpu: str, world_size: str, entry: dict) -> None:
    names = [n for n in entry if not n.startswith("_")]
    print(f"{gpu} / world size {world_size}: {', '.join(names)}")
    ref = entry.get(harness.REFERENCE)
    for name in names:
        losses = entry[name]
        gap = ""
        if ref is not None and name != harness.REFERENCE:
            gap = f"  max gap to {harness.REFERENCE} {100 * max(harness.relative_gaps(losses, ref)):.3f}%"
        print(f"  {name:20s} {losses[0]:.4f} -> {losses[-1]:.4f} ({len(losses)} iterations){gap}")


def _train() -> dict:
    world = harness.setup_world()
    try:
        names = (harness.REFERENCE,) + harness.STRATEGIES
        for name in names:
            c = harness.curve(name, world)
            if world.rank == 0:
                print(f"{name}: {len(c.losses)} iterations in {c.seconds:.1f} s ({c.path})", flush=True)
        entry = harness.measured_entry()
        entry["_meta"] = harness.golden_meta(world)
        return {world.gpu_name: {str(world.size): entry}} if world.rank == 0 else {}
    finally:
        harness.teardown_world()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="sources", nargs="+", metavar="JSON",
                        help="merge curves measured by a functional run instead of training")
    parser.add_argument("--golden", default=harness.GOLDEN_PATH, help="golden file to update (default: %(default)s)")
    parser.add_argument("--out", default=None, help="write the result here instead of --golden")
    args = parser.parse_args(argv)

    if args.sources:
        measured = {}
        for path in args.sources:
            with open(path) as f:
                for gpu, per_world in json.load(f).items():
                    measured.setdefault(gpu, {}).update(per_world)
    else:
        if harness.smoke_mode():
            print("refusing to record golden curves in FUNCTIONAL_CPU_SMOKE mode", file=sys.stderr)
            return 2
        measured = _train()
        if not measured:          # ranks > 0
            return 0
    golden = harness.load_golden(args.golden)
    changed = harness.merge_golden(golden, measured)
    if not changed:
        print("nothing to record", file=sys.stderr)
        return 1
    out = args.out or args.golden
    harness.save_golden(golden, out)
    for gpu, world_size, _ in changed:
        _print_entry(gpu, world_size, golden[gpu][world_size])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
