"""Which checkpoint format a directory holds, from its files and keys (Megatron-LM's
``--auto-detect-ckpt-format`` for the launcher): Megatron's ``torch_dist`` (``dist_checkpointing``:
a ``metadata.json``; ours and Megatron DDP's, the optimizer layout is read later by
``read_optimizer_layout``), Megatron-FSDP's ``fsdp_dtensor`` (plain DCP, ``model.module.*`` keys,
fsdp_dtensor_format.py) or the core's DCP ``save_checkpoint`` (plain DCP, ``model.<name>`` keys).
"""

from __future__ import annotations

import os

from ...checkpoint.safe_reader import SafeFileSystemReader
from .fsdp_dtensor_format import is_fsdp_dtensor_keys

__all__ = ["CORE_DCP", "FSDP_DTENSOR", "TORCH_DIST", "detect_checkpoint_format"]

TORCH_DIST, FSDP_DTENSOR, CORE_DCP = "torch_dist", "fsdp_dtensor", "megatron_fsdp_v2_dcp"


def detect_checkpoint_format(directory: "str | os.PathLike") -> str:
    """``"torch_dist"``, ``"fsdp_dtensor"`` or ``"megatron_fsdp_v2_dcp"``; ``ValueError`` naming the
    directory for anything else. Reads ``.metadata`` through ``SafeFileSystemReader`` (no unpickling
    outside DCP's own metadata classes)."""
    directory = os.fspath(directory)
    if os.path.isfile(os.path.join(directory, "metadata.json")):
        return TORCH_DIST
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise ValueError(f"checkpoint {directory!r}: neither Megatron's torch_dist (metadata.json) nor a DCP "
                         f"checkpoint (.metadata); the formats read here are torch_dist and fsdp_dtensor.")
    keys = SafeFileSystemReader(directory).read_metadata().state_dict_metadata
    if is_fsdp_dtensor_keys(keys):
        return FSDP_DTENSOR
    if any(k.startswith("model.") for k in keys):
        return CORE_DCP
    raise ValueError(f"checkpoint {directory!r}: a DCP checkpoint with neither Megatron-FSDP's 'model.module.*' "
                     f"keys nor megatron_fsdp_v2's 'model.<name>' keys (got e.g. {sorted(keys)[:3]}).")
