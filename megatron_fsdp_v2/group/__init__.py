"""One parameter group and its buffers. ``ParamGroup`` (``param_group.py``) holds a group's
main-weight, model-weight and gradient buffers and their verbs (unshard, reshard, accumulate,
refresh), driven by the strategy table, with its concerns in parts that each hold it (``part.py``);
the flat-buffer layout (``layout.py``) and the per-parameter shards' two orders
(``shard_order.py``); the main weights as the optimizer sees them (``main_weights.py``); the group's
levels of ranks, flat or HFSDP's inner and outer, each with its own gather, reduce and average
across replicas (``levels.py``); the group's gradient reduce (``reduce.py``), its held unreduced
gradients (``unreduced_grads.py``), its packed trainable part once partly frozen
(``trainable_pack.py``) and its reduced-gradient buffer (``grad_buffer.py``); ZeRO-3's main shards
in one allocation (``main_segment.py``); the group's offloaded part: its main shard on the host,
gathers fed from it (``offload.py``); and what a group reports and exports between steps
(``export.py``).
"""
