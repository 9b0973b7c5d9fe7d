import gc, weakref, torch
from torch import nn
from megatron_fsdp_v2 import fully_shard, OffloadPolicy
import megatron_fsdp_v2.meta_init as mi
def fn(rank, world, fraction):
    made = []
    orig = torch.empty
    def tracking_empty(*a, **k):
        t = orig(*a, **k)
        import sys
        if sys._getframe(1).f_code.co_filename.endswith("meta_init.py"):
            made.append(weakref.ref(t.untyped_storage()))
        return t
    torch.manual_seed(0)
    with torch.device("meta"):
        module = nn.Sequential(*[nn.TransformerEncoderLayer(64, 4, 256) for _ in range(6)])
    mi.torch.empty = tracking_empty
    peak = [0]
    orig_init = mi.initialize_meta_model
    def init(module, pending, write, restore, device, init_fn=None):
        def w(param, full):
            write(param, full)
            peak[0] = max(peak[0], sum(1 for r in made if r() is not None))
        return orig_init(module, pending, w, restore, device, init_fn)
    import megatron_fsdp_v2.build_units as bu
    bu.initialize_meta_model = init
    try:
        model = fully_shard(module, sharding_strategy="optim_grads_params", unit_modules=[nn.TransformerEncoderLayer],
                            offload=OffloadPolicy(fraction=fraction) if fraction else None)
    finally:
        mi.torch.empty = orig
    gc.collect()
    alive = [w() for w in made if w() is not None]
    return len(made), len(alive), peak[0]
