"""Runs the docs' Python snippets on each rank of a torchrun job (tests/unit/test_doc_snippets.py).

``torchrun --nproc-per-node 2 tests/snippet_driver.py PLAN.json``: PLAN holds a file (``file``:
its path, ``text``: its lines) and the snippets that continue it (``snippets``: ``[where, code]``).
The file's lines run as the module ``__main__`` up to its last line (its teardown,
``dist.destroy_process_group()``); each snippet then runs, as written, in a copy of the names the
file left (objects are shared, names are not: a snippet's names do not reach the next), and the
last line runs after them. Each rank prints ``snippet WHERE ran`` after each and ``rank R: all
snippets ran`` at the end, the line the test waits for.
"""

from __future__ import annotations

import json
import sys


def check_muon_split(names: dict) -> None:
    """A ``megatron_fsdp_v2.optim.Muon`` a snippet built steps the loop's embedding and output head
    with AdamW: none of their weights goes to Muon silently."""
    from megatron_fsdp_v2.optim import Muon

    opt, model = names.get("opt"), names.get("model")
    if not isinstance(opt, Muon) or model is None:
        return
    adamw = [p for g in opt.param_groups for p in g["params"] if not Muon.uses_muon(g, p)]
    for module in (model.embed, model.head):
        for name, p in module.named_parameters():
            if not any(p is q for q in adamw):
                raise AssertionError(f"Muon orthogonalizes the {type(module).__name__}'s {name}: the snippet's "
                                     f"AdamW selection missed it")


def main(plan_path: str) -> None:
    with open(plan_path) as f:
        plan = json.load(f)
    lines = plan["text"].rstrip("\n").split("\n")
    body, teardown = "\n".join(lines[:-1]) + "\n", lines[-1]
    names = {"__name__": "__main__", "__file__": plan["file"]}
    exec(compile(body, plan["file"], "exec"), names)
    import torch.distributed as dist

    rank = dist.get_rank()
    for where, code in plan["snippets"]:
        scope = dict(names)
        exec(compile(code, where, "exec"), scope)
        check_muon_split(scope)
        print(f"rank {rank}: snippet {where} ran", flush=True)
    exec(compile(teardown + "\n", plan["file"], "exec"), names)
    print(f"rank {rank}: all snippets ran", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
