"""Sizes from docs/design.md, computed independently of the engine: each unit's padded flat-buffer
length and the bytes a rank keeps per strategy. Used by the CPU suite (tests/unit/test_memory.py)
and the GPU suite (tests/functional, through ``harness``).
"""

from __future__ import annotations

from typing import Dict, List


def expected_group_numels(info: dict, dp: int, alignment: int) -> List[int]:
    """Padded element count P of each unit's (single) group, root first then the layers in module
    order: parameters in ``named_parameters`` order, laid out by the design's rule (docs/design.md,
    "Flat layout and padding: row-snapped shards"; ``layout.build_layout`` is that rule)."""
    from megatron_fsdp_v2.group.layout import build_layout

    units = [""] + list(info["unit_fqns"])
    owned: Dict[str, List[str]] = {u: [] for u in units}
    seen = set()
    for name in info["order"]:
        if name in seen or name not in info["numels"]:
            continue
        seen.add(name)
        owner = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        owned[owner].append(name)
    return [build_layout([info["shapes"][name] for name in owned[unit]], dp, alignment).total_numel
            for unit in units]


def design_persistent_bytes(strategy: str, padded: List[int], dp: int, c: int, m: int, g: int,
                            aliased: bool) -> dict:
    """docs/design.md "Buffers a rank keeps", summed over groups."""
    P = sum(padded)
    shard = sum(p // dp for p in padded)
    return {
        "no_shard": {"model_weights": 0 if aliased else c * P, "main_weights": m * P, "grads": g * P},
        "optim": {"model_weights": c * P, "main_weights": m * shard, "grads": g * P},
        "optim_grads": {"model_weights": c * P, "main_weights": m * shard, "grads": g * shard},
        "optim_grads_params": {"model_weights": 0, "main_weights": m * shard, "grads": g * shard},
    }[strategy]
