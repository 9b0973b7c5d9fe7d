"""Muon's per-matrix math, as ``torch.optim.Muon`` (torch 2.13, ``torch/optim/_muon.py``) computes it.

Kept here rather than imported from torch's private module: the distributed step splits torch's
per-parameter loop in three (momentum on each rank's rows, Newton-Schulz on the owner, the update
on each rank's rows) and needs each part alone. ``tests/unit/test_muon.py`` compares the whole step
with ``torch.optim.Muon`` on the full matrices, so a change of torch's rule shows there.

[Note: why the rows travel in bfloat16]
torch's Newton-Schulz begins with ``grad.bfloat16()`` and returns a bfloat16 matrix, which the
parameter (fp32) then adds. Casting each rank's rows to bfloat16 before they travel gives the owner
bitwise the matrix it would have cast itself, and the update comes back in the dtype it is made in:
exact, at half the bytes of fp32 rows.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # Keller Jordan's quintic, torch's defaults
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5
WIRE_DTYPE = torch.bfloat16       # what Newton-Schulz starts from and returns ([Note: why the rows travel in bfloat16])
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def momentum_update(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Advance the momentum ``buf`` in place and return the matrix to orthogonalize (elementwise:
    a rank's rows of it are computed from its rows of ``grad`` and ``buf`` alone)."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def zeropower_via_newtonschulz(matrix: torch.Tensor, ns_coefficients: tuple, ns_steps: int, eps: float) -> torch.Tensor:
    """The orthogonalized ``matrix`` (2-D), in bfloat16: torch's ``_zeropower_via_newtonschulz``.
    A bfloat16 input is used (and scaled) in place."""
    if ns_steps >= 100:
        raise ValueError(f"ns_steps must be less than 100, got {ns_steps}.")
    if matrix.dim() != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(matrix.shape)}.")
    a, b, c = ns_coefficients
    ortho = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))           # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape) -> float:
    """The learning rate of a matrix's orthogonalized update (torch's ``_adjust_lr``)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio
