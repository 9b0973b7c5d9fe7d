"""Every data-parallel rank must wrap the same model the same way; check it before any collective.

A strategy, unit list, mixed-precision policy or allocator that differs between ranks makes the
ranks issue different collectives, which ends in a process-group timeout or an abort with no
Python error. At wrap time each rank hashes each setting; one all-gather of the hashes finds the
settings that differ, and only then (on every rank alike) are the values themselves gathered, so
the error on every rank names the setting and each rank's value.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from .checks import check_same_model_on_all_ranks


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _short(value: str, limit: int = 160) -> str:
    return value if len(value) <= limit else value[:limit] + f"... ({len(value)} chars)"


def check_ranks_agree(comm, device: torch.device, settings: dict[str, str]) -> None:
    """Raise ``ValueError`` on every rank if any of ``settings`` ({name: text}) differs between ranks."""
    if comm.size == 1 or dist.get_backend(comm.group) == "fake":
        return
    names = list(settings)
    mine = torch.tensor([_digest(settings[n]) for n in names], dtype=torch.int64, device=device)
    everyone = torch.empty(comm.size * len(names), dtype=torch.int64, device=device)
    comm.all_gather(everyone, mine, label="settings digest (wrap-time check)")
    table = everyone.view(comm.size, len(names)).tolist()
    differing = [i for i, name in enumerate(names) if len({row[i] for row in table}) > 1]
    if not differing:
        return
    values = comm.all_gather_object({names[i]: settings[names[i]] for i in differing})
    lines = []
    for i in differing:
        name = names[i]
        per_rank = "; ".join(f"rank {r}: {_short(values[r][name])}" for r in range(comm.size))
        lines.append(f"{name} differs between data-parallel ranks ({per_rank})")
    raise ValueError("fully_shard: " + ". ".join(lines) + ". Every rank must wrap the same model with the "
                     "same settings.")


def agree_on_wrap(module, groups, model, strategy, allocator, options) -> None:
    """Every rank of every group of the wrap (``checks.WrapGroups``) uses the same settings
    (``options``: ``options.WrapOptions``), units and model (``model``: ``build_units.PreparedModel``);
    raises on every rank naming what differs."""
    check_same_model_on_all_ranks(module, groups.comm, model.device)
    if groups.replicas is not None:
        check_same_model_on_all_ranks(module, groups.replicas, model.device)
    agreed = {
        **options.agreed_settings(strategy, allocator),
        "units": ",".join(spec.fqn or "<root>" for spec in model.specs),
        "nested unit policies": ",".join(f"{type(m).__name__}:{p!r}:{r!r}" for m, p, r in model.inner_policies),
        "built on the meta device": str(model.from_meta),
        "expert parameters": ",".join(n for n, p in module.named_parameters() if id(p) in model.experts),
    }
    for comm in groups.all():
        check_ranks_agree(comm, model.device, agreed)
