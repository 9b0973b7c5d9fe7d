"""The strategy table: the one place that says what each sharding strategy keeps and when it talks.

Strategies differ only in data, never in code paths: which buffers a rank keeps sharded
between steps and which collective reduces gradients when. Code elsewhere asks
``strategy.grads_sharded``, never ``strategy.name == "optim_grads"``.

==========================  =======  =====  =========  ==================  ==================
name (Megatron's spelling)  weights  grads  optimizer  grads reduced        grad collective
==========================  =======  =====  =========  ==================  ==================
no_shard            (DDP)   full     full   full       last micro-batch    all-reduce
optim             (ZeRO-1)  full     full   shard      last micro-batch    reduce-scatter
optim_grads       (ZeRO-2)  full     shard  shard      every micro-batch   reduce-scatter
optim_grads_params(ZeRO-3)  shard    shard  shard      every micro-batch   reduce-scatter
==========================  =======  =====  =========  ==================  ==================
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardingStrategy:
    """What a rank keeps between steps, and when gradients are reduced.

    Attributes:
        name: Megatron's name for it (``--data-parallel-sharding-strategy``).
        optim_sharded: the fp32 main weights (and so the optimizer state) are a 1/dp shard.
        grads_sharded: the persistent gradient buffer is a 1/dp shard; full-size grads exist only
            temporarily, one unit at a time, until their reduce-scatter has run.
        weights_sharded: the compute weights are freed after each unit's forward and backward and
            all-gathered again before the next use (ZeRO-3).
        reduce_every_microbatch: gradients are reduced after every backward, also inside
            ``no_sync()``; otherwise they accumulate locally until the last micro-batch.
        shards_each_parameter: every rank holds ``torch.chunk``'s rows of every parameter, as FSDP2
            (group/layout.py, [Note: per-parameter shards]), rather than row-snapped pieces of one flat
            buffer: every sharded strategy, so each optimizer-facing parameter is a plain
            ``DTensor(Shard(0))`` (right on every torch, interchangeable with FSDP2's) and an
            optimizer stepping one parameter at a time never makes temporaries larger than FSDP2's.
    """

    name: str
    optim_sharded: bool
    grads_sharded: bool
    weights_sharded: bool
    reduce_every_microbatch: bool
    shards_each_parameter: bool = False

    @property
    def grad_reduce_op(self) -> str:
        """``"all_reduce"`` when every rank needs every gradient, else ``"reduce_scatter"``."""
        return "reduce_scatter" if self.optim_sharded else "all_reduce"


STRATEGIES: dict[str, ShardingStrategy] = {
    s.name: s
    for s in (
        ShardingStrategy("no_shard", optim_sharded=False, grads_sharded=False, weights_sharded=False,
                         reduce_every_microbatch=False),
        ShardingStrategy("optim", optim_sharded=True, grads_sharded=False, weights_sharded=False,
                         reduce_every_microbatch=False, shards_each_parameter=True),
        ShardingStrategy("optim_grads", optim_sharded=True, grads_sharded=True, weights_sharded=False,
                         reduce_every_microbatch=True, shards_each_parameter=True),
        ShardingStrategy("optim_grads_params", optim_sharded=True, grads_sharded=True, weights_sharded=True,
                         reduce_every_microbatch=True, shards_each_parameter=True),
    )
}

STRATEGY_NAMES = tuple(STRATEGIES)


def get_strategy(name: "str | ShardingStrategy", argument: str = "sharding_strategy",
                 also_allowed: tuple = ()) -> ShardingStrategy:
    """Look a strategy up by Megatron's name; anything else is a ``ValueError`` naming the choices,
    with ``also_allowed`` (the names the caller takes besides a strategy, e.g. ``"auto"``)."""
    if isinstance(name, ShardingStrategy):
        return name
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"{argument} must be one of {list(STRATEGY_NAMES) + list(also_allowed)}, got {name!r}.")
    return STRATEGIES[name]


def reshards_after_forward(rule: "bool | None", is_root: bool) -> bool:
    """Whether a ZeRO-3 unit gives its gathered weights back after its forward, by ``fully_shard``'s
    ``reshard_after_forward`` (FSDP2's): ``True`` every unit (two gathers per unit and micro-batch,
    the table's); ``False`` none (one gather, the weights held until the unit's backward ends);
    ``None`` (FSDP2's default) every unit but the root, which backward would gather again at once."""
    return rule is True or (rule is None and not is_root)
