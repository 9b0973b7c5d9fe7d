"""``Muon``: torch's Muon for matrices, AdamW for every other parameter, on sharded parameters.

[Note: why an optimizer of our own, with torch.optim.Muon's arguments]
``torch.optim.Muon`` orthogonalizes each parameter's momentum with Newton-Schulz iterations, which
need the whole matrix, one parameter after another. On our sharded parameters (DTensor rows) it
could only work by letting DTensor gather every matrix on every rank before its first matmul: N
times the orthogonalization work (each rank doing all of it), N-1 shards more bytes per rank, and
one blocking gather per parameter in sequence. torch also refuses non-matrix parameters in Muon,
so a model needs two optimizers. A class of our own sees every matrix of the step at once, so it
can give each matrix one owner rank (the work split about 1/N per rank), move all rows to their
owners in one all-to-all and the updates back in another (2 Psi_matrix in bfloat16 over all ranks,
counted in ``model.comm_stats()["all_to_all"]``), and step the rest with AdamW while the rows
travel. It takes torch's arguments, keeps torch's state names (``momentum_buffer``; AdamW's
``step``, ``exp_avg``, ``exp_avg_sq``) and is a ``torch.optim.Optimizer``: schedulers, ``zero_grad``,
``state_dict``, ``megatron_fsdp_v2.save_checkpoint`` and DCP work as with torch's optimizers, and our
engine's post-step weight refresh fires as for any optimizer holding main parameters.

[Note: momentum stays sharded like its parameter]
The momentum and Nesterov steps are elementwise, so each rank advances its own rows of
``momentum_buffer`` (a tensor laid out like the parameter: a DTensor of its rows) and sends its rows
of the matrix to orthogonalize. Keeping momentum whole on the owner instead would send the
gradient rows: the same 2 Psi_matrix per step, but the owner's state memory would follow the
owner assignment (lumpy, and tied to the dp size) where sharded state is 1/N of every matrix and
checkpoints and reshards like Adam's moments, with no code of ours.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim import Optimizer
from torch.optim.adam import adam

from ..row_sharded import local_piece
from .matrix_bucket import transform_whole_matrices
from .newton_schulz import (ADJUST_LR_FNS, DEFAULT_EPS, DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS, WIRE_DTYPE,
                            adjusted_lr, momentum_update, zeropower_via_newtonschulz)

__all__ = ["Muon"]


class Muon(Optimizer):
    """Muon (``torch.optim.Muon``'s update, exact) for 2-D parameters and AdamW for the others, in one
    optimizer, on ``fully_shard``'s parameters of every strategy (and plain or DTensor ``Shard(0)``
    parameters).

    Args: ``torch.optim.Muon``'s (``lr``, ``weight_decay``, ``momentum``, ``nesterov``,
    ``ns_coefficients``, ``eps``, ``ns_steps``, ``adjust_lr_fn``) for the matrices; ``adamw_lr``
    (None: ``lr``), ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay`` (torch AdamW's defaults)
    for the rest. A param group's ``use_muon`` says which: None (default) Muon for 2-D parameters,
    AdamW for others; False AdamW for all (embeddings and output heads, by the usual rule);
    True Muon, refusing a parameter that is not 2-D.

    With sharded parameters each matrix is orthogonalized on one rank of its group and the
    exchange is counted in the wrapped model's ``comm_stats()`` (matrix_owners.py, [Note:
    distributed Muon's exchange]); whole (``no_shard``) parameters step on every rank as torch's
    Muon would, without a collective. Every rank must step the same parameters (the same ones have
    a ``.grad``), as for any collective.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple = DEFAULT_NS_COEFFICIENTS, eps: float = DEFAULT_EPS,
                 ns_steps: int = DEFAULT_NS_STEPS, adjust_lr_fn: Optional[str] = None, adamw_lr: Optional[float] = None,
                 adamw_betas: tuple = (0.9, 0.999), adamw_eps: float = 1e-8, adamw_weight_decay: float = 1e-2) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps,
                    "adjust_lr_fn": adjust_lr_fn, "adamw_lr": adamw_lr, "adamw_betas": tuple(adamw_betas),
                    "adamw_eps": adamw_eps, "adamw_weight_decay": adamw_weight_decay, "use_muon": None}
        self._communicators: dict = {}      # process group -> Communicator, for groups no wrapped model owns
        self._rows: dict = {}               # id(param) -> MatrixRows or None, found once
        super().__init__(params, defaults)

    # -- param groups ----------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group)
        if group["use_muon"]:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon: a param group with use_muon=True holds a parameter of shape "
                                     f"{tuple(p.shape)}; Muon orthogonalizes 2-D matrices only (use_muon=None "
                                     f"steps the others with AdamW).")

    @staticmethod
    def uses_muon(group: dict, param: torch.Tensor) -> bool:
        """Whether ``param`` of param group ``group`` steps with Muon (else AdamW)."""
        return param.ndim == 2 if group["use_muon"] is None else bool(group["use_muon"])

    def initial_state(self, param: torch.Tensor) -> dict:
        """The state the first step creates for ``param`` (checkpoint/state_dict.py saves it for a
        model saved before any step, without stepping)."""
        group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
        if self.uses_muon(group, param):
            return {"momentum_buffer": torch.zeros_like(param, memory_format=torch.preserve_format)}
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return {"step": torch.tensor(0.0, dtype=scalar),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}

    # -- the step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrices, others = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (matrices if self.uses_muon(group, p) else others).append((group, p))
        # momentum on this rank's rows; the matrices to orthogonalize leave for their owners
        updates = [self._momentum(group, p) for group, p in matrices]

        def meanwhile() -> None:          # while the rows travel: AdamW, the matrices' weight decay
            self._adamw_step(others)
            for group, p in matrices:
                local_piece(p).mul_(1 - _scalar(group["lr"]) * group["weight_decay"])

        results = transform_whole_matrices([p for _, p in matrices], updates,
                                           lambda i, matrix: _orthogonalize(matrices[i][0], matrix), WIRE_DTYPE,
                                           self._communicators, self._rows, meanwhile)
        for (group, p), rows in zip(matrices, results):
            local_piece(p).add_(rows, alpha=-adjusted_lr(_scalar(group["lr"]), group["adjust_lr_fn"], p.shape))
        return loss

    def _momentum(self, group: dict, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        return momentum_update(local_piece(p.grad), local_piece(state["momentum_buffer"]), group["momentum"],
                               group["nesterov"])

    def _adamw_step(self, members: list) -> None:
        """torch.optim.AdamW's step (its functional kernel, on each rank's pieces) per param group."""
        by_group: dict = {}
        for group, p in members:
            by_group.setdefault(id(group), (group, []))[1].append(p)
        for group, params in by_group.values():
            states = []
            for p in params:
                if not self.state[p]:
                    self.state[p].update(self.initial_state(p))
                states.append(self.state[p])
            beta1, beta2 = group["adamw_betas"]
            lr = group["adamw_lr"] if group["adamw_lr"] is not None else group["lr"]
            adam([local_piece(p) for p in params], [local_piece(p.grad) for p in params],
                 [local_piece(s["exp_avg"]) for s in states], [local_piece(s["exp_avg_sq"]) for s in states], [],
                 [s["step"] for s in states], decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                 lr=lr, weight_decay=group["adamw_weight_decay"], eps=group["adamw_eps"], maximize=False)


def _orthogonalize(group: dict, matrix: torch.Tensor) -> torch.Tensor:
    return zeropower_via_newtonschulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])


def _scalar(value) -> float:
    return value.item() if isinstance(value, torch.Tensor) else value


def _check_hyperparameters(group: dict) -> None:
    """torch.optim.Muon's and AdamW's checks, with the value found."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"Muon: a tensor lr must have one element, got shape {tuple(lr.shape)}.")
    for key in ("lr", "momentum", "weight_decay", "eps", "adamw_eps", "adamw_weight_decay"):
        if not 0.0 <= _scalar(group[key]):
            raise ValueError(f"Muon: {key} must be >= 0, got {group[key]}.")
    if group["adamw_lr"] is not None and not 0.0 <= group["adamw_lr"]:
        raise ValueError(f"Muon: adamw_lr must be >= 0, got {group['adamw_lr']}.")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"Muon: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {group['adjust_lr_fn']!r}.")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError(f"Muon: ns_coefficients must be three numbers (a, b, c), got {group['ns_coefficients']}.")
    if not 0 <= group["ns_steps"] < 100:
        raise ValueError(f"Muon: ns_steps must be in [0, 100), got {group['ns_steps']}.")
    betas = group["adamw_betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Muon: adamw_betas must be two numbers in [0, 1), got {betas}.")
    if group["use_muon"] not in (None, True, False):
        raise ValueError(f"Muon: use_muon must be None, True or False, got {group['use_muon']!r}.")
